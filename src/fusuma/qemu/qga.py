"""Client for the QEMU guest agent protocol (QGA) over a virtio-serial chardev socket.

The agent may not be running yet when we connect (the guest is booting), and the
chardev buffers what we wrote meanwhile, so every exchange starts with
``guest-sync-delimited``: the agent answers a 0xFF byte then the id we sent, and any
stale answer to an older sync is skipped.

Every exchange is logged (the per-VM qmp.log), but never a guest payload: the argv,
environment and input of ``guest-exec``, the output of ``guest-exec-status`` and file
contents are logged as their sizes only (:func:`redact`).
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import json
import logging
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from fusuma.errors import GuestAgentError

LOG = logging.getLogger(__name__)

# Members of a guest-agent request's arguments or reply that carry guest data.
PAYLOAD_KEYS = frozenset({"path", "arg", "env", "input-data", "out-data", "err-data",
                          "buf-b64", "password", "keys"})


def _size(value: Any) -> str:
    if isinstance(value, str):
        return f"<{len(value)} bytes>"
    if isinstance(value, list):
        return f"<{len(value)} items, {sum(len(str(v)) for v in value)} bytes>"
    return "<redacted>"


def redact(msg: Any) -> Any:
    """``msg`` with each payload member (PAYLOAD_KEYS, in "arguments" or "return")
    replaced by its size, for the log."""
    if not isinstance(msg, dict):
        return msg
    out = dict(msg)
    for part in ("arguments", "return"):
        body = out.get(part)
        if isinstance(body, dict):
            out[part] = {k: _size(v) if k in PAYLOAD_KEYS else v for k, v in body.items()}
    return out


@dataclass(frozen=True)
class ExecResult:
    exit_code: int
    stdout: bytes
    stderr: bytes
    signal: int | None = None


class GuestAgent:
    """One connection to one VM's guest agent."""

    def __init__(self, vm: str, socket: Path, log: logging.Logger | None = None) -> None:
        self.vm = vm
        self.socket = socket
        self.log = log or LOG
        self._reader: asyncio.StreamReader | None = None
        self._writer: asyncio.StreamWriter | None = None

    async def __aenter__(self) -> GuestAgent:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def close(self) -> None:
        if self._writer is not None:
            self._writer.close()
            with contextlib.suppress(OSError):
                await self._writer.wait_closed()
        self._reader = self._writer = None

    async def connect(self, timeout: float = 60.0) -> None:
        """Connect and synchronise, waiting up to ``timeout`` for the agent to answer."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        while True:
            left = deadline - loop.time()
            if left <= 0:
                await self.close()
                raise GuestAgentError(
                    f"VM {self.vm}: the guest agent did not answer within {timeout:.0f} s; "
                    "is the guest still booting? See `fusuma vm console --log`.")
            try:
                if self._writer is None:
                    self._reader, self._writer = await asyncio.open_unix_connection(
                        str(self.socket))
                await self._sync(min(1.0, left))
                return
            except TimeoutError:
                continue
            except (OSError, asyncio.IncompleteReadError):
                await self.close()
                await asyncio.sleep(min(0.1, max(0.0, deadline - loop.time())))

    async def _sync(self, timeout: float) -> None:
        assert self._reader is not None and self._writer is not None
        sync_id = random.randrange(1, 2**31)
        self._send({"execute": "guest-sync-delimited", "arguments": {"id": sync_id}})
        await self._writer.drain()

        async def wait() -> None:
            assert self._reader is not None
            while True:
                await self._reader.readuntil(b"\xff")
                while True:
                    line = await self._reader.readline()
                    if not line:
                        raise asyncio.IncompleteReadError(b"", None)
                    line = line.strip().lstrip(b"\xff")
                    if not line:
                        continue
                    try:
                        msg = json.loads(line)
                    except ValueError:
                        break
                    if msg.get("return") == sync_id:
                        return
                    break

        await asyncio.wait_for(wait(), timeout)

    def _send(self, msg: dict[str, Any]) -> None:
        assert self._writer is not None
        self.log.debug("qga> %s", redact(msg))
        self._writer.write(json.dumps(msg).encode() + b"\n")

    async def execute(self, command: str, arguments: dict[str, Any] | None = None,
                      timeout: float = 30.0) -> Any:
        if self._writer is None or self._reader is None:
            await self.connect()
        assert self._reader is not None
        msg: dict[str, Any] = {"execute": command}
        if arguments:
            msg["arguments"] = arguments
        self._send(msg)
        try:
            line = await asyncio.wait_for(self._reader.readline(), timeout)
        except TimeoutError as exc:
            raise GuestAgentError(f"VM {self.vm}: guest agent command {command} got no "
                                  f"answer in {timeout:.0f} s.") from exc
        if not line:
            raise GuestAgentError(f"VM {self.vm}: the guest agent closed the connection "
                                  f"during {command}.")
        reply = json.loads(line.strip().lstrip(b"\xff"))
        self.log.debug("qga< %s", redact(reply))
        if "error" in reply:
            raise GuestAgentError(f"VM {self.vm}: guest agent {command} failed: "
                                  f"{reply['error'].get('desc', reply['error'])}")
        return reply.get("return")

    async def ping(self) -> None:
        await self.execute("guest-ping")

    async def run(self, argv: list[str], *, stdin: bytes | None = None,
                  timeout: float = 60.0) -> ExecResult:
        """Run ``argv`` in the guest, wait for it, and return its output and status."""
        if not argv:
            raise GuestAgentError("no command given to run in the guest.")
        args: dict[str, Any] = {"path": argv[0], "arg": argv[1:], "capture-output": True}
        if stdin is not None:
            args["input-data"] = base64.b64encode(stdin).decode()
        started = await self.execute("guest-exec", args)
        pid = int(started["pid"])
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        delay = 0.02
        while True:
            status = await self.execute("guest-exec-status", {"pid": pid})
            if status.get("exited"):
                return ExecResult(
                    exit_code=int(status.get("exitcode", -1)),
                    stdout=base64.b64decode(status.get("out-data", "")),
                    stderr=base64.b64decode(status.get("err-data", "")),
                    signal=status.get("signal"))
            if loop.time() >= deadline:
                raise GuestAgentError(f"VM {self.vm}: {argv[0]} did not finish within "
                                      f"{timeout:.0f} s (guest pid {pid} left running).")
            await asyncio.sleep(delay)
            delay = min(delay * 2, 0.25)
