"""Resolve a move whose orchestrator failed or died, asking the two QEMUs.

Used both by `fusuma migrate` itself when a step fails and by recovery after its
owner died (``fusuma.recovery``): one procedure, whatever went wrong.

Rules (issue "nothing lost, nothing wedged"):
- never two QEMUs running one guest: a destination runs only once the outcome
  "forward" is recorded, a source resumes only once "back" is;
- never resume a source after its destination has run: "forward" is final;
- if the destination holds the whole stream and nothing is decided yet, go forward
  (the guest keeps its newest state), otherwise back;
- a RAM file is never unlinked while a QEMU maps it (``Supervisor._remove_ram``).
"""

from __future__ import annotations

import contextlib
import logging

from fusuma.errors import FusumaError
from fusuma.frozen import frozen
from fusuma.partition.manager import PartitionManager
from fusuma.state import Decision, Job, VmState, vm_obj
from fusuma.supervisor import rpc

LOG = logging.getLogger(__name__)


@frozen
class Outcome:
    vm: str
    decision: str           # a Decision, or "lost"
    partition: str          # where the VM is now (or crashed)
    running: bool
    how: str                # one clause for the user

    def sentence(self) -> str:
        if self.running:
            return f"{self.vm!r} {self.how} and runs in partition {self.partition!r}"
        return f"{self.vm!r} is lost ({self.how}); it is marked crashed in partition " \
               f"{self.partition!r}: start it again with `fusuma vm start {self.vm}`"


def _instances(parts: PartitionManager, partition: str | None, vm: str) -> list[rpc.Instance]:
    if not partition:
        return []
    client = parts.client(partition)
    if parts.supervisor_pid(partition) is None:
        # Its supervisor died too: a new one adopts this partition's QEMUs first.
        with contextlib.suppress(FusumaError):
            parts.start_supervisor(partition)
    try:
        return client.send(rpc.ListInstances(vm)).instances
    except FusumaError as exc:
        LOG.warning("cannot ask partition %s about %s: %s", partition, vm, exc)
        return []


def recover_move(parts: PartitionManager, job: Job) -> Outcome:
    """Bring the VM of a move job to exactly one QEMU (or none), and its record with it.

    The caller owns ``job`` (began it or took it over) and ends it afterwards."""
    db = parts.db
    vm = job.name
    source, dest = job.source or "", job.peer or ""
    src = _instances(parts, source, vm)
    if source == dest:
        # An in-place move (fusuma.supervisor.moves.cpr): one partition holds both QEMUs,
        # told apart by the old one's pid.
        spid = job.detail.get("source_pid")
        s = next((i for i in src if i.pid == spid), None)
        d = next((i for i in src if i.pid != spid and i.role in ("incoming", "vm")), None)
    else:
        dst = _instances(parts, dest, vm)
        s = next((i for i in src if i.role in ("vm", "leaving")), None)
        d = next((i for i in dst if i.role in ("incoming", "vm")), None)
    cur = db.find_job(vm_obj(vm))
    decision = (cur.detail.get("decision") if cur else None)
    if decision is None:
        ready = d is not None and (d.role == "vm" or (
            d.migration == "completed" and d.status in ("paused", "running")))
        decision = db.decide(vm_obj(vm), Decision.FORWARD if ready
                             else Decision.BACK) or Decision.BACK
    LOG.info("recovering the move of %s: outcome %s (source %s, destination %s)", vm,
             decision, s, d)
    if decision == Decision.FORWARD:
        if d is not None:
            parts.client(dest).send(rpc.IncomingCommit(vm))
            with contextlib.suppress(FusumaError):
                parts.client(source).send(rpc.Release(vm))
            with contextlib.suppress(FusumaError):
                parts.client(dest).send(rpc.Settle(vm))
            return Outcome(vm, decision, dest, True, "moved")
        # The guest ran at the destination, which is gone: it must not run from the
        # source's older state either.
        with contextlib.suppress(FusumaError):
            parts.client(source).send(rpc.Release(vm))
        _crashed(parts, vm, dest, "its destination QEMU ended after the guest had moved")
        return Outcome(vm, "lost", dest, False, "its destination QEMU ended after the "
                       "guest had moved there")
    # back
    if d is not None and d.role == "incoming":
        with contextlib.suppress(FusumaError):
            parts.client(dest).send(rpc.IncomingAbort(vm))
    if s is not None:
        parts.client(source).send(rpc.ResumeSource(vm))
        rec = db.vm(vm)
        if rec.state == VmState.MIGRATING:
            db.transition(vm, VmState.RUNNING, expect={VmState.MIGRATING},
                          partition=source, pid=s.pid)
        return Outcome(vm, decision, source, True, "stays where it was")
    _crashed(parts, vm, source, "its source QEMU ended before the guest reached the "
             "destination")
    return Outcome(vm, "lost", source, False, "its source QEMU ended before the guest "
                   "reached the destination")


def _crashed(parts: PartitionManager, vm: str, partition: str, why: str) -> None:
    db = parts.db
    rec = db.vm(vm)
    if rec.state != VmState.CRASHED:
        db.transition(vm, VmState.CRASHED, partition=partition, pid=None,
                      error=f"QEMU lost during a move: {why}")
    else:
        db.set_vm(vm, partition=partition, pid=None)
    for dname in rec.disks:
        db.move_disk(dname, partition)
    # The guest's RAM is of no use now; free it unless some QEMU still maps it.
    from fusuma.qemu.process import remove_unmapped

    for ram in {rec.ram_path, *_copy_rams(parts, vm)}:
        if ram:
            remove_unmapped(ram, parts.paths)
    parts.cg.sweep_ram_groups(parts.paths.shm)


def _copy_rams(parts: PartitionManager, vm: str) -> list[str]:
    return [str(p) for p in parts.paths.shm.glob(f"{vm}.*.ram")] \
        if parts.paths.shm.exists() else []
