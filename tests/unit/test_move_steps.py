"""Where a move's downtime goes: the source's STOP and "completed", then the
destination's steps, each step's ms from the end of the one before."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from fusuma.errors import MigrationError, QemuError
from fusuma.migration import downtime_steps
from fusuma.qemu.qmp import MigrationInfo
from fusuma.supervisor import rpc
from fusuma.supervisor.moves.source import StreamEnd, final_figures, outcome_or, stream_end


def streamed(**kw: Any) -> rpc.Streamed:
    base: dict[str, Any] = dict(t0=99.0, stop_ts=100.0, qemu_total_ms=5.0,
                                qemu_downtime_ms=3.0, bytes_sent=1, source_pid=1,
                                paused=False, completed_ts=100.002)
    base.update(kw)
    return rpc.Streamed(**base)


def test_each_step_from_the_end_of_the_one_before() -> None:
    fin = rpc.Resumed(pid=2, resume_ts=100.0081, steps={
        "loaded": 100.0045, "seen": 100.005, "decided": 100.0052, "taps": 100.0055,
        "resumed": 100.0081})
    got = downtime_steps(streamed(), fin)
    assert got == {"source_saved": 2.0, "dest_loaded": 2.5, "event": 0.5, "decision": 0.2,
                   "taps": 0.3, "cont": 2.6}
    assert list(got) == ["source_saved", "dest_loaded", "event", "decision", "taps", "cont"]
    # The steps add up to the downtime (STOP to RESUME).
    assert round(sum(got.values()), 2) == round((fin.resume_ts - 100.0) * 1000, 2)


def test_a_step_a_side_did_not_time_is_left_out() -> None:
    fin = rpc.Resumed(pid=2, resume_ts=100.01, steps={"loaded": 100.004,
                                                      "resumed": 100.01})
    assert downtime_steps(streamed(completed_ts=None), fin) == {"dest_loaded": 4.0,
                                                                 "cont": 6.0}
    # No STOP, or a destination that timed nothing of its load (in place, an older
    # supervisor): no steps.
    assert downtime_steps(streamed(stop_ts=None), fin) is None
    assert downtime_steps(streamed(), rpc.Resumed(pid=2, resume_ts=100.01)) is None
    assert downtime_steps(streamed(), rpc.Resumed(pid=2, resume_ts=100.01,
                                                  steps={"decided": 100.005})) is None


class FakeListener:
    """Hands out queued events, then waits forever (as a quiet QEMU)."""

    def __init__(self, events: list[dict[str, Any]]) -> None:
        self.events = events

    async def get(self) -> dict[str, Any]:
        if not self.events:
            await asyncio.Event().wait()
        return self.events.pop(0)


class FakeQmp:
    """Counts the commands a source QEMU gets while its stream runs."""

    def __init__(self) -> None:
        self.commands: list[str] = []

    async def migrate_cancel(self) -> None:
        self.commands.append("migrate_cancel")


class FakeInstance:
    def __init__(self) -> None:
        self.vm = "vm0"
        self.qmp = FakeQmp()
        self.exited = asyncio.Event()


def ev(name: str, at: float, **data: Any) -> dict[str, Any]:
    return {"event": name, "data": data,
            "timestamp": {"seconds": int(at), "microseconds": round(at % 1 * 1e6)}}


def end(events: list[dict[str, Any]], timeout: float = 5.0,
        exit_after: float | None = None) -> tuple[StreamEnd | Exception, list[str]]:
    async def go() -> tuple[StreamEnd | Exception, list[str]]:
        inst: Any = FakeInstance()
        if exit_after is not None:
            asyncio.get_running_loop().call_later(exit_after, inst.exited.set)
        try:
            got: StreamEnd | Exception = await stream_end(inst, FakeListener(events),  # type: ignore[arg-type]
                                                          timeout)
        except MigrationError as exc:
            got = exc
        return got, inst.qmp.commands
    return asyncio.run(go())


def test_the_source_says_when_it_stopped_and_when_it_completed() -> None:
    # Its events alone: no command reaches the source QEMU while it streams and stops.
    got, commands = end([ev("MIGRATION", 10.0, status="setup"),
                         ev("MIGRATION", 10.001, status="active"), ev("STOP", 10.5),
                         ev("MIGRATION", 10.502, status="device"),
                         ev("MIGRATION", 10.503, status="completed")])
    assert got == StreamEnd("completed", 10.5, 10.503)
    assert commands == []


def test_a_failed_stream_ends_the_wait_with_its_status() -> None:
    got, _ = end([ev("MIGRATION", 10.0, status="active"),
                  ev("MIGRATION", 10.2, status="failed")])
    assert got == StreamEnd("failed", None, None)
    got, _ = end([ev("MIGRATION", 10.0, status="cancelled")])
    assert got == StreamEnd("cancelled", None, None)


def test_a_source_that_exits_during_the_stream_is_one_sentence() -> None:
    got, commands = end([ev("MIGRATION", 10.0, status="active")], exit_after=0.01)
    assert isinstance(got, MigrationError)
    assert "exited during migration" in str(got)
    assert commands == []


def test_a_stream_that_does_not_end_in_time_is_cancelled() -> None:
    got, commands = end([ev("MIGRATION", 10.0, status="active")], timeout=0.05)
    assert isinstance(got, MigrationError)
    assert "did not finish in 0 s and was cancelled" in str(got)
    assert commands == ["migrate_cancel"]


class FakeDb:
    """A job whose decision is recorded after ``after`` looks (None: never)."""

    def __init__(self, after: int | None, job: bool = True) -> None:
        self.after, self.looks, self.job = after, 0, job

    def find_job(self, obj: str) -> Any:
        self.looks += 1
        if not self.job:
            return None
        decided = self.after is not None and self.looks > self.after
        return type("Job", (), {"detail": {"decision": "forward"} if decided else {}})()


def wait_outcome(db: FakeDb, limit: float) -> bool:
    h: Any = type("Host", (), {"db": db})()
    return asyncio.run(outcome_or(h, "vm0", limit))


def test_the_source_reports_once_the_outcome_is_recorded() -> None:
    db = FakeDb(after=3)
    assert wait_outcome(db, 5.0) is True
    assert db.looks == 4


def test_without_an_outcome_the_source_reports_after_its_limit() -> None:
    db = FakeDb(after=None)
    assert wait_outcome(db, 0.02) is False
    assert db.looks > 1
    # No job (a recovery ended it): nothing to wait for.
    assert wait_outcome(FakeDb(after=None, job=False), 5.0) is False


class FiguresQmp:
    def __init__(self, totals: list[float | None]) -> None:
        self.totals = totals

    async def query_migrate(self) -> MigrationInfo:
        total = self.totals.pop(0) if len(self.totals) > 1 else self.totals[0]
        return MigrationInfo(status="completed", total_ms=total, downtime_ms=total)


def test_qemus_figures_are_asked_again_until_it_has_computed_them() -> None:
    q = FiguresQmp([0, 0, 7.0])
    got = asyncio.run(final_figures(q))  # type: ignore[arg-type]
    assert got.total_ms == 7.0 and q.totals == [7.0]
    # A QEMU that never says: the last answer, after a bounded number of asks.
    assert asyncio.run(final_figures(FiguresQmp([0]), tries=3)).total_ms == 0  # type: ignore[arg-type]


class StreamQmp:
    """A source QEMU whose stream completes; ``during`` runs while it streams (what
    another request of the supervisor does meanwhile). Like QEMU, it is still in
    "finish-migrate" for the first ``finishing`` asks after its "completed" event, and
    refuses `cont` then ("Migration is not finalized yet")."""

    def __init__(self, during: Any, finishing: int = 2) -> None:
        self.commands: list[str] = []
        self.during = during
        self.finishing = finishing
        self.events = [ev("STOP", 100.0), ev("MIGRATION", 100.002, status="completed")]

    async def query_status(self) -> str:
        if self.finishing > 0:
            self.finishing -= 1
            return "finish-migrate"
        return "postmigrate"

    async def clear_stale_stream(self) -> bool:
        self.commands.append("clear")
        return False

    def listener(self, *names: str) -> Any:
        qmp = self
        self.commands.append("listen")

        class Events(FakeListener):
            async def get(self) -> dict[str, Any]:
                if qmp.during is not None:
                    qmp.during()
                    qmp.during = None
                return await super().get()
        return Events(self.events)

    def drop_listener(self, listener: Any) -> None:
        pass

    async def migrate_set_capabilities(self, caps: Any) -> None:
        self.commands.append("caps")

    async def migrate(self, uri: str) -> None:
        self.commands.append("migrate")

    async def query_migrate(self) -> MigrationInfo:
        return MigrationInfo(status="completed", total_ms=9.0, downtime_ms=4.0)

    async def cont(self) -> None:
        if self.finishing > 0:
            raise QemuError("Migration is not finalized yet")
        self.commands.append("cont")


def perform_with(during: Any, decision: str | None, mode: str = "copy"
                 ) -> tuple[Any, list[str], list[str]]:
    """Run the source's ``perform`` of a move against fakes: the result (or the
    error), QMP's commands, and what became of the source (the leaving side, its
    runstate followed again, the control weight or its class's given to its leaf)."""
    from fusuma.state import VmState
    from fusuma.supervisor.moves import source

    inst: Any = FakeInstance()
    inst.pid, inst.resumed_back = 4321, False
    became: list[str] = []
    rec = type("Rec", (), {"state": VmState.MIGRATING, "accel_used": "kvm"})()
    job = type("Job", (), {"detail": {} if decision is None else {"decision": decision}})()
    db = type("Db", (), {"vm": lambda self, n: rec, "find_job": lambda self, o: job})()
    insts = type("Insts", (), {"get": lambda self, *a: inst})()
    h: Any = type("Host", (), {"instances": insts, "db": db,
                               "follow_runstate": lambda self, i: became.append("follow"),
                               "control_cpu": lambda self, vm: became.append("control"),
                               "class_cpu": lambda self, vm, pid: became.append("class")})()
    inst.qmp = StreamQmp(during(inst) if during else None)
    real = source.leaving
    source.leaving = lambda h, i, owns_ram: became.append("leaving")  # type: ignore[assignment]
    try:
        try:
            got: Any = asyncio.run(source.perform(h, "vm0", "tcp:10.0.0.2:4444", mode,
                                                  timeout=5.0, plain_tcp=True))
        except MigrationError as exc:
            got = exc
    finally:
        source.leaving = real   # type: ignore[assignment]
    return got, inst.qmp.commands, became


def test_a_stream_that_ends_after_back_was_decided_runs_the_guest_on_here() -> None:
    """An agent restarted mid-move decides "back" and asks ``resume`` while the stream
    still runs (the guest is running: nothing to do then). When that stream completes
    QEMU pauses the guest: the source runs it again instead of leaving it paused."""
    def resume_asked(inst: Any) -> Any:
        return lambda: setattr(inst, "resumed_back", True)

    got, commands, became = perform_with(resume_asked, None)
    assert isinstance(got, MigrationError) and "decided back" in str(got)
    # QEMU still finishing the stream (its "completed" event comes before it leaves
    # "finish-migrate", where it refuses `cont`): the source waits for it, then runs
    # the guest (a `cont` at once failed, and left the guest paused for good, in the
    # lab once in about ten runs).
    assert commands[-1] == "cont" and became == ["class", "follow"]
    # The same when the host's job holds "back" (mirrored there by the agent).
    got, commands, became = perform_with(None, "back")
    assert isinstance(got, MigrationError) and commands[-1] == "cont"
    # Without "back", the completed stream leaves this QEMU as the leaving side.
    got, commands, became = perform_with(None, None)
    assert isinstance(got, rpc.Streamed) and "cont" not in commands
    assert became == ["leaving"]
    # An earlier stream's leftovers go first: before this stream's listener and its
    # capabilities, which QEMU refuses while one runs (tests/unit/test_stale_stream.py).
    assert commands[:3] == ["clear", "listen", "caps"]


def test_a_zero_copy_source_streams_at_the_control_weight() -> None:
    """The guest is paused for nearly all of a zero-copy stream, while its QEMU saves
    the device state: its leaf gets the control weight just before `migrate` (a busy
    guaranteed VM beside it must not hold the move up), and its class's weight again
    when the guest runs on here."""
    got, _, became = perform_with(None, None, mode="zero-copy")
    assert isinstance(got, rpc.Streamed) and became == ["control", "leaving"]
    got, _, became = perform_with(None, "back", mode="zero-copy")
    assert isinstance(got, MigrationError) and became == ["control", "class", "follow"]

    def fails(inst: Any) -> Any:
        return lambda: inst.qmp.events.__setitem__(
            slice(None), [ev("MIGRATION", 100.0, status="failed")])
    got, _, became = perform_with(fails, None, mode="zero-copy")
    assert isinstance(got, MigrationError) and became == ["control", "class"]


class ResumeQmp:
    """A source QEMU for ``resume``: its migration status steps through ``statuses``
    (the last one repeated); it refuses `cont` while a stream is before its end."""

    def __init__(self, statuses: list[str], runstate: str) -> None:
        self.statuses, self.runstate = statuses, runstate
        self.commands: list[str] = []

    async def query_migrate(self) -> MigrationInfo:
        status = self.statuses.pop(0) if len(self.statuses) > 1 else self.statuses[0]
        return MigrationInfo(status=status)

    async def migrate_cancel(self) -> None:
        self.commands.append("migrate_cancel")

    async def execute(self, command: str, arguments: Any = None, timeout: float = 30) -> Any:
        assert command in ("query-jobs", "qom-list"), command   # no move's leftovers
        return []

    async def query_status(self) -> str:
        return self.runstate

    async def cont(self) -> None:
        from fusuma.supervisor.moves.source import STREAMING
        if self.statuses[0] in STREAMING:
            raise AssertionError("QEMU refuses cont: migration is not finalized yet")
        self.commands.append("cont")


def resume_with(qmp: ResumeQmp, streaming: bool) -> Any:
    from fusuma.qemu.instance import Role
    from fusuma.supervisor.moves import source

    inst: Any = FakeInstance()
    inst.qmp, inst.pid, inst.streaming, inst.resumed_back = qmp, 77, streaming, False
    inst.role = Role.RUNNING
    db = type("Db", (), {"decide": lambda self, o, d: "back",
                         "find_job": lambda self, o: None})()
    insts = type("Insts", (), {"get": lambda self, *a: inst})()
    inst.weights = []
    h: Any = type("Host", (), {"instances": insts, "db": db,
                               "follow_runstate": lambda self, i: None,
                               "class_cpu": lambda self, vm, pid:
                                   inst.weights.append(("class", vm, pid))})()
    asyncio.run(source.resume(h, "vm0"))
    return inst


def test_resume_leaves_a_stream_to_its_owner_and_cancels_one_without() -> None:
    """"back" reaches a source while its stream runs. With a ``perform`` owning it
    (QEMU may be paused before its switch, refusing `cont`), ``resume`` only marks the
    instance: ``perform`` runs the guest at the stream's end. With none (its supervisor
    was killed mid-move), ``resume`` cancels the stream, waits for its end, then runs
    the guest."""
    owned = ResumeQmp(["pre-switchover"], "finish-migrate")
    inst = resume_with(owned, streaming=True)
    assert inst.resumed_back and owned.commands == []
    orphan = ResumeQmp(["pre-switchover", "cancelling", "cancelling", "cancelled"],
                       "paused")
    resume_with(orphan, streaming=False)
    assert orphan.commands == ["migrate_cancel", "cont"]
    # No stream at all (the usual "back" after a failed one): just `cont`.
    idle = ResumeQmp(["failed"], "paused")
    inst = resume_with(idle, streaming=False)
    assert idle.commands == ["cont"]
    # Its leaf, at the control weight while it streamed, is back at its class's.
    assert inst.weights == [("class", "vm0", 77)]


def test_a_stream_that_fails_after_back_was_decided_leaves_the_guest_running() -> None:
    def fail_after_back(inst: Any) -> Any:
        def during() -> None:
            inst.resumed_back = True
            inst.qmp.events[:] = [ev("MIGRATION", 100.0, status="failed")]
        return during

    class FailingQmp(StreamQmp):
        async def query_migrate(self) -> MigrationInfo:
            return MigrationInfo(status="failed", error="connection reset")

        async def query_status(self) -> str:
            return "paused"

    from fusuma.state import VmState
    from fusuma.supervisor.moves import source

    inst: Any = FakeInstance()
    inst.pid, inst.resumed_back = 4321, False
    rec = type("Rec", (), {"state": VmState.MIGRATING, "accel_used": "kvm"})()
    db = type("Db", (), {"vm": lambda self, n: rec, "find_job": lambda self, o: None})()
    insts = type("Insts", (), {"get": lambda self, *a: inst})()
    weights: list[str] = []
    h: Any = type("Host", (), {"instances": insts, "db": db,
                               "class_cpu": lambda self, vm, pid: weights.append(vm)})()
    inst.qmp = FailingQmp(None, finishing=0)
    inst.qmp.during = fail_after_back(inst)
    try:
        asyncio.run(source.perform(h, "vm0", "tcp:10.0.0.2:4444", "copy", timeout=5.0,
                                   plain_tcp=True))
    except MigrationError as exc:
        assert "failed" in str(exc)
    else:
        raise AssertionError("the failed stream was taken for a move")
    assert inst.qmp.commands[-1] == "cont" and inst.streaming is False
    assert weights == ["vm0"]


def test_a_moves_wall_steps_each_from_the_mark_before_in_their_order(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """``wall_ms``: where the whole move went as its caller waited; a step not reached
    (a failed move, an in-place move that settles nothing) is left out, and the steps
    add up to the time from the first mark's making to the last step."""
    from fusuma import migration

    clock = iter([10.0, 10.001, 10.0015, 10.004, 10.070, 10.075, 10.0801, 10.090])
    monkeypatch.setattr(migration.time, "monotonic", lambda: next(clock))
    m = migration.Marks()
    for step in ("lock", "job", "checks", "prepare", "stream", "release", "done"):
        m.mark(step)
    got = m.steps()
    assert list(got) == ["lock", "job", "checks", "prepare", "stream", "release", "done"]
    assert got == {"lock": 1.0, "job": 0.5, "checks": 2.5, "prepare": 66.0,
                   "stream": 5.0, "release": 5.1, "done": 9.9}
    assert round(sum(got.values()), 2) == 90.0
