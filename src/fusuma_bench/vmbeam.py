"""`fusuma bench vmbeam`: the VMBeam experiment (papers README §3) on fusuma.

For each guest memory size two scratch partitions take one core each; a VM of that
size boots in the first, writes a random blob into its tmpfs, starts a background
writer that keeps dirtying memory, and is moved back and forth between the two
partitions N times in each migration mode: zero-copy, then copy. After every move the
blob's md5 inside the guest is compared with the one taken before the first move. The
two modes share the VM (one boot per size); a mode whose moves stopped on an error may
have left the guest broken, so the next mode then boots a VM of its own. Per (mode,
size) the result is the median over the moves; every move is kept as well.

Before fusuma's moves of each size, mode ``raw`` does the same zero-copy move with
two bare QEMUs and no fusuma (``fusuma_bench.rawmove``): the same guest image, size,
workload, cores and checks, measured the same way, so that fusuma's figures can be
read as a ratio to the mechanism's own on the same machine in the same run.

It needs every core of the host, so it refuses to run beside any partition, and it
removes everything it made afterwards, also on failure or Ctrl-C.
"""

from __future__ import annotations

import asyncio
import logging
import os
import re
import statistics
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from qemu.qmp import QMPError

from fusuma.capacity import SUPERVISOR_MIB, vm_footprint
from fusuma.errors import FusumaError, GuestAgentError, ResourceError
from fusuma.frozen import frozen
from fusuma.host.accel import probe_accel
from fusuma.migration import MigrationResult, migrate
from fusuma.partition.manager import PartitionManager
from fusuma.paths import Paths
from fusuma.spec import PartitionSpec, VmSpec
from fusuma.state import VmRecord
from fusuma.vm import VmManager
from fusuma_bench import rawmove
from fusuma_bench.report import meta

LOG = logging.getLogger(__name__)

PARTITIONS = ("bench-vmbeam-a", "bench-vmbeam-b")
VM = "bench-vmbeam-vm"
RAW = "raw"
MODES = (RAW, "zero-copy", "copy")
DEFAULT_SIZES = (256, 1024, 4096)
QUICK_SIZES = (256, 1024)
DEFAULT_MOVES = 5
QUICK_MOVES = 2
# Room in each partition beyond the VM and the supervisor (as the boot benchmark).
MARGIN_MIB = 64
BLOB_MAX_MIB = 100
EXEC_TIMEOUT_S = 300.0
# A guest whose memory was corrupted often cannot answer at all: give up sooner.
CHECK_TIMEOUT_S = 90.0
# Guest kernel messages that mean its memory or state is not what it was.
KERNEL_ERROR = re.compile(r"BUG|corruption|Oops|Kernel panic|general protection")

BLOB = "/tmp/blob"
CHURN_PID = "/tmp/churn.pid"
# Rewrites the same 16 MiB of tmpfs page cache forever, so the guest dirties memory
# while it is moved. setsid + closed stdio: guest-exec returns at once instead of
# waiting for the loop's output pipes to close.
CHURN = ("setsid sh -c 'echo $$ > " + CHURN_PID + "; while :; do dd if=/dev/zero "
         "of=/tmp/churn bs=1M count=16 2>/dev/null; done' </dev/null >/dev/null 2>&1 &")

Progress = Callable[[str], None]


@frozen
class GuestCheck:
    """What the guest looked like after a move."""

    data_intact: bool            # the blob's md5 equals its value before the first move
    writer_alive: bool           # the background writer still runs
    kernel_errors: list[str]     # new guest kernel error lines on the console
    error: str | None = None     # the check itself failed (e.g. the agent is gone)


@frozen
class Move:
    """One migration and the check that followed it."""

    memory_mib: int
    result: MigrationResult
    check: GuestCheck

    def as_json(self) -> dict[str, Any]:
        c = self.check
        return {**self.result.as_json(), "memory_mib": self.memory_mib,
                "data_intact": c.data_intact, "writer_alive": c.writer_alive,
                "kernel_errors": c.kernel_errors, "error": c.error}


@dataclass
class Case:
    """The moves of one (mode, size) and why they stopped early, if they did."""

    mode: str
    memory_mib: int
    planned: int
    moves: list[Move]
    error: str | None = None
    # The host's load averages (1, 5, 15 min) when the case began and ended.
    load_before: list[float] | None = None
    load_after: list[float] | None = None


def _load() -> list[float]:
    return [float(x) for x in Path("/proc/loadavg").read_text().split()[:3]]


def blob_mib(memory_mib: int) -> int:
    return max(1, min(BLOB_MAX_MIB, memory_mib // 4))


def partition_mib(memory_mib: int, accel: str) -> int:
    """Memory of one scratch partition: its supervisor plus one VM of this size."""
    vm = VmRecord(name=VM, partition=PARTITIONS[0], vcpus=1, memory_mib=memory_mib,
                  accel_used=accel)
    return SUPERVISOR_MIB + vm_footprint(vm) + MARGIN_MIB


def run(parts: PartitionManager, vms: VmManager, sizes: Sequence[int],
        moves: int = DEFAULT_MOVES, progress: Progress = lambda s: None,
        modes: Sequence[str] = MODES) -> dict[str, Any]:
    accel = probe_accel("auto").name
    cores = _check_host(parts, sizes, accel)
    results: list[dict[str, Any]] = []
    all_moves: list[dict[str, Any]] = []
    for size in sizes:
        for case in _one_size(parts, vms, cores, size, moves, accel, progress, modes):
            all_moves += [m.as_json() for m in case.moves]
            results.append(_summary(case))
            r = results[-1]
            progress(f"{case.mode} {size} MiB: median total {r['total_ms']} ms, downtime "
                     f"{r['downtime_ms']} ms, {r['bytes_sent']} bytes, data intact "
                     f"{r['data_intact']}" + (f"; {r['error']}" if r["error"] else ""))
    return {"meta": meta(accel, benchmark="vmbeam", sizes=list(sizes), moves=moves,
                         modes=list(modes), cores=cores,
                         blob_mib={str(s): blob_mib(s) for s in sizes},
                         vm_per_size="one VM per size, moved in each mode in turn (a new "
                                     "one after a mode that stopped on an error)",
                         writer="dd 16 MiB of zeros to guest tmpfs in a loop"),
            "results": results, "moves": all_moves}


def _check_host(parts: PartitionManager, sizes: Sequence[int], accel: str) -> list[int]:
    """Refuse before anything is made; return the two cores the partitions get."""
    existing = [p.name for p in parts.db.partitions()]
    if existing:
        raise ResourceError(f"the vmbeam benchmark needs every core of this host but "
                            f"partition(s) {', '.join(existing)} exist; remove them first "
                            "(`fusuma down`).")
    if len(parts.host.cpus) < 2:
        raise ResourceError("the vmbeam benchmark needs two cores (one per partition); "
                            f"this host has {len(parts.host.cpus)}.")
    need = 2 * partition_mib(max(sizes), accel)
    avail = parts.host.memory_available_for_partitions_mib
    if need > avail:
        raise ResourceError(f"a {max(sizes)} MiB guest needs two partitions of "
                            f"{need // 2} MiB but only {avail} MiB is available for "
                            "partitions; choose smaller --sizes.")
    return list(parts.host.cpus[:2])


def _one_size(parts: PartitionManager, vms: VmManager, cores: list[int], size: int,
              moves: int, accel: str, progress: Progress,
              modes: Sequence[str] = MODES) -> list[Case]:
    """Every mode's moves of one size. A failed setup raises; a failed move or a guest
    that no longer answers ends that mode's moves (recorded in its ``error``), and the
    next mode starts on a new VM."""
    cases: list[Case] = []
    guest: tuple[str, Console] | None = None
    try:
        for mode in modes:
            if mode == RAW:
                cases.append(_raw_case(cores, size, moves, progress))
                continue
            if guest is None:
                guest = _setup(parts, vms, cores, size, mode, accel, progress)
            case = Case(mode, size, moves, [])
            cases.append(case)
            case.load_before = _load()
            _moves(case, parts, vms, *guest, progress)
            case.load_after = _load()
            if case.error:
                _cleanup(parts, progress)
                guest = None
        return cases
    finally:
        progress("removing the scratch partitions")
        _cleanup(parts, progress)


def _setup(parts: PartitionManager, vms: VmManager, cores: list[int], size: int, mode: str,
           accel: str, progress: Progress) -> tuple[str, Console]:
    """Partitions, the VM booted in the first, its workload; (the blob's md5, the
    console from here on)."""
    mem = partition_mib(size, accel)
    for name, core in zip(PARTITIONS, cores, strict=True):
        parts.create(PartitionSpec(name=name, cpus=[core], memory_mib=mem))
    vms.create(VmSpec(name=VM, partition=PARTITIONS[0], memory_mib=size))
    progress(f"{mode} {size} MiB: booting {VM} in {PARTITIONS[0]}")
    vms.start(VM, wait_agent=120)
    digest = _start_workload(vms, size, progress)
    console = Console(parts.paths)
    console.new_errors()    # anything from boot is not the moves' doing
    return digest, console


def _moves(case: Case, parts: PartitionManager, vms: VmManager, digest: str,
           console: Console, progress: Progress) -> None:
    """Move the VM to the other partition ``case.planned`` times in ``case.mode``,
    checking the guest after each move."""
    mode, size, moves = case.mode, case.memory_mib, case.planned
    for i in range(moves):
        to = next(p for p in PARTITIONS if p != vms.db.vm(VM).partition)
        try:
            res = migrate(parts, VM, to, mode)
        except FusumaError as exc:
            case.error = f"move {i + 1} failed: {exc}"
            return
        check = _check_guest(vms, digest, console)
        case.moves.append(Move(size, res, check))
        down = f"{res.downtime_ms} ms" if res.downtime_ms is not None else "unknown"
        progress(f"{mode} {size} MiB move {i + 1}/{moves} -> {to}: {res.total_ms} ms, "
                 f"downtime {down}, {res.bytes_sent} bytes, data intact "
                 f"{check.data_intact}"
                 + (f", guest kernel: {check.kernel_errors[0]}" if check.kernel_errors
                    else "") + (f", {check.error}" if check.error else ""))
        if check.error:
            case.error = f"after move {i + 1}: {check.error}"
            return


def _sh(vms: VmManager, script: str) -> str:
    out = vms.exec(VM, ["/bin/sh", "-c", script], timeout=EXEC_TIMEOUT_S)
    if out.exit_code != 0:
        raise GuestAgentError(f"guest command `{script}` in {VM!r} exited {out.exit_code}: "
                              f"{out.stderr.decode(errors='replace').strip()}",
                              log_tail=out.stderr.decode(errors="replace"))
    return out.stdout.decode(errors="replace")


def _start_workload(vms: VmManager, size: int, progress: Progress) -> str:
    """Write the blob, remember its md5, start the writer; return the md5."""
    n = blob_mib(size)
    progress(f"writing a {n} MiB random blob in the guest")
    _sh(vms, f"dd if=/dev/urandom of={BLOB} bs=1M count={n} 2>/dev/null")
    digest = _sh(vms, f"md5sum {BLOB}").split()[0]
    _sh(vms, CHURN)
    # guest-exec has returned: the writer must still be running (and stay so).
    if not _writer_alive(vms):
        raise GuestAgentError(f"the background writer in {VM!r} did not keep running.")
    return digest


def _writer_alive(vms: VmManager) -> bool:
    out = vms.exec(VM, ["/bin/sh", "-c", f"kill -0 $(cat {CHURN_PID})"],
                   timeout=CHECK_TIMEOUT_S)
    return out.exit_code == 0


class Console:
    """New guest kernel error lines in the VM's console log since the last look."""

    def __init__(self, paths: Paths | None = None, path: Path | None = None) -> None:
        self.path = path or (paths.vm_dir(VM) / "console.log" if paths else Path("/"))
        self.offset = 0

    def new_errors(self) -> list[str]:
        try:
            with self.path.open("rb") as f:
                if os.fstat(f.fileno()).st_size < self.offset:
                    self.offset = 0        # rotated (fusuma.qemu.consolelog)
                f.seek(self.offset)
                text = f.read()
        except OSError:
            return []
        self.offset += len(text)
        lines = text.decode(errors="replace").splitlines()
        return [line.strip()[:200] for line in lines if KERNEL_ERROR.search(line)]


def _check_guest(vms: VmManager, digest: str, console: Console) -> GuestCheck:
    try:
        out = vms.exec(VM, ["/bin/sh", "-c", f"md5sum {BLOB}"], timeout=CHECK_TIMEOUT_S)
        words = out.stdout.decode(errors="replace").split()
        intact = out.exit_code == 0 and bool(words) and words[0] == digest
        alive = _writer_alive(vms)
        error = None
    except FusumaError as exc:
        intact = alive = False
        error = f"the guest did not answer ({exc})"
    return GuestCheck(intact, alive, console.new_errors(), error)


def _cleanup(parts: PartitionManager, progress: Progress) -> None:
    for name in PARTITIONS:
        if parts.db.find_partition(name) is None:
            continue
        try:
            parts.delete(name, force=True)
        except FusumaError as exc:
            progress(f"cleanup of partition {name} failed: {exc}")
            LOG.warning("cleanup of partition %s failed: %s", name, exc)


def _median(values: list[float]) -> float | None:
    return round(statistics.median(values), 3) if values else None


def _summary(case: Case) -> dict[str, Any]:
    """Medians over the moves done; data_intact only if every planned move was checked
    and intact."""
    rs = [m.result for m in case.moves]
    checks = [m.check for m in case.moves]
    sent = _median([float(r.bytes_sent) for r in rs])
    steps = [r.steps_ms for r in rs if r.steps_ms]
    names = list(dict.fromkeys(k for s in steps for k in s))
    return {"mode": case.mode, "memory_mib": case.memory_mib,
            "prepare_ms": _median([r.prepare_ms for r in rs]),
            "total_ms": _median([r.total_ms for r in rs]),
            "downtime_ms": _median([r.downtime_ms for r in rs if r.downtime_ms is not None]),
            "qemu_total_ms": _median([float(r.qemu_total_ms) for r in rs
                                      if r.qemu_total_ms is not None]),
            "qemu_downtime_ms": _median([float(r.qemu_downtime_ms) for r in rs
                                         if r.qemu_downtime_ms is not None]),
            "steps_ms": {k: _median([s[k] for s in steps if k in s]) for k in names},
            "load_before": case.load_before, "load_after": case.load_after,
            "bytes_sent": None if sent is None else int(sent),
            "cpu_s": _median([r.cpu_s for r in rs]),
            "data_intact": len(checks) == case.planned and all(c.data_intact for c in checks),
            "writer_alive": bool(checks) and all(c.writer_alive for c in checks),
            "guest_kernel_errors": sum(len(c.kernel_errors) for c in checks),
            "moves": len(case.moves), "error": case.error}


# -- raw QEMU (no fusuma) -------------------------------------------------------------
def _raw_case(cores: list[int], size: int, moves: int, progress: Progress) -> Case:
    """The same zero-copy moves by two bare QEMUs (``fusuma_bench.rawmove``); a failure
    ends them (recorded in the case's ``error``)."""
    case = Case(RAW, size, moves, [], load_before=_load())
    try:
        asyncio.run(_raw_moves(case, (cores[0], cores[1]), progress))
    except (OSError, RuntimeError, FusumaError, TimeoutError, KeyError, QMPError) as exc:
        case.error = f"raw QEMU: {exc}"
    case.load_after = _load()
    return case


async def _raw_moves(case: Case, cores: tuple[int, int], progress: Progress) -> None:
    size = case.memory_mib
    with rawmove.run_dir("fusuma-vmbeam-raw-") as (run, img):
        cfg = rawmove.RawConfig(run, img, rawmove.shm_ram(f"vmbeam-{size}"), size, cores,
                                console_file=True)
        pair = rawmove.RawPair(cfg)
        try:
            progress(f"{RAW} {size} MiB: booting two bare QEMUs (no fusuma)")
            await pair.boot()
            digest = await _raw_workload(pair, size, progress)
            console = Console(path=cfg.run / "console.log")
            console.new_errors()
            for i in range(case.planned):
                res, _ = await pair.move()
                check = await _raw_check(pair, digest, console)
                case.moves.append(Move(size, res, check))
                progress(f"{RAW} {size} MiB move {i + 1}/{case.planned} -> {res.to}: "
                         f"{res.total_ms} ms, downtime {res.downtime_ms} ms, "
                         f"{res.bytes_sent} bytes, data intact {check.data_intact}"
                         + (f", {check.error}" if check.error else ""))
                if check.error:
                    case.error = f"after move {i + 1}: {check.error}"
                    return
        finally:
            await pair.close()


async def _raw_sh(pair: rawmove.RawPair, script: str, timeout: float) -> tuple[int, str]:
    async with pair.agent() as ga:
        await ga.connect(timeout)
        out = await ga.run(["/bin/sh", "-c", script], timeout=timeout)
    return out.exit_code, out.stdout.decode(errors="replace")


async def _raw_workload(pair: rawmove.RawPair, size: int, progress: Progress) -> str:
    n = blob_mib(size)
    progress(f"writing a {n} MiB random blob in the raw guest")
    await _raw_sh(pair, f"dd if=/dev/urandom of={BLOB} bs=1M count={n} 2>/dev/null",
                  EXEC_TIMEOUT_S)
    code, out = await _raw_sh(pair, f"md5sum {BLOB}", EXEC_TIMEOUT_S)
    if code != 0 or not out.split():
        raise GuestAgentError("md5sum of the blob failed in the raw guest.")
    await _raw_sh(pair, CHURN, EXEC_TIMEOUT_S)
    code, _ = await _raw_sh(pair, f"kill -0 $(cat {CHURN_PID})", CHECK_TIMEOUT_S)
    if code != 0:
        raise GuestAgentError("the background writer in the raw guest did not keep "
                              "running.")
    return out.split()[0]


async def _raw_check(pair: rawmove.RawPair, digest: str, console: Console) -> GuestCheck:
    try:
        code, out = await _raw_sh(pair, f"md5sum {BLOB}", CHECK_TIMEOUT_S)
        words = out.split()
        intact = code == 0 and bool(words) and words[0] == digest
        alive = (await _raw_sh(pair, f"kill -0 $(cat {CHURN_PID})", CHECK_TIMEOUT_S))[0] == 0
        error = None
    except FusumaError as exc:
        intact = alive = False
        error = f"the guest did not answer ({exc})"
    return GuestCheck(intact, alive, console.new_errors(), error)
