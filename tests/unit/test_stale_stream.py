"""A new stream after a failed one: what QEMU 10.0 leaves behind and how ``Qmp`` clears
it (``Qmp.migrate``, ``Qmp.clear_stale_stream``), against a fake QMP peer that keeps
QEMU's outgoing migration state as migration/migration.c and util/yank.c do."""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path
from typing import Any

import pytest

from fusuma.errors import MigrationError, QemuError
from fusuma.qemu.qmp import EVENT_MIGRATION, EVENT_STOP, RUNNING, Qmp


class FakeQemu:
    """The source side of QEMU's migration: ``state`` (query-migrate's status) and
    whether the migration yank instance is registered (``yank``).

    An earlier stream QEMU says ended is cleaned up (its yank instance unregistered,
    "cancelling" made "cancelled") ``cleanup_after`` seconds on, or never (None: its
    threads are stuck on their channels) unless ``yank_unblocks`` and it is yanked.
    `migrate` sets "setup" before it registers the yank instance and returns on
    "duplicate yank instance" leaving "setup" (``qmp_migrate_finish``);
    `migrate_cancel` ends a "setup" with no channel at once when ``cancel_ends_setup``
    (QEMU 10.0's ``migration_cancel``), and leaves it "cancelling" otherwise."""

    def __init__(self, state: str = "none", yank: bool = False,
                 cleanup_after: float | None = None, yank_unblocks: bool = True,
                 cancel_ends_setup: bool = True) -> None:
        self.state = state
        self.yank = yank
        self.cleanup_after = cleanup_after
        self.cleanup_at: float | None = None
        self.yank_unblocks = yank_unblocks
        self.cancel_ends_setup = cancel_ends_setup
        self.has_channel = False       # the stream a `migrate` started has one
        self.commands: list[str] = []
        self.migrate_while_held = 0    # `migrate`s that found the yank instance held
        self.listeners: list[Any] = []

    def now(self) -> float:
        return asyncio.get_running_loop().time()

    async def emit(self, status: str) -> None:
        for listener in self.listeners:
            await listener.put({"event": EVENT_MIGRATION, "data": {"status": status}})

    async def set_state(self, status: str) -> None:
        self.state = status
        await self.emit(status)

    async def tick(self) -> None:
        """The earlier stream's cleanup (``migration_cleanup``), once it is due."""
        if self.cleanup_at is None and self.cleanup_after is not None:
            self.cleanup_at = self.now() + self.cleanup_after
        if self.cleanup_at is not None and self.now() >= self.cleanup_at:
            self.cleanup_at = self.cleanup_after = None
            self.yank = False
            if self.state == "cancelling":
                await self.set_state("cancelled")

    async def execute(self, command: str, arguments: Any = None,
                      timeout: float = 30.0) -> Any:
        self.commands.append(command)
        await self.tick()
        if command == "query-migrate":
            return {"status": self.state}
        if command == "query-yank":
            return [{"type": "migration"}] if self.yank else []
        if command == "migrate":
            if self.state in RUNNING:
                raise QemuError("VM vm0: QMP migrate failed: There's a migration "
                                "process in progress")
            await self.set_state("setup")           # migrate_init
            if self.yank:
                self.migrate_while_held += 1
                raise QemuError("VM vm0: QMP migrate failed: duplicate yank instance")
            self.yank = self.has_channel = True
            await self.set_state("active")
            return {}
        if command == "migrate_cancel":
            if self.state.startswith("postcopy"):
                raise QemuError("VM vm0: QMP migrate_cancel failed: Postcopy "
                                "migration in progress, cannot cancel.")
            if self.state in RUNNING:
                setup = self.state == "setup"
                await self.set_state("cancelling")
                if self.has_channel:        # its thread ends, then its cleanup
                    self.cleanup_after = 0.01
                elif setup and self.cancel_ends_setup:
                    await self.set_state("cancelled")
            return {}
        if command == "yank":
            if not self.yank:
                raise QemuError("VM vm0: QMP yank failed: Instance not found")
            if self.yank_unblocks:
                self.cleanup_after, self.cleanup_at = 0.01, None
            return {}
        raise AssertionError(f"unexpected command {command}")


def qmp_for(qemu: FakeQemu) -> Qmp:
    q = Qmp("vm0", Path("/nonexistent"), logging.getLogger("test.vm0"))
    q.execute = qemu.execute  # type: ignore[method-assign]
    return q


def test_a_failed_stream_cleaned_up_within_settle_then_the_stream_starts() -> None:
    """QEMU says "failed" a moment before its cleanup: the `migrate` asked meanwhile is
    refused ("duplicate yank instance") and leaves "setup" behind, which refuses the
    next one ("in progress"; the lab's second error). That "setup" is cancelled, the
    cleanup awaited, and the stream asked again, with no yank: within the settle time."""
    async def go() -> tuple[FakeQemu, float]:
        qemu = FakeQemu(state="failed", yank=True, cleanup_after=0.2)
        q = qmp_for(qemu)
        t0 = asyncio.get_running_loop().time()
        await q.migrate("tcp:10.0.0.2:1", settle=2.0, timeout=5.0)
        return qemu, asyncio.get_running_loop().time() - t0

    qemu, took = asyncio.run(go())
    assert qemu.state == "active" and qemu.has_channel
    assert qemu.commands.count("migrate") == 2 and qemu.migrate_while_held == 1
    assert qemu.commands.count("migrate_cancel") == 1 and "yank" not in qemu.commands
    assert 0.15 < took < 2.0


def test_checked_before_the_stream_a_failed_one_is_awaited_not_refused() -> None:
    """Asked before the capabilities (as a move does), the check waits for the failed
    stream's cleanup: `migrate` never meets its yank instance, so QEMU never resets
    its state under the old stream's threads (``migrate_init``)."""
    async def go() -> tuple[FakeQemu, bool]:
        qemu = FakeQemu(state="failed", yank=True, cleanup_after=0.1)
        q = qmp_for(qemu)
        left = await q.clear_stale_stream(settle=2.0, timeout=5.0)
        await q.migrate("tcp:10.0.0.2:1")
        return qemu, left

    qemu, left = asyncio.run(go())
    assert left and qemu.state == "active"
    assert qemu.migrate_while_held == 0 and qemu.commands.count("migrate") == 1
    assert "migrate_cancel" not in qemu.commands and "yank" not in qemu.commands
    # Nothing left: two questions, nothing done.
    idle = FakeQemu(state="completed")
    assert asyncio.run(qmp_for(idle).clear_stale_stream()) is False
    assert idle.commands == ["query-migrate", "query-yank"]


def test_a_stale_stream_is_cancelled_and_the_stream_starts() -> None:
    """A "setup" nothing runs (a refused `migrate` of an earlier move) refuses the next
    stream; it is cancelled, the stream asked again, and the events of the cancel and
    of the refused `migrate` are no part of the new stream's (a move's listener would
    take the "cancelled" for its own end); other events stay, in order."""
    async def go() -> tuple[FakeQemu, list[Any]]:
        qemu = FakeQemu(state="setup")
        q = qmp_for(qemu)
        listener = q.listener(EVENT_STOP, EVENT_MIGRATION)
        qemu.listeners.append(listener)
        await listener.put({"event": EVENT_STOP, "data": {}})
        await q.migrate("tcp:10.0.0.2:1", settle=2.0, timeout=5.0)
        return qemu, listener.clear()

    qemu, queued = asyncio.run(go())
    assert qemu.state == "active"
    assert qemu.commands.count("migrate_cancel") == 1
    assert qemu.commands.count("migrate") == 2
    assert [(e["event"], e["data"].get("status")) for e in queued] == [
        (EVENT_STOP, None), (EVENT_MIGRATION, "setup"), (EVENT_MIGRATION, "active")]


def test_a_stream_this_connection_started_is_never_cancelled() -> None:
    async def go() -> tuple[FakeQemu, Exception | None]:
        qemu = FakeQemu()
        q = qmp_for(qemu)
        await q.migrate("tcp:10.0.0.2:1")
        try:
            await q.migrate("tcp:10.0.0.2:1", timeout=1.0)
        except MigrationError as exc:
            return qemu, exc
        return qemu, None

    qemu, err = asyncio.run(go())
    assert err is not None and "still active" in str(err)
    assert "migrate_cancel" not in qemu.commands and qemu.state == "active"


@pytest.mark.parametrize("qemu, said, done", [
    # An older QEMU's cancel leaves a channel-less "setup" "cancelling" for good.
    (dict(state="setup", cancel_ends_setup=False), "cancelling", ["migrate_cancel"]),
    # A failed stream whose threads stay stuck even once its channels are yanked (the
    # refused `migrate`'s "setup" is cancelled first).
    (dict(state="failed", yank=True, yank_unblocks=False), "cancelled, its channels",
     ["migrate_cancel", "yank"]),
])
def test_a_leftover_that_recovery_does_not_clear_is_one_error(
        qemu: dict[str, Any], said: str, done: list[str]) -> None:
    async def go() -> tuple[FakeQemu, Exception | None, float]:
        fake = FakeQemu(**qemu)
        q = qmp_for(fake)
        t0 = asyncio.get_running_loop().time()
        try:
            await q.migrate("tcp:10.0.0.2:1", settle=0.05, timeout=0.25)
        except MigrationError as exc:
            return fake, exc, asyncio.get_running_loop().time() - t0
        return fake, None, 0.0

    fake, err, took = asyncio.run(go())
    assert err is not None and said in str(err) and "stop and start the VM" in str(err)
    assert 0.2 < took < 1.5
    assert [c for c in fake.commands if c in ("migrate_cancel", "yank")] == done
    assert fake.commands.count("migrate") <= 2


def test_a_failed_stream_stuck_on_its_channels_is_yanked_after_settle() -> None:
    async def go() -> tuple[FakeQemu, float]:
        qemu = FakeQemu(state="failed", yank=True)
        q = qmp_for(qemu)
        t0 = asyncio.get_running_loop().time()
        assert await q.clear_stale_stream(settle=0.1, timeout=5.0)
        return qemu, asyncio.get_running_loop().time() - t0

    qemu, took = asyncio.run(go())
    assert qemu.commands.count("yank") == 1 and not qemu.yank
    assert "migrate_cancel" not in qemu.commands
    assert 0.1 <= took < 1.0


def test_postcopy_is_not_cancelled_and_other_refusals_are_said_at_once() -> None:
    qemu = FakeQemu(state="postcopy-active")
    with pytest.raises(MigrationError, match="cannot cancel"):
        asyncio.run(qmp_for(qemu).clear_stale_stream())
    assert "migrate_cancel" not in qemu.commands

    class Disabled(FakeQemu):
        async def execute(self, command: str, arguments: Any = None,
                          timeout: float = 30.0) -> Any:
            if command == "migrate":
                self.commands.append(command)
                raise QemuError("VM vm0: QMP migrate failed: Migration is disabled")
            return await super().execute(command, arguments, timeout)

    disabled = Disabled()
    with pytest.raises(QemuError, match="disabled"):
        asyncio.run(qmp_for(disabled).migrate("tcp:10.0.0.2:1"))
    assert disabled.commands == ["migrate"]
