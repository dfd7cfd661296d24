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

Every step runs under the move's job (``fusuma.recovery.job``), its phase recorded
before it: prepare, prepared, streaming, streamed, switched, released. A failure at any
step, or the death of this process, is resolved by ``migration.resolve`` asking both
QEMUs. After every outcome the VM is in exactly one partition, in ``ps`` and in the DB.

Mode ``cpr-transfer`` moves a VM to a new QEMU process in its own partition (``to`` is
that partition; ``fusuma maintain P --in-place``): the same steps and phases, with the
supervisor's ``cpr-prepare`` and ``cpr-transfer`` in place of ``incoming-prepare`` and
``migrate-out`` (``migration.cpr``; its checks in ``migration.inplace``).
"""

from __future__ import annotations

import contextlib
import logging
import os
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

from fusuma import capacity
from fusuma.errors import FusumaError, MigrationError, ResourceError, StateError
from fusuma.frozen import frozen
from fusuma.governor.qos import check_admission
from fusuma.migration import compat, inplace
from fusuma.migration.inplace import MODE as CPR_MODE
from fusuma.migration.resolve import recover_move
from fusuma.partition.manager import PartitionManager
from fusuma.state import Decision, JobKind, MovePhase, VmRecord, VmState, vm_obj
from fusuma.state.joblock import JobLock
from fusuma.state.lock import host_lock
from fusuma.supervisor import rpc
from fusuma.vm import VmView

LOG = logging.getLogger(__name__)

# Fault injection for tests: seconds to sleep after the source reports completion
# (so a test can kill the source QEMU there) or before streaming starts.
FAULT_AFTER_COMPLETE = "FUSUMA_FAULT_SLEEP_AFTER_COMPLETE"
FAULT_BEFORE_STREAM = "FUSUMA_FAULT_SLEEP_BEFORE_STREAM"
FAULT_AFTER_SWITCH = "FUSUMA_FAULT_SLEEP_AFTER_SWITCH"
# ... and passed to the supervisors: the destination waits this long between the
# completed stream and recording the outcome; the source streams at this rate (bytes/s).
FAULT_BEFORE_DECIDE = "FUSUMA_FAULT_SLEEP_BEFORE_DECIDE"
FAULT_STREAM_BPS = "FUSUMA_FAULT_STREAM_BYTES_PER_S"
FAULT_AFTER_RELEASE = "FUSUMA_FAULT_SLEEP_AFTER_RELEASE"
# In-place moves: between the new QEMU's start on the guest's descriptors and its
# migrate-incoming (fusuma.supervisor.moves.cpr).
FAULT_BEFORE_INCOMING = "FUSUMA_FAULT_SLEEP_BEFORE_INCOMING"


@frozen
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
    # An in-place move: the migration mode the old QEMU reported (query-migrate-
    # parameters) once it had completed, and the two QEMUs' pids.
    qemu_mode: str | None = None
    source_pid: int | None = None
    dest_pid: int | None = None
    # Where the downtime went (ms per step, in order; ``downtime_steps``).
    steps_ms: dict[str, float] | None = None
    # Where the whole move went, as this process saw it (ms per step, in order;
    # ``WALL_STEPS``): from the call of ``migrate`` to its return.
    wall_ms: dict[str, float] | None = None

    def as_json(self) -> dict[str, Any]:
        d = asdict(self)
        d["from"] = d.pop("source")
        d["method"] = self.mode
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
    db.partition(to)          # an unknown partition: refused first
    if mode == CPR_MODE:
        if rec.partition != to:
            raise StateError(f"{CPR_MODE} moves a VM to a new QEMU in its own partition "
                             f"({rec.partition!r}), not to {to!r}.")
        inplace.check(parts, vm)
        return
    state = VmView(rec).state
    if state != "running":
        raise StateError(f"VM {vm!r} is {state}; only a running VM can be migrated.")
    if rec.partition == to:
        raise StateError(f"VM {vm!r} is already in partition {to!r}.")
    if mode not in ("zero-copy", "copy"):
        raise StateError(f"unknown mode {mode!r}; use zero-copy or copy.")
    if mode == "zero-copy" and rec.template is not None:
        raise StateError(f"VM {vm!r} is a clone of template {rec.template!r}: its RAM is a "
                         "private copy-on-write mapping of the template's file, which "
                         "zero-copy migration cannot hand over; use --mode copy.")
    if mode == "zero-copy" and rec.mergeable:
        raise StateError(f"VM {vm!r} is mergeable: its RAM is private so that KSM can "
                         "merge it, and zero-copy migration needs RAM in a shared file; "
                         "use --mode copy.")
    if mode == "zero-copy" and not rec.shared_ram:
        raise StateError(f"VM {vm!r} has private RAM, which zero-copy migration cannot "
                         "hand over (it needs RAM in a shared file); use --mode copy.")
    _fits(parts, rec, to, mode)
    for name in (rec.partition, to):
        if parts.supervisor_pid(name) is None:
            raise StateError(f"the supervisor of partition {name!r} is not running; start "
                             f"it with `fusuma partition restart {name}`.")
    # The destination's QEMU must have the guest's machine type (fusuma.migration.compat).
    compat.check_destination(parts.paths, db, rec, to)


def _fits(parts: PartitionManager, rec: VmRecord, to: str, mode: str) -> None:
    """Refuse ``rec`` in partition ``to`` unless it fits there: room, cores, QoS."""
    db = parts.db
    dest = db.partition(to)
    capacity.check_move(parts.paths, db, rec, to, mode, host=parts.host)
    if rec.vcpus > len(dest.cpus):
        raise ResourceError(f"partition {to!r} has {len(dest.cpus)} core(s), fewer than the "
                            f"{rec.vcpus} vCPUs of {rec.name!r}.")
    check_admission(to, len(dest.cpus), db.vms(to), rec)
    from fusuma.governor.qos import check_emulators

    check_emulators(to, dest.cpus, [*db.vms(to), rec.with_(partition=to)])


def migrate(parts: PartitionManager, vm: str, to: str, mode: str = "zero-copy",
            progress: Callable[[str], None] = lambda s: None,
            checkpoint: Callable[[], None] = lambda: None) -> MigrationResult:
    """Move running ``vm`` to partition ``to``. ``checkpoint`` is called once, at the
    last point where stopping leaves everything as it was (before the stream starts);
    a FusumaError it raises ends the move there, the VM staying where it ran."""
    wall = Marks()
    with host_lock(parts.paths.home):
        wall.mark("lock")
        op = _Open(parts, Planned(vm, to, mode), progress, checkpoint, wall)
        op.begin()
        try:
            op.steps.prepared(op.asked)
            op.steps.switch()
            res = op.steps.release()
        except FusumaError as exc:
            op.close(None, exc)
            raise
        except BaseException:
            op.jh.end()
            raise
        op.close(res, None)
        wall.mark("done")
    return replace(res, wall_ms=wall.steps())


@frozen
class Planned:
    """One move of ``migrate_many``'s list."""
    vm: str
    to: str
    mode: str


class ManyFailed(MigrationError):
    """A move of ``migrate_many``'s list failed: the moves before it are done (their
    results in ``moved``), it and those after it are not (their VMs run where they
    ran), and the message says which is which."""

    def __init__(self, message: str, moved: list[MigrationResult]) -> None:
        super().__init__(message)
        self.moved = moved


class _Open:
    """A move begun (``migrate``'s one, or one of ``migrate_many``'s): its job held and
    its checks passed; ``begin`` makes the VM ``migrating`` and, given a pool, asks the
    destination to prepare on its thread (only the request, no state); ``close`` ends
    the job with its event."""

    def __init__(self, parts: PartitionManager, p: Planned,
                 progress: Callable[[str], None],
                 checkpoint: Callable[[], None] = lambda: None,
                 wall: Marks | None = None) -> None:
        self.wall = wall or Marks()
        if wall is None:
            self.wall.mark("lock")
        parts.ensure_recovered(vm_obj(p.vm))
        self.parts, self.plan = parts, p
        self.source = parts.db.vm(p.vm).partition
        self.jh = parts.job(vm_obj(p.vm), JobKind.MIGRATE, source=self.source, peer=p.to)
        try:
            self.wall.mark("job")
            check(parts, p.vm, p.to, p.mode)
            self.wall.mark("checks")
            self.steps = MoveSteps(parts, self.jh, p.vm, p.to, p.mode, progress,
                                   checkpoint, self.wall)
        except BaseException:
            self.jh.end()
            raise
        # The destination's answer: asked when the move needs it, or ahead (begin).
        self.asked: Callable[[], rpc.Prepared] = self.steps.move.dest_prepare

    def begin(self, pool: ThreadPoolExecutor | None = None) -> None:
        try:
            self.steps.start()
        except FusumaError as exc:
            self.close(None, exc)
            raise
        except BaseException:
            self.jh.end()
            raise
        if pool is not None:
            self.asked = pool.submit(self.steps.move.dest_prepare).result

    def close(self, res: MigrationResult | None, exc: FusumaError | None) -> None:
        """End its job and write its event, as ``migrate`` does."""
        vm, db = self.plan.vm, self.parts.db
        try:
            if res is not None:
                db.emit_context("lifecycle", "vm-moved", f"/1.0/vms/{vm}",
                                {**res.as_json(), "result": "ok"})
            else:
                where = db.find_vm(vm)
                db.emit("lifecycle", "vm-move-failed", f"/1.0/vms/{vm}", vm=vm,
                        mode=self.plan.mode, result="failed", error=str(exc),
                        partition=where.partition if where else None,
                        state=where.state.value if where else None,
                        **{"from": self.source, "to": self.plan.to})
        finally:
            self.jh.end()

    def call_off(self, why: str) -> None:
        """Undo a move that has not streamed: its destination's QEMU (once started)
        ended, the VM running where it ran (the recovery of a move before its stream)."""
        with contextlib.suppress(FusumaError):
            self.asked()
        try:
            cur = self.parts.db.find_job(vm_obj(self.plan.vm))
            if cur is not None:
                recover_move(self.parts, cur)
        finally:
            self.close(None, MigrationError(why))


def migrate_many(parts: PartitionManager, plan: list[Planned],
                 progress: Callable[[str], None] = lambda s: None,
                 ahead: bool = True) -> list[MigrationResult]:
    """Make the moves of ``plan`` one after another, each as ``migrate`` makes it
    (its own job, so a kill at any point is recovered move by move), the next move's
    destination QEMU asked for while this move's guest already runs at its destination
    and its source QEMU is being ended: a QEMU never starts during another guest's
    pause, and at most two moves are open. The first failure ends the run: the next
    move, if begun, is called off; ManyFailed says which VMs moved and which did not.

    ``ahead=False``: each move begun once the one before is done. ``bench maintain
    --compare-pipeline`` measures both in one run: on a quiet machine the pipeline made
    16 VMs' maintain 1.3-1.4x faster; with other work on the cores it made it slower
    (docs/results/qemu-upgrade.md)."""
    done: list[MigrationResult] = []
    if not plan:
        return done
    with host_lock(parts.paths.home), ThreadPoolExecutor(1) as pool:
        nxt: _Open | None = _begun(parts, plan[0], pool, progress)
        for i in range(len(plan)):
            cur, nxt = nxt, None
            assert cur is not None
            steps = cur.steps
            try:
                steps.prepared(cur.asked)
                steps.switch()
            except FusumaError as exc:
                cur.close(None, exc)
                raise _many_failed(plan, done, i, exc) from exc
            later: FusumaError | None = None
            if ahead and i + 1 < len(plan) and not steps.over:
                try:
                    nxt = _begun(parts, plan[i + 1], pool, progress)
                except FusumaError as exc:
                    later = exc
            try:
                res = steps.release()
            except FusumaError as exc:
                cur.close(None, exc)
                if nxt is not None:
                    nxt.call_off(f"the move of {cur.plan.vm!r} before it failed")
                raise _many_failed(plan, done, i, exc) from exc
            cur.wall.mark("done")
            res = replace(res, wall_ms=cur.wall.steps())
            cur.close(res, None)
            done.append(res)
            if nxt is None and later is None and i + 1 < len(plan):
                try:
                    nxt = _begun(parts, plan[i + 1], pool, progress)
                except FusumaError as exc:
                    later = exc
            if later is not None:
                raise _many_failed(plan, done, i + 1, later) from later
        return done


def _begun(parts: PartitionManager, p: Planned, pool: ThreadPoolExecutor,
           progress: Callable[[str], None]) -> _Open:
    op = _Open(parts, p, progress)
    op.begin(pool)
    return op


def _many_failed(plan: list[Planned], done: list[MigrationResult], i: int,
                 exc: FusumaError) -> ManyFailed:
    """The sentence of a run whose move ``i`` failed (``exc`` says where that VM is)."""
    moved = ", ".join(r.vm for r in done) or "none"
    left = ", ".join(p.vm for p in plan[i + 1:])
    rest = f"; not moved, running where they ran: {left}" if left else ""
    return ManyFailed(f"{exc} Moved before it: {moved}{rest}.", list(done))


# The steps of a whole move as ``migrate``'s caller waits for it (``wall_ms``): the
# host lock, the job (recovering one whose owner died), the checks, the destination's
# preparation (its QEMU started), the stream (to the source's "completed"), the
# destination's finish (the guest runs there, its record taken), the source's release
# (its QEMU ended), the destination's settling (its sockets renamed), and the rest
# (the job closed, the event written).
WALL_STEPS = ("lock", "job", "checks", "prepare", "stream", "finish", "release", "settle",
              "done")


class Marks:
    """Monotonic marks of a move's steps, each step's time measured from the mark
    before it (the first from this object's making)."""

    def __init__(self) -> None:
        self.t0 = time.monotonic()
        self.at: dict[str, float] = {}

    def mark(self, step: str) -> None:
        self.at[step] = time.monotonic()

    def steps(self) -> dict[str, float]:
        out, last = {}, self.t0
        for step in WALL_STEPS:
            at = self.at.get(step)
            if at is not None:
                out[step] = round((at - last) * 1000, 2)
                last = at
        return out


def move_stopped(parts: PartitionManager, vm: str, to: str) -> None:
    """Give stopped (or crashed) ``vm`` partition ``to``: nothing runs, so nothing is
    carried but its record. Its files (disk overlay, NVRAM, seed, snapshots) stay where
    they are and its disks change partition with it, in one transaction, after the same
    refusals as a move's (room, cores, QoS, machine type). It starts there next time."""
    with host_lock(parts.paths.home):
        parts.ensure_recovered(vm_obj(vm))
        db = parts.db
        rec = db.vm(vm)
        job = db.find_job(vm_obj(vm))
        state = VmView(rec).state
        if job is not None or state not in ("stopped", "crashed"):
            raise StateError(f"VM {vm!r} is {state}; only a stopped VM changes partition "
                             "this way (a running one moves live: `fusuma migrate`).")
        if rec.partition == to:
            raise StateError(f"VM {vm!r} is already in partition {to!r}.")
        _fits(parts, rec, to, "zero-copy")
        compat.check_destination(parts.paths, db, rec, to)
        with db.atomic():
            db.set_vm(vm, expect=rec.state, partition=to)
            for disk in rec.disks:
                db.move_disk(disk, to)
        with contextlib.suppress(Exception):
            parts.cg.delete_leaf(rec.partition, f"vm.{vm}")
        db.emit("lifecycle", "vm-moved", f"/1.0/vms/{vm}", vm=vm, mode="stopped",
                result="ok", **{"from": rec.partition, "to": to})


class MovedNotRunning(MigrationError):
    """The guest reached its destination, whose QEMU then did not run it."""


@frozen
class LocalMove:
    """The two sides of a move inside this host, each a partition's supervisor asked
    by typed request (``fusuma.supervisor.moves``): between two partitions (zero-copy
    or copy), or in place (cpr-transfer: one supervisor holds both QEMUs). The steps
    pair the way libvirt's do: destination prepare and finish, source perform and
    confirm."""

    parts: PartitionManager
    vm: str
    source: str
    to: str
    mode: str

    @property
    def in_place(self) -> bool:
        return self.mode == CPR_MODE

    def dest_prepare(self) -> rpc.Prepared:
        delay = float(os.environ.get(FAULT_BEFORE_DECIDE, 0))
        req: rpc.Request[rpc.Prepared] = (
            rpc.CprPrepare(self.vm, fault_decide_delay=delay) if self.in_place
            else rpc.IncomingPrepare(self.vm, self.mode, fault_decide_delay=delay))
        return self.parts.client(self.to).send(req)

    def source_perform(self, prep: rpc.Prepared) -> rpc.Streamed:
        req: rpc.Request[rpc.Streamed] = (
            rpc.CprTransfer(self.vm, fault_incoming_delay=float(
                os.environ.get(FAULT_BEFORE_INCOMING, 0))) if self.in_place
            else rpc.MigrateOut(self.vm, str(prep.uri), self.mode, max_bandwidth=int(
                os.environ.get(FAULT_STREAM_BPS, 0))))
        return self.parts.client(self.source).send(req, timeout=700)

    def dest_finish(self) -> rpc.Resumed:
        return self.parts.client(self.to).send(rpc.IncomingFinish(self.vm))

    def source_confirm(self) -> None:
        self.parts.client(self.source).send(rpc.Release(self.vm))

    def dest_settle(self, progress: Callable[[str], None]) -> None:
        dst = self.parts.client(self.to)
        try:
            dst.send(rpc.Settle(self.vm))
        except FusumaError as exc:
            # The guest runs there; a new supervisor adopts it and settles its sockets.
            progress(f"could not settle {self.vm} in {self.to} ({exc}); restarting its "
                     "supervisor")
            if self.parts.supervisor_pid(self.to) is None:
                self.parts.start_supervisor(self.to)
                dst.send(rpc.Settle(self.vm))


class MoveSteps:
    """A move's steps after its checks, each phase (``MovePhase``) recorded before it
    is taken (see the module docstring), in four calls: ``start`` (the VM becomes
    ``migrating``), ``prepared`` (the destination's QEMU waits for the stream),
    ``switch`` (the stream, and the guest running at the destination) and ``release``
    (the source's QEMU ended, the destination's sockets settled). ``migrate`` makes
    them one after another; ``migrate_many`` overlaps the next move's preparation with
    this one's release. Any failure after the VM became ``migrating`` is resolved by
    the same procedure that recovers a move whose owner died (``migration.resolve``):
    a step then raises, or, when the guest already runs at the destination, the
    steps after it are skipped and the move counts as done."""

    def __init__(self, parts: PartitionManager, jh: JobLock, vm: str, to: str, mode: str,
                 progress: Callable[[str], None],
                 checkpoint: Callable[[], None] = lambda: None,
                 wall: Marks | None = None) -> None:
        self.parts, self.jh, self.vm, self.to, self.mode = parts, jh, vm, to, mode
        self.progress, self.checkpoint = progress, checkpoint
        self.wall = wall or Marks()
        self.rec = parts.db.vm(vm)
        self.move = LocalMove(parts, vm, self.rec.partition, to, mode)
        self.switched = False   # the destination took the guest: a later failure is no undo
        self.over = False       # resolved forward after a failure: nothing more to do
        self.cpu0 = self.cpu1 = 0.0
        self.prep: rpc.Prepared | None = None
        self.out: rpc.Streamed | None = None
        self.fin: rpc.Resumed | None = None

    def start(self) -> None:
        self.parts.db.transition(self.vm, VmState.MIGRATING, expect={VmState.RUNNING})
        self.jh.phase(MovePhase.PREPARE, mode=self.mode, source_pid=self.rec.pid)
        self.progress(f"preparing {self.vm} in {self.to} ({self.mode})")

    def _guard(self, fn: Callable[[], None]) -> None:
        if self.over:
            return
        try:
            fn()
        except MovedNotRunning:
            raise
        except FusumaError as exc:
            _resolve_failed(self.parts, self.vm, self.move.source, exc,
                            switched=self.switched, progress=self.progress)
            self.over = True

    def prepared(self, prep: Callable[[], rpc.Prepared]) -> None:
        """``prep``: the destination's answer (``LocalMove.dest_prepare``, or the
        future of one asked ahead), or its error."""
        def step() -> None:
            self.prep = p = prep()
            self.wall.mark("prepare")
            self.jh.phase(MovePhase.PREPARED, dest_pid=p.pid, dest_run=p.run_dir,
                          dest_ram=p.dest_ram)
            self.cpu0 = cpu_seconds(int(self.rec.pid or 0)) + cpu_seconds(p.pid)
        self._guard(step)

    def switch(self) -> None:
        def step() -> None:
            assert self.prep is not None
            _fault_sleep(FAULT_BEFORE_STREAM)
            self.checkpoint()
            self.progress(f"moving {self.vm} {self.move.source} -> {self.to}")
            self.jh.phase(MovePhase.STREAMING)
            self.out = self.move.source_perform(self.prep)
            self.wall.mark("stream")
            self.jh.phase(MovePhase.STREAMED, bytes_sent=self.out.bytes_sent)
            self.cpu1 = cpu_seconds(int(self.rec.pid or 0)) + cpu_seconds(self.prep.pid)
            _fault_sleep(FAULT_AFTER_COMPLETE)
            self.fin = self.move.dest_finish()
            self.wall.mark("finish")
            self.switched = True
            self.jh.phase(MovePhase.SWITCHED)
            _fault_sleep(FAULT_AFTER_SWITCH)
        self._guard(step)

    def release(self) -> MigrationResult:
        def step() -> None:
            self.move.source_confirm()
            self.wall.mark("release")
            self.jh.phase(MovePhase.RELEASED)
            _fault_sleep(FAULT_AFTER_RELEASE)
            self.move.dest_settle(self.progress)
            self.wall.mark("settle")
            after = self.parts.db.vm(self.vm)
            if after.partition != self.to \
                    or after.state not in (VmState.RUNNING, VmState.PAUSED):
                raise MovedNotRunning(
                    f"{self.vm!r} moved to partition {self.to!r}, but is "
                    f"{after.state.value} there: {after.error or 'see ps'}; start it "
                    f"again with `fusuma vm start {self.vm}`.")
        self._guard(step)
        return self.result()

    def result(self) -> MigrationResult:
        prep, out, fin = self.prep, self.out, self.fin
        assert prep is not None and out is not None and fin is not None
        # An in-place transfer answers once the guest runs again, with that moment.
        resume_ts = out.resume_ts or fin.resume_ts
        stop_ts = out.stop_ts
        return MigrationResult(
            vm=self.vm, source=self.move.source, to=self.to, mode=self.mode,
            total_ms=round((resume_ts - out.t0) * 1000, 2),
            downtime_ms=round((resume_ts - stop_ts) * 1000, 2) if stop_ts else None,
            bytes_sent=out.bytes_sent, prepare_ms=prep.prepare_ms,
            cpu_s=round(self.cpu1 - self.cpu0, 3), qemu_total_ms=out.qemu_total_ms,
            qemu_downtime_ms=out.qemu_downtime_ms, paused=out.paused,
            qemu_mode=out.source_mode, source_pid=int(self.rec.pid or 0),
            dest_pid=prep.pid, steps_ms=downtime_steps(out, fin))


# The steps of a move's downtime: the source QEMU stopped the guest and sent the
# device state (STOP to its "completed"), the destination QEMU finished loading it,
# then the destination's steps (``fusuma.supervisor.moves.dest.STEPS``).
DOWNTIME_STEPS = {"completed": "source_saved", "loaded": "dest_loaded", "seen": "event",
                  "decided": "decision", "taps": "taps", "resumed": "cont"}


def downtime_steps(out: rpc.Streamed, fin: rpc.Resumed) -> dict[str, float] | None:
    """How long each step between the source's STOP and the destination's RESUME
    took, in ms (``DOWNTIME_STEPS``), each from the end of the one before; None when
    a side did not say (an in-place move, an older supervisor)."""
    if out.stop_ts is None or "loaded" not in fin.steps:
        return None
    marks = {"completed": out.completed_ts, **fin.steps}
    steps, last = {}, out.stop_ts
    for key, name in DOWNTIME_STEPS.items():
        at = marks.get(key)
        if at is not None:
            steps[name] = round((at - last) * 1000, 2)
            last = at
    return steps


def _resolve_failed(parts: PartitionManager, vm: str, source: str, exc: FusumaError, *,
                    switched: bool, progress: Callable[[str], None]) -> None:
    """A step failed: resolve the move as a recovery would, then say where the guest is
    (one sentence). Returns only when the guest runs at the destination after a step
    past the switch failed (the move is then done)."""
    cur = parts.db.find_job(vm_obj(vm))
    if cur is None:
        raise exc
    try:
        outcome = recover_move(parts, cur)
    except FusumaError as exc2:
        raise MigrationError(f"migration of {vm!r} failed ({exc}) and could not be "
                             f"resolved ({exc2}); see `fusuma ps`.") from exc
    if outcome.decision == Decision.FORWARD and outcome.running and switched:
        progress(f"a step after the switch failed ({exc}); {outcome.sentence()}")
        return
    if outcome.decision == Decision.FORWARD:
        raise MigrationError(f"migration of {vm!r} hit a fault after the guest "
                             f"moved ({exc}); {outcome.sentence()}.") from exc
    if outcome.running:
        raise MigrationError(f"migration of {vm!r} failed ({exc}); it stays in "
                             f"partition {source!r}.") from exc
    raise MigrationError(f"migration of {vm!r} failed ({exc}); "
                         f"{outcome.sentence()}.") from exc


def _fault_sleep(var: str) -> None:
    value = os.environ.get(var)
    if value:
        time.sleep(float(value))
