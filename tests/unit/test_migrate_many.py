"""``migrate_many`` (maintain's moves): the next move's destination QEMU starts while
this move's source is released, never during a guest's pause; the first failure ends
the run, calls off a move begun, and says which VMs moved. Fake supervisors answer by
request type; the moves' own steps are the real ``MoveSteps``."""

from __future__ import annotations

import itertools
import threading
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import pytest

from fusuma import migration
from fusuma.errors import MigrationError, StateError, SupervisorError
from fusuma.migration import ManyFailed, Planned, migrate_many
from fusuma.migration.resolve import Outcome
from fusuma.state import Decision, VmState, vm_obj
from fusuma.supervisor import rpc

VMS = ["v0", "v1", "v2"]


@dataclass(frozen=True)
class Rec:
    name: str
    partition: str
    state: VmState = VmState.RUNNING
    pid: int = 100
    error: str | None = None


@dataclass
class Job:
    obj: str
    phases: list[str] = field(default_factory=list)
    ended: bool = False

    def phase(self, phase: str, **detail: Any) -> None:
        self.phases.append(str(phase))

    def end(self) -> None:
        self.ended = True


class Db:
    def __init__(self, world: World) -> None:
        self.w = world

    def vm(self, name: str) -> Rec:
        return self.w.vms[name]

    find_vm = vm

    def transition(self, name: str, state: VmState, expect: Any = None) -> None:
        self.w.vms[name] = replace(self.w.vms[name], state=state)

    def find_job(self, obj: str) -> Job | None:
        return next((j for j in self.w.jobs if j.obj == obj and not j.ended), None)

    def emit(self, *a: Any, **kw: Any) -> None:
        self.w.events.append(("failed", kw.get("vm")))

    def emit_context(self, type_: str, action: str, source: str, ctx: Any) -> None:
        self.w.events.append(("moved", ctx["vm"]))


class World:
    """The host: its VMs, the jobs taken, every request its supervisors got, in order."""

    def __init__(self, tmp: Path, to: str = "p1") -> None:
        self.paths = type("P", (), {"home": tmp})()
        self.to = to
        self.vms = {n: Rec(n, "p0") for n in VMS}
        self.jobs: list[Job] = []
        self.events: list[tuple[str, str | None]] = []
        self.log: list[tuple[str, str]] = []
        self.lock = threading.Lock()
        self.asked: dict[str, threading.Event] = {n: threading.Event() for n in VMS}
        self.overlapped: dict[str, bool] = {}
        self.overlap_wait = 2.0
        self.fail: dict[tuple[str, str], Exception] = {}
        self.db = Db(self)

    # PartitionManager's part
    def ensure_recovered(self, obj: str) -> None:
        pass

    def job(self, obj: str, kind: str, **kw: Any) -> Job:
        j = Job(obj)
        self.jobs.append(j)
        return j

    def client(self, part: str) -> World:
        return self

    # the supervisors
    def send(self, req: Any, timeout: float | None = None) -> Any:
        name = type(req).__name__
        with self.lock:
            self.log.append((name, req.vm))
        if (name, req.vm) in self.fail:
            raise self.fail[(name, req.vm)]
        if isinstance(req, rpc.IncomingPrepare):
            self.asked[req.vm].set()
            return rpc.Prepared(pid=200 + VMS.index(req.vm), prepare_ms=60.0, run_dir="/r")
        if isinstance(req, rpc.MigrateOut):
            return rpc.Streamed(t0=1.0, stop_ts=1.04, qemu_total_ms=40.0,
                                qemu_downtime_ms=3.0, bytes_sent=10, source_pid=100,
                                paused=False, completed_ts=1.042)
        if isinstance(req, rpc.IncomingFinish):
            self.vms[req.vm] = replace(self.vms[req.vm], partition=self.to,
                                       state=VmState.RUNNING)
            return rpc.Resumed(pid=200, resume_ts=1.045, steps={"loaded": 1.043,
                                                                "resumed": 1.045})
        if isinstance(req, rpc.Release):
            i = VMS.index(req.vm)
            if i + 1 < len(VMS):
                # The next move's QEMU is asked for while this one is released (a
                # serial run would ask for it only after this answer: False).
                self.overlapped[VMS[i + 1]] = self.asked[VMS[i + 1]].wait(self.overlap_wait)
            return None
        return None


@pytest.fixture
def world(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> World:
    monkeypatch.setattr(migration, "check", lambda parts, vm, to, mode: None)
    monkeypatch.setattr(migration, "cpu_seconds", lambda pid: 0.0)
    return World(tmp_path)


def plan() -> list[Planned]:
    return [Planned(n, "p1", "zero-copy") for n in VMS]


def test_the_next_qemu_starts_during_the_release_never_during_a_pause(
        world: World) -> None:
    res = migrate_many(world, plan(), ahead=True)  # type: ignore[arg-type]
    assert [r.vm for r in res] == VMS
    assert all(r.wall_ms and "prepare" in r.wall_ms and "done" in r.wall_ms for r in res)
    assert world.overlapped == {"v1": True, "v2": True}
    order = [(n, vm) for n, vm in world.log if n != "Settle"]
    for i, vm in enumerate(VMS):
        # Each move's own steps in order ...
        mine = [n for n, v in order if v == vm]
        assert mine == ["IncomingPrepare", "MigrateOut", "IncomingFinish", "Release"]
        # ... and no QEMU starts between a stream and its guest running again.
        out, fin = order.index(("MigrateOut", vm)), order.index(("IncomingFinish", vm))
        assert not [n for n, _ in order[out:fin] if n == "IncomingPrepare"]
        if i + 1 < len(VMS):
            assert order.index(("IncomingPrepare", VMS[i + 1])) > fin
    assert all(j.ended for j in world.jobs) and len(world.jobs) == 3
    assert world.events == [("moved", v) for v in VMS]
    assert all(r.partition == "p1" for r in world.vms.values())


def test_a_failed_stream_ends_the_run_and_begins_nothing_after_it(
        world: World, monkeypatch: pytest.MonkeyPatch) -> None:
    world.fail[("MigrateOut", "v1")] = SupervisorError("the destination QEMU died")
    recovered: list[str] = []

    def recover(parts: Any, job: Job) -> Outcome:
        recovered.append(job.obj)
        return Outcome(job.obj, Decision.BACK, "p0", True, "stayed")
    monkeypatch.setattr(migration, "recover_move", recover)
    with pytest.raises(ManyFailed) as e:
        migrate_many(world, plan())  # type: ignore[arg-type]
    assert str(e.value) == (
        "migration of 'v1' failed (the destination QEMU died); it stays in partition "
        "'p0'. Moved before it: v0; not moved, running where they ran: v2.")
    assert [r.vm for r in e.value.moved] == ["v0"]
    assert len(recovered) == 1
    assert ("IncomingPrepare", "v2") not in world.log
    assert all(j.ended for j in world.jobs) and len(world.jobs) == 2
    assert world.events == [("moved", "v0"), ("failed", "v1")]


def test_a_failed_release_calls_off_the_move_begun_after_it(
        world: World, monkeypatch: pytest.MonkeyPatch) -> None:
    world.fail[("Release", "v0")] = SupervisorError("no answer")
    recovered: list[str] = []

    def recover(parts: Any, job: Job) -> Outcome:
        recovered.append(job.obj)
        if job.obj.endswith("v0"):       # the guest runs there, but not as asked
            return Outcome("v0", Decision.FORWARD, "p1", False, "its QEMU exited")
        return Outcome("v1", Decision.BACK, "p0", True, "stayed")
    monkeypatch.setattr(migration, "recover_move", recover)
    with pytest.raises(ManyFailed) as e:
        migrate_many(world, plan(), ahead=True)  # type: ignore[arg-type]
    assert str(e.value).startswith("migration of 'v0' hit a fault after the guest moved "
                                   "(no answer); 'v0' is lost")
    assert str(e.value).endswith("Moved before it: none; not moved, running where they "
                                 "ran: v1, v2.")
    # v1 had begun (its QEMU asked for while v0 was released): called off, undone.
    assert ("IncomingPrepare", "v1") in world.log and ("MigrateOut", "v1") not in world.log
    assert recovered == [vm_obj("v0"), vm_obj("v1")]
    assert all(j.ended for j in world.jobs) and len(world.jobs) == 2
    assert ("IncomingPrepare", "v2") not in world.log


@pytest.mark.parametrize("ahead", [False, True])
def test_a_refused_next_move_still_finishes_the_one_before(
        world: World, monkeypatch: pytest.MonkeyPatch, ahead: bool) -> None:
    def check(parts: Any, vm: str, to: str, mode: str) -> None:
        if vm == "v1":
            raise StateError("partition 'p1' has no room for 'v1'.")
    monkeypatch.setattr(migration, "check", check)
    world.overlap_wait = 0.05         # v1 is never asked for
    with pytest.raises(ManyFailed) as e:
        migrate_many(world, plan(), ahead=ahead)  # type: ignore[arg-type]
    assert str(e.value) == ("partition 'p1' has no room for 'v1'. Moved before it: v0; "
                            "not moved, running where they ran: v2.")
    assert [r.vm for r in e.value.moved] == ["v0"]
    assert world.vms["v0"].partition == "p1" and world.vms["v1"].partition == "p0"
    assert world.vms["v1"].state == VmState.RUNNING
    assert all(j.ended for j in world.jobs) and len(world.jobs) == 2


def test_a_moves_error_is_a_migration_error() -> None:
    assert issubclass(ManyFailed, MigrationError)


def test_serially_each_move_begins_after_the_one_before(world: World) -> None:
    """``ahead=False`` (``maintain --serial``): the same moves, none overlapped."""
    world.overlap_wait = 0.05
    res = migrate_many(world, plan(), ahead=False)  # type: ignore[arg-type]
    assert [r.vm for r in res] == VMS
    assert world.overlapped == {"v1": False, "v2": False}
    order = [(n, vm) for n, vm in world.log if n != "Settle"]
    for prev, vm in itertools.pairwise(VMS):
        assert order.index(("IncomingPrepare", vm)) > order.index(("Release", prev))
    assert all(j.ended for j in world.jobs) and len(world.jobs) == 3


def test_a_single_migrate_is_the_same_move(world: World, monkeypatch: pytest.MonkeyPatch
                                           ) -> None:
    """``migrate`` makes one move of the same kind (its job, its steps, its event): done,
    then failed in its stream (resolved back, the failure's event, the job ended)."""
    res = migration.migrate(world, "v0", "p1")  # type: ignore[arg-type]
    assert res.vm == "v0" and res.wall_ms and list(res.wall_ms)[-1] == "done"
    assert [n for n, v in world.log if v == "v0" and n != "Settle"] == [
        "IncomingPrepare", "MigrateOut", "IncomingFinish", "Release"]
    world.fail[("MigrateOut", "v1")] = SupervisorError("the destination QEMU died")
    monkeypatch.setattr(migration, "recover_move", lambda parts, job: Outcome(
        "v1", Decision.BACK, "p0", True, "stayed"))
    with pytest.raises(MigrationError, match="it stays in partition 'p0'"):
        migration.migrate(world, "v1", "p1")  # type: ignore[arg-type]
    assert world.events == [("moved", "v0"), ("failed", "v1")]
    assert all(j.ended for j in world.jobs) and len(world.jobs) == 2
