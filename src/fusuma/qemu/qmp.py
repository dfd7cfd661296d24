"""Typed QMP commands on top of one generic call, with every exchange logged per VM."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from qemu.qmp import EventListener, QMPClient, QMPError

from fusuma.errors import QemuError

# QMP event names used by fusuma.
EVENT_SHUTDOWN = "SHUTDOWN"
EVENT_STOP = "STOP"
EVENT_RESUME = "RESUME"
EVENT_MIGRATION = "MIGRATION"


@dataclass(frozen=True)
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


@dataclass(frozen=True)
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
        return listener

    def drop_listener(self, listener: EventListener) -> None:
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

    async def migrate(self, uri: str, settle: float = 2.0) -> None:
        """Start a stream to ``uri``. QEMU says a failed stream has ended (its MIGRATION
        event, ``query-migrate``) a moment before it has cleaned it up, and refuses a
        new one meanwhile ("duplicate yank instance"): asked again for up to
        ``settle`` seconds, as nothing was started."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + settle
        while True:
            try:
                await self.execute("migrate", {"uri": uri})
                return
            except QemuError as exc:
                if "duplicate yank instance" not in str(exc) or loop.time() > deadline:
                    raise
            await asyncio.sleep(0.02)

    async def migrate_incoming(self, uri: str) -> None:
        await self.execute("migrate-incoming", {"uri": uri})

    async def migrate_cancel(self) -> None:
        await self.execute("migrate_cancel")

    async def query_migrate(self) -> MigrationInfo:
        r = await self.execute("query-migrate")
        ram = r.get("ram") or {}
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
