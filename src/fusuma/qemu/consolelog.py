"""A VM's serial console log, written by its supervisor, capped and rotated.

A guest writes to its serial port as fast and as long as it likes, and the log lands
in the filesystem that holds ``state.db``. So QEMU does not write the log file: its
console chardev's ``logfile`` is the write end of a FIFO (:func:`open_pipe`, passed
as a descriptor), and the supervisor reads the other end (:class:`ConsolePump`) and
appends to ``console.log`` through :class:`CappedLog`: a write that would take the file
past the cap turns it into ``console.log.1`` (replacing the older one) and starts a new
``console.log``. Whatever the guest writes, a VM's console takes at most twice the cap
on disk (``FUSUMA_CONSOLE_LOG_MAX``, default 16 MiB: fusuma.paths).

Rotating a file that QEMU itself writes would not hold the bound: its descriptor
follows a renamed file, truncation races with its writes, and nothing at all would
watch it while the supervisor is down. Here, while no supervisor reads (it is being
restarted), QEMU's writes fail with EPIPE, which QEMU ignores: that output is lost
rather than kept without bound, and the next supervisor reopens the FIFO when it
adopts the QEMU (:func:`open_reader`). The pipe holds 1 MiB, so a busy supervisor
does not slow a chatty guest down; QEMU writes the log synchronously, so a reader that
stopped altogether without closing would (only) hold up that guest's serial port.

One FIFO per QEMU process, in its run dir (``console.fifo``): a move's two QEMUs each
have their own, read by their own supervisors into the same log (each write checks
that the file is still the one at the path, so a rotation by the other side is
followed). The FIFO is root's, mode 0600, and is reopened only if it still is root's
FIFO: the run dir belongs to the VM's uid, which could put something else there.
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import logging
import os
import stat
from pathlib import Path

from fusuma.frozen import frozen
from fusuma.paths import CONSOLE_LOG_MAX

LOG = logging.getLogger(__name__)

FIFO_NAME = "console.fifo"
LOG_NAME = "console.log"
ROTATED_SUFFIX = ".1"
PIPE_BYTES = 2**20
CHUNK = 65536
# Most one wake-up of the event loop copies, so a flood does not starve the rest.
PER_WAKE = 2**20
# After a wake that copied something, the next read is this much later (below).
PAUSE_S = 0.02


def rotated(path: Path) -> Path:
    return path.with_name(path.name + ROTATED_SUFFIX)


@frozen
class ConsoleLog:
    """Where a VM's console log goes and how large one file of it may grow."""

    path: Path
    cap: int = CONSOLE_LOG_MAX


class CappedLog:
    """An append-only file of at most ``cap`` bytes, rotated once (``path.1``)."""

    def __init__(self, spec: ConsoleLog) -> None:
        self.path = spec.path
        self.cap = spec.cap
        self._fd: int | None = None

    def _open(self) -> int:
        if self._fd is None:
            self._fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT
                               | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        return self._fd

    def _current(self) -> int:
        """The descriptor of the file now at ``path`` (another writer may have rotated
        it away since the last write)."""
        fd = self._open()
        try:
            here = os.lstat(self.path)
        except FileNotFoundError:
            here = None
        st = os.fstat(fd)
        if here is None or (here.st_dev, here.st_ino) != (st.st_dev, st.st_ino):
            self.close()
            fd = self._open()
        return fd

    def write(self, data: bytes) -> None:
        if len(data) > self.cap:
            data = data[-self.cap:]        # more than a whole file: its end
        fd = self._current()
        if os.fstat(fd).st_size + len(data) > self.cap:
            with contextlib.suppress(FileNotFoundError):
                os.replace(self.path, rotated(self.path))
            self.close()
            fd = self._open()
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view):]

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None


def open_reader(fifo: Path) -> int | None:
    """The read end of a QEMU's console FIFO, non-blocking; None unless ``fifo`` is a
    FIFO of this process's user (never following a link)."""
    try:
        fd = os.open(fifo, os.O_RDONLY | os.O_NONBLOCK | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError:
        return None
    st = os.fstat(fd)
    if not stat.S_ISFIFO(st.st_mode) or st.st_uid != os.geteuid():
        os.close(fd)
        return None
    return fd


def open_pipe(fifo: Path) -> tuple[int, int]:
    """Make the FIFO ``fifo`` (0600; an old file of that name is replaced) and open
    both ends: (the supervisor's read end, non-blocking; QEMU's write end). OSError
    if it cannot be made."""
    with contextlib.suppress(FileNotFoundError):
        os.unlink(fifo)
    os.mkfifo(fifo, 0o600)
    reader = open_reader(fifo)
    if reader is None:
        raise OSError(f"{fifo} is not the FIFO just made")
    try:
        # A reader is there: opening the write end does not block.
        writer = os.open(fifo, os.O_WRONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except BaseException:
        os.close(reader)
        raise
    with contextlib.suppress(OSError):
        fcntl.fcntl(writer, fcntl.F_SETPIPE_SZ, PIPE_BYTES)
    return reader, writer


class ConsolePump:
    """Copies one QEMU's console FIFO into its capped log, from the event loop, until
    QEMU closes it (it exited) or :meth:`close`."""

    def __init__(self, fd: int, spec: ConsoleLog, log: logging.Logger | None = None) -> None:
        self._fd: int | None = fd
        self.log = CappedLog(spec)
        self.logger = log or LOG
        self._loop: asyncio.AbstractEventLoop | None = None
        self._failed = False

    @classmethod
    def reopen(cls, fifo: Path, spec: ConsoleLog,
               log: logging.Logger | None = None) -> ConsolePump | None:
        """A pump for a QEMU started by an earlier supervisor (None if its FIFO is
        not there, or not ours: a QEMU from before fusuma capped logs)."""
        fd = open_reader(fifo)
        return None if fd is None else cls(fd, spec, log)

    def start(self) -> None:
        if self._fd is None or self._loop is not None:
            return
        self._loop = asyncio.get_running_loop()
        self._loop.add_reader(self._fd, self._drain, PER_WAKE)

    def _drain(self, limit: int) -> None:
        got = self._copy(limit)
        if got and self._fd is not None and self._loop is not None:
            # Read again in PAUSE_S, not at the guest's next write: the supervisor's
            # cgroup weight is above its VMs' (the control path), so waking per write
            # of a flooding guest would take its core from the guests (the pipe holds
            # PIPE_BYTES meanwhile, far more than a console writes in PAUSE_S).
            self._loop.remove_reader(self._fd)
            self._loop.call_later(PAUSE_S, self._resume)

    def _resume(self) -> None:
        if self._fd is not None and self._loop is not None:
            self._loop.add_reader(self._fd, self._drain, PER_WAKE)

    def _copy(self, limit: int) -> int:
        got = 0
        while self._fd is not None and got < limit:
            try:
                data = os.read(self._fd, CHUNK)
            except BlockingIOError:
                return got
            except OSError as exc:
                self.logger.warning("console of this VM unreadable: %s", exc)
                self._end()
                return got
            if not data:           # every writer has gone: QEMU exited
                self._end()
                return got
            got += len(data)
            try:
                self.log.write(data)
            except OSError as exc:
                # A full disk: the guest's output is dropped (and said once), so that
                # QEMU is never held up by a log that cannot be written.
                if not self._failed:
                    self.logger.warning("cannot write console log %s: %s; console "
                                        "output is dropped", self.log.path, exc.strerror)
                self._failed = True
        return got

    def _end(self) -> None:
        fd, self._fd = self._fd, None
        if fd is None:
            return
        if self._loop is not None:
            self._loop.remove_reader(fd)
        os.close(fd)
        self.log.close()

    def close(self) -> None:
        """Copy what the pipe still holds, then stop."""
        self._copy(2 * PIPE_BYTES)
        self._end()

    @property
    def open(self) -> bool:
        return self._fd is not None
