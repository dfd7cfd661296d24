"""Wire format between the CLI and a partition supervisor: one JSON object per line.

Request:  {"op": "start", "args": {"vm": "vm0"}}
Response: {"ok": true, "result": ...} or
          {"ok": false, "error": "one sentence", "kind": "StateError"}
"""

from __future__ import annotations

import json
from typing import Any

from fusuma import errors

OPS = ("ping", "start", "stop", "kill", "exec", "repin", "status", "wait-agent")


def encode(msg: dict[str, Any]) -> bytes:
    return json.dumps(msg).encode() + b"\n"


def error_reply(exc: BaseException) -> dict[str, Any]:
    kind = type(exc).__name__ if isinstance(exc, errors.FusumaError) else "FusumaError"
    return {"ok": False, "error": str(exc) or type(exc).__name__, "kind": kind}


def raise_reply(reply: dict[str, Any]) -> Any:
    """Return the result of a reply, or raise the error it carries as its own class."""
    if reply.get("ok"):
        return reply.get("result")
    cls = getattr(errors, str(reply.get("kind", "FusumaError")), errors.FusumaError)
    if not (isinstance(cls, type) and issubclass(cls, errors.FusumaError)):
        cls = errors.FusumaError
    raise cls(str(reply.get("error", "the supervisor reported an unknown error")))
