"""The one job lock: every long operation on a VM or partition holds its object's job
(Incus's ``operationlock`` is the model), whoever runs it: the CLI, a supervisor, a
recovery, the API daemon or the cluster agent.

:class:`JobLock` records the job before the operation's first step and ends it after
the last; :meth:`JobLock.phase` records each step before it is taken. Taking a held
object is refused with one sentence naming the operation, its phase, since when and by
which pid (:func:`busy_sentence`); an object held by a dead owner is recovered first,
by the ``recover`` the caller gives (``fusuma.recovery.recover`` on the CLI's side, a
supervisor's own recovery of its local jobs), and then taken. The lock is a context
manager for synchronous callers and an asynchronous one for the supervisors.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Awaitable, Callable, Iterator
from types import TracebackType

from fusuma.errors import StateError
from fusuma.state.db import Database
from fusuma.state.jobs import Job, JobOwner, busy_sentence

Recover = Callable[[Job], None]
AsyncRecover = Callable[[Job], Awaitable[None]]


def _attempts(db: Database, job: Job, tries: int) -> Iterator[Job]:
    """Try to record ``job``; yield each holder whose owner is dead (the caller
    recovers it before the next try); refuse a live holder with its sentence."""
    for _ in range(tries):
        held = db.begin_job(job)
        if held is None:
            return
        if held.owner.alive():
            raise StateError(busy_sentence(held))
        yield held
    raise StateError(f"{job.what} {job.name!r} is busy; try again.")


class JobLock:
    """Hold one object's job for one operation (see the module docstring)."""

    def __init__(self, db: Database, obj: str, kind: str, *, source: str | None = None,
                 peer: str | None = None, owner: JobOwner | None = None,
                 tries: int = 3) -> None:
        self.db = db
        self.obj = obj
        self.owner = owner or JobOwner.me()
        self.job = Job(obj, kind, "begin", self.owner, source=source, peer=peer)
        self.tries = tries

    # -- taking and ending it ------------------------------------------------------------
    def take(self, recover: Recover) -> JobLock:
        for dead in _attempts(self.db, self.job, self.tries):
            recover(dead)
        return self

    async def take_async(self, recover: AsyncRecover) -> JobLock:
        for dead in _attempts(self.db, self.job, self.tries):
            await recover(dead)
        return self

    def end(self) -> None:
        self.db.end_job(self.obj, self.owner)

    def __enter__(self) -> JobLock:
        return self

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.end()

    async def __aenter__(self) -> JobLock:
        return self

    async def __aexit__(self, kind: type[BaseException] | None, exc: BaseException | None,
                        tb: TracebackType | None) -> None:
        self.end()

    # -- while held ----------------------------------------------------------------------
    def phase(self, phase: str, **detail: object) -> Job:
        """Record the next step (merging ``detail``) before it is taken."""
        return self.db.set_phase(self.obj, self.owner, phase, **detail)

    def try_phase(self, phase: str, **detail: object) -> None:
        """:meth:`phase`, for a step that goes on even if the job was taken over."""
        with contextlib.suppress(StateError):
            self.phase(phase, **detail)


def ensure_recovered(db: Database, obj: str, recover: Recover) -> None:
    """Before an operation touches ``obj``: recover a job whose owner died."""
    held = db.find_job(obj)
    if held is not None and not held.owner.alive():
        recover(held)


def wait_until(db: Database, obj: str, wait: float,
               done: Callable[[Job | None], bool]) -> None:
    """Wait (up to ``wait`` s) until ``done(obj's job or None)``: another process is
    recovering it."""
    deadline = time.monotonic() + wait
    while time.monotonic() < deadline:
        if done(db.find_job(obj)):
            return
        time.sleep(0.05)
