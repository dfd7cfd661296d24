"""Migration of a running VM between two partitions on one host.

    fusuma migrate VM --to PARTITION [--mode zero-copy|copy]

The CLI orchestrates; each partition's supervisor does its half
(``supervisor_ops``). Steps, and what a failure at each step leaves:

1. checks (running VM, live supervisors, room in the destination, shared RAM for
   zero-copy) — nothing started;
2. destination prepares a QEMU waiting for the stream — on failure it is removed;
3. source streams the VM — on failure (e.g. the destination QEMU was killed) the
   destination is aborted and the VM keeps running at the source;
4. destination waits for the guest to run and takes the VM's record — on failure the
   paused source is resumed;
5. the source QEMU is ended, then the destination's sockets take their usual names.

After every outcome the VM is in exactly one partition, in ``ps`` and in the DB.
"""

from __future__ import annotations

import contextlib
import logging
import os
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from fusuma.errors import FusumaError, MigrationError, ResourceError, StateError
from fusuma.governor.qos import check_admission
from fusuma.partition.manager import SUPERVISOR_MIB, PartitionManager, vm_need_mib
from fusuma.state.lock import host_lock
from fusuma.vm import VmView

LOG = logging.getLogger(__name__)

# Fault injection for tests: seconds to sleep after the source reports completion
# (so a test can kill the source QEMU there) or before streaming starts.
FAULT_AFTER_COMPLETE = "FUSUMA_FAULT_SLEEP_AFTER_COMPLETE"
FAULT_BEFORE_STREAM = "FUSUMA_FAULT_SLEEP_BEFORE_STREAM"


@dataclass(frozen=True)
class MigrationResult:
    vm: str
    source: str
    to: str
    mode: str
    total_ms: float
    downtime_ms: float | None
    bytes_sent: int
    prepare_ms: float
    cpu_s: float
    qemu_total_ms: float | None
    qemu_downtime_ms: float | None
    # Copy mode under TCG with QEMU < 9.0: the guest was paused for the transfer
    # (live pre-copy there can lose guest writes; see supervisor_ops.TCG_DIRTY_FIX).
    paused: bool = False

    def as_json(self) -> dict[str, Any]:
        d = asdict(self)
        d["from"] = d.pop("source")
        return d


def cpu_seconds(pid: int) -> float:
    """utime + stime of a process, in seconds (0 if it is gone)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def check(parts: PartitionManager, vm: str, to: str, mode: str) -> None:
    """Every refusal happens here, before anything starts."""
    db = parts.db
    rec = db.vm(vm)
    dest = db.partition(to)
    state = VmView(rec).state
    if state != "running":
        raise StateError(f"VM {vm!r} is {state}; only a running VM can be migrated.")
    if rec.partition == to:
        raise StateError(f"VM {vm!r} is already in partition {to!r}.")
    if mode not in ("zero-copy", "copy"):
        raise StateError(f"unknown mode {mode!r}; use zero-copy or copy.")
    if mode == "zero-copy" and rec.mergeable:
        raise StateError(f"VM {vm!r} is mergeable: its RAM is private so that KSM can "
                         "merge it, and zero-copy migration needs RAM in a shared file; "
                         "use --mode copy.")
    if mode == "zero-copy" and not rec.shared_ram:
        raise StateError(f"VM {vm!r} has private RAM, which zero-copy migration cannot "
                         "hand over (it needs RAM in a shared file); use --mode copy.")
    need = SUPERVISOR_MIB + sum(vm_need_mib(v) for v in db.vms(to)) + vm_need_mib(rec)
    if need > dest.memory_mib:
        raise ResourceError(f"partition {to!r} has no room for {vm!r}: it would need "
                            f"{need} MiB of its {dest.memory_mib} MiB; grow it with "
                            f"`fusuma partition resize {to} --memory {need}`.")
    if rec.vcpus > len(dest.cpus):
        raise ResourceError(f"partition {to!r} has {len(dest.cpus)} core(s), fewer than the "
                            f"{rec.vcpus} vCPUs of {vm!r}.")
    check_admission(to, len(dest.cpus), db.vms(to), rec)
    for name in (rec.partition, to):
        if parts.supervisor_pid(name) is None:
            raise StateError(f"the supervisor of partition {name!r} is not running; start "
                             f"it with `fusuma partition restart {name}`.")


def migrate(parts: PartitionManager, vm: str, to: str, mode: str = "zero-copy",
            progress: Callable[[str], None] = lambda s: None) -> MigrationResult:
    with host_lock(parts.paths.home):
        return _migrate(parts, vm, to, mode, progress)


def _migrate(parts: PartitionManager, vm: str, to: str, mode: str,
             progress: Callable[[str], None]) -> MigrationResult:
    check(parts, vm, to, mode)
    rec = parts.db.vm(vm)
    source = rec.partition
    src, dst = parts.client(source), parts.client(to)
    progress(f"preparing {vm} in {to} ({mode})")
    try:
        prep = dst.call("incoming-prepare", vm=vm, mode=mode)
    except FusumaError as exc:
        raise MigrationError(f"the destination for {vm!r} in partition {to!r} could not "
                             f"be prepared ({exc}); {vm!r} stays in partition "
                             f"{source!r}.") from exc
    src_pid, dst_pid = int(rec.pid or 0), int(prep["pid"])
    cpu0 = cpu_seconds(src_pid) + cpu_seconds(dst_pid)
    _fault_sleep(FAULT_BEFORE_STREAM)
    progress(f"moving {vm} {source} -> {to}")
    try:
        out = src.call("migrate-out", rpc_timeout=700, vm=vm, uri=prep["uri"], mode=mode)
    except FusumaError as exc:
        with contextlib.suppress(FusumaError):
            dst.call("incoming-abort", vm=vm)
        if isinstance(exc, MigrationError):
            raise
        raise MigrationError(f"migration of {vm!r} failed ({exc}); it stays in partition "
                             f"{source!r}.") from exc
    cpu1 = cpu_seconds(src_pid) + cpu_seconds(dst_pid)
    _fault_sleep(FAULT_AFTER_COMPLETE)
    try:
        fin = dst.call("incoming-finish", vm=vm, resume=bool(out.get("paused")))
    except FusumaError as exc:
        with contextlib.suppress(FusumaError):
            dst.call("incoming-abort", vm=vm)
        try:
            src.call("resume-source", vm=vm)
        except FusumaError as exc2:
            raise MigrationError(f"{vm!r} did not start at {to!r} ({exc}) and its source "
                                 f"could not be resumed ({exc2}).") from exc
        raise MigrationError(f"{vm!r} did not start in partition {to!r} ({exc}); it was "
                             f"resumed in {source!r}.") from exc
    with contextlib.suppress(FusumaError):
        src.call("release", vm=vm)
    with contextlib.suppress(FusumaError):
        dst.call("settle", vm=vm)
    resume_ts = float(fin["resume_ts"])
    stop_ts = out.get("stop_ts")
    return MigrationResult(
        vm=vm, source=source, to=to, mode=mode,
        total_ms=round((resume_ts - float(out["t0"])) * 1000, 2),
        downtime_ms=round((resume_ts - float(stop_ts)) * 1000, 2) if stop_ts else None,
        bytes_sent=int(out["bytes_sent"]), prepare_ms=float(prep["prepare_ms"]),
        cpu_s=round(cpu1 - cpu0, 3), qemu_total_ms=out.get("qemu_total_ms"),
        qemu_downtime_ms=out.get("qemu_downtime_ms"), paused=bool(out.get("paused")))


def _fault_sleep(var: str) -> None:
    value = os.environ.get(var)
    if value:
        time.sleep(float(value))
