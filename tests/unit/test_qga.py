"""The guest-agent client against a fake agent peer on a UNIX socket.

The fake behaves like qemu-ga behind a virtio-serial chardev: requests sent before the
agent "boots" are buffered and answered late (stale sync replies), sync answers are
preceded by 0xFF, and guest-exec output is base64."""

from __future__ import annotations

import asyncio
import base64
import json
from pathlib import Path
from typing import Any

import pytest

from fusuma.errors import GuestAgentError
from fusuma.qemu.qga import GuestAgent


class FakeAgent:
    def __init__(self, boot_delay: float) -> None:
        self.boot_delay = boot_delay
        self.execs: list[dict[str, Any]] = []

    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await asyncio.sleep(self.boot_delay)   # requests pile up meanwhile
        polls = 0
        while line := await reader.readline():
            msg = json.loads(line)
            cmd, args = msg["execute"], msg.get("arguments", {})
            if cmd == "guest-sync-delimited":
                writer.write(b"\xff" + json.dumps({"return": args["id"]}).encode() + b"\n")
            elif cmd == "guest-ping":
                writer.write(b'{"return": {}}\n')
            elif cmd == "guest-exec":
                self.execs.append(args)
                writer.write(b'{"return": {"pid": 7}}\n')
            elif cmd == "guest-exec-status":
                polls += 1
                if polls < 2:
                    writer.write(b'{"return": {"exited": false}}\n')
                else:
                    out = base64.b64encode(b"hello\n").decode()
                    writer.write(json.dumps({"return": {
                        "exited": True, "exitcode": 3, "out-data": out}}).encode() + b"\n")
            else:
                writer.write(json.dumps({"error": {"class": "CommandNotFound",
                                                   "desc": f"{cmd} not found"}}).encode()
                             + b"\n")
            await writer.drain()


def run(coro: Any) -> Any:
    return asyncio.run(coro)


@pytest.mark.parametrize("boot_delay", [0.0, 1.5])
def test_sync_exec_and_errors(tmp_path: Path, boot_delay: float) -> None:
    sock = tmp_path / "qga.sock"
    fake = FakeAgent(boot_delay)

    async def main() -> None:
        server = await asyncio.start_unix_server(fake.handle, path=str(sock))
        async with server, GuestAgent("vm0", sock) as ga:
            await ga.connect(timeout=10)
            await ga.ping()
            res = await ga.run(["/bin/echo", "hello"], stdin=b"in")
            assert (res.exit_code, res.stdout, res.stderr) == (3, b"hello\n", b"")
            assert fake.execs == [{"path": "/bin/echo", "arg": ["hello"],
                                   "capture-output": True,
                                   "input-data": base64.b64encode(b"in").decode()}]
            with pytest.raises(GuestAgentError, match="guest-bogus not found"):
                await ga.execute("guest-bogus")

    run(main())


def test_no_agent_times_out_with_hint(tmp_path: Path) -> None:
    async def main() -> None:
        async with GuestAgent("vm0", tmp_path / "missing.sock") as ga:
            with pytest.raises(GuestAgentError, match="did not answer within 1 s"):
                await ga.connect(timeout=1)

    run(main())
