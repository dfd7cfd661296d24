"""Live moves between hosts: changing a running FusumaVM's ``spec.host``.

The two agents share no state file, so the FusumaVM's ``status.move`` is the move's
record, and its outcome is written there once: ``decision`` is set with a
resourceVersion precondition (``decide``), so of the two agents (or a restarted one)
only the first writer wins and the other follows. The same rules as a move inside a
host (``fusuma.migration.resolve``) hold: the destination runs the guest only after
"forward" is recorded, the source resumes only after "back" is; so one guest never
runs twice, and never runs from an older state after it ran at the destination.

    source agent (A)                         destination agent (B)
    job host-move; VM migrating
    move: phase Preparing  ─────────────▶    job host-move-in; define the VM here;
                                             QEMU -incoming on tcp:B:port
                          ◀─────────────     move: phase Prepared, uri
    migrate-out to the uri (copy mode;
    live with QEMU >= 9.0 under TCG)
    move: phase Streamed                     stream completed: decide "forward";
                                             cont; move: phase Switched, resumeTs
    decision forward: quit the source,
    remove it here; lastMove; move cleared

A failure before "forward" (the stream fails, B's QEMU dies, B's Lease expires while A
waits) is "back": A resumes its guest and B removes what it made. Each agent holds a job
on its host's VM for its half (``fusuma.supervisor.moves.remote``); an agent that restarts
mid-move finds ``status.move`` and finishes its half from the recorded decision, or
records one: A records "back" (B cannot have run the guest without "forward"), B
records "forward" only if its QEMU holds the whole stream.
"""

from __future__ import annotations

import contextlib
import logging
import time
import uuid
from typing import TYPE_CHECKING, Any

from fusuma.cluster import ConflictApiError, NotFoundApiError
from fusuma.cluster.context import AgentContext, VmMoves
from fusuma.cluster.events import WARNING
from fusuma.cluster.kube import VM, Obj
from fusuma.cluster.owners import Owner
from fusuma.cluster.resources import MOVING, PLACED, RUNNING, VmView, now_iso, set_condition
from fusuma.errors import FusumaError, MigrationError
from fusuma.state import Decision, JobKind, VmState, vm_obj
from fusuma.supervisor import rpc

if TYPE_CHECKING:
    from fusuma.ops.context import Ctx
    from fusuma.state import VmRecord

LOG = logging.getLogger(__name__)
PREPARE_TIMEOUT_S = 60.0
STREAM_TIMEOUT_S = 600.0
DECIDE_TIMEOUT_S = 60.0
# A move that failed is tried again for the same spec after this long.
MOVE_RETRY_S = 60.0
# Fields of the source's record the destination's must carry: the guest-visible machine
# and devices it booted with (the incoming QEMU must match them exactly).
CARRIED = ("machine", "devices", "accel_used")


class MoveAborted(MigrationError):
    """The other side gave up, or the move was decided "back"."""


# -- the move record in the cluster -----------------------------------------------------
def fresh(a: AgentContext, v: VmView) -> VmView:
    return VmView(a.kube.get(VM, v.name, v.namespace))


def patch_move(a: AgentContext, v: VmView, fields: dict[str, Any], **status: Any) -> None:
    """Start the move record (the source, once)."""
    new = a.kube.patch_status(VM, v.name, {"move": fields, **status}, v.namespace)
    a.vms_informer.put(new)


def update_move(a: AgentContext, v: VmView, move_id: str, fields: dict[str, Any],
                **status: Any) -> bool:
    """Add ``fields`` to move ``move_id``'s record (and ``status``) only while that
    move is still the one recorded: a late write never revives a finished move."""
    for _ in range(20):
        obj = a.kube.get(VM, v.name, v.namespace)
        st = obj.setdefault("status", {})
        move = st.get("move") or {}
        if move.get("id") != move_id:
            return False
        move.update(fields)
        st["move"] = move
        st.update(status)
        try:
            new = a.kube.replace(VM, obj, sub="status")
        except ConflictApiError:
            continue
        a.vms_informer.put(new)
        return True
    raise MigrationError(f"could not update the move record of {v.name!r}.")


def decide(a: AgentContext, v: VmView, move_id: str, decision: str,
           why: str | None = None) -> str | None:
    """Record the move's outcome once; return the outcome in force (None: the move
    is no longer recorded)."""
    for _ in range(20):
        obj = a.kube.get(VM, v.name, v.namespace)
        move = (obj.get("status") or {}).get("move") or {}
        if move.get("id") != move_id:
            return None
        if move.get("decision"):
            return str(move["decision"])
        move.update({"decision": decision, "decidedBy": a.host})
        if why:
            move["message"] = why
        obj["status"]["move"] = move
        try:
            new = a.kube.replace(VM, obj, sub="status")
        except ConflictApiError:
            continue
        a.vms_informer.put(new)
        LOG.info("move %s of %s: decided %s", move_id, v.name, decision)
        return decision
    raise MigrationError(f"could not record the outcome of the move of {v.name!r}.")


def wait_move(a: AgentContext, v: VmView, move_id: str, until: Any, timeout: float,
              peer: str | None = None) -> Obj:
    """Poll the move record until ``until(move)``; raise MoveAborted if it is gone,
    failed or decided back, or ``peer``'s Lease expired meanwhile."""
    deadline = time.monotonic() + timeout
    while True:
        obj = a.vms_informer.get(v.namespace, v.name) or a.kube.get(VM, v.name, v.namespace)
        move = (obj.get("status") or {}).get("move") or {}
        if move.get("id") != move_id:
            raise MoveAborted(f"the move of {v.name!r} is no longer recorded.")
        if until(move):
            return dict(move)
        if move.get("decision") == Decision.BACK or move.get("phase") == "Failed":
            raise MoveAborted(f"the move of {v.name!r} was called off "
                              f"({move.get('message') or 'decided back'})")
        if peer and a.host_lost(peer):
            raise MoveAborted(f"host {peer}'s Lease expired during the move.")
        if time.monotonic() > deadline:
            raise MigrationError(f"the move of {v.name!r} did not reach the next step "
                                 f"within {timeout:.0f} s.")
        time.sleep(0.01)


# -- source -----------------------------------------------------------------------------
def begin(a: AgentContext, r: VmMoves, v: VmView, local: VmRecord) -> None:
    """This host runs ``v`` and its spec now names another host: move it there."""
    from fusuma.vm.view import VmView as LocalView

    c = a.ctx()
    dest = str(v.want_host)
    part = v.want_partition or local.partition
    key = f"{v.namespace}/{v.name}"
    state = LocalView(local).state
    if a.host_lost(dest) or a.hosts_informer.get("", dest) is None:
        r.fail(v, "MoveFailed", f"cannot move {v.name!r} to host {dest!r}: it is not a "
               "registered, live host (kubectl get fusumahosts).", state=v.state)
        return
    if state in ("stopped", "crashed"):
        # Nothing to carry: the destination defines it anew from the spec.
        c.vms.delete(v.name, force=True)
        a.owners.remove("vms", v.name)
        new = a.kube.patch_status(VM, v.name, {"host": None, "partition": None, "pid": None,
                                               "state": PLACED}, v.namespace)
        a.vms_informer.put(new)
        a.events.emit(v.obj, "Moved", f"stopped VM handed from {a.host} to {dest}")
        return
    if state != "running":
        return
    gen, when = r.move_failed.get(key, (-1, 0.0))
    if gen == v.generation and time.monotonic() - when < MOVE_RETRY_S:
        return       # this spec's move failed a moment ago: not again at once
    move_id = uuid.uuid4().hex[:12]
    record = {f: getattr(local, f) for f in CARRIED if getattr(local, f, None) is not None}
    with c.parts.job(vm_obj(v.name), JobKind.HOST_MOVE, source=local.partition,
                      peer=f"{dest}/{part}") as jh:
        c.db.transition(v.name, VmState.MIGRATING, expect={VmState.RUNNING})
        jh.phase("prepare", move=move_id)
        started = now_iso()
        patch_move(a, v, {"id": move_id, "kind": "between-hosts", "mode": "copy",
                          "fromHost": a.host, "toHost": dest,
                          "from": f"{a.host}/{local.partition}", "to": f"{dest}/{part}",
                          "phase": "Preparing", "startedAt": started,
                          "record": record}, state=MOVING)
        a.events.emit(v.obj, "MoveStarted", f"moving live from {a.host} to {dest}/{part}")
        src = c.parts.client(local.partition)
        out: rpc.Streamed | None = None
        try:
            prep = wait_move(a, v, move_id, lambda m: m.get("phase") == "Prepared",
                             PREPARE_TIMEOUT_S, peer=dest)
            jh.phase("streaming", uri=prep["uri"])
            update_move(a, v, move_id, {"phase": "Streaming"})
            out = src.send(rpc.MigrateOut(v.name, str(prep["uri"]), "copy"),
                           timeout=STREAM_TIMEOUT_S + 60)
            jh.phase("streamed", bytes_sent=out.bytes_sent)
            update_move(a, v, move_id, {"phase": "Streamed",
                                        "bytesSent": out.bytes_sent,
                                        "paused": out.paused,
                                        "qemuDowntimeMs": out.qemu_downtime_ms})
            decision: str | None = wait_move(
                a, v, move_id, lambda m: m.get("decision"), DECIDE_TIMEOUT_S,
                peer=dest).get("decision")
        except FusumaError as exc:
            LOG.warning("move of %s to %s: %s", v.name, dest, exc)
            decision = decide(a, v, move_id, Decision.BACK, f"host {a.host}: {exc}")
            if decision != Decision.FORWARD:
                _source_back(a, c, v, move_id, local.partition, str(exc))
                return
        if decision != Decision.FORWARD:
            _source_back(a, c, v, move_id, local.partition, "decided back")
            return
        _release_source(c, v.name, local.partition)
    _source_forward(a, c, v, move_id, out, started)


def _release_source(c: Ctx, name: str, partition: str) -> None:
    """Under the source's job: the outcome is "forward", so end the source QEMU."""
    c.db.decide(vm_obj(name), Decision.FORWARD)
    with contextlib.suppress(FusumaError):
        c.parts.client(partition).send(rpc.Release(name))


def _source_forward(a: AgentContext, c: Ctx, v: VmView, move_id: str, out: rpc.Streamed | None,
                    started: str) -> None:
    """After the source's job: the destination runs the guest; forget it here (a
    record is removed only under a delete job of its own) and record the move."""
    if c.db.find_vm(v.name) is not None:
        c.vms.delete(v.name, force=True)
    a.owners.remove("vms", v.name)
    # The record is cleared only once the destination said the guest runs there (or
    # its host is lost): until then it may still need the decision recorded in it.
    try:
        move = wait_move(a, v, move_id, lambda m: m.get("phase") == "Switched",
                         STREAM_TIMEOUT_S, peer=str(v.want_host))
    except FusumaError:
        move = (fresh(a, v).move or {})
    resume = move.get("resumeTs")
    stop = out.stop_ts if out is not None else None
    t0 = out.t0 if out is not None else None
    last = {k: move.get(k) for k in ("id", "kind", "mode", "from", "to", "bytesSent",
                                     "paused", "decision", "decidedBy")}
    last.update({"result": "ok", "startedAt": started, "finishedAt": now_iso(),
                 "downtimeMs": round((float(resume) - float(stop)) * 1000, 2)
                 if resume and stop else move.get("qemuDowntimeMs"),
                 "totalMs": round((float(resume) - float(t0)) * 1000, 2)
                 if resume and t0 else None, "phase": "Done"})
    new = a.kube.patch_status(VM, v.name, {"move": None, "lastMove": last}, v.namespace)
    a.vms_informer.put(new)
    a.events.emit(v.obj, "Moved", f"moved live {last['from']} -> {last['to']}: "
                  f"{last['downtimeMs']} ms downtime, {last['totalMs']} ms total, "
                  f"{last['bytesSent']} bytes")


def _source_back(a: AgentContext, c: Ctx, v: VmView, move_id: str, partition: str,
                 why: str) -> None:
    """The move is off: run the guest here again (or say it is lost)."""
    c.db.decide(vm_obj(v.name), Decision.BACK)
    state = RUNNING
    try:
        res = c.parts.client(partition).send(rpc.ResumeSource(v.name))
        rec = c.db.vm(v.name)
        if rec.state == VmState.MIGRATING:
            c.db.transition(v.name, VmState.RUNNING, expect={VmState.MIGRATING},
                            partition=partition, pid=res.pid)
    except FusumaError as exc:
        why = f"{why}; the source QEMU is gone too ({exc})"
        rec = c.db.vm(v.name)
        if rec.state != VmState.CRASHED:
            c.db.transition(v.name, VmState.CRASHED, pid=None, error=why)
        state = "Failed"
    msg = f"move to {v.want_host} failed ({why}); the VM stays on {a.host}."
    cur = fresh(a, v)
    last = {**(cur.move or {}), "result": "failed", "message": msg,
            "finishedAt": now_iso(), "phase": "Failed"}
    last.pop("record", None)
    conds = set_condition(list(cur.status.get("conditions") or []), "Moved", False,
                          "MoveFailed", msg, cur.generation)
    new = a.kube.patch_status(VM, v.name, {"move": None, "lastMove": last, "state": state,
                                           "message": msg, "conditions": conds},
                              v.namespace)
    a.vms_informer.put(new)
    a.events.emit(v.obj, "MoveFailed", msg, WARNING)
    a.vm_rec.move_failed[f"{v.namespace}/{v.name}"] = (cur.generation, time.monotonic())


# -- after a restart, or the destination's half -------------------------------------------
def step(a: AgentContext, r: VmMoves, v: VmView) -> None:
    m = v.move or {}
    if m.get("fromHost") == a.host:
        _recover_source(a, v, m)
    elif m.get("toHost") == a.host:
        _destination(a, r, v, m)


def _recover_source(a: AgentContext, v: VmView, m: dict[str, Any]) -> None:
    """The agent that began this move died: its job here may still be held by no one.
    "back" unless the destination already went forward."""
    c = a.ctx()
    job = c.db.find_job(vm_obj(v.name))
    if job is not None and job.owner.alive():
        return       # this agent's own worker still runs it (not a restart)
    part = str(m.get("from", "/")).split("/", 1)[1]
    decision = m.get("decision") or decide(a, v, str(m.get("id")), Decision.BACK)
    if c.db.find_vm(v.name) is not None:
        with c.parts.job(vm_obj(v.name), JobKind.HOST_MOVE, source=part):
            if decision != Decision.FORWARD:
                _source_back(a, c, v, str(m.get("id")), part,
                             "the agent restarted mid-move")
                return
            _release_source(c, v.name, part)
    if decision == Decision.FORWARD:
        _source_forward(a, c, v, str(m.get("id")), None, str(m.get("startedAt")))


def _destination(a: AgentContext, r: VmMoves, v: VmView, m: dict[str, Any]) -> None:
    c = a.ctx()
    job = c.db.find_job(vm_obj(v.name))
    if job is not None and job.owner.alive():
        return
    move_id = str(m.get("id"))
    part = str(m.get("to", "/")).split("/", 1)[1]
    local = c.db.find_vm(v.name)
    owner = a.owners.get("vms", v.name)
    if local is not None and (owner is None or owner.uid != v.uid):
        _dest_refuse(a, v, move_id, f"host {a.host} already has a VM named {v.name!r} "
                     f"(made by {owner.label if owner else 'the CLI'})")
        return
    if local is not None and local.state in (VmState.RUNNING, VmState.PAUSED):
        # Committed here already (a pass after the switch): never undone; make sure
        # the record says so.
        if m.get("decision") == Decision.FORWARD and m.get("phase") != "Switched":
            update_move(a, v, move_id, {"phase": "Switched", "destPid": local.pid},
                        host=a.host, partition=local.partition, pid=local.pid,
                        state=RUNNING)
        return
    decision = m.get("decision")
    if decision == Decision.BACK or m.get("phase") == "Failed":
        if local is not None:
            with c.parts.job(vm_obj(v.name), JobKind.HOST_MOVE_IN, source=part):
                _dest_abort(c, v.name, part)
            _dest_remove(a, c, v.name)
        return
    if local is None and m.get("phase") != "Preparing":
        return        # nothing here: the source will decide back
    failed: str | None = None
    with c.parts.job(vm_obj(v.name), JobKind.HOST_MOVE_IN, source=part) as jh:
        try:
            if local is None:
                _dest_prepare(a, c, v, m, part)
                jh.phase("prepared")
            _dest_receive(a, c, v, move_id, part, m)
        except FusumaError as exc:
            LOG.warning("incoming move of %s: %s", v.name, exc)
            if decide(a, v, move_id, Decision.BACK, f"host {a.host}: {exc}") == Decision.FORWARD:
                raise      # the guest is here: the next pass commits it
            rec = c.db.find_vm(v.name)
            if rec is not None and rec.state in (VmState.RUNNING, VmState.PAUSED):
                raise      # committed here: never undone
            _dest_abort(c, v.name, part)
            failed = str(exc)
    if failed is not None:
        _dest_remove(a, c, v.name)
        with contextlib.suppress(FusumaError):
            update_move(a, v, move_id, {"phase": "Failed", "message": failed})


def _dest_refuse(a: AgentContext, v: VmView, move_id: str, why: str) -> None:
    if decide(a, v, move_id, Decision.BACK, why) == Decision.BACK:
        update_move(a, v, move_id, {"phase": "Failed", "message": why})


def _dest_prepare(a: AgentContext, c: Ctx, v: VmView, m: dict[str, Any], part: str) -> None:
    from fusuma.spec import VmSpec

    if c.db.find_partition(part) is None:
        raise MigrationError(f"partition {part!r} does not exist on host {a.host}")
    a.owners.set("vms", v.name, Owner(v.uid, v.namespace, v.name))
    try:
        c.vms.create(VmSpec.model_validate(v.vm_spec_fields(part)))
    except FusumaError:
        a.owners.remove("vms", v.name)
        raise
    carried = {k: val for k, val in (m.get("record") or {}).items()
               if k in CARRIED and k in c.db.VM_FIELDS}
    if carried:
        c.db.set_vm(v.name, **carried)
    c.db.transition(v.name, VmState.STARTING, expect={VmState.STOPPED})
    prep = c.parts.client(part).send(rpc.RemoteIncoming(v.name, a.address), timeout=120)
    update_move(a, v, str(m.get("id")), {"phase": "Prepared", "uri": prep.uri,
                                         "destPid": prep.pid,
                                         "prepareMs": prep.prepare_ms})


def _dest_receive(a: AgentContext, c: Ctx, v: VmView, move_id: str, part: str,
                  m: dict[str, Any]) -> None:
    dst = c.parts.client(part)
    src_host = str(m.get("fromHost"))
    deadline = time.monotonic() + STREAM_TIMEOUT_S
    while True:
        status = dst.send(rpc.RemoteIncomingWait(v.name, timeout=1.0), timeout=30).status
        if status in ("completed", "running"):
            break
        if status in ("failed", "cancelled", "gone"):
            raise MigrationError(f"the stream of {v.name!r} into host {a.host} {status}")
        cur = a.vms_informer.get(v.namespace, v.name) or {}
        cm = (cur.get("status") or {}).get("move") or {}
        if cm.get("id") != move_id or cm.get("decision") == Decision.BACK:
            raise MoveAborted(f"the move of {v.name!r} was called off by {src_host}")
        if a.host_lost(src_host):
            raise MoveAborted(f"host {src_host}'s Lease expired during the move")
        if time.monotonic() > deadline:
            raise MigrationError(f"the stream of {v.name!r} did not complete in time")
    if decide(a, v, move_id, Decision.FORWARD) != Decision.FORWARD:
        raise MoveAborted(f"the move of {v.name!r} was decided back")
    c.db.decide(vm_obj(v.name), Decision.FORWARD)
    fin = dst.send(rpc.IncomingCommit(v.name))
    with contextlib.suppress(FusumaError):
        dst.send(rpc.Settle(v.name))
    rec = c.db.vm(v.name)
    if rec.state == VmState.STARTING:
        c.db.transition(v.name, VmState.RUNNING, expect={VmState.STARTING})
    rec = c.db.vm(v.name)
    a.add_finalizer(VM, a.vms_informer.get(v.namespace, v.name) or v.obj)
    update_move(a, v, move_id, {"phase": "Switched", "resumeTs": fin.resume_ts,
                                "destPid": rec.pid},
                host=a.host, partition=part, pid=rec.pid, state=RUNNING, message=None,
                ownerUID=v.uid)
    a.events.emit(v.obj, "MovedIn", f"running on host {a.host} in partition {part} "
                  f"(pid {rec.pid})")


def _dest_abort(c: Ctx, name: str, part: str) -> None:
    """Under the destination's job: the move went back; end the incoming QEMU."""
    c.db.decide(vm_obj(name), Decision.BACK)
    with contextlib.suppress(FusumaError, NotFoundApiError):
        c.parts.client(part).send(rpc.IncomingAbort(name))


def _dest_remove(a: AgentContext, c: Ctx, name: str) -> None:
    """After the destination's job: remove the definition made for the move."""
    if c.db.find_vm(name) is not None:
        c.vms.delete(name, force=True)
    a.owners.remove("vms", name)
