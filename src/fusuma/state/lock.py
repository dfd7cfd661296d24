"""One host-wide lock for changes: two `fusuma` commands never interleave their
check-then-change steps (say, two `partition create` claiming the same core, or two
`partition restart` each starting a supervisor).

It is an flock on ``FUSUMA_HOME/lock``, re-entrant within a thread (``up`` creates
partitions, which lock too), and held only while definitions change: reads (`ps`,
`vm exec`, `top`) never wait for it. Each thread opens the file itself, so two threads
of one process (the API daemon's operations) exclude each other as two processes do:
flock belongs to the open file, not to the process.
"""

from __future__ import annotations

import fcntl
import functools
import os
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Protocol, TypeVar


class _Held(threading.local):
    def __init__(self) -> None:
        self.locks: dict[Path, tuple[int, int]] = {}   # lock path -> (fd, depth)


_local = _Held()

F = TypeVar("F", bound=Callable[..., Any])


@contextmanager
def host_lock(home: Path) -> Iterator[None]:
    path = (home / "lock").resolve()
    _held = _local.locks
    if path in _held:
        fd, depth = _held[path]
        _held[path] = (fd, depth + 1)
        try:
            yield
        finally:
            fd, depth = _held[path]
            _held[path] = (fd, depth - 1)
        return
    home.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        _held[path] = (fd, 1)
        yield
    finally:
        _held.pop(path, None)
        os.close(fd)   # closing the last descriptor releases the flock


class _HasHome(Protocol):
    @property
    def paths(self) -> Any: ...


def locked(method: F) -> F:
    """Run a manager method under the host lock of its ``self.paths.home``."""

    @functools.wraps(method)
    def wrapper(self: _HasHome, *args: Any, **kwargs: Any) -> Any:
        with host_lock(self.paths.home):
            return method(self, *args, **kwargs)

    return wrapper  # type: ignore[return-value]
