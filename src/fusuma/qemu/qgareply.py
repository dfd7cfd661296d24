"""Guest-agent replies as bounded, typed models: nothing a guest sends reaches fusuma
unchecked.

A guest (and so its agent) is not trusted. Every reply line is at most
:data:`MAX_LINE` bytes, must be one JSON object with either ``return`` or ``error``,
and every field fusuma uses is checked for its JSON type and range (a JSON ``true`` is
not an integer here); base64 output is decoded strictly and bounded by
:data:`MAX_OUTPUT`. Every failure is a ``GuestAgentError`` (fusuma.errors) with a
sentence of fusuma's own; the agent's own error text, which the guest controls, is
kept apart in ``GuestAgentError.agent_said`` (bounded, printable), so that callers that
publish a reason (the state's ``error``, the event log) can leave it out.
"""

from __future__ import annotations

import base64
import binascii
import json
from typing import Any

from fusuma.errors import GuestAgentError
from fusuma.frozen import frozen

# qemu-ga keeps at most 16 MiB of a command's stdout and of its stderr
# (GUEST_EXEC_MAX_OUTPUT); a guest-exec-status reply carries both in base64.
MAX_OUTPUT = 16 * 2**20
MAX_LINE = 2 * (4 * MAX_OUTPUT // 3 + 4) + 64 * 1024
# Of the agent's own error text, what a message quotes.
MAX_DESC = 200
INT32 = 2**31


def printable(text: str, limit: int = MAX_DESC) -> str:
    """``text`` cut to ``limit`` characters, control characters (a terminal escape a
    guest could send to whoever reads the message) shown as ``?``."""
    cut = text[:limit]
    out = "".join(c if c.isprintable() else "?" for c in cut)
    return out + ("..." if len(text) > limit else "")


def _kind(value: Any) -> str:
    return {dict: "an object", list: "an array", str: "a string", bool: "a boolean",
            type(None): "null", float: "a number", int: "an integer"}.get(type(value),
                                                                         "something else")


def bad(vm: str, command: str, what: str) -> GuestAgentError:
    """The error for a reply that breaks the protocol (no guest text in it)."""
    return GuestAgentError(f"VM {vm}: the guest agent answered {command} with {what}; "
                           "a guest agent that answers garbage is not used (the guest "
                           "may be compromised or its agent broken).")


def parse_line(vm: str, command: str, line: bytes) -> dict[str, Any]:
    """One reply line as a JSON object (a leading 0xFF of a sync answer removed)."""
    if len(line) > MAX_LINE:
        raise bad(vm, command, f"a line longer than {MAX_LINE} bytes")
    raw = line.strip().lstrip(b"\xff")
    try:
        msg = json.loads(raw)
    except (ValueError, RecursionError):
        # ValueError: not JSON, not UTF-8 (UnicodeDecodeError), or an integer of more
        # digits than Python converts; RecursionError: nesting deeper than the parser's.
        raise bad(vm, command, f"{len(raw)} bytes that are not JSON") from None
    if not isinstance(msg, dict):
        raise bad(vm, command, f"{_kind(msg)} where an object belongs")
    return msg


def unwrap(vm: str, command: str, msg: dict[str, Any]) -> Any:
    """The ``return`` value of a reply, or its ``error`` as a GuestAgentError."""
    if "error" in msg:
        err = msg["error"]
        desc = err.get("desc") if isinstance(err, dict) else None
        if not isinstance(desc, str):
            raise bad(vm, command, "an error without a description")
        said = printable(desc)
        raise GuestAgentError(f"VM {vm}: guest agent {command} failed: {said}",
                              agent_said=said,
                              summary=f"VM {vm}: guest agent {command} failed")
    if "return" not in msg:
        raise bad(vm, command, "an object holding neither return nor error")
    return msg["return"]


def _int(vm: str, command: str, obj: dict[str, Any], key: str, lo: int, hi: int,
         required: bool = True) -> int | None:
    if key not in obj and not required:
        return None
    value = obj.get(key)
    if not isinstance(value, int) or isinstance(value, bool):
        raise bad(vm, command, f'{_kind(value)} as "{key}", not an integer')
    if not lo <= value < hi:
        raise bad(vm, command, f'"{key}" {value} out of range [{lo}, {hi})')
    return value


def _bool(vm: str, command: str, obj: dict[str, Any], key: str) -> bool:
    value = obj.get(key, False)
    if not isinstance(value, bool):
        raise bad(vm, command, f'{_kind(value)} as "{key}", not a boolean')
    return value


def _object(vm: str, command: str, value: Any) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise bad(vm, command, f"{_kind(value)} as its return value, not an object")
    return value


def _b64(vm: str, command: str, obj: dict[str, Any], key: str) -> bytes:
    value = obj.get(key, "")
    if not isinstance(value, str):
        raise bad(vm, command, f'{_kind(value)} as "{key}", not a string')
    if len(value) > 4 * (MAX_OUTPUT // 3 + 1):
        raise bad(vm, command, f'"{key}" of {len(value)} characters, more than the '
                  f"agent's own limit of {MAX_OUTPUT} bytes")
    try:
        return base64.b64decode(value.encode("ascii"), validate=True)
    except (binascii.Error, UnicodeError, ValueError):
        raise bad(vm, command, f'"{key}" that is not base64') from None


def sync_id(msg: dict[str, Any]) -> int | None:
    """The id a ``guest-sync-delimited`` reply returns (None if it is no such reply)."""
    value = msg.get("return")
    return value if isinstance(value, int) and not isinstance(value, bool) else None


@frozen
class ExecStarted:
    """``guest-exec``'s reply: the guest pid of the command."""

    pid: int

    @classmethod
    def parse(cls, vm: str, value: Any) -> ExecStarted:
        obj = _object(vm, "guest-exec", value)
        pid = _int(vm, "guest-exec", obj, "pid", 1, INT32)
        assert pid is not None
        return cls(pid)


@frozen
class ExecStatus:
    """``guest-exec-status``'s reply: whether the command ended, how, and its output."""

    exited: bool
    exit_code: int | None = None
    signal: int | None = None
    stdout: bytes = b""
    stderr: bytes = b""
    stdout_truncated: bool = False
    stderr_truncated: bool = False

    @classmethod
    def parse(cls, vm: str, value: Any) -> ExecStatus:
        cmd = "guest-exec-status"
        obj = _object(vm, cmd, value)
        exited = obj.get("exited")
        if not isinstance(exited, bool):
            raise bad(vm, cmd, f'{_kind(exited)} as "exited", not a boolean')
        if not exited:
            return cls(exited=False)
        return cls(exited=True,
                   exit_code=_int(vm, cmd, obj, "exitcode", -INT32, INT32, required=False),
                   signal=_int(vm, cmd, obj, "signal", 0, 256, required=False),
                   stdout=_b64(vm, cmd, obj, "out-data"),
                   stderr=_b64(vm, cmd, obj, "err-data"),
                   stdout_truncated=_bool(vm, cmd, obj, "out-truncated"),
                   stderr_truncated=_bool(vm, cmd, obj, "err-truncated"))
