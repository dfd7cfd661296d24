"""`fusuma maintain`: restart a partition's hypervisor instance with ~no VM downtime.

Every running VM of the partition moves to another partition, the partition's
supervisor is restarted (optionally with a new QEMU binary for its VMs), and the VMs
move back — onto QEMU processes started by the new supervisor."""

from __future__ import annotations

from collections.abc import Callable

from fusuma import capacity
from fusuma.errors import MigrationError, StateError
from fusuma.frozen import frozen
from fusuma.migration import (
    ManyFailed,
    MigrationResult,
    Planned,
    check,
    compat,
    inplace,
    migrate_many,
)
from fusuma.migration.inplace import MODE as CPR_MODE
from fusuma.partition.manager import PartitionManager
from fusuma.qemu import versions
from fusuma.state import JobKind, partition_obj
from fusuma.state.joblock import JobLock
from fusuma.state.lock import host_lock
from fusuma.vm import VmView


@frozen
class MaintainResult:
    partition: str
    via: str | None           # None: in place (cpr-transfer)
    qemu: str | None
    supervisor_pid: int
    moves: list[MigrationResult]


def maintain(parts: PartitionManager, partition: str, via: str, qemu: str | None = None,
             progress: Callable[[str], None] = lambda s: None,
             ahead: bool = True) -> MaintainResult:
    """Every step under the host lock and a job on the partition, so no other change
    (a restart, a resize, another maintain) slips in between the moves."""
    with host_lock(parts.paths.home), \
            parts.job(partition_obj(partition), JobKind.MAINTAIN, peer=via) as jh:
        return _maintain(parts, jh, partition, via, qemu, progress, ahead)


def _maintain(parts: PartitionManager, jh: JobLock, partition: str, via: str,
              qemu: str | None, progress: Callable[[str], None],
              ahead: bool = True) -> MaintainResult:
    db = parts.db
    rec = db.partition(partition)
    db.partition(via)
    if via == partition:
        raise StateError("--via must name another partition.")
    parts.check_qemu(qemu)
    vms = [v for v in db.vms(partition) if VmView(v).state == "running"]
    modes = {v.name: "zero-copy" if v.shared_ram else "copy" for v in vms}
    # Refuse before the first move if any VM cannot go (the checks are per VM, so
    # room for all of them together is checked next).
    for v in vms:
        check(parts, v.name, via, modes[v.name])
    if qemu is not None:
        # ... and come back onto the new QEMU: it must have every guest's machine type.
        new = versions.resolve(parts.paths, qemu)
        for v in vms:
            compat.check_runs_on(parts.paths, db.vm(v.name), new, partition)
    capacity.check_many(parts.paths, db, vms, via, modes, host=parts.host)
    jh.phase("moving out", vms=[v.name for v in vms])
    moves = migrate_many(parts, [Planned(v.name, via, modes[v.name]) for v in vms],
                         progress, ahead)
    if qemu is not None:
        progress(f"switching {partition} to {qemu}")
        parts.db.update_partition(type(rec)(**{**parts.db.partition(partition).__dict__,
                                               "qemu": qemu}))
    progress(f"restarting the supervisor of {partition}")
    jh.phase("restarting")
    pid = parts.restart(partition)
    jh.phase("moving back")
    try:
        moves += migrate_many(parts, [Planned(v.name, partition, modes[v.name])
                                      for v in vms], progress, ahead)
    except ManyFailed as exc:
        back = ""
        if qemu is not None and qemu != rec.qemu:
            # The new QEMU could not take the guest (it died, or will not start):
            # what starts in the partition next runs on the old QEMU again, as
            # before the upgrade. The guests keep the QEMUs they run on.
            db.update_partition(type(rec)(**{**db.partition(partition).__dict__,
                                             "qemu": rec.qemu}))
            back = (f" Partition {partition!r} is back on its old QEMU "
                    f"({rec.qemu or 'the system one'}).")
        raise MigrationError(f"{exc}{back} The VMs not moved back run in "
                             f"{via!r}.") from exc
    return MaintainResult(partition, via, qemu, pid, moves)


def maintain_in_place(parts: PartitionManager, partition: str, qemu: str | None = None,
                      progress: Callable[[str], None] = lambda s: None,
                      ahead: bool = True) -> MaintainResult:
    """Move every running VM of ``partition`` to a new QEMU process in the partition
    itself by cpr-transfer (``fusuma.supervisor.moves.cpr``), with ``qemu`` (a version or
    path) the partition's QEMU from now on. No second partition is needed. Refused,
    with nothing changed, where a QEMU lacks cpr-transfer (QEMU < 10.0)."""
    with host_lock(parts.paths.home), \
            parts.job(partition_obj(partition), JobKind.MAINTAIN,
                         peer=partition) as jh:
        db = parts.db
        rec = db.partition(partition)
        new = inplace.partition_qemu(parts, partition, qemu)
        inplace.check_partition(partition, new, switching=qemu is not None)
        vms = [v for v in db.vms(partition) if VmView(v).state == "running"]
        for v in vms:
            inplace.check(parts, v.name, new)
        if qemu is not None:
            progress(f"switching {partition} to QEMU {new.version}")
            db.update_partition(type(rec)(**{**db.partition(partition).__dict__,
                                             "qemu": qemu}))
        jh.phase("moving in place", vms=[v.name for v in vms])
        # Those not moved run on their old QEMU (ManyFailed says which).
        moves = migrate_many(parts, [Planned(v.name, partition, CPR_MODE) for v in vms],
                             progress, ahead)
        return MaintainResult(partition, None, qemu, parts.supervisor_pid(partition) or 0,
                              moves)
