"""A private operation (``exec``) reaches the event log and the daemon's log as sizes
and codes only; whoever holds the operation still gets its whole result."""

from __future__ import annotations

import json
import logging
from typing import Any

import pytest

from fusuma.api.operations import Operation, Operations, sizes_only
from fusuma.errors import GuestAgentError

MARK = "topsecret-7f3a"


def run(work: Any, private: bool = True) -> tuple[Operation, list[dict[str, Any]]]:
    events: list[dict[str, Any]] = []
    ops = Operations(lambda op, action: events.append(op.as_event()), workers=1)
    op = ops.submit("vm-exec", "exec in VM v", {"vms": ["/1.0/vms/v"]}, work,
                    private=private)
    assert op.done.wait(10)
    ops.shutdown()
    return op, events


def test_result_is_sizes_in_events_and_whole_in_the_operation() -> None:
    result = {"exit_code": 3, "signal": None, "stdout": f"{MARK}\n", "stderr": "ü"}
    op, events = run(lambda op: result)
    assert op.as_json()["result"] == result
    last = events[-1]
    assert last["status"] == "Success"
    assert last["result"] == {"exit_code": 3, "signal": None, "stdout_bytes": 15,
                              "stderr_bytes": 2}
    assert MARK not in json.dumps(events)


def test_error_text_is_withheld_from_events(caplog: pytest.LogCaptureFixture) -> None:
    def fails(op: Operation) -> Any:
        raise GuestAgentError(f"VM v: guest agent guest-exec failed: no such file {MARK}")

    def crashes(op: Operation) -> Any:
        raise ValueError(f"bug while holding {MARK}")
    with caplog.at_level(logging.DEBUG):
        for work, code in ((fails, 500), (crashes, 500)):
            op, events = run(work)
            assert MARK in op.as_json()["err"]            # the caller learns why
            assert events[-1]["status"] == "Failure"
            assert events[-1]["error_code"] == code
            assert "withheld from the event log" in events[-1]["err"]
            assert MARK not in json.dumps(events)
    assert MARK not in caplog.text
    assert "ValueError at" in caplog.text                 # the bug is still logged


def test_other_operations_are_told_in_full() -> None:
    _op, events = run(lambda op: {"name": "p0", "cpus": [0]}, private=False)
    assert events[-1]["result"] == {"name": "p0", "cpus": [0]}


def test_sizes_only() -> None:
    assert sizes_only({"a": "xyz", "b": [1, 2], "c": {"d": 1}, "e": 1.5, "f": True}) == \
        {"a_bytes": 3, "b_items": 2, "c_items": 1, "e": 1.5, "f": True}
    assert sizes_only("abc") == {"bytes": 3}
    assert sizes_only([1]) == {"items": 1}
    assert sizes_only(None) is None
