"""Client for the QEMU guest agent protocol (QGA) over a virtio-serial chardev socket.

The agent may not be running yet when we connect (the guest is booting), and the
chardev buffers what we wrote meanwhile, so every exchange starts with
``guest-sync-delimited``: the agent answers a 0xFF byte then the id we sent, and any
stale answer to an older sync is skipped.

Every exchange is logged (the per-VM qmp.log), but never a guest payload: the argv,
environment and input of ``guest-exec``, the output of ``guest-exec-status``, file
contents and the agent's error text are logged as their sizes only (:func:`redact`).

Nothing the agent sends is trusted (fusuma.qemu.qgareply): each reply is read as one
bounded line and parsed into a checked model, and every failure (no answer, a closed
channel, garbage of any kind) is a ``GuestAgentError``. After any failure the
connection is closed, so a late or stray answer can never be taken for the answer to
the next command: the next command connects and synchronises anew.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import json
import logging
import random
from pathlib import Path
from typing import Any

from fusuma.errors import GuestAgentError
from fusuma.frozen import frozen
from fusuma.qemu.qgareply import MAX_LINE, ExecStarted, ExecStatus, parse_line, sync_id, unwrap

LOG = logging.getLogger(__name__)
# The least time one answer of the agent is given while a command runs (run()).
ANSWER_S = 5.0

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
    err = out.get("error")
    if isinstance(err, dict):
        # The agent's error text may quote the command it could not run.
        out["error"] = {k: _size(v) if k == "desc" else v for k, v in err.items()}
    return out


@frozen
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
        why = ""
        while True:
            left = deadline - loop.time()
            if left <= 0:
                await self.close()
                raise GuestAgentError(
                    f"VM {self.vm}: the guest agent did not answer within {timeout:.0f} s"
                    f"{why}; is the guest still booting? See `fusuma vm console --log`.")
            try:
                if self._writer is None:
                    self._reader, self._writer = await asyncio.open_unix_connection(
                        str(self.socket), limit=MAX_LINE)
                await self._sync(min(1.0, left))
                return
            except TimeoutError:
                continue
            except asyncio.LimitOverrunError:
                # Garbage where a sync answer belongs: start afresh on a new connection.
                why = f" (it sent more than {MAX_LINE} bytes without a line end)"
                await self.close()
            except (OSError, asyncio.IncompleteReadError):
                await self.close()
                await asyncio.sleep(min(0.1, max(0.0, deadline - loop.time())))

    async def _sync(self, timeout: float) -> None:
        assert self._reader is not None and self._writer is not None
        want = random.randrange(1, 2**31)
        self._send({"execute": "guest-sync-delimited", "arguments": {"id": want}})
        await self._writer.drain()

        async def wait() -> None:
            assert self._reader is not None
            while True:
                # The agent answers a sync with 0xFF first; anything before it is the
                # tail of older answers (or junk), skipped within the reader's bound.
                await self._reader.readuntil(b"\xff")
                while True:
                    line = await self._reader.readuntil(b"\n")
                    if not line.strip().lstrip(b"\xff"):
                        continue
                    try:
                        msg = parse_line(self.vm, "guest-sync-delimited", line)
                    except GuestAgentError:
                        break
                    if sync_id(msg) == want:
                        return
                    break

        await asyncio.wait_for(wait(), timeout)

    def _send(self, msg: dict[str, Any]) -> None:
        assert self._writer is not None
        self.log.debug("qga> %s", redact(msg))
        self._writer.write(json.dumps(msg).encode() + b"\n")

    async def execute(self, command: str, arguments: dict[str, Any] | None = None,
                      timeout: float = 30.0) -> Any:
        """Run one agent command; its ``return`` value (its JSON type unchecked: the
        typed commands below check it). Any failure closes the connection."""
        if self._writer is None or self._reader is None:
            await self.connect()
        assert self._reader is not None and self._writer is not None
        msg: dict[str, Any] = {"execute": command}
        if arguments:
            msg["arguments"] = arguments
        try:
            self._send(msg)
            await asyncio.wait_for(self._writer.drain(), timeout)
            line = await asyncio.wait_for(self._reader.readuntil(b"\n"), timeout)
        except TimeoutError as exc:
            await self.close()
            raise GuestAgentError(f"VM {self.vm}: guest agent command {command} got no "
                                  f"answer in {timeout:.0f} s.") from exc
        except asyncio.LimitOverrunError as exc:
            await self.close()
            raise GuestAgentError(f"VM {self.vm}: the guest agent answered {command} with "
                                  f"a line longer than {MAX_LINE} bytes; a guest agent "
                                  "that answers garbage is not used.") from exc
        except (asyncio.IncompleteReadError, OSError) as exc:
            await self.close()
            raise GuestAgentError(f"VM {self.vm}: the guest agent closed the connection "
                                  f"during {command}.") from exc
        try:
            reply = parse_line(self.vm, command, line)
        except GuestAgentError:
            self.log.debug("qga< garbage (%d bytes)", len(line))
            await self.close()
            raise
        self.log.debug("qga< %s", redact(reply))
        try:
            return unwrap(self.vm, command, reply)
        except GuestAgentError as exc:
            if exc.agent_said is None:      # a reply of neither kind: out of step
                await self.close()
            raise

    async def ping(self) -> None:
        await self.execute("guest-ping")

    async def run(self, argv: list[str], *, stdin: bytes | None = None,
                  timeout: float = 60.0) -> ExecResult:
        """Run ``argv`` in the guest, wait for it, and return its output and status."""
        if not argv:
            raise GuestAgentError("no command given to run in the guest.")
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout

        def left(least: float = 0.1) -> float:
            return max(least, min(30.0, deadline - loop.time()))
        args: dict[str, Any] = {"path": argv[0], "arg": argv[1:], "capture-output": True}
        if stdin is not None:
            args["input-data"] = base64.b64encode(stdin).decode()
        try:
            started = ExecStarted.parse(self.vm, await self.execute("guest-exec", args,
                                                                    timeout=left()))
            delay = 0.02
            while True:
                status = ExecStatus.parse(self.vm, await self.execute(
                    # ``timeout`` bounds the command, not one answer: near the
                    # deadline the agent still gets ANSWER_S to say how the command
                    # is (a loaded TCG guest takes seconds to answer), so that an
                    # unfinished command is named as such, not as a silent agent.
                    "guest-exec-status", {"pid": started.pid}, timeout=left(ANSWER_S)))
                if status.exited:
                    return ExecResult(
                        exit_code=-1 if status.exit_code is None else status.exit_code,
                        stdout=status.stdout, stderr=status.stderr, signal=status.signal)
                if loop.time() >= deadline:
                    raise GuestAgentError(f"VM {self.vm}: the command did not finish "
                                          f"within {timeout:.0f} s (guest pid "
                                          f"{started.pid} left running).")
                await asyncio.sleep(delay)
                delay = min(delay * 2, 0.25)
        except GuestAgentError as exc:
            if exc.agent_said is None:
                await self.close()
            raise
