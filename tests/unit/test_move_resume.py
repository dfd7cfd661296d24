"""A move's source runs its guest again ("back") only once its stream has ended: a
stream still running (the process that asked for it died mid-stream) is cancelled
first, or it would complete afterwards and stop the guest; a stream that completes
after the decision does not make the running QEMU the move's leaving side."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Any

import pytest

from fusuma.qemu.instance import Role
from fusuma.qemu.qmp import MigrationInfo
from fusuma.state import Decision
from fusuma.supervisor.moves import source


class Qmp:
    """A source QEMU whose stream is in ``status``; a cancel ends it after two polls."""

    def __init__(self, status: str, vm_status: str = "running") -> None:
        self.status = status
        self.vm_status = vm_status
        self.calls: list[str] = []
        self._polls_to_cancelled: int | None = None

    async def query_migrate(self) -> MigrationInfo:
        self.calls.append("query-migrate")
        if self._polls_to_cancelled is not None:
            self._polls_to_cancelled -= 1
            if self._polls_to_cancelled <= 0:
                self.status = "cancelled"
        return MigrationInfo(status=self.status)

    async def migrate_cancel(self) -> None:
        self.calls.append("migrate_cancel")
        self.status = "cancelling"
        self._polls_to_cancelled = 2

    async def query_status(self) -> str:
        return self.vm_status

    async def cont(self) -> None:
        self.calls.append("cont")
        self.vm_status = "running"


@dataclass
class Inst:
    qmp: Qmp
    vm: str = "vm0"
    pid: int = 100
    role: Role = Role.RUNNING
    owns_ram: bool = False
    exited: Any = field(default_factory=asyncio.Event)


@dataclass
class Job:
    detail: dict[str, Any]


class Db:
    def __init__(self, decision: str | None) -> None:
        self.job = Job({"decision": decision} if decision else {})

    def decide(self, obj: str, decision: str) -> str:
        return str(self.job.detail.setdefault("decision", decision))

    def find_job(self, obj: str) -> Job:
        return self.job


class Instances:
    def __init__(self, inst: Inst) -> None:
        self.inst = inst

    def get(self, vm: str, role: Role = Role.RUNNING) -> Inst | None:
        return self.inst if self.inst.role == role else None

    def change(self, inst: Inst, role: Role) -> None:
        inst.role = role


class Host:
    def __init__(self, inst: Inst, decision: str | None) -> None:
        self.instances = Instances(inst)
        self.db = Db(decision)
        self.followed: list[Inst] = []

    def follow_runstate(self, inst: Inst) -> None:
        self.followed.append(inst)


def test_a_stream_still_running_is_cancelled_before_the_guest_runs_again() -> None:
    inst = Inst(Qmp("active"))
    h: Any = Host(inst, Decision.BACK)
    asyncio.run(source.resume(h, "vm0"))
    assert inst.qmp.calls[:2] == ["query-migrate", "migrate_cancel"]
    assert inst.qmp.status == "cancelled" and inst.role == Role.RUNNING


@pytest.mark.parametrize("status", ["none", "failed", "cancelled"])
def test_a_stream_that_ended_is_left_alone(status: str) -> None:
    inst = Inst(Qmp(status))
    h: Any = Host(inst, Decision.BACK)
    asyncio.run(source.resume(h, "vm0"))
    assert inst.qmp.calls == ["query-migrate"]


def test_a_completed_stream_the_move_went_back_from_runs_the_guest_again() -> None:
    """The stream completed (the guest is paused, postmigrate) after "back": ``cont``,
    and the stream's own end no longer makes the QEMU the leaving side."""
    inst = Inst(Qmp("completed", vm_status="postmigrate"), role=Role.RUNNING)
    h: Any = Host(inst, Decision.BACK)
    asyncio.run(source.resume(h, "vm0"))
    assert inst.qmp.calls == ["query-migrate", "cont"]
    source.leaving(h, inst, owns_ram=False)  # type: ignore[arg-type]
    assert inst.role == Role.RUNNING and inst.owns_ram


def test_an_undecided_completed_stream_makes_the_leaving_side() -> None:
    inst = Inst(Qmp("completed", vm_status="postmigrate"))
    h: Any = Host(inst, None)
    source.leaving(h, inst, owns_ram=True)  # type: ignore[arg-type]
    assert inst.role == Role.LEAVING
