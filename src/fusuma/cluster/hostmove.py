"""Live moves between hosts: changing a running FusumaVM's ``spec.host``.

The same move machine as a move inside a host (``fusuma.migration.LocalMove``), with the
cluster as its transport: the phases are ``MovePhase`` members, each recorded in the
host's job before its step, and the steps are paired per side as libvirt's are
(``qemu_migration.h``): ``HostMoveSource`` prepare, perform and confirm on the host that
runs the guest, ``HostMoveDest`` prepare and finish (or abort and remove) on the host it
goes to. Each agent holds a job on its host's VM for its half
(``fusuma.supervisor.moves.remote``).

The two agents share no state file, so the FusumaVM's ``status.move`` is the move's
record: its ``phase`` is the MovePhase's name for users (``RECORD_PHASE``, or
``RECORD_FAILED``), and its outcome is written there once: ``decide`` sets ``decision``
with a resourceVersion precondition, so of the two agents (or a restarted one) only the
first writer wins and the other follows; each then mirrors it into its host's job
(``mirror``), which its supervisor's QEMU steps check. The same rules as a move inside a
host (``fusuma.migration.resolve``) hold: the destination runs the guest only after
"forward" is recorded, the source resumes only after "back" is; so one guest never runs
twice, and never runs from an older state after it ran at the destination.

    source agent (A): HostMoveSource          destination agent (B): HostMoveDest
    job host-move
    prepare: VM migrating;
      move: phase Preparing  ─────────────▶   job host-move-in
                                              prepare: define the VM here; QEMU
                                                -incoming on tcp:B:port;
                          ◀─────────────        move: phase Prepared, uri
    perform: migrate-out to the uri (copy
      mode; live with QEMU >= 9.0 under TCG);
      move: phase Streaming, then Streamed    finish: the stream completed: decide
                                                "forward"; commit, settle;
                                                move: phase Switched, resumeTs
    confirm: decision forward: quit the
      source QEMU; the job ends
    forget: remove the VM here; lastMove
      (phase Done); move cleared

A failure before "forward" (the stream fails, B's QEMU dies, B's Lease expires while A
waits) is "back": A's confirm resumes its guest, B's abort ends its QEMU and remove
removes what it made. An agent that restarts mid-move finds ``status.move`` (``step``)
and finishes its half with the same steps from the recorded decision, or records one: A
records "back" (B cannot have run the guest without "forward"), B records "forward" only
if its QEMU holds the whole stream.
"""

from __future__ import annotations

import contextlib
import logging
import os
import time
import uuid
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from fusuma.cluster import ConflictApiError, NotFoundApiError, addresses
from fusuma.cluster.context import PLAIN_MOVES_ENV, AgentContext, VmMoves
from fusuma.cluster.events import WARNING
from fusuma.cluster.kube import HOST, VM, Obj
from fusuma.cluster.moveslots import MOVE_QUEUED, unqueued
from fusuma.cluster.owners import Owner
from fusuma.cluster.resources import (
    FAILED,
    MOVING,
    PLACED,
    RUNNING,
    VmView,
    now_iso,
    set_condition,
)
from fusuma.errors import FusumaError, MigrationError, NotFoundError, StateError
from fusuma.frozen import frozen
from fusuma.images import store
from fusuma.migration import FAULT_STREAM_BPS
from fusuma.qemu import recorded
from fusuma.state import Decision, JobKind, MovePhase, VmState, vm_obj
from fusuma.state.lock import host_lock
from fusuma.supervisor import rpc
from fusuma.supervisor.moves.source import MAX_CHANNELS
from fusuma.vm import boot, shared

if TYPE_CHECKING:
    from fusuma.ops.context import Ctx
    from fusuma.state import VmRecord
    from fusuma.state.joblock import JobLock
    from fusuma.supervisor.client import SupervisorClient

LOG = logging.getLogger(__name__)
PREPARE_TIMEOUT_S = 60.0
STREAM_TIMEOUT_S = 600.0
DECIDE_TIMEOUT_S = 60.0
# A move that failed is tried again for the same spec after this long.
MOVE_RETRY_S = 60.0
# Fields of the source's record the destination's must carry: the guest-visible machine
# and devices it booted with (the incoming QEMU must match them exactly).
CARRIED = recorded.CARRIED
# The phase the move's record shows (status.move, then lastMove): each MovePhase's name
# for users, as the CRD and kubectl show it, and the phase of a move that failed.
RECORD_PHASE: dict[MovePhase, str] = {
    MovePhase.PREPARE: "Preparing", MovePhase.PREPARED: "Prepared",
    MovePhase.STREAMING: "Streaming", MovePhase.STREAMED: "Streamed",
    MovePhase.SWITCHED: "Switched", MovePhase.RELEASED: "Done"}
RECORD_FAILED = "Failed"
# Connections a stream between hosts takes (QEMU's multifd) under TLS: TLS costs CPU per
# record (QEMU 10.0 writes one record, and one send, per page and per page header), and
# several channels, each receiving its pages straight into guest RAM, win most of it
# back (docs/results/cluster-tls*.json: one channel made moves 63 % slower than in the
# clear, four 5 to 34 %); the channels' zstd (``source.MULTIFD_COMPRESSION``) hands TLS
# whole packets and sends fewer bytes.
# In the clear (the benchmark's before) the stream is one connection, as it was.
TLS_CHANNELS = 4
# Fault injection (tests), read from the source agent's environment: seconds it waits
# between the destination's prepare and the stream; and, as for a move inside a host,
# the stream's rate in bytes/s (``FAULT_STREAM_BPS``: a stream slow enough to kill
# something during it; the source QEMU keeps the limit for its later moves); and the
# bytes/s of a thin disk's mirror.
FAULT_STREAM_DELAY = "FUSUMA_FAULT_HOST_MOVE_STREAM_DELAY"
FAULT_MIRROR_SPEED = "FUSUMA_FAULT_HOST_MOVE_MIRROR_SPEED"
# ... and from the destination agent's: seconds it waits after it recorded "forward",
# before its QEMU runs the guest (a test kills it there).
FAULT_DECIDED_DELAY = "FUSUMA_FAULT_HOST_MOVE_DECIDED_DELAY"
# Holds at the other phases of a move, for the kill matrix between hosts
# (tests/cluster/test_move_kill_matrix.py): the destination's agent waits once its
# incoming QEMU started, before the record says Prepared (PREPARE), and once it
# is prepared, before it asks that QEMU whether it holds the whole stream, so that the
# stream ends (Streamed) before it decides (STREAMED); the source's waits once
# "forward" is recorded, before it ends its own QEMU (RELEASE).
FAULT_PREPARE_DELAY = "FUSUMA_FAULT_HOST_MOVE_PREPARE_DELAY"
FAULT_STREAMED_DELAY = "FUSUMA_FAULT_HOST_MOVE_STREAMED_DELAY"
FAULT_RELEASE_DELAY = "FUSUMA_FAULT_HOST_MOVE_RELEASE_DELAY"


def fault_hold(env: str) -> None:
    """Fault injection (tests): sleep the seconds environment variable ``env`` names."""
    delay = float(os.environ.get(env) or 0)
    if delay > 0:
        time.sleep(delay)


class MoveRefused(MigrationError):
    """The destination cannot take the VM (one sentence for the user); nothing was
    made there."""


class MoveAborted(MigrationError):
    """The other side gave up, or the move was decided "back" (``reason``: the
    sentence the move's record gives, if any)."""

    def __init__(self, message: str, reason: str | None = None) -> None:
        super().__init__(message)
        self.reason = reason


# -- the move record in the cluster -----------------------------------------------------
def at(move: Obj, phase: MovePhase) -> bool:
    """Whether the move record ``move`` shows ``phase``."""
    return move.get("phase") == RECORD_PHASE[phase]


def called_off(move: Obj) -> bool:
    """Whether the move record says the move goes back (decided, or failed)."""
    return move.get("decision") == Decision.BACK or move.get("phase") == RECORD_FAILED


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


def wait_move(a: AgentContext, v: VmView, move_id: str, until: Callable[[Obj], object],
              timeout: float, peer: str | None = None) -> Obj:
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
        if called_off(move):
            raise MoveAborted(f"the move of {v.name!r} was called off "
                              f"({move.get('message') or 'decided back'})",
                              move.get("message"))
        if peer and a.host_lost(peer):
            raise MoveAborted(f"host {peer}'s Lease expired during the move.")
        if time.monotonic() > deadline:
            raise MigrationError(f"the move of {v.name!r} did not reach the next step "
                                 f"within {timeout:.0f} s.")
        time.sleep(0.01)


def stream_uri(a: AgentContext, dest: str, published: str) -> str:
    """Where the source sends the stream: the port the destination published (in the
    move's record), at the address host ``dest`` registered (its FusumaHost), never at
    an address the record alone names."""
    host = a.kube.find(HOST, dest)
    addr = str(((host or {}).get("status") or {}).get("address") or "")
    if not addr:
        raise MigrationError(f"host {dest} has registered no address for moves; is its "
                             "agent running?")
    scheme, _, rest = published.partition(":")
    where, _, port = rest.rpartition(":")
    if scheme != "tcp" or not port.isdigit() or not 0 < int(port) < 65536:
        raise MigrationError(f"the destination of the move published {published!r}, not "
                             "a tcp:ADDRESS:PORT to stream to.")
    bare = addr.strip("[]")
    if where.strip("[]") != bare:
        raise MigrationError(f"the destination of the move published {published}, but host "
                             f"{dest} is registered at {addr}: the guest's memory goes to "
                             "the registered address only, so the move is refused.")
    return f"tcp:[{bare}]:{port}" if ":" in bare else f"tcp:{bare}:{port}"


# -- the two sides ------------------------------------------------------------------------
@frozen
class _Side:
    """What either half of one move holds: this host's agent and context, the VM, the
    move's id and the VM's partition on this host."""

    a: AgentContext
    c: Ctx
    v: VmView
    move_id: str
    partition: str

    def record(self, phase: MovePhase, fields: dict[str, Any] | None = None,
               **status: Any) -> bool:
        """Show ``phase`` (with ``fields``, and ``status``) in the move's record."""
        return update_move(self.a, self.v, self.move_id,
                           {"phase": RECORD_PHASE[phase], **(fields or {})}, **status)

    def record_failed(self, why: str) -> bool:
        return update_move(self.a, self.v, self.move_id,
                           {"phase": RECORD_FAILED, "message": why})

    def decide(self, decision: Decision, why: str | None = None) -> str | None:
        """Record the outcome in the cluster (``decide``); the outcome in force."""
        return decide(self.a, self.v, self.move_id, decision, why)

    def mirror(self, decision: Decision) -> None:
        """Follow the cluster's decision in this host's job, which gates what its
        supervisor does with the guest's QEMU (release, resume, commit)."""
        self.c.db.decide(vm_obj(self.v.name), decision)

    def supervisor(self) -> SupervisorClient:
        """This side's partition's supervisor, started first if it is not running
        (killed mid-move): a new one adopts the move's QEMUs, asking each what it holds,
        so the move's next step finds the guest's QEMU rather than giving it up for
        lost, and need not wait for the agent's next pass over the partitions."""
        parts = self.c.parts
        if parts.supervisor_pid(self.partition) is None:
            LOG.warning("move %s of %s: the supervisor of partition %s is not running; "
                        "starting it", self.move_id, self.v.name, self.partition)
            with host_lock(self.c.paths.home), contextlib.suppress(StateError):
                parts.start_supervisor(self.partition)
        return parts.client(self.partition)

    def remove(self) -> None:
        """After this host's job (a delete takes its own): the VM is no longer here.
        Its files on shared storage stay: they are the other host's now (forward) or
        still (back)."""
        if self.c.db.find_vm(self.v.name) is not None:
            shared.detach(self.c.paths, self.v.name)
            self.c.vms.delete(self.v.name, force=True)
        self.a.owners.remove("vms", self.v.name)


@frozen
class HostMoveSource(_Side):
    """The source host's half (libvirt's ``qemuMigrationSrc*``), under its host-move
    job (``job``): ``prepare`` begins the move, ``perform`` streams the guest once the
    destination is prepared, ``confirm`` follows the recorded outcome; ``forget``
    finishes a move that went forward, after the job."""

    dest: str        # the destination host

    def job(self, peer: str | None = None) -> JobLock:
        return self.c.parts.job(vm_obj(self.v.name), JobKind.HOST_MOVE,
                                source=self.partition, peer=peer)

    def prepare(self, jh: JobLock, to: str, record: dict[str, Any]) -> str:
        """The VM is migrating; begin the move's record, which the destination prepares
        from (into its partition ``to``, carrying ``record``). Returns the start time."""
        a, v = self.a, self.v
        self.c.db.transition(v.name, VmState.MIGRATING, expect={VmState.RUNNING})
        jh.phase(MovePhase.PREPARE, move=self.move_id)
        started = now_iso()
        try:
            patch_move(a, v, {"id": self.move_id, "kind": "between-hosts", "mode": "copy",
                              "fromHost": a.host, "toHost": self.dest,
                              "from": f"{a.host}/{self.partition}",
                              "to": f"{self.dest}/{to}",
                              "phase": RECORD_PHASE[MovePhase.PREPARE],
                              "startedAt": started, "record": record}, state=MOVING,
                       **unqueued(v.status))
        except Exception:
            # No record, so no destination can have begun: the guest never stopped
            # running here; say so, or no later pass would take it up again.
            self.c.db.transition(v.name, VmState.RUNNING, expect={VmState.MIGRATING})
            raise
        a.events.emit(v.obj, "MoveStarted", f"moving live from {a.host} to {self.dest}/{to}")
        return started

    def perform(self, jh: JobLock) -> rpc.Streamed:
        """Once the destination says it is prepared, stream the guest to the port it
        published, at the address its host registered, under TLS to that host."""
        prep = wait_move(self.a, self.v, self.move_id, lambda m: at(m, MovePhase.PREPARED),
                         PREPARE_TIMEOUT_S, peer=self.dest)
        plain = self.a.cfg.plain_moves
        if bool(prep.get("tls")) == plain:
            raise MigrationError(
                f"host {self.dest} offers the stream {'encrypted' if plain else 'in the clear'}"
                f" and host {self.a.host} sends it {'in the clear' if plain else 'encrypted'}:"
                f" both hosts' agents must run with the same {PLAIN_MOVES_ENV}.")
        uri = stream_uri(self.a, self.dest, str(prep.get("uri") or ""))
        channels = prep.get("channels", 1)
        if isinstance(channels, bool) or not isinstance(channels, int) \
                or not 1 <= channels <= MAX_CHANNELS:
            raise MigrationError(f"the destination of the move asks for {channels!r} "
                                 f"channels, not 1 to {MAX_CHANNELS}.")
        nbd = ""
        if self.c.db.vm(self.v.name).boot != "kernel" \
                and store.placed_in(self.c.paths, self.v.name) is None:
            # Its thin disk is mirrored to the destination's export, at the address
            # that host registered, as the stream is (on shared storage it stays put).
            nbd = stream_uri(self.a, self.dest, str(prep.get("nbd") or ""))
        if not plain:
            self.a.move_creds()
        fault_hold(FAULT_STREAM_DELAY)      # (tests) someone else may connect first
        jh.phase(MovePhase.STREAMING, uri=uri)
        self.record(MovePhase.STREAMING)
        out = self.c.parts.client(self.partition).send(
            rpc.MigrateOut(self.v.name, uri, "copy", tls_peer=self.dest, plain_tcp=plain,
                           channels=channels, nbd=nbd,
                           max_bandwidth=int(os.environ.get(FAULT_STREAM_BPS) or 0),
                           mirror_speed=int(os.environ.get(FAULT_MIRROR_SPEED) or 0)),
            timeout=STREAM_TIMEOUT_S + 60)
        jh.phase(MovePhase.STREAMED, bytes_sent=out.bytes_sent)
        self.record(MovePhase.STREAMED, {"bytesSent": out.bytes_sent, "paused": out.paused,
                                         "qemuDowntimeMs": out.qemu_downtime_ms})
        return out

    def outcome(self) -> str | None:
        """Wait for the destination to record the outcome (once its QEMU holds the
        whole stream)."""
        move = wait_move(self.a, self.v, self.move_id, lambda m: m.get("decision"),
                         DECIDE_TIMEOUT_S, peer=self.dest)
        return move.get("decision")

    def confirm(self, decision: str | None, why: str) -> bool:
        """Under the job, follow the recorded outcome: "forward" ends the source QEMU
        (``forget`` then removes the VM here); anything else runs the guest here again
        (or says it is lost) and records the failed move, ``why``. Returns whether the
        move went forward."""
        if decision == Decision.FORWARD:
            self.mirror(Decision.FORWARD)
            fault_hold(FAULT_RELEASE_DELAY)
            with contextlib.suppress(FusumaError):
                self.supervisor().send(rpc.Release(self.v.name))
            return True
        self._back(why)
        return False

    def _back(self, why: str) -> None:
        a, c, v = self.a, self.c, self.v
        self.mirror(Decision.BACK)
        state = RUNNING
        try:
            res = self.supervisor().send(rpc.ResumeSource(v.name))
            if c.db.vm(v.name).state == VmState.MIGRATING:
                c.db.transition(v.name, VmState.RUNNING, expect={VmState.MIGRATING},
                                partition=self.partition, pid=res.pid)
        except FusumaError as exc:
            why = f"{why}; the source QEMU is gone too ({exc})"
            if c.db.vm(v.name).state != VmState.CRASHED:
                c.db.transition(v.name, VmState.CRASHED, pid=None, error=why)
            state = FAILED
        msg = f"move to {self.dest} failed ({why.rstrip('.')}); the VM stays on {a.host}."
        cur = fresh(a, v)
        last = {**(cur.move or {}), "result": "failed", "message": msg,
                "finishedAt": now_iso(), "phase": RECORD_FAILED}
        last.pop("record", None)
        conds = set_condition(list(cur.status.get("conditions") or []), "Moved", False,
                              "MoveFailed", msg, cur.generation)
        new = a.kube.patch_status(VM, v.name, {"move": None, "lastMove": last,
                                               "state": state, "message": msg,
                                               "conditions": conds}, v.namespace)
        a.vms_informer.put(new)
        a.events.emit(v.obj, "MoveFailed", msg, WARNING)
        # Keyed by destination too: a drain that re-places the VM elsewhere after this
        # failure (fusuma.cluster.drain) has it tried there at once.
        a.vm_rec.move_failed[f"{v.namespace}/{v.name}>{self.dest}"] = (
            cur.generation, time.monotonic())

    def forget(self, out: rpc.Streamed | None, started: str | None,
               began: float | None = None) -> None:
        """After the job, once the move went forward: the destination runs the guest;
        remove it here and record the move (``lastMove``; ``began``: when this agent
        began it, epoch seconds: ``wallMs`` runs from then to the guest running there)."""
        a, v = self.a, self.v
        self.remove()
        # The record is cleared only once the destination said the guest runs there:
        # until then its agent (one restarted too) needs the decision recorded in it to
        # run the guest it holds, paused, the only copy now. If that host stops renewing
        # its Lease first, the record stays; this host's next pass (when the destination
        # records the switch) finishes it.
        try:
            move = wait_move(a, v, self.move_id, lambda m: at(m, MovePhase.SWITCHED),
                             STREAM_TIMEOUT_S, peer=self.dest)
        except FusumaError as exc:
            LOG.warning("move %s of %s went forward; the record is kept until host %s "
                        "says the guest runs there: %s", self.move_id, v.name, self.dest,
                        exc)
            return
        resume = move.get("resumeTs")
        stop = out.stop_ts if out is not None else None
        t0 = out.t0 if out is not None else None
        last = {k: move.get(k) for k in ("id", "kind", "mode", "from", "to", "uri", "tls",
                                         "channels", "prepareMs", "bytesSent", "paused",
                                         "decision", "decidedBy", "message")}
        last.update({"result": "ok", "startedAt": started, "finishedAt": now_iso(),
                     "downtimeMs": round((float(resume) - float(stop)) * 1000, 2)
                     if resume and stop else move.get("qemuDowntimeMs"),
                     "totalMs": round((float(resume) - float(t0)) * 1000, 2)
                     if resume and t0 else None,
                     "wallMs": round((float(resume) - began) * 1000, 2)
                     if resume and began else None,
                     "phase": RECORD_PHASE[MovePhase.RELEASED]})
        new = a.kube.patch_status(VM, v.name, {"move": None, "lastMove": last}, v.namespace)
        a.vms_informer.put(new)
        a.events.emit(v.obj, "Moved", f"moved live {last['from']} -> {last['to']}: "
                      f"{last['downtimeMs']} ms downtime, {last['totalMs']} ms total, "
                      f"{last['bytesSent']} bytes")


@frozen
class HostMoveDest(_Side):
    """The destination host's half (libvirt's ``qemuMigrationDst*``), under its
    host-move-in job (``job``): ``prepare`` defines the VM here and starts its incoming
    QEMU, ``finish`` runs the guest once the whole stream arrived and "forward" is
    recorded; ``abort`` (under the job) and ``remove`` (after it) undo ``prepare``."""

    source: str      # the source host

    def job(self) -> JobLock:
        return self.c.parts.job(vm_obj(self.v.name), JobKind.HOST_MOVE_IN,
                                source=self.partition)

    def prepare(self, jh: JobLock, record: dict[str, Any]) -> None:
        """Define the VM here from its spec, carrying the source's ``record``, and
        start a QEMU waiting for the stream; tell the source where."""
        from fusuma.spec import VmSpec

        a, c, v, part = self.a, self.c, self.v, self.partition
        jh.phase(MovePhase.PREPARE)
        # The record is the source host's word: checked against what fusuma makes
        # before anything is defined or started here.
        record = dict(record)
        thin = record.pop(boot.CARRIED_DISK, None)
        placed = record.pop(shared.CARRIED_PLACE, None)
        try:
            carried: dict[str, Any] = recorded.check_carried(record)
            nics = recorded.carried_nics(record)
            disk = None if thin is None else boot.check_carried(thin)
            place = None if placed is None else shared.check_carried(placed)
            if place is not None and disk is None:
                raise StateError("the move's record names shared storage for a VM with "
                                 "no thin disk")
        except (recorded.DeviceSetRefused, StateError) as exc:
            raise MigrationError(f"{exc}; nothing was started on host {a.host}") from exc
        if c.db.find_partition(part) is None:
            raise MigrationError(f"partition {part!r} does not exist on host {a.host}")
        where = None
        if place is not None:
            # The very directory the source's QEMU has its files in, or no move.
            try:
                where = shared.check_here(c.db, v.name, place, a.host)
            except StateError as exc:
                raise MoveRefused(str(exc)) from exc
        fields = v.vm_spec_fields(part)
        if disk is not None:
            # A thin disk on this host's copy of its image (the same checksum), as large
            # as at the source; its top layer is mirrored here before the stream.
            try:
                base = boot.base_for(c.db, disk, a.host)
            except StateError as exc:
                raise MoveRefused(str(exc)) from exc
            fields.update(image=base.name, disk_size=str(disk.virtual_size))
        if fields.pop("storage", None) and where is None:
            raise MoveRefused(f"VM {v.name!r} is placed on shared storage (spec.storage), "
                              "and the move's record does not say where its files are: "
                              "nothing was made on host " + a.host + ".")
        if where is not None:
            fields["storage"] = str(where.parent)
        if nics or fields.get("nics"):
            # The same NICs (MAC, address) as at the source, on taps of this host's.
            fields["nics"] = [{"network": n, "mac": mac, "ip": ip}
                              for _, n, mac, ip in nics]
        a.owners.set("vms", v.name, Owner(v.uid, v.namespace, v.name))
        try:
            rec = c.vms.create(VmSpec.model_validate(fields), adopt=where)
        except FusumaError:
            a.owners.remove("vms", v.name)
            raise
        if disk is not None:
            boot.adopt_carried(c.paths, rec, disk)
        if carried:
            c.db.set_vm(v.name, **carried)
        c.db.transition(v.name, VmState.STARTING, expect={VmState.STOPPED})
        tls = not a.cfg.plain_moves
        channels = TLS_CHANNELS if tls else 1
        if tls:
            a.move_creds()
        prep = c.parts.client(part).send(
            rpc.RemoteIncoming(v.name, a.address, self.source, tls=tls, channels=channels,
                               nbd=disk is not None and where is None,
                               shared_disk=where is not None),
            timeout=120)
        fault_hold(FAULT_PREPARE_DELAY)
        jh.phase(MovePhase.PREPARED, uri=prep.uri)
        self.record(MovePhase.PREPARED, {"uri": prep.uri, "destPid": prep.pid,
                                         "prepareMs": prep.prepare_ms, "tls": tls,
                                         "channels": channels, "nbd": prep.nbd,
                                         "sharedStorage": where is not None})

    def finish(self, jh: JobLock) -> None:
        """Wait until the incoming QEMU holds the whole stream; record "forward" (in the
        cluster, then in the job), run the guest here and record the switch."""
        a, c, v = self.a, self.c, self.v
        fault_hold(FAULT_STREAMED_DELAY)
        dst = self.supervisor()
        deadline = time.monotonic() + STREAM_TIMEOUT_S
        while True:
            status = dst.send(rpc.RemoteIncomingWait(v.name, timeout=1.0), timeout=30).status
            if status in ("completed", "running"):
                break
            if status in ("failed", "cancelled", "gone"):
                raise MigrationError(f"the stream of {v.name!r} into host {a.host} {status}")
            cur = a.vms_informer.get(v.namespace, v.name) or {}
            cm = (cur.get("status") or {}).get("move") or {}
            if cm.get("id") != self.move_id or cm.get("decision") == Decision.BACK:
                raise MoveAborted(f"the move of {v.name!r} was called off by {self.source}")
            if a.host_lost(self.source):
                raise MoveAborted(f"host {self.source}'s Lease expired during the move")
            if time.monotonic() > deadline:
                raise MigrationError(f"the stream of {v.name!r} did not complete in time")
        if self.decide(Decision.FORWARD) != Decision.FORWARD:
            raise MoveAborted(f"the move of {v.name!r} was decided back")
        self.mirror(Decision.FORWARD)
        fault_hold(FAULT_DECIDED_DELAY)     # (tests) this agent is killed here
        # Asked afresh: a supervisor killed since "forward" is started again, and adopts
        # the incoming QEMU, which holds the only copy of the guest now.
        fin = self.supervisor().send(rpc.IncomingCommit(v.name))
        jh.phase(MovePhase.SWITCHED)
        with contextlib.suppress(FusumaError):
            dst.send(rpc.Settle(v.name))
        if c.db.vm(v.name).state == VmState.STARTING:
            c.db.transition(v.name, VmState.RUNNING, expect={VmState.STARTING})
        rec = c.db.vm(v.name)
        a.add_finalizer(VM, a.vms_informer.get(v.namespace, v.name) or v.obj)
        self.record(MovePhase.SWITCHED, {"resumeTs": fin.resume_ts, "destPid": rec.pid},
                    host=a.host, partition=self.partition, pid=rec.pid, state=RUNNING,
                    message=None, ownerUID=v.uid)
        a.events.emit(v.obj, "MovedIn", f"running on host {a.host} in partition "
                      f"{self.partition} (pid {rec.pid})")

    def abort(self) -> None:
        """Under the job: the move went back; end the incoming QEMU."""
        self.mirror(Decision.BACK)
        with contextlib.suppress(FusumaError, NotFoundApiError):
            self.supervisor().send(rpc.IncomingAbort(self.v.name))

    def lost(self) -> str | None:
        """After "forward", once finishing failed: why the guest is lost here (its
        incoming QEMU, the only copy now, exited before it ran the guest), or None (it
        is still there, and a next pass commits it; or its supervisor cannot be asked)."""
        try:
            status = self.supervisor().send(
                rpc.RemoteIncomingWait(self.v.name, timeout=0.0), timeout=30).status
        except NotFoundError:
            status = "gone"
        except FusumaError:
            return None
        if status != "gone":
            return None
        return (f"its QEMU on host {self.a.host} exited after the move was decided "
                "forward, before it ran the guest")

    def bury(self, why: str) -> None:
        """Under the job: the guest was lost here (``why``). Say so, in this host's
        record and in the cluster's (the switch, to no QEMU), so that the source
        finishes the move and the VM is started again as any crashed VM is, here;
        otherwise each pass tried to commit a QEMU that is gone, and the FusumaVM named
        the source, which holds nothing, for ever."""
        a, c, v = self.a, self.c, self.v
        if c.db.vm(v.name).state != VmState.CRASHED:
            c.db.transition(v.name, VmState.CRASHED, pid=None, error=why)
        msg = f"the guest was lost: {why}."
        a.add_finalizer(VM, a.vms_informer.get(v.namespace, v.name) or v.obj)
        self.record(MovePhase.SWITCHED, {"message": msg}, host=a.host,
                    partition=self.partition, pid=None, state=FAILED, message=msg,
                    ownerUID=v.uid)
        a.events.emit(v.obj, "GuestLost", msg, WARNING)

    def refuse(self, why: str) -> None:
        """Call the move off before preparing anything here."""
        if self.decide(Decision.BACK, why) == Decision.BACK:
            self.record_failed(why)


def carried_nics(c: Ctx, vm: str) -> list[dict[str, Any]]:
    """VM ``vm``'s NICs as a move's record carries them (recorded.carried_nics)."""
    return [{"index": n.index, "network": n.network, "mac": n.mac, "ip": n.ip}
            for n in sorted(c.db.nics(vm=vm), key=lambda n: n.index)]


# -- the agent's entry points -------------------------------------------------------------
def begin(a: AgentContext, r: VmMoves, v: VmView, local: VmRecord) -> None:
    """This host runs ``v`` and its spec now names another host: move it there."""
    from fusuma.vm.view import VmView as LocalView

    c = a.ctx()
    dest = str(v.want_host)
    part = v.want_partition or local.partition
    key = f"{v.namespace}/{v.name}>{dest}"
    state = LocalView(local).state
    if a.host_lost(dest) or a.hosts_informer.get("", dest) is None:
        r.fail(v, "MoveFailed", f"cannot move {v.name!r} to host {dest!r}: it is not a "
               "registered, live host (kubectl get fusumahosts).", state=v.state)
        return
    placed = store.placed_in(c.paths, local.name) is not None
    try:
        boot.check_host_move(local, dest, running=state not in ("stopped", "crashed"),
                             snapshots=[s.name for s in c.db.snapshots(local.name,
                                                                       every=True)],
                             placed=placed)
    except StateError as exc:
        r.fail(v, "MoveFailed", str(exc), state=v.state)
        return
    if state in ("stopped", "crashed"):
        # Nothing to carry: the destination defines it anew from the spec.
        c.vms.delete(v.name, force=True)
        a.owners.remove("vms", v.name)
        new = a.kube.patch_status(VM, v.name, {"host": None, "partition": None, "pid": None,
                                               "state": PLACED}, v.namespace)
        a.vms_informer.put(new)
        addresses.hand_on(a.kube, a.host, v.uid, dest)
        a.events.emit(v.obj, "Moved", f"stopped VM handed from {a.host} to {dest}")
        return
    if state != "running":
        return
    gen, when = r.move_failed.get(key, (-1, 0.0))
    if gen == v.generation and time.monotonic() - when < MOVE_RETRY_S:
        return       # this spec's move failed a moment ago: not again at once
    slot = f"{v.namespace}/{v.name}"      # the VM's place in its pair's slots
    waiting = a.move_slots.take(a.host, dest, slot)
    if waiting is not None:
        queued(a, v, waiting.sentence(a.host, dest))
        return
    with a.move_slots.held(a.host, dest, slot):
        _live(a, r, v, local, dest, part, placed)


def queued(a: AgentContext, v: VmView, why: str) -> None:
    """Say in the VM's Moved condition that its move waits for a slot (``why``)."""
    conds = list(v.status.get("conditions") or [])
    now: Obj = next((cd for cd in conds if cd.get("type") == "Moved"), {})
    if (now.get("reason"), now.get("message")) == (MOVE_QUEUED, why):
        return
    new = a.kube.patch_status(VM, v.name, {"conditions": set_condition(
        conds, "Moved", False, MOVE_QUEUED, why, v.generation)}, v.namespace)
    a.vms_informer.put(new)


def _live(a: AgentContext, r: VmMoves, v: VmView, local: VmRecord, dest: str, part: str,
          placed: bool) -> None:
    """Under a slot of the pair (this host, ``dest``): move running ``v`` there."""
    c = a.ctx()
    record: dict[str, Any] = {f: getattr(local, f) for f in CARRIED
                              if getattr(local, f, None) is not None}
    if local.boot != "kernel":
        # Its seed and what its thin disk is made on (the disk is mirrored with the
        # move, its NVRAM travels in the stream).
        try:
            record[boot.CARRIED_DISK] = boot.carry(c.paths, c.db, local).as_record()
            if placed:
                # On shared storage: the token that proves the destination sees the
                # very directory its files are in (fusuma.vm.shared).
                record[shared.CARRIED_PLACE] = shared.mark(c.paths, local.name).as_record()
        except OSError as exc:
            r.fail(v, "MoveFailed", f"cannot move {v.name!r}: its shared storage cannot "
                   f"be written ({exc.strerror}).", state=v.state)
            return
        except FusumaError as exc:
            r.fail(v, "MoveFailed", f"cannot move {v.name!r}: {exc}", state=v.state)
            return
    nics = carried_nics(c, local.name)
    if nics:
        record[recorded.CARRIED_NICS] = nics
    began = time.time()
    src = HostMoveSource(a, c, v, uuid.uuid4().hex[:12], local.partition, dest)
    with src.job(peer=f"{dest}/{part}") as jh:
        started = src.prepare(jh, part, record)
        out: rpc.Streamed | None = None
        why = "decided back"
        try:
            out = src.perform(jh)
            decision = src.outcome()
        except FusumaError as exc:
            LOG.warning("move of %s to %s: %s", v.name, dest, exc)
            why = (exc.reason if isinstance(exc, MoveAborted) else None) or str(exc)
            decision = src.decide(Decision.BACK, f"host {a.host}: {exc}")
        if not src.confirm(decision, why):
            return
    src.forget(out, started, began)
    # The guest runs there now: so do its addresses' holder (else the next sweep).
    addresses.hand_on(a.kube, a.host, v.uid, dest)


def step(a: AgentContext, r: VmMoves, v: VmView) -> None:
    """``v`` has a move record naming this host: take this side's next steps (the
    destination's whole half; the source's after a restart)."""
    m = v.move or {}
    if m.get("fromHost") == a.host:
        _recover_source(a, v, m)
    elif m.get("toHost") == a.host:
        _destination(a, v, m)


def _held_here(c: Ctx, name: str) -> bool:
    """Whether a live process of this host (this agent's own worker) holds the VM's job."""
    job = c.db.find_job(vm_obj(name))
    return job is not None and job.owner.alive()


def _partition(m: Obj, side: str) -> str:
    """The partition in the record's ``from`` or ``to`` (HOST/PARTITION)."""
    return str(m.get(side, "/")).split("/", 1)[1]


def _recover_source(a: AgentContext, v: VmView, m: Obj) -> None:
    """The agent that began this move died: its job here may still be held by no one.
    "back" unless the destination already went forward."""
    c = a.ctx()
    if _held_here(c, v.name):
        return       # this agent's own worker still runs it (not a restart)
    src = HostMoveSource(a, c, v, str(m.get("id")), _partition(m, "from"),
                         str(m.get("toHost")))
    decision = m.get("decision") or src.decide(Decision.BACK)
    if c.db.find_vm(v.name) is not None:
        with src.job():
            if not src.confirm(decision, "the agent restarted mid-move"):
                return
    if decision == Decision.FORWARD:
        src.forget(None, str(m.get("startedAt")))


def current_record(a: AgentContext, v: VmView, m: Obj) -> dict[str, Any] | None:
    """The record of move ``m`` as the API server holds it now, read afresh: the view a
    pass began with may be an older version of the object (a watch's events queue while
    the agent is busy or stopped, and a later one may have changed the record), and the
    destination prepares from the latest. None if the move is no longer ``m`` (the next
    pass takes up the one there is)."""
    cur = fresh(a, v).move or {}
    if cur.get("id") != m.get("id") or called_off(cur):
        return None
    out: dict[str, Any] = cur.get("record") or {}
    return out


def _destination(a: AgentContext, v: VmView, m: Obj) -> None:
    """This host is the move's destination: prepare and finish, or undo, as the record
    asks (the first pass and any pass after a restart alike)."""
    c = a.ctx()
    if _held_here(c, v.name):
        return
    dst = HostMoveDest(a, c, v, str(m.get("id")), _partition(m, "to"),
                       str(m.get("fromHost")))
    local = c.db.find_vm(v.name)
    owner = a.owners.get("vms", v.name)
    if local is not None and (owner is None or owner.uid != v.uid):
        dst.refuse(f"host {a.host} already has a VM named {v.name!r} "
                   f"(made by {owner.label if owner else 'the CLI'})")
        return
    if local is not None and local.state in (VmState.RUNNING, VmState.PAUSED):
        # Committed here already (a pass after the switch): never undone; make sure
        # the record says so.
        if m.get("decision") == Decision.FORWARD and not at(m, MovePhase.SWITCHED):
            dst.record(MovePhase.SWITCHED, {"destPid": local.pid}, host=a.host,
                       partition=local.partition, pid=local.pid, state=RUNNING)
        return
    if local is not None and at(m, MovePhase.SWITCHED):
        return        # it ran here, and crashed since: a crash like any other, no move's
    if called_off(m):
        if local is not None:
            with dst.job():
                dst.abort()
            dst.remove()
        return
    if local is None and not at(m, MovePhase.PREPARE):
        return        # nothing here: the source will decide back
    if local is not None and at(m, MovePhase.PREPARE):
        # This host's agent died (or lost the API server) preparing: the record never
        # said Prepared, so the source does not know where to stream and would wait
        # for it in vain (PREPARE_TIMEOUT_S): call the move off now.
        why = f"host {a.host}'s agent was interrupted while preparing the move"
        LOG.warning("incoming move of %s: %s; calling it off", v.name, why)
        if dst.decide(Decision.BACK, why) == Decision.BACK:
            with dst.job():
                dst.abort()
            dst.remove()
            with contextlib.suppress(FusumaError):
                dst.record_failed(why)
        return
    record = current_record(a, v, m) if local is None else {}
    if record is None:
        return
    failed: str | None = None
    with dst.job() as jh:
        try:
            if local is None:
                dst.prepare(jh, record)
            dst.finish(jh)
        except MoveRefused as exc:
            LOG.warning("incoming move of %s refused: %s", v.name, exc)
            dst.refuse(str(exc))
            return
        except FusumaError as exc:
            LOG.warning("incoming move of %s: %s", v.name, exc)
            if dst.decide(Decision.BACK, f"host {a.host}: {exc}") == Decision.FORWARD:
                gone = dst.lost()
                if gone is None:
                    raise      # the guest is here: the next pass commits it
                LOG.warning("incoming move of %s: %s", v.name, gone)
                dst.bury(gone)
                return
            rec = c.db.find_vm(v.name)
            if rec is not None and rec.state in (VmState.RUNNING, VmState.PAUSED):
                raise      # committed here: never undone
            dst.abort()
            failed = str(exc)
    if failed is not None:
        dst.remove()
        with contextlib.suppress(FusumaError):
            dst.record_failed(failed)
