"""`fusuma bench maintain`: upgrade a partition's QEMU under N running VMs.

For each VM count N, two scratch partitions take the cores no partition holds (one
core each): ``bench-maintain-p`` runs N VMs (256 MiB, the minimal image) on QEMU
``--from``; ``bench-maintain-via`` (also ``--from``) holds them meanwhile. Each guest
writes a random blob and remembers its md5. Then:

1. ``zero-copy`` (always): ``maintain P --via VIA --qemu TO``: every VM moves out
   (zero-copy), P's supervisor restarts on QEMU ``--to``, every VM moves back onto a
   ``--to`` QEMU. Two moves per VM.
2. ``cpr-transfer`` (with ``--in-place``): on the same VMs, now on ``--to`` (whose QEMUs
   started with aux-ram-share=on): ``maintain P --in-place``, each VM to a new ``--to``
   QEMU in P itself. One move per VM, no second partition.

With ``--busy`` every guest runs a CPU loop during each maintain (the issue's "with
the guests busy"); its CPU use before the maintain is recorded. Without it, each
maintain waits until the guests are idle.

Recorded per (method, N): the whole maintain's wall time, every move's downtime,
total and bytes sent, and whether every guest's blob still has its md5 afterwards
(and every guest answers). The result file carries the ``meta`` block; the report
(``report_maintain``) is rendered from it alone. Everything the benchmark made is
removed afterwards, also on failure.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from functools import partial
from typing import Any

from fusuma.capacity import SUPERVISOR_MIB, vm_overhead
from fusuma.errors import FusumaError, GuestAgentError, ResourceError
from fusuma.host.accel import probe_accel
from fusuma.migration.maintain import MaintainResult, maintain, maintain_in_place
from fusuma.partition.manager import PartitionManager
from fusuma.qemu import versions
from fusuma.spec import PartitionSpec, VmSpec
from fusuma.state import VmRecord
from fusuma.vm import VmManager
from fusuma_bench.agents import wait_agents
from fusuma_bench.report import meta
from fusuma_bench.report_maintain import median, nearest_rank
from fusuma_bench.steady import qemu_cpu_s, wait_quiet

LOG = logging.getLogger(__name__)

PARTITION = "bench-maintain-p"
VIA = "bench-maintain-via"
VM_PREFIX = "bench-maintain-vm"
MEMORY_MIB = 256
BLOB_MIB = 16
BOOT_BATCH = 4           # VMs booted together (TCG boots are CPU-bound)
EXEC_TIMEOUT_S = 120.0
MARGIN_MIB = 64
DEFAULT_VMS = (1, 4, 16)
# Before each maintain: wait (at most QUIESCE_S) until the guests' QEMUs use less than
# QUIET_CORES together.
QUIET_CORES = 0.5
QUIESCE_S = 30.0
METHODS = ("zero-copy", "cpr-transfer")
# --busy: every guest's CPU loop, stopped by this file, and by `timeout` at the latest.
BUSY_STOP = "/tmp/fusuma-bench-busy.stop"
BUSY_MAX_S = 600
BUSY_SAMPLE_S = 2.0

Progress = Callable[[str], None]


@dataclass
class Case:
    """One maintain of N VMs by one method."""

    method: str
    vms: int
    source_qemu: str
    target_qemu: str
    maintain_s: float | None = None
    moves: list[dict[str, Any]] = field(default_factory=list)
    data_intact: bool = False
    error: str | None = None
    busy_cores_before: float | None = None    # the guests' CPU use when it started
    # The next move's QEMU started during this one's release (fusuma.migration.
    # migrate_many, as maintain runs by default); False: each move after the one
    # before (--compare-pipeline).
    pipelined: bool = True
    busy: bool = False         # every guest ran a CPU loop during the maintain (--busy)

    def as_json(self) -> dict[str, Any]:
        downs = [float(m["downtime_ms"]) for m in self.moves
                 if m.get("downtime_ms") is not None]
        per_vm: dict[str, float] = {}
        for m in self.moves:
            if m.get("downtime_ms") is not None:
                per_vm[m["vm"]] = max(per_vm.get(m["vm"], 0.0), float(m["downtime_ms"]))
        return {"method": self.method, "pipelined": self.pipelined, "vms": self.vms,
                "from_qemu": self.source_qemu,
                "to_qemu": self.target_qemu, "maintain_s": self.maintain_s,
                "moves": len(self.moves),
                "downtime_ms_max": max(downs) if downs else None,
                "downtime_ms_median": median(downs),
                "downtime_ms_p99": nearest_rank(downs, 0.99),
                "wall_ms_sum": _wall_sums(self.moves),
                "bytes_sent_median": median([float(m["bytes_sent"]) for m in self.moves]),
                "bytes_sent_total": sum(int(m["bytes_sent"]) for m in self.moves),
                "vm_downtime_ms": per_vm, "data_intact": self.data_intact,
                "busy_guests": self.busy,
                "busy_cores_before": self.busy_cores_before, "error": self.error}


def _wall_sums(moves: Sequence[dict[str, Any]]) -> dict[str, float]:
    """Each step of the moves' ``wall_ms`` (``fusuma.migration.WALL_STEPS``) summed
    over the moves, in the steps' order: where a maintain's time went. A step of one
    move can overlap another move's (the next destination prepared during a release),
    so the sum can exceed the maintain's time."""
    from fusuma.migration import WALL_STEPS

    sums = {step: 0.0 for step in WALL_STEPS}
    for m in moves:
        for step, ms in (m.get("wall_ms") or {}).items():
            sums[step] = sums.get(step, 0.0) + float(ms)
    return {k: round(v, 2) for k, v in sums.items() if v}


def run(parts: PartitionManager, vms: VmManager, counts: Sequence[int], source: str,
        target: str, in_place: bool, progress: Progress = lambda s: None,
        compare_pipeline: bool = False, busy: bool = False) -> dict[str, Any]:
    accel = probe_accel("auto").name
    cores = _check_host(parts, counts, accel)
    q_from = versions.resolve(parts.paths, source)
    q_to = versions.resolve(parts.paths, target)
    t_start = time.monotonic()
    load_start = os.getloadavg()[0]
    results: list[dict[str, Any]] = []
    all_moves: list[dict[str, Any]] = []
    for n in counts:
        for case in _one_count(parts, vms, cores, n, source, target, q_from.version,
                               q_to.version, in_place, accel, progress,
                               compare_pipeline, busy):
            results.append(case.as_json())
            all_moves += [{**m, "method": case.method, "vms": n,
                           "pipelined": case.pipelined} for m in case.moves]
            r = results[-1]
            progress(f"{case.method}{'' if case.pipelined else ' (serial)'} x{n}: "
                     f"maintain {r['maintain_s']} s, downtime max "
                     f"{r['downtime_ms_max']} ms, data intact {r['data_intact']}"
                     + (f"; {r['error']}" if r["error"] else ""))
    return {"meta": meta(accel, benchmark="maintain", vms=list(counts), source=source,
                         target=target, from_version=q_from.version,
                         to_version=q_to.version, in_place=in_place, cores=cores,
                         compare_pipeline=compare_pipeline, busy_guests=busy,
                         guest_memory_mib=MEMORY_MIB, blob_mib=BLOB_MIB,
                         quiet_cores=QUIET_CORES, quiesce_s=QUIESCE_S,
                         methods=[m for m in METHODS if in_place or m != "cpr-transfer"],
                         duration_s=round(time.monotonic() - t_start, 1),
                         loadavg_1m_start=round(load_start, 2),
                         loadavg_1m_end=round(os.getloadavg()[0], 2)),
            "results": results, "moves": all_moves}


def partition_mib(n: int, accel: str) -> int:
    """A scratch partition's memory: its supervisor and the QEMUs of N VMs plus one
    (a move's second QEMU). Guest RAM is admitted host-wide (fusuma.capacity)."""
    vm = VmRecord(name=VM_PREFIX, partition=PARTITION, vcpus=1, memory_mib=MEMORY_MIB,
                  accel_used=accel)
    return SUPERVISOR_MIB + (n + 1) * vm_overhead(vm) + MARGIN_MIB


def _check_host(parts: PartitionManager, counts: Sequence[int], accel: str) -> list[int]:
    used = {c for p in parts.db.partitions() for c in p.cpus}
    free = [c for c in parts.host.cpus if c not in used]
    if len(free) < 2:
        raise ResourceError(f"`bench maintain` needs two cores no partition holds (one for "
                            f"the maintained partition, one for --via); free: "
                            f"{free or 'none'}. Run `fusuma down` first.")
    for name in (PARTITION, VIA):
        if parts.db.find_partition(name) is not None:
            raise ResourceError(f"partition {name!r} exists (an earlier run?); remove it "
                                f"with `fusuma partition delete {name} --force`.")
    return free[:2]


def _one_count(parts: PartitionManager, vms: VmManager, cores: list[int], n: int,
               source: str, target: str, v_from: str, v_to: str, in_place: bool,
               accel: str, progress: Progress,
               compare_pipeline: bool = False, busy: bool = False) -> list[Case]:
    mem = partition_mib(n, accel)
    names = [f"{VM_PREFIX}{i}" for i in range(n)]
    cases: list[Case] = []
    try:
        parts.create(PartitionSpec(name=PARTITION, cpus=[cores[0]], memory_mib=mem,
                                   qemu=source))
        parts.create(PartitionSpec(name=VIA, cpus=[cores[1]], memory_mib=mem, qemu=source))
        for name in names:
            vms.create(VmSpec(name=name, partition=PARTITION, memory_mib=MEMORY_MIB))
        _boot(parts, vms, names, progress)
        digests = {name: _write_blob(vms, name) for name in names}
        # With --compare-pipeline each method runs first serially (each move begun
        # once the one before is done), then pipelined as maintain runs by default:
        # both in this run. The second --via maintain runs from --to to --to.
        kinds = (False, True) if compare_pipeline else (True,)
        for ahead in kinds:
            via = Case("zero-copy", n, v_from if not cases else v_to, v_to,
                       pipelined=ahead)
            cases.append(via)
            _measure(via, names, digests, vms, progress,
                     partial(maintain, parts, PARTITION, VIA, target, progress=progress,
                             ahead=ahead), busy)
            if via.error:
                break
        if in_place:
            for ahead in kinds:
                cpr = Case("cpr-transfer", n, v_to, v_to, pipelined=ahead)
                cases.append(cpr)
                if any(c.error for c in cases):
                    cpr.error = "not run: a maintain before it failed"
                    continue
                _measure(cpr, names, digests, vms, progress,
                         partial(maintain_in_place, parts, PARTITION, progress=progress,
                                 ahead=ahead), busy)
        return cases
    finally:
        progress("removing the scratch partitions")
        for name in (PARTITION, VIA):
            if parts.db.find_partition(name) is None:
                continue
            try:
                parts.delete(name, force=True)
            except FusumaError as exc:
                progress(f"cleanup of partition {name} failed: {exc}")
                LOG.warning("cleanup of partition %s failed: %s", name, exc)


def _quiesce(case: Case, vms: VmManager, names: list[str], progress: Progress) -> None:
    """Wait until the guests are idle again (under TCG a guest on a new QEMU process
    translates its code anew for a while), so each method starts from the same quiet
    partition; at most QUIESCE_S."""
    busy, waited, _ = wait_quiet(
        lambda: qemu_cpu_s(p for p in (vms.db.vm(n).pid for n in names) if p),
        QUIET_CORES, QUIESCE_S)
    case.busy_cores_before = round(busy, 3)
    progress(f"{case.method}: guests use {busy:.2f} core(s) after {waited:.1f} s of "
             "waiting")


def _measure(case: Case, names: list[str], digests: dict[str, str], vms: VmManager,
             progress: Progress, fn: Callable[[], MaintainResult],
             busy: bool = False) -> None:
    _quiesce(case, vms, names, progress)
    if busy:
        _busy(case, vms, names, progress)
    stopped = False

    def unbusy() -> None:
        # Before the data check: md5 of the blob in 16 busy guests on one core took
        # minutes each.
        nonlocal stopped
        if busy and not stopped:
            stopped = True
            for name in names:
                try:
                    _sh(vms, name, f"touch {BUSY_STOP}")
                except FusumaError as exc:
                    progress(f"could not end the CPU loop of {name} (it ends by itself "
                             f"within {BUSY_MAX_S} s): {exc}")
    try:
        _maintain(case, names, digests, vms, progress, fn, unbusy)
    finally:
        unbusy()


def _busy(case: Case, vms: VmManager, names: list[str], progress: Progress) -> None:
    """Start a CPU loop in every guest (ended by BUSY_STOP, or by `timeout` after
    BUSY_MAX_S), then record how many cores the guests use together."""
    for name in names:
        _sh(vms, name, f"rm -f {BUSY_STOP}; timeout {BUSY_MAX_S} sh -c 'while [ ! -e "
                       f"{BUSY_STOP} ]; do :; done' </dev/null >/dev/null 2>&1 &")
    pids = [p for p in (vms.db.vm(n).pid for n in names) if p]
    cpu0, t0 = qemu_cpu_s(pids), time.monotonic()
    time.sleep(BUSY_SAMPLE_S)
    case.busy = True
    case.busy_cores_before = round((qemu_cpu_s(pids) - cpu0)
                                   / max(time.monotonic() - t0, 1e-6), 3)
    progress(f"{case.method}: guests busy, using {case.busy_cores_before:.2f} core(s)")


def _maintain(case: Case, names: list[str], digests: dict[str, str], vms: VmManager,
              progress: Progress, fn: Callable[[], MaintainResult],
              after: Callable[[], None] = lambda: None) -> None:
    progress(f"{case.method}: maintaining {len(names)} VM(s), QEMU {case.source_qemu} -> "
             f"{case.target_qemu}")
    t0 = time.monotonic()
    try:
        res = fn()
        case.moves = [m.as_json() for m in res.moves]
    except FusumaError as exc:
        case.error = str(exc)
    finally:
        case.maintain_s = round(time.monotonic() - t0, 3)
        after()
    # Checked after a failed maintain too: wherever the guests run now, their data must
    # be what it was.
    bad = [name for name in names if not _intact(vms, name, digests[name])]
    case.data_intact = not bad
    if bad:
        what = f"data not intact (or no answer) in {', '.join(bad)}"
        case.error = f"{case.error}; {what}" if case.error else what


def _boot(parts: PartitionManager, vms: VmManager, names: list[str],
          progress: Progress) -> None:
    """Start the VMs BOOT_BATCH at a time, each batch to its guest agents."""
    for first in range(0, len(names), BOOT_BATCH):
        batch = names[first:first + BOOT_BATCH]
        progress(f"booting {', '.join(batch)} ({first + len(batch)}/{len(names)})")
        for vname in batch:
            vms.start(vname)
        wait_agents(parts, [(vname, PARTITION) for vname in batch], timeout=300)


def _sh(vms: VmManager, vm: str, script: str) -> str:
    out = vms.exec(vm, ["/bin/sh", "-c", script], timeout=EXEC_TIMEOUT_S)
    if out.exit_code != 0:
        raise GuestAgentError(f"guest command `{script}` in {vm!r} exited {out.exit_code}: "
                              f"{out.stderr.decode(errors='replace').strip()}",
                              log_tail=out.stderr.decode(errors="replace"))
    return out.stdout.decode(errors="replace")


def _write_blob(vms: VmManager, vm: str) -> str:
    return _sh(vms, vm, f"dd if=/dev/urandom of=/tmp/blob bs=1M count={BLOB_MIB} "
                        "2>/dev/null && md5sum /tmp/blob").split()[0]


def _intact(vms: VmManager, vm: str, digest: str) -> bool:
    try:
        return _sh(vms, vm, "md5sum /tmp/blob").split()[0] == digest
    except (FusumaError, IndexError):
        return False
