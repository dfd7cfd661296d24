"""Background operations of the API: long work answers ``202`` with one of these.

Like Incus' operations: each has an id, a class (``task``), a status (Pending, Running,
Success, Failure, Cancelled) with Incus' status codes, the resources it touches, and
when done its result (what the CLI prints with ``--json``) or its error (the CLI's one
sentence, with the HTTP code the same error gets on a synchronous call).

The work runs in a thread pool: the same functions the CLI calls, under the same host
lock, jobs and state file, so the CLI and the API can be mixed. Operations live in the
daemon's memory (the last ``KEEP`` finished ones are kept); what they did is in the
state file and in the event log, which outlive the daemon.

Waiting (``GET /1.0/operations/ID/wait``) holds no thread: a waiter is an asyncio
future that the thread ending the operation completes (:meth:`Operations.wait`), so
any number of waiters cost the daemon only their connections.

Cancelling: a Pending operation is dropped before it starts; a running one only where
its work has a safe point to stop at (a move, before its stream starts: the VM stays
where it was). Elsewhere ``DELETE`` answers 409 with the reason.

A ``private`` operation (``exec``: its result is the guest's output, its error may quote
the command) is told to the event log, which ``/1.0/events?since=0`` replays to every
viewer, and to the daemon's log without them: that it ran, how it ended, its exit code
and the sizes of its output (:meth:`Operation.as_event`). Its full result stays with the
operation, for whoever started it.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
import threading
import time
import traceback
import uuid
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

from fusuma.errors import (
    ConflictError,
    FusumaError,
    HostError,
    ImageError,
    NotFoundError,
    ResourceError,
    SpecError,
    StateError,
    SupervisorError,
)

LOG = logging.getLogger(__name__)

# Incus' status codes.
PENDING, RUNNING, SUCCESS, FAILURE, CANCELLED = 105, 103, 200, 400, 401
STATUS = {PENDING: "Pending", RUNNING: "Running", SUCCESS: "Success", FAILURE: "Failure",
          CANCELLED: "Cancelled"}


class CancelledError(FusumaError):
    """The operation was cancelled at a safe point (raised inside its work)."""

    exit_code = 130


def http_code(exc: BaseException) -> int:
    """The HTTP status a FusumaError gets: the same on a synchronous call and in a
    failed operation's ``error_code``."""
    if isinstance(exc, SpecError):
        return 400
    if isinstance(exc, NotFoundError):
        return 404
    if isinstance(exc, ConflictError | StateError | ResourceError):
        return 409
    if isinstance(exc, SupervisorError):
        return 503
    if isinstance(exc, ImageError | HostError):
        return 500
    if isinstance(exc, CancelledError):
        return 499
    return 500


def _iso(ts: float) -> str:
    return datetime.fromtimestamp(ts, UTC).isoformat(timespec="milliseconds").replace(
        "+00:00", "Z")


@dataclass
class Operation:
    id: str
    description: str
    kind: str
    resources: dict[str, list[str]]
    created_at: float = field(default_factory=time.time)
    updated_at: float = field(default_factory=time.time)
    status_code: int = PENDING
    result: Any = None
    err: str = ""
    error_code: int | None = None
    progress: str = ""
    cancellable: bool = False          # the work can stop at a safe point
    private: bool = False              # result and error are the guest's: sizes only
    cancel_requested: bool = False
    done: threading.Event = field(default_factory=threading.Event)
    future: Future[None] | None = None
    # Called once, from the thread that ends the operation (Operations.watch).
    watchers: list[Callable[[], None]] = field(default_factory=list, repr=False)

    @property
    def status(self) -> str:
        return STATUS[self.status_code]

    @property
    def may_cancel(self) -> bool:
        return self.status_code == PENDING or (self.status_code == RUNNING
                                               and self.cancellable)

    def as_json(self) -> dict[str, Any]:
        return {"id": self.id, "class": "task", "description": self.description,
                "kind": self.kind, "created_at": _iso(self.created_at),
                "updated_at": _iso(self.updated_at), "status": self.status,
                "status_code": self.status_code, "resources": self.resources,
                "metadata": {"progress": self.progress} if self.progress else {},
                "result": self.result, "may_cancel": self.may_cancel, "err": self.err,
                "error_code": self.error_code}

    def as_event(self) -> dict[str, Any]:
        """What the event log may hold: :meth:`as_json`, but for a private operation
        its result as sizes and no error text (its error code stays)."""
        out = self.as_json()
        if self.private:
            out["result"] = sizes_only(self.result)
            if self.err:
                out["err"] = "withheld from the event log (it may quote the guest); " \
                             "the operation holds it"
        return out

    def check_cancel(self) -> None:
        """Called by the work at its safe points."""
        if self.cancel_requested:
            raise CancelledError(f"operation {self.id} was cancelled")


def sizes_only(value: Any) -> Any:
    """A JSON result with each string replaced by its size (``stdout`` ->
    ``stdout_bytes``): numbers, booleans and null stay."""
    if isinstance(value, dict):
        out: dict[str, Any] = {}
        for k, v in value.items():
            if isinstance(v, str):
                out[f"{k}_bytes"] = len(v.encode())
            elif isinstance(v, dict | list):
                out[f"{k}_items"] = len(v)
            else:
                out[k] = v
        return out
    if isinstance(value, str):
        return {"bytes": len(value.encode())}
    if isinstance(value, list):
        return {"items": len(value)}
    return value


# The work of an operation: gets the operation (for progress and cancel points) and
# returns the JSON result.
Work = Callable[[Operation], Any]


class Operations:
    """The daemon's operations; ``notify`` is called on every change (the event log)."""

    KEEP = 1000

    def __init__(self, notify: Callable[[Operation, str], None], workers: int = 16) -> None:
        self._ops: collections.OrderedDict[str, Operation] = collections.OrderedDict()
        self._lock = threading.Lock()
        self._pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="op")
        self._notify = notify

    def submit(self, kind: str, description: str, resources: dict[str, list[str]],
               work: Work, *, cancellable: bool = False, private: bool = False) -> Operation:
        op = Operation(id=str(uuid.uuid4()), description=description, kind=kind,
                       resources=resources, cancellable=cancellable, private=private)
        with self._lock:
            self._ops[op.id] = op
            self._trim()
        self._emit(op, "operation-created")
        op.future = self._pool.submit(self._run, op, work)
        return op

    def _run(self, op: Operation, work: Work) -> None:
        if op.status_code == CANCELLED:
            return
        self._set(op, RUNNING)
        try:
            result = work(op)
        except FusumaError as exc:
            if op.cancel_requested:
                self._set(op, CANCELLED, err=str(exc), error_code=499)
            else:
                self._set(op, FAILURE, err=str(exc), error_code=http_code(exc))
        except Exception as exc:  # a bug: say it in the operation, keep the daemon up
            # A private operation's exception may quote the guest: its frames only.
            LOG.error("operation %s (%s) failed: %s", op.id, op.description,
                      f"{type(exc).__name__} at\n{''.join(traceback.format_tb(exc.__traceback__))}"
                      if op.private else traceback.format_exc())
            self._set(op, FAILURE, err=f"internal error: {exc!r}", error_code=500)
        else:
            self._set(op, SUCCESS, result=result)

    def _set(self, op: Operation, code: int, **fields: Any) -> None:
        with self._lock:
            op.status_code = code
            for k, v in fields.items():
                setattr(op, k, v)
            op.updated_at = time.time()
        self._emit(op, "operation-updated")
        if code in (SUCCESS, FAILURE, CANCELLED):
            self._end(op)

    def _end(self, op: Operation) -> None:
        """Mark ``op`` done and call its watchers (each once)."""
        with self._lock:
            op.done.set()
            watchers, op.watchers = op.watchers, []
        for fn in watchers:
            try:
                fn()
            except Exception:  # a waiter's loop gone: the operation is not its waiter's
                LOG.exception("a watcher of operation %s failed", op.id)

    def watch(self, op: Operation, fn: Callable[[], None]) -> Callable[[], None]:
        """Call ``fn`` once ``op`` has ended (now, if it has; else from the thread
        that ends it). Returns a function that forgets ``fn``."""
        with self._lock:
            ended = op.done.is_set()
            if not ended:
                op.watchers.append(fn)
        if ended:
            fn()

        def forget() -> None:
            with self._lock, contextlib.suppress(ValueError):
                op.watchers.remove(fn)
        return forget

    async def wait(self, op: Operation, timeout: float) -> bool:
        """Whether ``op`` ended within ``timeout`` seconds. Holds no thread: the thread
        that ends the operation wakes this coroutine on its loop."""
        loop = asyncio.get_running_loop()
        ended = asyncio.Event()

        def wake() -> None:
            with contextlib.suppress(RuntimeError):      # the loop has closed
                loop.call_soon_threadsafe(ended.set)
        forget = self.watch(op, wake)
        try:
            await asyncio.wait_for(ended.wait(), timeout)
            return True
        except TimeoutError:
            return op.done.is_set()
        finally:
            forget()

    def set_progress(self, op: Operation, text: str) -> None:
        with self._lock:
            op.progress = text
            op.updated_at = time.time()
        self._emit(op, "operation-updated")

    def _emit(self, op: Operation, action: str) -> None:
        try:
            self._notify(op, action)
        except Exception as exc:  # the event log is best effort; the operation is not
            LOG.warning("cannot record event of operation %s: %s", op.id, exc)

    def _trim(self) -> None:
        done = [k for k, o in self._ops.items() if o.done.is_set()]
        for k in done[: max(0, len(done) - self.KEEP)]:
            del self._ops[k]

    def get(self, op_id: str) -> Operation:
        with self._lock:
            op = self._ops.get(op_id)
        if op is None:
            raise NotFoundError(f"no operation {op_id!r} (finished operations are kept "
                                f"for the last {self.KEEP}).")
        return op

    def all(self) -> list[Operation]:
        with self._lock:
            return list(self._ops.values())

    def cancel(self, op_id: str) -> Operation:
        op = self.get(op_id)
        with self._lock:
            if op.status_code == PENDING and op.future is not None and op.future.cancel():
                op.status_code = CANCELLED
                op.err = "cancelled before it started"
                op.error_code = 499
                op.updated_at = time.time()
                pending = True
            else:
                pending = False
        if pending:
            self._end(op)
            self._emit(op, "operation-updated")
            return op
        if op.done.is_set():
            raise StateError(f"operation {op_id} has already ended ({op.status}).")
        if not op.cancellable:
            raise StateError(f"operation {op_id} ({op.description}) cannot be cancelled "
                             "while it runs: it has no point at which stopping leaves "
                             "everything as it was; wait for it.")
        op.cancel_requested = True
        return op

    def shutdown(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
