"""A template save that failed after its stream completed runs the guest again: QEMU
refuses `cont` while the completed save is still "finish-migrate" ("Migration is not
finalized yet"), so the undo waits that out (fusuma.supervisor.templates._undo, through
fusuma.qemu.instance.run_again), with a fake QMP peer."""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from fusuma.errors import QemuError
from fusuma.qemu.qmp import MigrationInfo
from fusuma.supervisor.templates import _undo


class FakeQmp:
    def __init__(self, statuses: list[str]) -> None:
        self.statuses = statuses
        self.calls: list[str] = []

    async def query_migrate(self) -> MigrationInfo:
        return MigrationInfo(status="completed")

    async def migrate_cancel(self) -> None:
        self.calls.append("migrate_cancel")

    async def query_status(self) -> str:
        return self.statuses.pop(0) if len(self.statuses) > 1 else self.statuses[0]

    async def cont(self) -> None:
        if self.statuses[0] == "finish-migrate":
            raise QemuError("QMP cont failed: Migration is not finalized yet")
        self.calls.append("cont")


def undo(qmp: FakeQmp, tmp: Path) -> None:
    inst: Any = SimpleNamespace(vm="src", qmp=qmp, exited=asyncio.Event())
    h: Any = SimpleNamespace(log=logging.getLogger("test"))
    asyncio.run(_undo(h, inst, tmp / "state", None, True, []))


def test_the_guest_runs_again_once_the_completed_save_is_finalized(tmp_path: Path) -> None:
    qmp = FakeQmp(["finish-migrate", "finish-migrate", "finish-migrate", "postmigrate"])
    undo(qmp, tmp_path)
    assert qmp.calls == ["cont"]


def test_a_guest_already_running_is_left_alone(tmp_path: Path) -> None:
    qmp = FakeQmp(["running"])
    undo(qmp, tmp_path)
    assert qmp.calls == []
