"""Recovery: the one entry point that finishes or undoes a job whose owner died.

Every long operation holds its object's job (``fusuma.state.joblock``). When a job's
owner is found dead, :func:`recover` takes the job over (a conditional update: only
one process can) and dispatches on its kind (:data:`RECOVERERS`), asking the QEMUs, not
the record:

- start, stop, kill, template save: the partition's supervisor owns them and finishes
  them itself (its sweep, or its adoption when it starts): make sure it runs, and wait;
- migrate: ``fusuma.migration.resolve`` brings the VM to exactly one QEMU;
- delete: the VM's QEMU is ended and its record and files removed;
- restore (a new VM made from a backup): the half-made VM is removed;
- resize: the partition's cgroup gets the limits its record names;
- maintain: nothing (its moves are jobs of their own);
- host-move, host-move-in: the cluster agent resolves them from the FusumaVM.

Recovery runs (1) inline, before any command touches an object whose job owner is dead
(``PartitionManager.recover`` is this function in the CLI, the API daemon and the
agent); (2) on its own within seconds of an owner's death: each supervisor sweeps the
jobs every second and starts ``python -m fusuma.recovery OBJ``; (3) when a supervisor
starts.
"""

from __future__ import annotations

import contextlib
import logging
import sys
from collections.abc import Callable

from fusuma.errors import FusumaError, StateError
from fusuma.partition.manager import PartitionManager
from fusuma.state import LOCAL_JOBS, Job, JobKind, JobOwner
from fusuma.state.joblock import wait_until
from fusuma.state.lock import host_lock
from fusuma.vm import VmManager

LOG = logging.getLogger(__name__)


def recover(parts: PartitionManager, held: Job, wait: float = 60.0) -> None:
    """Take over ``held`` (its owner is dead) and finish or undo it."""
    if held.kind in LOCAL_JOBS:
        _local(parts, held, wait)
        return
    me = JobOwner.me()
    with host_lock(parts.paths.home):
        taken = parts.db.take_over(held.obj, held.owner, me)
        if taken is None:
            # Another process took it over first: wait for it to end.
            wait_until(parts.db, held.obj, wait,
                       lambda cur: cur is None or not cur.owner.alive())
            return
        try:
            RECOVERERS.get(taken.kind, _nothing)(parts, taken)
        except FusumaError as exc:
            LOG.error("recovery of the %s job on %s failed: %s", held.kind, held.obj, exc)
            raise
        finally:
            parts.db.end_job(held.obj, me)
    LOG.warning("recovered the %s job on %s (phase %s) whose owner pid %d died", held.kind,
                held.obj, held.phase, held.owner.pid)


def _local(parts: PartitionManager, held: Job, wait: float) -> None:
    """A job of a supervisor's (``LOCAL_JOBS``): it finishes it itself (its sweep, or
    its adoption when it starts); make sure one runs, and wait."""
    if held.source and parts.db.find_partition(held.source) is not None \
            and parts.supervisor_pid(held.source) is None:
        with host_lock(parts.paths.home), contextlib.suppress(StateError):
            parts.start_supervisor(held.source)
    wait_until(parts.db, held.obj, wait, lambda cur: cur is None or cur.owner.alive())


def _move(parts: PartitionManager, j: Job) -> None:
    from fusuma.migration.resolve import recover_move  # only a dead move needs the mover

    out = recover_move(parts, j)
    LOG.warning("move of %s: %s", j.name, out.sentence())
    parts.db.emit_context("lifecycle", "vm-move-recovered", f"/1.0/vms/{j.name}",
                          {"vm": j.name, "from": j.source, "to": j.peer,
                           "mode": j.detail.get("mode"), "result": "recovered",
                           "decision": out.decision, "phase": j.phase,
                           "sentence": out.sentence()})


def _delete(parts: PartitionManager, j: Job) -> None:
    if parts.db.find_vm(j.name) is not None:
        VmManager(parts.paths, parts.db, parts).finish_delete(j.name)


def _restore(parts: PartitionManager, j: Job) -> None:
    """A restore into a new VM whose process died: the VM it was making is removed
    (in phase ``begin`` it had made none, and a VM of that name is another's)."""
    if j.phase != "begin":
        from fusuma.vm.backups import undo

        disks = j.detail.get("disks")
        undo(VmManager(parts.paths, parts.db, parts), j.name,
             [str(d) for d in disks] if isinstance(disks, list) else [])


def _resize(parts: PartitionManager, j: Job) -> None:
    rec = parts.db.find_partition(j.name)
    if rec is not None:
        parts.cg.update(j.name, parts.limits(rec))


def _nothing(parts: PartitionManager, j: Job) -> None:
    """maintain: its moves are jobs of their own; the VMs run wherever those left them.
    host-move, host-move-in: the cluster agent resolves them from the FusumaVM."""


#: What finishing a job of each kind takes (the local kinds are the supervisors').
RECOVERERS: dict[str, Callable[[PartitionManager, Job], None]] = {
    JobKind.MIGRATE: _move,
    JobKind.DELETE: _delete,
    JobKind.RESTORE: _restore,
    JobKind.RESIZE: _resize,
    JobKind.MAINTAIN: _nothing,
    JobKind.HOST_MOVE: _nothing,
    JobKind.HOST_MOVE_IN: _nothing,
}


def in_process(parts: PartitionManager) -> PartitionManager:
    """``parts`` recovering dead jobs in this process (see the module docstring)."""
    parts.recover = lambda held: recover(parts, held)
    return parts


def main() -> None:
    """`python -m fusuma.recovery OBJ`: recover one job whose owner died."""
    from fusuma.paths import Paths
    from fusuma.state import Database

    logging.basicConfig(level=logging.INFO, stream=sys.stderr,
                        format="%(asctime)s recovery %(levelname)s %(message)s")
    logging.getLogger("qemu.qmp").setLevel(logging.CRITICAL)
    paths = Paths.from_env()
    parts = in_process(PartitionManager(paths, Database(paths.db)))
    for obj in sys.argv[1:]:
        held = parts.db.find_job(obj)
        if held is None or held.owner.alive():
            continue
        try:
            recover(parts, held)
        except FusumaError as exc:
            LOG.error("%s", exc)
            sys.exit(1)


if __name__ == "__main__":
    main()
