"""A guest agent that answers garbage: every kind of malformed reply is a
``GuestAgentError`` (never a ValueError, KeyError, TypeError, UnicodeError or a
RecursionError escaping), bounded in time and size, and the next command after it is
answered correctly, on a fresh connection.

The peer is a fake agent on a UNIX socket (as QEMU's chardev socket is to fusuma): it
answers the sync properly, then ``reply(command)``'s bytes."""

from __future__ import annotations

import asyncio
import base64
import contextlib
import json
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from fusuma.errors import GuestAgentError
from fusuma.qemu import qga, qgareply
from fusuma.qemu.qga import GuestAgent

Reply = Callable[[str, dict[str, Any]], bytes | None]


def good(cmd: str, args: dict[str, Any]) -> bytes | None:
    if cmd == "guest-exec":
        return b'{"return": {"pid": 7}}\n'
    if cmd == "guest-exec-status":
        out = base64.b64encode(b"fine\n").decode()
        return json.dumps({"return": {"exited": True, "exitcode": 0,
                                      "out-data": out}}).encode() + b"\n"
    return b'{"return": {}}\n'


class Peer:
    """A fake agent: a proper sync answer (unless ``sync`` says otherwise), then
    ``reply`` for each command (None: no answer at all)."""

    def __init__(self, reply: Reply, sync: Callable[[int], bytes] | None = None) -> None:
        self.reply = reply
        self.sync = sync or (lambda i: b"\xff" + json.dumps({"return": i}).encode() + b"\n")
        self.connections = 0

    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        try:
            while line := await reader.readline():
                msg = json.loads(line)
                cmd, args = msg["execute"], msg.get("arguments", {})
                out = self.sync(args["id"]) if cmd == "guest-sync-delimited" \
                    else self.reply(cmd, args)
                if out is not None:
                    writer.write(out)
                    await writer.drain()
        except (ConnectionError, asyncio.CancelledError):
            pass
        finally:
            writer.close()


async def _serve(sock: Path, peer: Peer) -> asyncio.Server:
    return await asyncio.start_unix_server(peer.handle, path=str(sock))


def on_exec(bad: bytes) -> Reply:
    return lambda cmd, args: bad if cmd == "guest-exec" else good(cmd, args)


def on_status(bad: bytes) -> Reply:
    return lambda cmd, args: bad if cmd == "guest-exec-status" else good(cmd, args)


def js(obj: Any) -> bytes:
    return json.dumps(obj).encode() + b"\n"


GARBAGE = {
    "not JSON": on_exec(b"}{ not json\n"),
    "not UTF-8": on_exec(b'{"return": {"pid": "\xc3\x28"}}\n'),
    "an array": on_exec(b"[1, 2]\n"),
    "a bare string": on_exec(b'"seven"\n'),
    "pid a string": on_exec(js({"return": {"pid": "seven"}})),
    "pid a boolean": on_exec(js({"return": {"pid": True}})),
    "pid a float": on_exec(js({"return": {"pid": 7.5}})),
    "pid negative": on_exec(js({"return": {"pid": -1}})),
    "pid huge": on_exec(js({"return": {"pid": 2**80}})),
    "pid missing": on_exec(js({"return": {}})),
    "return an array": on_exec(js({"return": []})),
    "neither return nor error": on_exec(js({"surprise": 1})),
    "error a string": on_exec(js({"error": "no"})),
    "error desc a number": on_exec(js({"error": {"desc": 5}})),
    "deep nesting": on_exec(b"[" * 200_000 + b"\n"),
    "5000-digit integer": on_exec(b'{"return": {"pid": ' + b"9" * 5000 + b"}}\n"),
    "exited a string": on_status(js({"return": {"exited": "yes"}})),
    "exitcode a string": on_status(js({"return": {"exited": True, "exitcode": "0"}})),
    "exitcode a float": on_status(js({"return": {"exited": True, "exitcode": 1.5}})),
    "signal out of range": on_status(js({"return": {"exited": True, "signal": 999}})),
    "out-data not base64": on_status(js({"return": {"exited": True, "exitcode": 0,
                                                    "out-data": "!!not base64!!"}})),
    "out-data not ASCII": on_status(js({"return": {"exited": True, "exitcode": 0,
                                                   "out-data": "ü" * 8}})),
    "out-data a number": on_status(js({"return": {"exited": True, "out-data": 5}})),
    "err-data null": on_status(js({"return": {"exited": True, "err-data": None}})),
    "truncated a string": on_status(js({"return": {"exited": True,
                                                   "out-truncated": "no"}})),
    "status an array": on_status(js({"return": [True]})),
}


@pytest.mark.parametrize("case", sorted(GARBAGE))
def test_garbage_reply_is_a_guest_agent_error_and_the_next_command_works(
        tmp_path: Path, case: str) -> None:
    sock = tmp_path / "qga.sock"
    answers = iter([GARBAGE[case]])

    def reply(cmd: str, args: dict[str, Any]) -> bytes | None:
        # The first exec goes to the garbage, later ones to a sound agent.
        if cmd == "guest-exec":
            nonlocal current
            current = next(answers, good)
        return current(cmd, args)
    current: Reply = good
    peer = Peer(reply)

    async def main() -> None:
        async with await _serve(sock, peer), GuestAgent("vm0", sock) as ga:
            await ga.connect(timeout=5)
            t0 = time.monotonic()
            with pytest.raises(GuestAgentError) as err:
                await ga.run(["/bin/true"], timeout=5)
            assert time.monotonic() - t0 < 3
            assert "VM vm0: the guest agent answered guest-exec" in str(err.value), err
            # A fresh connection, synchronised anew, gets a sound answer.
            res = await ga.run(["/bin/true"], timeout=5)
            assert (res.exit_code, res.stdout) == (0, b"fine\n")
            assert peer.connections == 2

    asyncio.run(main())


BOUNDS = {
    # A reply line longer than the reader's bound (here 4096 bytes).
    "line": (qga, "MAX_LINE", 4096,
             on_exec(b'{"return": {"pid": "' + b"x" * 100_000 + b'"}}\n'),
             "a line longer than 4096 bytes"),
    # Output larger than qemu-ga itself would ever send (here 1024 bytes).
    "output": (qgareply, "MAX_OUTPUT", 1024,
               on_status(js({"return": {"exited": True, "exitcode": 0,
                                        "out-data": base64.b64encode(b"x" * 4096).decode()}})),
               "more than the agent's own limit"),
}


@pytest.mark.parametrize("case", sorted(BOUNDS))
def test_sizes_beyond_the_bounds_are_refused(tmp_path: Path, case: str,
                                             monkeypatch: pytest.MonkeyPatch) -> None:
    module, name, bound, reply, said = BOUNDS[case]
    monkeypatch.setattr(module, name, bound)
    sock = tmp_path / "qga.sock"
    peer = Peer(reply)

    async def main() -> None:
        async with await _serve(sock, peer), GuestAgent("vm0", sock) as ga:
            await ga.connect(timeout=5)
            with pytest.raises(GuestAgentError, match=said):
                await ga.run(["/bin/true"], timeout=5)

    asyncio.run(main())


def test_agent_error_text_is_bounded_printable_and_kept_apart(tmp_path: Path) -> None:
    sock = tmp_path / "qga.sock"
    peer = Peer(on_exec(js({"error": {"class": "GenericError",
                                      "desc": "\x1b]0;owned\x07" + "y" * 1000}})))

    async def main() -> None:
        async with await _serve(sock, peer), GuestAgent("vm0", sock) as ga:
            await ga.connect(timeout=5)
            with pytest.raises(GuestAgentError) as err:
                await ga.run(["/bin/true"], timeout=5)
            exc = err.value
            assert "\x1b" not in str(exc) and "\x07" not in str(exc)
            assert exc.agent_said is not None and len(exc.agent_said) <= 203
            assert exc.agent_said.startswith("?]0;owned?y")
            assert exc.summary == "VM vm0: guest agent guest-exec failed"
            assert "owned" not in exc.summary

    asyncio.run(main())


def test_a_late_answer_is_never_taken_for_the_next_one(tmp_path: Path) -> None:
    sock = tmp_path / "qga.sock"
    peer = Peer(good)
    first = True

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        nonlocal first
        if not first:
            return await peer.handle(reader, writer)
        first = False
        peer.connections += 1
        while line := await reader.readline():
            msg = json.loads(line)
            if msg["execute"] == "guest-sync-delimited":
                writer.write(peer.sync(msg["arguments"]["id"]))
            else:
                # Answered late, and with what would pass for the next exec's answer.
                await asyncio.sleep(0.6)
                writer.write(js({"return": {"pid": 99}}))
            with contextlib.suppress(ConnectionError):
                await writer.drain()

    async def main() -> None:
        async with await asyncio.start_unix_server(handle, path=str(sock)), \
                GuestAgent("vm0", sock) as ga:
            await ga.connect(timeout=5)
            with pytest.raises(GuestAgentError, match="got no answer in 0 s"):
                await ga.execute("guest-ping", timeout=0.3)
            await asyncio.sleep(0.5)      # the late answer has been sent by now
            res = await ga.run(["/bin/true"], timeout=5)
            assert res.stdout == b"fine\n" and peer.connections == 2

    asyncio.run(main())


SYNC_GARBAGE = {
    "no 0xFF, only junk lines": lambda i: b"junk\n" * 10,
    "0xFF then not JSON": lambda i: b"\xff}{\n",
    "0xFF then a string": lambda i: b"\xff" + js({"return": "x"}),
    "0xFF then the wrong id": lambda i: b"\xff" + js({"return": i + 1}),
    "0xFF then an array": lambda i: b"\xff[1]\n",
    "endless bytes, no line end": lambda i: b"z" * 200_000,
}


@pytest.mark.parametrize("case", sorted(SYNC_GARBAGE))
def test_garbage_sync_answer_is_a_timeout_not_a_crash(tmp_path: Path, case: str,
                                                      monkeypatch: pytest.MonkeyPatch
                                                      ) -> None:
    monkeypatch.setattr(qga, "MAX_LINE", 65536)
    sock = tmp_path / "qga.sock"
    peer = Peer(good, sync=SYNC_GARBAGE[case])

    async def main() -> None:
        async with await _serve(sock, peer), GuestAgent("vm0", sock) as ga:
            t0 = time.monotonic()
            with pytest.raises(GuestAgentError, match="did not answer within 1 s"):
                await ga.connect(timeout=1)
            assert time.monotonic() - t0 < 3

    asyncio.run(main())


def test_silence_and_a_closed_channel(tmp_path: Path) -> None:
    sock = tmp_path / "qga.sock"
    peer = Peer(lambda cmd, args: None if cmd == "guest-exec" else good(cmd, args))

    async def main() -> None:
        async with await _serve(sock, peer), GuestAgent("vm0", sock) as ga:
            await ga.connect(timeout=5)
            t0 = time.monotonic()
            with pytest.raises(GuestAgentError, match="got no answer in 1 s"):
                await ga.run(["/bin/true"], timeout=1)
            assert time.monotonic() - t0 < 3

    asyncio.run(main())


class SlowPeer(Peer):
    """An agent of a loaded guest: each guest-exec-status answered ``delay`` s late,
    the command still running."""

    def __init__(self, delay: float) -> None:
        super().__init__(good)
        self.delay = delay

    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while line := await reader.readline():
                msg = json.loads(line)
                cmd, args = msg["execute"], msg.get("arguments", {})
                if cmd == "guest-sync-delimited":
                    out = self.sync(args["id"])
                elif cmd == "guest-exec-status":
                    await asyncio.sleep(self.delay)
                    out = js({"return": {"exited": False}})
                else:
                    out = good(cmd, args)
                writer.write(out or b"")
                await writer.drain()
        except (ConnectionError, asyncio.CancelledError):
            pass
        finally:
            writer.close()


def test_a_slow_answer_at_the_deadline_names_the_unfinished_command(tmp_path: Path) -> None:
    """A command that outlives its timeout in a guest whose agent answers late: the
    error says the command did not finish (and its pid), not that the agent was silent
    (as it did when the last status question got what was left of the deadline)."""
    sock = tmp_path / "qga.sock"

    async def main() -> None:
        async with await _serve(sock, SlowPeer(1.2)), GuestAgent("vm0", sock) as ga:
            await ga.connect(timeout=5)
            t0 = time.monotonic()
            with pytest.raises(GuestAgentError,
                               match=r"did not finish within 1 s \(guest pid 7 left running"):
                await ga.run(["/bin/sleep", "9"], timeout=1)
            assert time.monotonic() - t0 < 1 + 1.2 + 1

    asyncio.run(main())
