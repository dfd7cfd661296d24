"""How many moves between hosts one agent runs at once per pair of hosts.

A burst of ``spec.host`` changes (a user re-hosting many VMs, a script, a drain of
several hosts) would otherwise start a stream for every VM the agent has a thread for:
each stream takes its TLS channels and CPU on both hosts (QEMU's TLS writes one record
per page), and its pre-copy is slower the more streams share the link and the cores,
so every move of the burst gets longer and its guest's last pause with it. The source
host takes a slot of its pair (this host, the destination) before it starts a move;
beyond ``per_pair`` the move waits its turn, first come first served, and the VM's
``Moved`` condition says so (``MOVE_QUEUED``); a slot that frees wakes the agent, whose
next pass takes the next move of the queue up.

A VM that stops asking (its spec changed back, it was deleted) leaves the queue after
``FORGET_S`` without asking again: the agent asks on every pass, at least every
``fusuma.cluster.agent.RESYNC_S``.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

from fusuma.frozen import frozen

# Moves between hosts that run at once from one host to one other (the source's bound).
DEFAULT_PER_PAIR = 4
# The Moved condition's reason while a move waits for a slot.
MOVE_QUEUED = "MoveQueued"
# A waiting VM not seen for this long leaves the queue (the agent asks every 5 s).
FORGET_S = 15.0


@frozen
class Waiting:
    """A move that could not start: the moves of its pair under way, and its place in
    the queue (1: next)."""

    running: tuple[str, ...]
    place: int
    per_pair: int

    def sentence(self, source: str, dest: str) -> str:
        return (f"waiting to move to host {dest}: {len(self.running)} moves from {source} "
                f"to {dest} run already (at most {self.per_pair} at once per pair of "
                f"hosts, `fusuma cluster agent --moves-per-pair`); "
                f"number {self.place} in the queue.")


class PairSlots:
    """The slots of each (source, destination) pair of one agent, and their queues."""

    def __init__(self, per_pair: int = DEFAULT_PER_PAIR,
                 on_free: Callable[[], None] = lambda: None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        if per_pair < 1:
            raise ValueError("at least one move per pair of hosts")
        self.per_pair = per_pair
        self._on_free = on_free
        self._clock = clock
        self._lock = threading.Lock()
        self._running: dict[tuple[str, str], list[str]] = {}
        # Per pair: who waits, in the order they first asked, and when each last asked.
        self._queue: dict[tuple[str, str], dict[str, float]] = {}

    def take(self, source: str, dest: str, who: str) -> Waiting | None:
        """Take a slot of the pair for ``who`` (None: taken; ``release`` gives it
        back), or say where it waits."""
        pair = (source, dest)
        now = self._clock()
        with self._lock:
            running = self._running.setdefault(pair, [])
            if who in running:
                raise RuntimeError(f"{who} holds a slot of {source} -> {dest} already")
            queue = self._queue.setdefault(pair, {})
            for w, seen in list(queue.items()):
                if now - seen > FORGET_S and w != who:
                    del queue[w]
            queue[who] = now
            free = self.per_pair - len(running)
            ahead = list(queue).index(who)
            if ahead < free:
                del queue[who]
                running.append(who)
                return None
            return Waiting(tuple(running), ahead + 1, self.per_pair)

    def release(self, source: str, dest: str, who: str) -> None:
        with self._lock:
            running = self._running.get((source, dest), [])
            if who in running:
                running.remove(who)
        self._on_free()

    @contextmanager
    def held(self, source: str, dest: str, who: str) -> Iterator[None]:
        """Release the slot ``take`` gave ``who`` when the block ends, however."""
        try:
            yield
        finally:
            self.release(source, dest, who)

    def running(self, source: str, dest: str) -> list[str]:
        with self._lock:
            return list(self._running.get((source, dest), []))


def unqueued(status: dict[str, Any]) -> dict[str, Any]:
    """The status fields that drop a Moved condition saying a move waits (none if it
    says nothing of the kind): for the write that starts the move, or ends the wait."""
    conds = list(status.get("conditions") or [])
    keep = [cd for cd in conds
            if not (cd.get("type") == "Moved" and cd.get("reason") == MOVE_QUEUED)]
    return {"conditions": keep} if len(keep) != len(conds) else {}
