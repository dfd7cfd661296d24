"""`fusuma bench network`: throughput of a VM's NIC on a fusuma network (a tap on a
managed network's bridge) against QEMU's user-mode network (slirp), measured in one run.

Everything happens in network namespaces the benchmark makes and removes: fusuma's own
(a scratch FUSUMA_HOME, runtime dir, shm dir and cgroup prefix, every fusuma command run
under ``nsenter --net``) and an "uplink" behind a veth pair, which holds an iperf3 server
and is where fusuma's namespace routes by default. Four Debian guests (the ``debian``
image, which has iperf3), 256 MiB each: ``tap-a`` and ``tap-b`` on the managed network
``bench`` (NAT on), ``user-a`` and ``user-b`` on the user-mode network, each with a
port forwarded from 127.0.0.1 (user-a's to its iperf3 server; a VM without --nic has a
user-mode NIC only when it forwards a port). ``*-a`` run in partition ``p0`` (core 0),
``*-b`` in ``p1`` (core 1), so both kinds meet the same placement.

Paths, each an iperf3 TCP stream of SECONDS (3 s) from client to server:

  host_to_vm   fusuma's namespace (the host) -> ``*-a``: to the tap VM's address on the
               bridge; to the user-mode VM through its port forward (127.0.0.1)
  vm_to_vm     ``*-b`` -> ``*-a``: across the bridge; between user-mode VMs the only way
               is out of one slirp and into the other's port forward (10.0.2.2 is the
               host's loopback to a user-mode guest)
  vm_to_nat    ``*-a`` -> the uplink's server: through the network's nftables NAT; out
               of slirp (QEMU's own sockets in fusuma's namespace)

The runs are interleaved (run 1 of every path and kind, then run 2, ...) so a drift of
the machine touches both kinds alike; each figure is the median of RUNS runs, and the
ratio tap / user-mode of those medians is what the result says (under TCG the absolute
numbers are low; the ratio is the point).

Moves (``fusuma_bench.network_moves``, unless ``moves=False``): once the throughput runs
are done and their guests deleted, the ping loss, outage and TCP stall of each kind of
move of a VM with a tap NIC, and the zero-copy downtime of the same VM with a tap NIC
and without any NIC, side by side.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import statistics
import subprocess
import tempfile
import time
import uuid
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from fusuma import spawn
from fusuma.errors import FusumaError
from fusuma.paths import UID_SPAN
from fusuma_bench import network_moves
from fusuma_bench.report import meta

Progress = Callable[[str], None]

RUNS = 3
SECONDS = 3
MEMORY_MIB = 256
IMAGE = "debian"
NETWORK = "bench"
SUBNET = "10.124.1.0/24"
TAP_A, TAP_B = "10.124.1.10", "10.124.1.11"
UP_HOST, UP_PEER = "172.31.251.1", "172.31.251.2"
IPERF_PORT = 5201
FORWARD_PORT = 15201            # user-a's iperf3 port on 127.0.0.1 (slirp hostfwd)
SLIRP_HOST = "10.0.2.2"         # what a user-mode guest reaches the host's loopback as
KINDS = ("tap", "user-mode")
PATHS = ("host_to_vm", "vm_to_vm", "vm_to_nat")
BOOT_TIMEOUT_S = 300.0


class BenchError(FusumaError):
    """The benchmark's world could not be made or measured."""


@dataclass
class Sample:
    path: str
    kind: str
    run: int
    mbit_s: float | None = None
    error: str | None = None

    def as_json(self) -> dict[str, Any]:
        return {"path": self.path, "kind": self.kind, "run": self.run,
                "throughput_mbit_s": self.mbit_s, "error": self.error}


def median(values: Sequence[float]) -> float | None:
    return round(statistics.median(values), 2) if values else None


def summarize(samples: Sequence[Sample]) -> list[dict[str, Any]]:
    """Per path: each kind's median, min and max, and the ratio tap / user-mode of the
    medians (None when either is missing)."""
    out = []
    for path in PATHS:
        row: dict[str, Any] = {"path": path}
        for kind in KINDS:
            got = [s.mbit_s for s in samples if s.path == path and s.kind == kind
                   and s.mbit_s is not None]
            key = kind.replace("-", "_")
            row[f"{key}_mbit_s_median"] = median(got)
            row[f"{key}_mbit_s_min"] = min(got) if got else None
            row[f"{key}_mbit_s_max"] = max(got) if got else None
            row[f"{key}_runs"] = len(got)
        tap, user = row["tap_mbit_s_median"], row["user_mode_mbit_s_median"]
        row["tap_over_user_mode"] = round(tap / user, 2) if tap and user else None
        out.append(row)
    return out


def iperf_mbit_s(text: str) -> float:
    """The receiver's throughput of an ``iperf3 -J`` client run, in Mbit/s."""
    try:
        data = json.loads(text)
    except ValueError as exc:
        raise BenchError(f"iperf3 printed no JSON: {text[-200:]!r}") from exc
    if data.get("error"):
        raise BenchError(f"iperf3: {data['error']}")
    try:
        return round(float(data["end"]["sum_received"]["bits_per_second"]) / 1e6, 2)
    except (KeyError, TypeError, ValueError) as exc:
        raise BenchError(f"iperf3's JSON has no end.sum_received: {exc}") from exc


# -- the world ------------------------------------------------------------------------
@dataclass
class World:
    """fusuma's namespace, the uplink's, the scratch fusuma home, the uplink's iperf3."""

    base: Path
    tag: str = field(default_factory=lambda: uuid.uuid4().hex[:6])
    made: list[str] = field(default_factory=list)
    server: subprocess.Popen[bytes] | None = None

    @property
    def ns(self) -> str:
        return f"fzbn-{self.tag}"

    @property
    def up(self) -> str:
        return f"fzbn-{self.tag}-up"

    @property
    def env(self) -> dict[str, str]:
        t = self.tag
        return spawn.child_env({
            **os.environ, "FUSUMA_HOME": str(self.base / "home"),
            "FUSUMA_RUNTIME_DIR": f"/tmp/fzbn-{t}", "FUSUMA_SHM_DIR": f"/dev/shm/fzbn-{t}",
            "FUSUMA_CGROUP_PREFIX": f"fusuma-bench-net-{t}", "FUSUMA_CPU_EXCLUSIVE": "0",
            "FUSUMA_UID_BASE": str(0x7A00_0000 + (int(t, 16) % 512) * UID_SPAN),
            "FUSUMA_CACHE": os.environ.get("FUSUMA_CACHE", "/var/cache/fusuma")})

    def nsenter(self, ns: str) -> list[str]:
        return ["nsenter", f"--net=/run/netns/{ns}", "--"]

    def run(self, argv: list[str], timeout: float = 120, check: bool = True
            ) -> subprocess.CompletedProcess[str]:
        p = subprocess.run(argv, capture_output=True, text=True, timeout=timeout,
                           env=self.env, cwd=spawn.CWD)
        if check and p.returncode != 0:
            raise BenchError(f"`{' '.join(argv)}` exited {p.returncode}: "
                             f"{(p.stderr or p.stdout).strip()[-400:]}")
        return p

    def fusuma(self, *args: str, timeout: float = 300, check: bool = True
               ) -> subprocess.CompletedProcess[str]:
        return self.run([*self.nsenter(self.ns),
                         *spawn.module_argv("fusuma.cli.main", *args)], timeout, check)

    def guest(self, vm: str, script: str, timeout: float = 60) -> str:
        return self.fusuma("vm", "exec", vm, "--timeout", str(timeout), "--", "/bin/sh",
                           "-c", script, timeout=timeout + 30).stdout

    def make(self) -> None:
        for ns in (self.ns, self.up):
            self.run(["ip", "netns", "add", ns])
            self.made.append(ns)
            self.run(["ip", "-n", ns, "link", "set", "lo", "up"])
        self.run(["ip", "-n", self.ns, "link", "add", "uplink0", "type", "veth", "peer",
                  "name", "down0", "netns", self.up])
        for ns, dev, ip in ((self.ns, "uplink0", UP_HOST), (self.up, "down0", UP_PEER)):
            self.run(["ip", "-n", ns, "addr", "add", f"{ip}/30", "dev", dev])
            self.run(["ip", "-n", ns, "link", "set", dev, "up"])
        self.run(["ip", "-n", self.ns, "route", "add", "default", "via", UP_PEER])
        self.server = subprocess.Popen(
            [*self.nsenter(self.up), "iperf3", "-s", "-B", UP_PEER, "-p", str(IPERF_PORT)],
            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)

    def remove(self, progress: Progress) -> list[str]:
        """`fusuma down`, the uplink's server, the namespaces and scratch dirs; what was
        left behind (which the result file records)."""
        left: list[str] = []
        if (self.base / "home").exists():
            p = self.fusuma("down", timeout=300, check=False)
            if p.returncode != 0:
                left.append(f"fusuma down failed: {p.stderr.strip()[-300:]}")
        if self.server is not None:      # iperf3 itself (nsenter execs it)
            self.server.terminate()
            try:
                self.server.wait(5)
            except subprocess.TimeoutExpired:
                self.server.kill()
                self.server.wait()
        if self.ns in self.made:
            links = self.run(["ip", "-n", self.ns, "-o", "link", "show"], check=False).stdout
            left += [f"link {w}" for w in re.findall(r"^\d+: (fz[bt]-[^:@]+)", links, re.M)]
        for ns in self.made:
            self.run(["ip", "netns", "del", ns], check=False)
        env = self.env
        for d in (env["FUSUMA_RUNTIME_DIR"], env["FUSUMA_SHM_DIR"], str(self.base)):
            shutil.rmtree(d, ignore_errors=True)
        if left:
            progress(f"left behind: {', '.join(left)}")
        return left


@contextlib.contextmanager
def world(progress: Progress) -> Iterator[tuple[World, list[str]]]:
    w = World(Path(tempfile.mkdtemp(prefix="fusuma-bench-net-")))
    left: list[str] = []
    try:
        w.make()
        yield w, left
    finally:
        progress("removing the VMs, the network and the namespaces")
        left += w.remove(progress)


# -- measuring -------------------------------------------------------------------------
def _boot(w: World, progress: Progress) -> None:
    w.fusuma("partition", "create", "p0", "--cpus", "0", "--memory", "1024")
    w.fusuma("partition", "create", "p1", "--cpus", "1", "--memory", "1024")
    w.fusuma("network", "create", NETWORK, "--subnet", SUBNET)
    common = ["--memory", str(MEMORY_MIB), "--image", IMAGE]
    w.fusuma("vm", "create", "tap-a", "-p", "p0", *common, "--nic", f"{NETWORK},ip={TAP_A}")
    w.fusuma("vm", "create", "tap-b", "-p", "p1", *common, "--nic", f"{NETWORK},ip={TAP_B}")
    w.fusuma("vm", "create", "user-a", "-p", "p0", *common,
             "--port", f"127.0.0.1:{FORWARD_PORT}:{IPERF_PORT}")
    # fusuma gives a VM without --nic a user-mode NIC only when it forwards a port.
    w.fusuma("vm", "create", "user-b", "-p", "p1", *common,
             "--port", f"127.0.0.1:{FORWARD_PORT + 1}:{IPERF_PORT}")
    for vm in ("tap-a", "tap-b", "user-a", "user-b"):
        progress(f"booting {vm} ({IMAGE} image, {MEMORY_MIB} MiB)")
        w.fusuma("vm", "start", vm, "--wait", "--timeout", str(BOOT_TIMEOUT_S),
                 timeout=BOOT_TIMEOUT_S + 30)
    for vm, ip in (("tap-a", TAP_A), ("tap-b", TAP_B)):
        deadline = time.monotonic() + 60
        while f"inet {ip}/" not in w.guest(vm, "ip -4 -o addr show eth0"):
            if time.monotonic() > deadline:
                raise BenchError(f"{vm} got no lease for {ip} in 60 s.")
            time.sleep(1)
    for vm in ("tap-a", "user-a"):
        w.guest(vm, f"setsid iperf3 -s -D -p {IPERF_PORT} </dev/null >/dev/null 2>&1; "
                    "sleep 0.5; pidof iperf3")


def _client(path: str, kind: str) -> tuple[str | None, str]:
    """Where the client runs (a VM, or None: the host's namespace) and the server's
    address it connects to, as ``HOST PORT``."""
    if path == "host_to_vm":
        return None, (f"{TAP_A} {IPERF_PORT}" if kind == "tap"
                      else f"127.0.0.1 {FORWARD_PORT}")
    if path == "vm_to_vm":
        return (("tap-b", f"{TAP_A} {IPERF_PORT}") if kind == "tap"
                else ("user-b", f"{SLIRP_HOST} {FORWARD_PORT}"))
    return ("tap-a" if kind == "tap" else "user-a"), f"{UP_PEER} {IPERF_PORT}"


def measure(w: World, path: str, kind: str, seconds: int) -> float:
    where, target = _client(path, kind)
    host, port = target.split()
    args = ["iperf3", "-c", host, "-p", port, "-t", str(seconds), "-J"]
    if where is None:
        out = w.run([*w.nsenter(w.ns), *args], timeout=seconds + 30).stdout
    else:
        out = w.guest(where, " ".join(args) + " 2>&1", timeout=seconds + 30)
    return iperf_mbit_s(out)


def run(runs: int = RUNS, seconds: int = SECONDS, moves: bool = True,
        move_runs: int = network_moves.MOVE_RUNS,
        downtime_runs: int = network_moves.DOWNTIME_RUNS,
        progress: Progress = lambda s: None) -> dict[str, Any]:
    """Throughput, then (with ``moves``) the moves part, in one world."""
    from fusuma.host.accel import probe_accel

    for tool in ("iperf3", "nsenter", "ip"):
        if shutil.which(tool) is None:
            raise BenchError(f"`bench network` needs {tool} on the host; install it "
                             "(`apt-get install iperf3` for iperf3).")
    accel = probe_accel("auto").name
    t0 = time.monotonic()
    samples: list[Sample] = []
    moved: dict[str, Any] | None = None
    with world(progress) as (w, left):
        _boot(w, progress)
        for r in range(runs):
            for path in PATHS:
                for kind in KINDS:
                    s = Sample(path, kind, r)
                    try:
                        s.mbit_s = measure(w, path, kind, seconds)
                    except (BenchError, FusumaError, subprocess.SubprocessError) as exc:
                        s.error = str(exc)[:300]
                    samples.append(s)
                    progress(f"run {r + 1}/{runs} {path:10} {kind:9}: "
                             + (f"{s.mbit_s} Mbit/s" if s.error is None else s.error))
        if moves:
            # Both cores for the moves: the throughput guests go first.
            for vm in ("tap-a", "tap-b", "user-a", "user-b"):
                w.fusuma("vm", "delete", vm, "--force")
            moved = network_moves.run(w, move_runs, downtime_runs, progress)
    return {"meta": meta(accel, benchmark="network", runs=runs, seconds_per_run=seconds,
                         guest_image=IMAGE, guest_memory_mib=MEMORY_MIB, vcpus=1,
                         tool="iperf3 (TCP, one stream, -J)",
                         move_runs=move_runs if moves else 0,
                         downtime_runs=downtime_runs if moves else 0,
                         move_guest_memory_mib=network_moves.MOVE_MEMORY_MIB,
                         iperf3=_version(["iperf3", "--version"]),
                         duration_s=round(time.monotonic() - t0, 1)),
            "summary": summarize(samples),
            "samples": [s.as_json() for s in samples],
            "moves": moved,
            "leftovers": left}


def _version(argv: list[str]) -> str:
    try:
        out = subprocess.run(argv, capture_output=True, text=True, timeout=10).stdout
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    return out.splitlines()[0] if out else "unknown"
