"""The live event stream: the state file's event log, tailed and fanned out.

Every process that changes something writes an event into the state file (a VM's
state transition, a partition created, resized or restarted, a move with its downtime,
a governor decision, an API operation), so a change made through the CLI or by a
supervisor is streamed like one made through the API. The hub reads the log every
``POLL_S`` seconds (one indexed query), feeds the event-derived metrics, and hands each
event to every subscriber of ``GET /1.0/events``.

A subscriber that cannot keep up (``QUEUE`` events behind) is dropped with a last
``overflow`` event, rather than slowing the others or growing without bound; it can
reconnect with ``Last-Event-ID`` and get what it missed from the log.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

from fusuma.state import Database

LOG = logging.getLogger(__name__)

TYPES = ("lifecycle", "operation", "governor")


def api_event(row: dict[str, Any]) -> dict[str, Any]:
    """An event log row as the API shows it (Incus' event shape)."""
    ts = datetime.fromtimestamp(row["ts"], UTC).isoformat(timespec="milliseconds")
    return {"id": row["id"], "type": row["type"],
            "timestamp": ts.replace("+00:00", "Z"),
            "metadata": {"action": row["action"], "source": row["source"],
                         "context": row["context"]}}


def sse(event: dict[str, Any]) -> bytes:
    """One server-sent event: ``id``, ``event`` (the type) and the JSON ``data``."""
    return (f"id: {event['id']}\nevent: {event['type']}\n"
            f"data: {json.dumps(event, separators=(',', ':'))}\n\n").encode()


@dataclass(eq=False)
class _Subscriber:
    types: frozenset[str]
    queue: asyncio.Queue[dict[str, Any] | None] = field(
        default_factory=lambda: asyncio.Queue(maxsize=EventHub.QUEUE))


class EventHub:
    POLL_S = 0.05
    QUEUE = 2000
    KEEPALIVE_S = 15.0

    def __init__(self, db: Callable[[], Database],
                 observe: Callable[[dict[str, Any]], None] = lambda e: None) -> None:
        self._db = db
        self._observe = observe
        self._subs: set[_Subscriber] = set()
        self.last_id = 0
        self._task: asyncio.Task[None] | None = None
        self.polls = 0

    async def start(self) -> None:
        self.last_id = await asyncio.to_thread(lambda: self._db().last_event_id())
        self._task = asyncio.create_task(self._run(), name="event-hub")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        for sub in list(self._subs):
            with contextlib.suppress(asyncio.QueueFull):
                sub.queue.put_nowait(None)

    async def _run(self) -> None:
        while True:
            try:
                rows = await asyncio.to_thread(self._read)
            except Exception as exc:  # a locked or replaced file: try again next time
                LOG.warning("cannot read the event log: %s", exc)
                rows = []
            for row in rows:
                self.last_id = row["id"]
                try:
                    self._observe(row)
                except Exception:
                    LOG.exception("event metrics failed on event %s", row["id"])
                self._publish(api_event(row))
            self.polls += 1
            await asyncio.sleep(self.POLL_S if len(rows) < 1000 else 0)

    def _read(self) -> list[dict[str, Any]]:
        return self._db().events_since(self.last_id)

    def _publish(self, event: dict[str, Any]) -> None:
        for sub in list(self._subs):
            if event["type"] not in sub.types:
                continue
            try:
                sub.queue.put_nowait(event)
            except asyncio.QueueFull:
                self._subs.discard(sub)
                with contextlib.suppress(asyncio.QueueEmpty):
                    sub.queue.get_nowait()
                sub.queue.put_nowait({"id": event["id"], "type": "overflow",
                                      "timestamp": event["timestamp"],
                                      "metadata": {"error": "this client fell "
                                                   f"{self.QUEUE} events behind and was "
                                                   "dropped; reconnect with Last-Event-ID"}})
                sub.queue.put_nowait(None)

    async def stream(self, types: frozenset[str], since: int | None) -> AsyncIterator[bytes]:
        """The SSE byte stream of one subscriber: first the logged events after
        ``since`` (if given), then live ones, with a keep-alive comment when idle."""
        sub = _Subscriber(types)
        self._subs.add(sub)
        try:
            yield b": fusuma events\n\n"
            sent = since if since is not None else self.last_id
            if since is not None:
                rows = await asyncio.to_thread(lambda: self._db().events_since(since, 10000))
                for row in rows:
                    if row["id"] <= self.last_id and row["type"] in types:
                        yield sse(api_event(row))
                        sent = row["id"]
            while True:
                try:
                    event = await asyncio.wait_for(sub.queue.get(), self.KEEPALIVE_S)
                except TimeoutError:
                    yield b": keep-alive\n\n"
                    continue
                if event is None:
                    return
                if event["type"] != "overflow" and event["id"] <= sent:
                    continue      # already sent from the log
                yield sse(event)
        finally:
            self._subs.discard(sub)

    @property
    def subscribers(self) -> int:
        return len(self._subs)
