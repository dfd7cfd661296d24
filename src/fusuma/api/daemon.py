"""The daemon's shared parts, which every route module receives."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

from fastapi.responses import JSONResponse

from fusuma.api.events import EventHub
from fusuma.api.guard import Gate
from fusuma.api.http import accepted
from fusuma.api.operations import Operation, Operations
from fusuma.api.sampler import Sampler
from fusuma.api.sessions import Sessions
from fusuma.errors import StateError
from fusuma.ops.context import Ctx, ThreadContexts
from fusuma.paths import Paths
from fusuma.state import Database, busy_sentence

T = TypeVar("T")

# Threads that read tokens (the state file) for the TCP listener's requests and logins.
# Their own, so that no other kind of request can use them up: a flood of one kind
# leaves a token check a thread.
AUTH_WORKERS = 4


class Daemon:
    """The daemon's shared parts: per-thread contexts, operations, events, metrics, the
    token checks' threads and each listener's gate (which `fusuma serve` fills in)."""

    def __init__(self, paths: Paths) -> None:
        from fusuma.api import metrics

        self.paths = paths
        self._contexts = ThreadContexts(paths)
        self.started = time.time()
        self.ops = Operations(self._operation_event)
        self.registry, self.event_metrics = metrics.build_registry(
            paths, self.db, lambda: self.ctx().parts.cg)
        self.hub = EventHub(self.db, self.event_metrics.observe)
        self.sessions = Sessions()
        self.sampler = Sampler(paths, self.db)
        self.auth_pool = ThreadPoolExecutor(AUTH_WORKERS, thread_name_prefix="auth")
        self.gates: dict[str, Gate] = {}

    async def authenticate(self, fn: Callable[[], T]) -> T:
        """``fn`` (a token's lookup) on the token checks' own threads."""
        return await asyncio.get_running_loop().run_in_executor(self.auth_pool, fn)

    def ctx(self) -> Ctx:
        """This thread's context (a state-file connection is per thread)."""
        return self._contexts.get()

    def db(self) -> Database:
        return self.ctx().db

    def _operation_event(self, op: Operation, action: str) -> None:
        self.db().emit_context("operation", action, f"/1.0/operations/{op.id}",
                               op.as_event())

    def submit(self, kind: str, description: str, resources: dict[str, list[str]],
               work: Callable[[Operation], Any], cancellable: bool = False,
               private: bool = False) -> JSONResponse:
        return accepted(self.ops.submit(kind, description, resources, work,
                                        cancellable=cancellable, private=private))


def not_busy(c: Ctx, obj: str) -> None:
    """409 now (not in a failed operation later) while a live owner holds ``obj``."""
    job = c.db.find_job(obj)
    if job is not None and job.owner.alive():
        raise StateError(busy_sentence(job))
