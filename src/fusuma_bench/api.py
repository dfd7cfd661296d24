"""`fusuma bench api`: how fast `fusuma serve` answers with N running VMs.

The benchmark makes two scratch partitions on the cores no partition holds (one core
each, or the free cores split in two), defines N VMs spread over them and boots them a
few at a time, each to its guest agent. Then it starts a real ``fusuma serve`` (a
subprocess of this installation's `fusuma`, in the caller's namespace, access log off)
and talks to it over its UNIX socket with httpx:

- ``GET /1.0/vms``: SEQUENTIAL_GETS requests one after another on one keep-alive
  connection; p50/p99 latency (the answer holds every VM with its PSS, read from /proc).
- ``GET /metrics``: SEQUENTIAL_SCRAPES scrapes, as Prometheus makes them; p50/p99.
- requests/s of ``GET /1.0/vms`` with 16 and with 100 concurrent clients, each client its
  own connection issuing requests back to back for LOAD_S seconds (asyncio, one client
  process: its CPU time is recorded beside the result, as it shares the host's cores
  with the daemon and the guests).
- the time from a move's end to its ``vm-moved`` event arriving on ``GET /1.0/events``:
  MOVES zero-copy moves of one VM back and forth through the API. For each, the event's
  arrival (local clock) minus its own ``timestamp`` (written by the mover right when the
  move ended), and minus the move operation's end (its ``updated_at``); the medians of
  both are reported.

Every latency is client-side wall time (``time.perf_counter``) from before the request
to the whole body read. The daemon is stopped by its pid and everything the benchmark
made (partitions, VMs) is removed afterwards, also when it fails.
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime as dt
import json
import math
import os
import signal
import statistics
import subprocess
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import httpx

from fusuma.errors import ConflictError, FusumaError, ResourceError
from fusuma.supervisor import rpc
from fusuma_bench.report import meta

if TYPE_CHECKING:
    from fusuma.partition.manager import PartitionManager
    from fusuma.vm.manager import VmManager

PARTITION = "bench-api"
MEMORY_MIB = 128
BOOT_BATCH = 4             # VMs booted together (TCG boots are CPU-bound)
SEQUENTIAL_GETS = 200
SEQUENTIAL_SCRAPES = 50
LOAD_CLIENTS = (16, 100)
LOAD_S = 10.0
MOVES = 10
READY_S = 60.0
# Targets of issue 11 on this machine, in ms.
TARGETS = {"get_vms_p99_ms": 20.0, "scrape_p99_ms": 100.0,
           "event_after_move_ms_median": 100.0}


# -- statistics ---------------------------------------------------------------------------

def percentile(values: Sequence[float], q: float) -> float:
    """The nearest-rank ``q``-th percentile (0 < q <= 100) of a non-empty sample."""
    ordered = sorted(values)
    rank = max(1, math.ceil(q / 100 * len(ordered)))
    return ordered[rank - 1]


def summarize_ms(seconds: Sequence[float]) -> dict[str, float]:
    ms = [s * 1000 for s in seconds]
    return {"n": len(ms), "p50_ms": round(percentile(ms, 50), 2),
            "p90_ms": round(percentile(ms, 90), 2), "p99_ms": round(percentile(ms, 99), 2),
            "max_ms": round(max(ms), 2), "mean_ms": round(statistics.fmean(ms), 2)}


# -- load ---------------------------------------------------------------------------------

@dataclass
class LoadResult:
    """What concurrent clients saw: per path, the status codes and the latency of every
    answered request (seconds), and the transport errors by exception type."""

    clients: int
    duration_s: float = 0.0
    latencies: dict[str, list[float]] = field(default_factory=dict)
    statuses: dict[str, Counter[int]] = field(default_factory=dict)
    errors: Counter[str] = field(default_factory=Counter)
    client_cpu_s: float = 0.0

    def record(self, path: str, status: int, seconds: float) -> None:
        self.latencies.setdefault(path, []).append(seconds)
        self.statuses.setdefault(path, Counter())[status] += 1

    @property
    def requests(self) -> int:
        return sum(sum(c.values()) for c in self.statuses.values())

    def count(self, predicate: Callable[[int], bool]) -> int:
        return sum(n for c in self.statuses.values() for code, n in c.items()
                   if predicate(code))

    def as_json(self) -> dict[str, Any]:
        per_path = {path: {"requests": len(lat),
                           "statuses": {str(k): v for k, v in sorted(
                               self.statuses[path].items())},
                           **summarize_ms(lat)}
                    for path, lat in sorted(self.latencies.items()) if lat}
        return {"clients": self.clients, "duration_s": round(self.duration_s, 2),
                "requests": self.requests,
                "requests_per_s": round(self.requests / self.duration_s, 1)
                if self.duration_s else 0.0,
                "status_5xx": self.count(lambda c: c >= 500),
                "status_non_2xx": self.count(lambda c: not 200 <= c < 300),
                "transport_errors": dict(self.errors),
                "client_cpu_s": round(self.client_cpu_s, 2), "paths": per_path}


def load(socket_path: Path, paths: Sequence[str], clients: int, duration_s: float,
         stop: threading.Event | None = None, timeout: float = 30.0) -> LoadResult:
    """``clients`` concurrent clients, each on a connection of its own to the daemon's
    UNIX socket, GETting ``paths`` in turn back to back for ``duration_s`` seconds (or
    until ``stop`` is set). Runs its own event loop in the calling thread."""
    res = LoadResult(clients)
    halt = stop or threading.Event()

    async def client(index: int, deadline: float) -> None:
        transport = httpx.AsyncHTTPTransport(uds=str(socket_path))
        async with httpx.AsyncClient(transport=transport, base_url="http://fusuma",
                                     timeout=timeout) as c:
            i = index
            while time.monotonic() < deadline and not halt.is_set():
                path = paths[i % len(paths)]
                i += 1
                t0 = time.perf_counter()
                try:
                    r = await c.get(path)
                except httpx.HTTPError as exc:
                    res.errors[type(exc).__name__] += 1
                    await asyncio.sleep(0.05)
                    continue
                res.record(path, r.status_code, time.perf_counter() - t0)

    async def main() -> None:
        deadline = time.monotonic() + duration_s
        await asyncio.gather(*(client(i, deadline) for i in range(clients)))

    cpu0, t0 = time.thread_time(), time.monotonic()
    asyncio.run(main())
    res.duration_s = time.monotonic() - t0
    res.client_cpu_s = time.thread_time() - cpu0
    return res


def sequential(client: httpx.Client, path: str, n: int) -> list[float]:
    """``n`` GETs of ``path`` one after another; each one's wall time in seconds. Any
    answer but 200 is an error."""
    out = []
    for _ in range(n):
        t0 = time.perf_counter()
        r = client.get(path)
        out.append(time.perf_counter() - t0)
        if r.status_code != 200:
            raise FusumaError(f"GET {path} answered {r.status_code}: {r.text[:300]}")
    return out


# -- events -------------------------------------------------------------------------------

def parse_ts(iso: str) -> float:
    """An API timestamp (``2024-01-01T00:00:00.123Z``) as seconds since the epoch."""
    return dt.datetime.fromisoformat(iso.replace("Z", "+00:00")).timestamp()


class EventWatch:
    """``GET /1.0/events`` read in a thread; each event kept with its local arrival time
    (``time.time()``, the clock the event log's timestamps use)."""

    def __init__(self, socket_path: Path, types: str = "lifecycle") -> None:
        self.events: list[tuple[float, dict[str, Any]]] = []
        self._lock = threading.Lock()
        self._ready = threading.Event()
        self._stop = threading.Event()
        self._socket = socket_path
        self._types = types
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._read, daemon=True, name="events")

    def __enter__(self) -> EventWatch:
        self._thread.start()
        if not self._ready.wait(10):
            raise FusumaError(f"the event stream did not open: {self._error}")
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()

    def _read(self) -> None:
        transport = httpx.HTTPTransport(uds=str(self._socket))
        try:
            with httpx.Client(transport=transport, base_url="http://fusuma",
                              timeout=httpx.Timeout(10, read=None)) as c, \
                    c.stream("GET", "/1.0/events", params={"type": self._types}) as r:
                self._ready.set()
                data = ""
                for line in r.iter_lines():
                    if self._stop.is_set():
                        return
                    if line.startswith("data: "):
                        data = line[6:]
                    elif line == "" and data:
                        now = time.time()
                        with self._lock:
                            self.events.append((now, json.loads(data)))
                        data = ""
        except BaseException as exc:
            self._error = exc
            self._ready.set()

    def moved(self, vm: str) -> list[tuple[float, dict[str, Any]]]:
        with self._lock:
            return [(t, e) for t, e in self.events
                    if e["metadata"]["action"] == "vm-moved"
                    and e["metadata"]["context"].get("vm") == vm]


# -- the daemon ---------------------------------------------------------------------------

@contextlib.contextmanager
def daemon(fusuma: list[str], env: dict[str, str], log: Path) -> Iterator[dict[str, Any]]:
    """A `fusuma serve` subprocess (access log off); yields its ready line and ends it
    by its pid."""
    with open(log, "wb") as logf:
        proc = subprocess.Popen([*fusuma, "serve", "--no-access-log"], env=env,
                                stdout=logf, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL)
        try:
            deadline = time.monotonic() + READY_S
            info: dict[str, Any] | None = None
            while info is None:
                for line in log.read_text(errors="replace").splitlines():
                    if line.startswith('{"ready"'):
                        info = json.loads(line)["ready"]
                if info is None:
                    if proc.poll() is not None or time.monotonic() > deadline:
                        raise FusumaError("`fusuma serve` did not start: "
                                          + log.read_text(errors="replace")[-800:])
                    time.sleep(0.05)
            yield info
        finally:
            if proc.poll() is None:
                os.kill(proc.pid, signal.SIGTERM)
                try:
                    proc.wait(20)
                except subprocess.TimeoutExpired:
                    os.kill(proc.pid, signal.SIGKILL)
                    proc.wait(5)


# -- the benchmark ------------------------------------------------------------------------

def run(parts: PartitionManager, vms_mgr: VmManager, n: int,
        progress: Callable[[str], None] = lambda s: None) -> dict[str, Any]:
    from fusuma.api.server import _in_use, api_socket
    from fusuma.host.accel import probe_accel
    from fusuma_bench.clitime import fusuma_argv

    accel = probe_accel("auto").name
    sock = api_socket(parts.paths)
    if sock.exists() and _in_use(sock):
        raise ConflictError(f"a `fusuma serve` already answers on {sock}; the benchmark "
                            "starts its own: stop that one first (or use another "
                            "FUSUMA_RUNTIME_DIR).")
    used = {c for p in parts.db.partitions() for c in p.cpus}
    free = [c for c in parts.host.cpus if c not in used]
    if len(free) < 2:
        raise ResourceError(f"`bench api` needs two cores no partition holds (it moves a VM "
                            f"between two scratch partitions); free: {free or 'none'}. Run "
                            "`fusuma down` first.")
    groups = [free[0::2], free[1::2]]
    made: list[str] = []
    scratch = Path(tempfile.mkdtemp(prefix="fusuma-bench-api-"))
    t_start = time.monotonic()
    try:
        names = _make_vms(parts, vms_mgr, n, groups, accel, made, progress)
        _boot(parts, vms_mgr, names, progress)
        env = {**os.environ, **parts.paths.as_env()}
        progress("starting `fusuma serve`")
        with daemon(fusuma_argv(), env, scratch / "serve.log") as info:
            data = _measure(Path(info["socket"]), names, n, progress)
    finally:
        for pname in made:
            try:
                parts.delete(pname, force=True)
            except FusumaError as exc:
                progress(f"cleanup of {pname} failed: {exc}")
        with contextlib.suppress(OSError):
            for f in scratch.iterdir():
                f.unlink()
            scratch.rmdir()
    summ = data["summary"]
    return {"meta": meta(accel, benchmark="api", vms=n, guest_memory_mib=MEMORY_MIB,
                         partition_cores=groups, access_log=False,
                         client="httpx over the UNIX socket, one process (asyncio for "
                                "concurrent clients)",
                         sequential_gets=SEQUENTIAL_GETS,
                         sequential_scrapes=SEQUENTIAL_SCRAPES, load_s=LOAD_S,
                         moves=MOVES, duration_s=round(time.monotonic() - t_start, 1),
                         loadavg_1m_end=round(os.getloadavg()[0], 2)),
            **data,
            "targets": [{"metric": k, "target_ms": v, "value_ms": summ[k],
                         "met": summ[k] <= v} for k, v in TARGETS.items()]}


def _make_vms(parts: PartitionManager, vms_mgr: VmManager, n: int, groups: list[list[int]],
              accel: str, made: list[str], progress: Callable[[str], None]) -> list[str]:
    """Two partitions, ``n`` VMs spread over them; the partitions are appended to
    ``made`` as they are created (the caller removes them). Each partition has room
    for one VM more than it holds, for the moves."""
    from fusuma.capacity import SUPERVISOR_MIB
    from fusuma.qemu.cmdline import overhead_mib
    from fusuma.spec import PartitionSpec, VmSpec

    per = [n // 2 + n % 2, n // 2]
    names = []
    for i, (cpus, count) in enumerate(zip(groups, per, strict=True)):
        pname = f"{PARTITION}-{i}"
        mem = SUPERVISOR_MIB + (count + 1) * (MEMORY_MIB + overhead_mib(accel)) + 64
        progress(f"partition {pname}: cores {cpus}, {mem} MiB, {count} VMs")
        parts.create(PartitionSpec(name=pname, cpus=sorted(cpus), memory_mib=mem))
        made.append(pname)
        for j in range(count):
            vname = f"{PARTITION}-{i}-{j}"
            vms_mgr.create(VmSpec(name=vname, partition=pname, memory_mib=MEMORY_MIB))
            names.append(vname)
    return names


def _boot(parts: PartitionManager, vms_mgr: VmManager, names: list[str],
          progress: Callable[[str], None]) -> None:
    """Start the VMs BOOT_BATCH at a time, each batch booted to its guest agents before
    the next starts."""
    errors: list[BaseException] = []

    def wait(client: Any, vname: str) -> None:
        try:
            client.send(rpc.WaitAgent(vname, timeout=300), timeout=310)
        except BaseException as exc:
            errors.append(exc)

    for first in range(0, len(names), BOOT_BATCH):
        batch = names[first:first + BOOT_BATCH]
        progress(f"booting {', '.join(batch)} ({first + len(batch)}/{len(names)})")
        threads = []
        for vname in batch:
            vms_mgr.start(vname)
            client = parts.client(parts.db.vm(vname).partition)
            th = threading.Thread(target=wait, args=(client, vname))
            th.start()
            threads.append(th)
        for th in threads:
            th.join()
        if errors:
            raise errors[0]


def _measure(sock: Path, names: list[str], n: int,
             progress: Callable[[str], None]) -> dict[str, Any]:
    transport = httpx.HTTPTransport(uds=str(sock))
    with httpx.Client(transport=transport, base_url="http://fusuma", timeout=60) as c:
        vms = c.get("/1.0/vms").json()
        running = [v["name"] for v in vms if v["name"] in names and v["state"] == "running"]
        if len(running) != n:
            raise FusumaError(f"expected {n} running VMs in GET /1.0/vms, got {running}")
        sequential(c, "/1.0/vms", 10)        # warm-up: imports, thread-local state
        sequential(c, "/metrics", 3)
        progress(f"GET /1.0/vms x {SEQUENTIAL_GETS}, one after another")
        gets = sequential(c, "/1.0/vms", SEQUENTIAL_GETS)
        progress(f"GET /metrics x {SEQUENTIAL_SCRAPES}, one after another")
        scrapes = sequential(c, "/metrics", SEQUENTIAL_SCRAPES)
        body = c.get("/metrics").text
        cpu_vms = {line.split('vm="', 1)[1].split('"', 1)[0] for line in body.splitlines()
                   if line.startswith("fusuma_vm_cpu_seconds_total{")}
        if not set(names) <= cpu_vms:
            raise FusumaError(f"/metrics lacks CPU samples of {sorted(set(names) - cpu_vms)}")
        loads = []
        for k in LOAD_CLIENTS:
            progress(f"GET /1.0/vms with {k} concurrent clients for {LOAD_S:g} s")
            res = load(sock, ["/1.0/vms"], k, LOAD_S)
            if res.requests == 0 or res.count(lambda s: s != 200):
                raise FusumaError(f"{k} clients: {res.as_json()}")
            loads.append(res.as_json())
        progress(f"{MOVES} moves of {names[0]} through the API, timing their events")
        moves = _moves(c, sock, names[0])
    get_s, scrape_s = summarize_ms(gets), summarize_ms(scrapes)
    after_move = [m["event_after_move_ms"] for m in moves]
    after_op = [m["event_after_op_end_ms"] for m in moves]
    after_wait = [m["event_after_wait_return_ms"] for m in moves]
    summary: dict[str, float] = {
        "get_vms_p50_ms": get_s["p50_ms"], "get_vms_p99_ms": get_s["p99_ms"],
        "scrape_p50_ms": scrape_s["p50_ms"], "scrape_p99_ms": scrape_s["p99_ms"],
        **{f"rps_{r['clients']}_clients": r["requests_per_s"] for r in loads},
        **{f"p99_ms_{r['clients']}_clients": r["paths"]["/1.0/vms"]["p99_ms"] for r in loads},
        "event_after_move_ms_median": round(statistics.median(after_move), 1),
        "event_after_move_ms_max": round(max(after_move), 1),
        "event_after_op_end_ms_median": round(statistics.median(after_op), 1),
        "event_after_wait_return_ms_median": round(statistics.median(after_wait), 1),
        "move_downtime_ms_median": round(statistics.median(
            m["downtime_ms"] for m in moves), 1),
    }
    return {"summary": summary,
            "results": {"get_vms": get_s, "scrape": {**scrape_s, "bytes": len(body)},
                        "load": loads, "moves": moves}}


def _moves(c: httpx.Client, sock: Path, vm: str) -> list[dict[str, Any]]:
    """MOVES moves of ``vm`` back and forth; for each, when it ended (its event's
    timestamp, its operation's end, the wait's return) and when its event arrived."""
    home = c.get(f"/1.0/vms/{vm}").json()["partition"]
    other = f"{PARTITION}-1" if home == f"{PARTITION}-0" else f"{PARTITION}-0"
    out = []
    with EventWatch(sock) as watch:
        for i in range(MOVES):
            to = other if i % 2 == 0 else home
            r = c.post(f"/1.0/vms/{vm}/move", json={"partition": to, "mode": "zero-copy"})
            if r.status_code != 202:
                raise FusumaError(f"move {i + 1}: {r.status_code} {r.text[:300]}")
            op = c.get(f"/1.0/operations/{r.json()['id']}/wait",
                       params={"timeout": 300}, timeout=310).json()
            waited = time.time()
            if op["status"] != "Success":
                raise FusumaError(f"move {i + 1} to {to}: {op['status']}: {op['err']}")
            deadline = time.monotonic() + 5
            while len(watch.moved(vm)) <= i and time.monotonic() < deadline:
                time.sleep(0.005)
            seen = watch.moved(vm)
            if len(seen) <= i:
                raise FusumaError(f"no vm-moved event of move {i + 1} within 5 s")
            arrived, ev = seen[i]
            if ev["metadata"]["context"].get("to") != to:
                raise FusumaError(f"event {ev} is not that of move {i + 1} to {to}")
            out.append({"to": to, "downtime_ms": op["result"]["downtime_ms"],
                        "total_ms": op["result"]["total_ms"],
                        "event_after_move_ms": round(
                            (arrived - parse_ts(ev["timestamp"])) * 1000, 1),
                        "event_after_op_end_ms": round(
                            (arrived - parse_ts(op["updated_at"])) * 1000, 1),
                        "event_after_wait_return_ms": round((arrived - waited) * 1000, 1)})
            time.sleep(0.5)     # let the guest settle between moves
    return out
