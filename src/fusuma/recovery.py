"""Jobs held by the CLI (moves, deletes, resizes, maintenance) and their recovery.

``job(...)`` records an operation before its first step and ends it after the last;
the operation writes each phase with ``JobHandle.phase``. A command that finds its
object held by a live owner is refused with one sentence naming the operation, its
phase, since when and by which pid; held by a dead owner, it recovers the job first.

Recovery runs (1) inline, before any command touches an object whose job owner is
dead; (2) on its own within seconds of an owner's death: each supervisor sweeps the
jobs every second and starts ``python -m fusuma.recovery OBJ``; (3) when a supervisor
starts. It takes the job over (a conditional update: only one process can) and
finishes or undoes it, asking the QEMUs, not the record.
"""

from __future__ import annotations

import contextlib
import logging
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass

from fusuma.errors import FusumaError, StateError
from fusuma.partition.manager import PartitionManager
from fusuma.state import Job, JobOwner, busy_sentence
from fusuma.state.lock import host_lock

LOG = logging.getLogger(__name__)


@dataclass
class JobHandle:
    parts: PartitionManager
    obj: str
    owner: JobOwner

    def phase(self, phase: str, **detail: object) -> Job:
        return self.parts.db.set_phase(self.obj, self.owner, phase, **detail)


@contextlib.contextmanager
def job(parts: PartitionManager, obj: str, kind: str, *, source: str | None = None,
        peer: str | None = None) -> Iterator[JobHandle]:
    """Hold ``obj`` for one operation (see the module docstring)."""
    owner = JobOwner.me()
    new = Job(obj, kind, "begin", owner, source=source, peer=peer)
    for _ in range(3):
        held = parts.db.begin_job(new)
        if held is None:
            break
        if held.owner.alive():
            raise StateError(busy_sentence(held))
        recover(parts, held)
    else:
        raise StateError(f"{obj} is busy; try again.")
    try:
        yield JobHandle(parts, obj, owner)
    finally:
        parts.db.end_job(obj, owner)


def ensure_recovered(parts: PartitionManager, obj: str) -> None:
    """Before a command touches ``obj``: recover a job whose owner died."""
    held = parts.db.find_job(obj)
    if held is not None and not held.owner.alive():
        recover(parts, held)


def recover(parts: PartitionManager, held: Job, wait: float = 60.0) -> None:
    """Take over ``held`` (its owner is dead) and finish or undo it."""
    me = JobOwner.me()
    if held.kind in ("start", "stop", "kill", "template"):
        _local(parts, held, wait)
        return
    with host_lock(parts.paths.home):
        taken = parts.db.take_over(held.obj, held.owner, me)
        if taken is None:
            # Another process took it over first: wait for it to end.
            deadline = time.monotonic() + wait
            while time.monotonic() < deadline:
                cur = parts.db.find_job(held.obj)
                if cur is None or not cur.owner.alive():
                    return
                time.sleep(0.05)
            return
        try:
            _dispatch(parts, taken)
        except FusumaError as exc:
            LOG.error("recovery of the %s job on %s failed: %s", held.kind, held.obj, exc)
            raise
        finally:
            parts.db.end_job(held.obj, me)
    LOG.warning("recovered the %s job on %s (phase %s) whose owner pid %d died", held.kind,
                held.obj, held.phase, held.owner.pid)


def _local(parts: PartitionManager, held: Job, wait: float) -> None:
    """A start, stop, kill or template save belongs to a supervisor, which finishes it
    itself (its sweep, or its adoption when it starts): make sure one runs, and wait."""
    if held.source and parts.db.find_partition(held.source) is not None \
            and parts.supervisor_pid(held.source) is None:
        with host_lock(parts.paths.home), contextlib.suppress(StateError):
            parts.start_supervisor(held.source)
    deadline = time.monotonic() + wait
    while time.monotonic() < deadline:
        cur = parts.db.find_job(held.obj)
        if cur is None or cur.owner.alive():
            return
        time.sleep(0.05)


def _dispatch(parts: PartitionManager, j: Job) -> None:
    if j.kind == "migrate":
        from fusuma.migration.resolve import recover_move

        out = recover_move(parts, j)
        LOG.warning("move of %s: %s", j.name, out.sentence())
        parts.db.emit_context("lifecycle", "vm-move-recovered", f"/1.0/vms/{j.name}",
                              {"vm": j.name, "from": j.source, "to": j.peer,
                               "mode": j.detail.get("mode"), "result": "recovered",
                               "decision": out.decision, "phase": j.phase,
                               "sentence": out.sentence()})
    elif j.kind == "delete":
        from fusuma.vm import VmManager

        if parts.db.find_vm(j.name) is not None:
            VmManager(parts.paths, parts.db, parts).finish_delete(j.name)
    elif j.kind == "resize":
        rec = parts.db.find_partition(j.name)
        if rec is not None:
            parts.cg.update(j.name, parts._limits(rec))
    # maintain: its moves are jobs of their own; the VMs run wherever those left them.


def main() -> None:
    """`python -m fusuma.recovery OBJ`: recover one job whose owner died."""
    from fusuma.paths import Paths
    from fusuma.state import Database

    logging.basicConfig(level=logging.INFO, stream=sys.stderr,
                        format="%(asctime)s recovery %(levelname)s %(message)s")
    logging.getLogger("qemu.qmp").setLevel(logging.CRITICAL)
    paths = Paths.from_env()
    parts = PartitionManager(paths, Database(paths.db))
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
