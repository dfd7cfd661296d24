"""Where a move's downtime goes: the source's STOP and "completed", then the
destination's steps, each step's ms from the end of the one before."""

from __future__ import annotations

import asyncio
from typing import Any

from fusuma.errors import QemuError
from fusuma.migration import downtime_steps
from fusuma.supervisor import rpc
from fusuma.supervisor.moves.source import stop_and_completion


def streamed(**kw: Any) -> rpc.Streamed:
    base: dict[str, Any] = dict(t0=99.0, stop_ts=100.0, qemu_total_ms=5.0,
                                qemu_downtime_ms=3.0, bytes_sent=1, source_pid=1,
                                paused=False, completed_ts=100.002)
    base.update(kw)
    return rpc.Streamed(**base)


def test_each_step_from_the_end_of_the_one_before() -> None:
    fin = rpc.Resumed(pid=2, resume_ts=100.0081, steps={
        "loaded": 100.0045, "seen": 100.005, "decided": 100.0052, "taps": 100.0055,
        "resumed": 100.0081})
    got = downtime_steps(streamed(), fin)
    assert got == {"source_saved": 2.0, "dest_loaded": 2.5, "event": 0.5, "decision": 0.2,
                   "taps": 0.3, "cont": 2.6}
    assert list(got) == ["source_saved", "dest_loaded", "event", "decision", "taps", "cont"]
    # The steps add up to the downtime (STOP to RESUME).
    assert round(sum(got.values()), 2) == round((fin.resume_ts - 100.0) * 1000, 2)


def test_a_step_a_side_did_not_time_is_left_out() -> None:
    fin = rpc.Resumed(pid=2, resume_ts=100.01, steps={"loaded": 100.004,
                                                      "resumed": 100.01})
    assert downtime_steps(streamed(completed_ts=None), fin) == {"dest_loaded": 4.0,
                                                                 "cont": 6.0}
    # No STOP, or a destination that timed nothing of its load (in place, an older
    # supervisor): no steps.
    assert downtime_steps(streamed(stop_ts=None), fin) is None
    assert downtime_steps(streamed(), rpc.Resumed(pid=2, resume_ts=100.01)) is None
    assert downtime_steps(streamed(), rpc.Resumed(pid=2, resume_ts=100.01,
                                                  steps={"decided": 100.005})) is None


class FakeQmp:
    """Hands out queued events, then times out like ``Qmp.wait_event``."""

    def __init__(self, events: list[dict[str, Any]]) -> None:
        self.events = events

    async def wait_event(self, listener: object, timeout: float) -> dict[str, Any]:
        if not self.events:
            raise QemuError("no event")
        return self.events.pop(0)


def ev(name: str, at: float, **data: Any) -> dict[str, Any]:
    return {"event": name, "data": data,
            "timestamp": {"seconds": int(at), "microseconds": round(at % 1 * 1e6)}}


def test_the_source_says_when_it_stopped_and_when_it_completed() -> None:
    qmp: Any = FakeQmp([ev("MIGRATION", 10.0, status="active"), ev("STOP", 10.5),
                        ev("MIGRATION", 10.503, status="completed")])
    assert asyncio.run(stop_and_completion(qmp, None)) == (10.5, 10.503)
    qmp = FakeQmp([ev("STOP", 10.5)])
    assert asyncio.run(stop_and_completion(qmp, None)) == (10.5, None)
