"""Typed QMP commands on top of one generic call, with every exchange logged per VM."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from pathlib import Path
from typing import Any

from qemu.qmp import EventListener, QMPClient, QMPError

from fusuma.errors import MigrationError, QemuError
from fusuma.frozen import frozen
from fusuma.qemu import process

# QMP event names used by fusuma.
EVENT_SHUTDOWN = "SHUTDOWN"
EVENT_STOP = "STOP"
EVENT_RESUME = "RESUME"
EVENT_MIGRATION = "MIGRATION"

# The outgoing migration states in which QEMU refuses a new stream ("There's a
# migration process in progress"): ``migration_is_running()``, migration/migration.c.
RUNNING = frozenset({"setup", "active", "pre-switchover", "device", "wait-unplug",
                     "cancelling", "postcopy-active", "postcopy-paused",
                     "postcopy-recover-setup", "postcopy-recover", "colo"})
# ... of which none is cancelled as a leftover: past the switch the source cannot take
# the guest back (``qmp_migrate_cancel`` refuses postcopy), and fusuma starts no COLO.
UNCANCELLABLE = frozenset({"postcopy-active", "postcopy-paused", "postcopy-recover-setup",
                           "postcopy-recover", "colo"})
# The one yank instance all of a QEMU's migration channels hang on, from `migrate`
# until the stream's cleanup (``migration_cleanup``) has run.
MIGRATION_YANK: dict[str, Any] = {"type": "migration"}
# How QEMU refuses `migrate` while an earlier stream is not cleaned up.
LEFTOVER_REFUSALS = ("duplicate yank instance", "There's a migration process in progress")
# How long a failed stream's own cleanup is waited for before its channels are yanked,
# and the bound on clearing an earlier stream's leftovers before a new one.
SETTLE_S = 2.0
CLEAR_TIMEOUT_S = 10.0


@frozen
class MigrationInfo:
    """The fields of ``query-migrate`` fusuma uses (times in ms, sizes in bytes)."""

    status: str
    total_ms: float | None = None
    downtime_ms: float | None = None
    setup_ms: float | None = None
    transferred: int = 0
    error: str | None = None


def event_time(event: Any) -> float:
    """A QMP event's own timestamp (host realtime, seconds)."""
    ts = event["timestamp"]
    return float(ts["seconds"]) + float(ts["microseconds"]) / 1e6


@frozen
class VcpuInfo:
    index: int
    thread_id: int


class Qmp:
    """One QMP connection to one VM's QEMU."""

    def __init__(self, vm: str, socket: Path, log: logging.Logger) -> None:
        self.vm = vm
        self.socket = socket
        self.log = log
        self._client = QMPClient(vm)
        # A stream this connection's `migrate` started and no `query-migrate` has seen
        # end yet: never cancelled as a leftover.
        self._own_stream = False
        self._listeners: list[EventListener] = []
        # The QEMU's pid when known (fusuma.qemu.instance sets it): what its threads
        # were doing goes into the log when a stream will not clear.
        self.pid: int | None = None

    async def connect(self, timeout: float = 10.0) -> None:
        """Connect, retrying while QEMU creates its socket."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        while True:
            try:
                # Bounded: a socket that accepts but never greets (a QEMU whose one
                # monitor connection is taken) must not hang the caller.
                await asyncio.wait_for(self._client.connect(str(self.socket)),
                                       max(0.1, deadline - loop.time()))
                return
            except (QMPError, OSError) as exc:
                if loop.time() >= deadline:
                    raise QemuError(f"VM {self.vm}: QEMU did not answer on its QMP socket "
                                    f"{self.socket} within {timeout:.0f} s.") from exc
                self._client = QMPClient(self.vm)
                # QEMU opens its socket within ~50-100 ms of exec: poll finely, a
                # clone's start (fusuma.memshare.templates) counts every ms.
                await asyncio.sleep(0.01)

    async def execute(self, command: str, arguments: dict[str, Any] | None = None,
                      timeout: float = 30.0) -> Any:
        """Run one QMP command; a QMP error becomes QemuError with QEMU's message."""
        self.log.debug("qmp> %s %s", command, arguments or {})
        try:
            # A deadline on this task, not wait_for's task per command: a command in a
            # move's pause (the destination's `cont`) costs no extra turn of the loop.
            async with asyncio.timeout(timeout):
                reply = await self._client.execute(command, arguments)
        except TimeoutError as exc:
            raise QemuError(f"VM {self.vm}: QMP {command} got no answer in "
                            f"{timeout:.0f} s.") from exc
        except QMPError as exc:
            self.log.debug("qmp< error %s", exc)
            raise QemuError(f"VM {self.vm}: QMP {command} failed: {exc}") from exc
        self.log.debug("qmp< %s", reply)
        return reply

    async def disconnect(self) -> None:
        try:
            await self._client.disconnect()
        except Exception as exc:  # the library re-raises whatever ended its reader (EOF)
            self.log.debug("qmp disconnect: %r", exc)

    # -- typed commands -------------------------------------------------------------
    async def query_status(self) -> str:
        reply = await self.execute("query-status")
        return str(reply["status"])

    async def query_cpus_fast(self) -> list[VcpuInfo]:
        reply = await self.execute("query-cpus-fast")
        return [VcpuInfo(index=int(c["cpu-index"]), thread_id=int(c["thread-id"]))
                for c in reply]

    async def balloon(self, target_bytes: int) -> None:
        """Ask the guest's balloon to leave it ``target_bytes`` of RAM (virtio-balloon;
        the guest inflates or deflates toward it in its own time)."""
        await self.execute("balloon", {"value": int(target_bytes)})

    async def query_balloon(self) -> int | None:
        """The RAM the balloon leaves the guest now (bytes), None if QEMU says none."""
        got = await self.execute("query-balloon")
        actual = got.get("actual") if isinstance(got, dict) else None
        return actual if isinstance(actual, int) and actual > 0 else None

    async def quit(self) -> None:
        try:
            await self.execute("quit", timeout=5.0)
        except QemuError as exc:
            # QEMU may close the socket before answering.
            self.log.debug("quit: %s", exc)

    async def system_powerdown(self) -> None:
        await self.execute("system_powerdown")

    def listener(self, *names: str) -> EventListener:
        """Start collecting events ``names``; call ``drop_listener`` when done."""
        listener = EventListener(names)
        self._client.register_listener(listener)
        self._listeners.append(listener)
        return listener

    def drop_listener(self, listener: EventListener) -> None:
        with contextlib.suppress(ValueError):
            self._listeners.remove(listener)
        with contextlib.suppress(Exception):
            self._client.remove_listener(listener)

    async def wait_event(self, listener: EventListener, timeout: float) -> Any:
        try:
            return await asyncio.wait_for(listener.get(), timeout)
        except TimeoutError as exc:
            raise QemuError(f"VM {self.vm}: no {'/'.join(listener.names or [])} event "
                            f"within {timeout:.0f} s.") from exc

    async def set_stream_capabilities(self, *, ignore_shared: bool, multifd: bool = False,
                                      pause_before_switchover: bool = False) -> None:
        """Every capability a stream of fusuma's may turn on, each named, so that what an
        earlier stream of this QEMU set (a mirrored move's pause before the switch, a
        move's channels) is never left behind for the next (a template's save, an
        in-place move)."""
        await self.migrate_set_capabilities({
            "x-ignore-shared": ignore_shared, "events": True, "multifd": multifd,
            "pause-before-switchover": pause_before_switchover})

    async def migrate_set_capabilities(self, caps: dict[str, bool]) -> None:
        await self.execute("migrate-set-capabilities", {"capabilities": [
            {"capability": k, "state": v} for k, v in caps.items()]})

    async def migrate_set_parameters(self, params: dict[str, Any]) -> None:
        await self.execute("migrate-set-parameters", params)

    async def object_add(self, props: dict[str, Any]) -> None:
        """Create a QOM object (``qom-type``, ``id`` and its properties)."""
        await self.execute("object-add", props)

    async def object_del(self, obj_id: str) -> None:
        await self.execute("object-del", {"id": obj_id})

    async def migrate(self, uri: str | None = None, *,
                      channels: list[dict[str, Any]] | None = None,
                      settle: float = SETTLE_S, timeout: float = CLEAR_TIMEOUT_S) -> None:
        """Start a stream to ``uri`` (or over ``channels``). QEMU refuses it while an
        earlier stream is not cleaned up, and a refused `migrate` leaves QEMU in
        "setup" with nothing running there (``qmp_migrate_finish`` returns on
        "duplicate yank instance" after ``migrate_init`` set "setup"), which refuses
        every later stream ("There's a migration process in progress"). On either
        refusal the leftovers are cleared (``clear_stale_stream``) and the stream asked
        again, for up to ``timeout`` seconds; then one MigrationError."""
        args: dict[str, Any] = {"uri": uri} if channels is None else {"channels": channels}
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        while True:
            try:
                await self.execute("migrate", args)
            except QemuError as exc:
                reason = next((r for r in LEFTOVER_REFUSALS if r in str(exc)), None)
                if reason is None:
                    raise
                left = deadline - loop.time()
                if left <= 0:
                    raise MigrationError(
                        f"VM {self.vm}: QEMU still refuses a new stream ({reason}) after "
                        f"{timeout:.0f} s of clearing what an earlier stream left; stop "
                        "and start the VM, then move it again.") from exc
                self.log.warning("%s: QEMU refused the stream (%s); clearing what an "
                                 "earlier stream left, then asking again", self.vm, reason)
                await self.clear_stale_stream(settle, left)
                await asyncio.sleep(0.02)
                continue
            self._own_stream = True
            return

    async def clear_stale_stream(self, settle: float = SETTLE_S,
                                 timeout: float = CLEAR_TIMEOUT_S) -> bool:
        """Make sure nothing of an earlier stream is left before a new one begins
        (before its capabilities too, which QEMU refuses while one runs); True if
        something was. Called under the VM's job, so a stream running here is one no
        caller runs; one this connection started is never touched.

        What clears what, in QEMU 10.0 (migration/migration.c, util/yank.c): a stream
        QEMU already says "failed" holds the migration yank instance until
        ``migration_cleanup`` runs, once its threads have ended: that is awaited for
        ``settle`` seconds, then its channels are yanked (QMP ``yank`` shuts them down,
        so that threads blocked on them end). A stream left running (the "setup" a
        refused `migrate` leaves) is cancelled: ``migration_cancel`` ends a "setup"
        that has no channel at once (since 10.0), any other through its thread.
        MigrationError if that does not clear it within ``timeout`` seconds."""
        loop = asyncio.get_running_loop()
        start = loop.time()
        left = cancelled = yanked = False
        delay = 0.005
        while True:
            info = await self.query_migrate()
            held = await self.migration_yank_held()
            running = info.status in RUNNING
            if not running and not held:
                if left:
                    self.log.warning("%s: an earlier stream's leftovers are cleared after "
                                     "%.2f s (%s)", self.vm, loop.time() - start,
                                     ", ".join(["waited for its cleanup"]
                                               + ["cancelled it"] * cancelled
                                               + ["yanked its channels"] * yanked))
                    # Its events (and a refused `migrate`'s "setup") are no part of
                    # the stream asked next.
                    await self._drop_migration_events()
                return left
            left = True
            if running and self._own_stream:
                raise MigrationError(f"VM {self.vm}: the stream this supervisor started "
                                     f"is still {info.status}; a new one waits for its end.")
            if running and info.status in UNCANCELLABLE:
                raise MigrationError(f"VM {self.vm}: an earlier stream is {info.status}, "
                                     "which QEMU cannot cancel; end or recover that move "
                                     "first.")
            if running and not cancelled and info.status != "cancelling":
                self.log.warning("%s: QEMU holds a stream in %r that no move runs; "
                                 "cancelling it", self.vm, info.status)
                await self.migrate_cancel()
                cancelled = True
                continue
            waited = loop.time() - start
            if held and not yanked and waited >= settle:
                self.log.warning("%s: an earlier stream (%s) still holds its channels "
                                 "%.1f s on; yanking them", self.vm, info.status, waited)
                with contextlib.suppress(QemuError):    # cleaned up meanwhile
                    await self.execute("yank", {"instances": [MIGRATION_YANK]})
                yanked = True
            if waited >= timeout:
                if self.pid is not None:
                    self.log.warning("%s: QEMU (pid %d) threads while its earlier stream "
                                     "will not clear: %s", self.vm, self.pid,
                                     process.thread_states(self.pid) or "unknown")
                raise MigrationError(
                    f"VM {self.vm}: QEMU still holds an earlier stream ({info.status}"
                    f"{', its channels registered' if held else ''}) after {timeout:.0f} s "
                    "of clearing it; stop and start the VM, then move it again.")
            await asyncio.sleep(delay)
            delay = min(delay * 2, 0.05)

    async def migration_yank_held(self) -> bool:
        """Whether QEMU holds its migration yank instance (a stream, either way, not
        yet cleaned up): `migrate` is refused while it does."""
        reply = await self.execute("query-yank")
        return any(isinstance(i, dict) and i.get("type") == "migration"
                   for i in reply or [])

    async def _drop_migration_events(self) -> None:
        """Drop the MIGRATION events queued for this connection's listeners, keeping
        the others in their order (no await in between: ``put`` does not wait on an
        unbounded queue)."""
        for listener in self._listeners:
            for event in listener.clear():
                if event.get("event") != EVENT_MIGRATION:
                    await listener.put(event)

    async def migrate_incoming(self, uri: str) -> None:
        await self.execute("migrate-incoming", {"uri": uri})

    async def migrate_cancel(self) -> None:
        await self.execute("migrate_cancel")

    async def query_migrate(self) -> MigrationInfo:
        r = await self.execute("query-migrate")
        ram = r.get("ram") or {}
        if r.get("status", "none") not in RUNNING:
            self._own_stream = False
        return MigrationInfo(status=str(r.get("status", "none")),
                             total_ms=r.get("total-time"), downtime_ms=r.get("downtime"),
                             setup_ms=r.get("setup-time"),
                             transferred=int(ram.get("transferred", 0)),
                             error=r.get("error-desc"))

    async def add_fd(self, fd: int, opaque: str) -> int:
        """Pass descriptor ``fd`` to QEMU (SCM_RIGHTS) into a new fdset; its id (QEMU
        opens it as ``/dev/fdset/ID``). ``fd`` stays open here: close it after."""
        self._client.send_fd_scm(fd)
        reply = await self.execute("add-fd", {"opaque": opaque})
        return int(reply["fdset-id"])

    async def get_fd(self, fd: int, name: str) -> None:
        """Pass descriptor ``fd`` to QEMU (SCM_RIGHTS) under ``name`` (``getfd``: what
        a socket address of type fd names). ``fd`` stays open here: close it after."""
        self._client.send_fd_scm(fd)
        await self.execute("getfd", {"fdname": name})

    async def cont(self) -> None:
        await self.execute("cont")

    async def stop(self) -> None:
        await self.execute("stop")

    async def announce_self(self) -> None:
        """Have every NIC send gratuitous RARPs from its MAC (5 rounds, 50 ms then
        every 100 ms more), so that bridges and switches learn the guest's new port."""
        await self.execute("announce-self", {"initial": 50, "max": 550, "rounds": 5,
                                             "step": 100})
