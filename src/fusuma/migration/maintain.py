"""`fusuma maintain`: restart a partition's hypervisor instance with ~no VM downtime.

Every running VM of the partition moves to another partition, the partition's
supervisor is restarted (optionally with a new QEMU binary for its VMs), and the VMs
move back — onto QEMU processes started by the new supervisor."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from fusuma import capacity, recovery
from fusuma.errors import MigrationError, StateError
from fusuma.migration import MigrationResult, check, migrate
from fusuma.partition.manager import PartitionManager
from fusuma.state import partition_obj
from fusuma.state.lock import host_lock
from fusuma.vm import VmView


@dataclass(frozen=True)
class MaintainResult:
    partition: str
    via: str
    qemu: str | None
    supervisor_pid: int
    moves: list[MigrationResult]


def maintain(parts: PartitionManager, partition: str, via: str, qemu: str | None = None,
             progress: Callable[[str], None] = lambda s: None) -> MaintainResult:
    """Every step under the host lock and a job on the partition, so no other change
    (a restart, a resize, another maintain) slips in between the moves."""
    with host_lock(parts.paths.home), \
            recovery.job(parts, partition_obj(partition), "maintain", peer=via) as jh:
        return _maintain(parts, jh, partition, via, qemu, progress)


def _maintain(parts: PartitionManager, jh: recovery.JobHandle, partition: str, via: str,
              qemu: str | None, progress: Callable[[str], None]) -> MaintainResult:
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
    capacity.check_many(parts.paths, db, vms, via, modes, host=parts.host)
    moves: list[MigrationResult] = []
    jh.phase("moving out", vms=[v.name for v in vms])
    for v in vms:
        moves.append(migrate(parts, v.name, via, modes[v.name], progress))
    if qemu is not None:
        progress(f"switching {partition} to {qemu}")
        parts.db.update_partition(type(rec)(**{**parts.db.partition(partition).__dict__,
                                               "qemu": qemu}))
    progress(f"restarting the supervisor of {partition}")
    jh.phase("restarting")
    pid = parts.restart(partition)
    jh.phase("moving back")
    for v in vms:
        try:
            moves.append(migrate(parts, v.name, partition, modes[v.name], progress))
        except MigrationError as exc:
            raise MigrationError(f"{exc} The VMs not yet moved back run in {via!r}.") from exc
    return MaintainResult(partition, via, qemu, pid, moves)
