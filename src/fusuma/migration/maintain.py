"""`fusuma maintain`: restart a partition's hypervisor instance with ~no VM downtime.

Every running VM of the partition moves to another partition, the partition's
supervisor is restarted (optionally with a new QEMU binary for its VMs), and the VMs
move back — onto QEMU processes started by the new supervisor."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from fusuma.errors import MigrationError, StateError
from fusuma.migration import MigrationResult, check, migrate
from fusuma.partition.manager import PartitionManager
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
    db = parts.db
    rec = db.partition(partition)
    db.partition(via)
    if via == partition:
        raise StateError("--via must name another partition.")
    parts.check_qemu(qemu)
    vms = [v for v in db.vms(partition) if VmView(v).state == "running"]
    modes = {v.name: "zero-copy" if v.shared_ram else "copy" for v in vms}
    # Refuse before the first move if any VM cannot go (the checks are per VM, so
    # room for all of them together is checked by their sum below).
    for v in vms:
        check(parts, v.name, via, modes[v.name])
    from fusuma.partition.manager import SUPERVISOR_MIB, vm_need_mib

    need = SUPERVISOR_MIB + sum(vm_need_mib(v) for v in db.vms(via)) + sum(
        vm_need_mib(v) for v in vms)
    if need > db.partition(via).memory_mib:
        raise MigrationError(f"partition {via!r} has no room for all VMs of {partition!r} "
                             f"({need} MiB needed, {db.partition(via).memory_mib} MiB there).")
    moves: list[MigrationResult] = []
    for v in vms:
        moves.append(migrate(parts, v.name, via, modes[v.name], progress))
    if qemu is not None:
        progress(f"switching {partition} to {qemu}")
        parts.db.update_partition(type(rec)(**{**parts.db.partition(partition).__dict__,
                                               "qemu": qemu}))
    progress(f"restarting the supervisor of {partition}")
    pid = parts.restart(partition)
    for v in vms:
        try:
            moves.append(migrate(parts, v.name, partition, modes[v.name], progress))
        except MigrationError as exc:
            raise MigrationError(f"{exc} The VMs not yet moved back run in {via!r}.") from exc
    return MaintainResult(partition, via, qemu, pid, moves)
