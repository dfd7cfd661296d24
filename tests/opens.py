"""Whether anyone opened a file: the kernel's inotify ``IN_OPEN`` on it, read through
libc (the standard library has no inotify). An ``O_PATH`` descriptor, which opens
nothing, raises no event; any open for reading or writing does."""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import os
import struct
from collections.abc import Iterator
from pathlib import Path

IN_OPEN = 0x20
IN_NONBLOCK = os.O_NONBLOCK
IN_CLOEXEC = os.O_CLOEXEC
_libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)


class Opens:
    def __init__(self, fd: int) -> None:
        self._fd = fd
        self._seen = 0

    def count(self) -> int:
        """Opens of the file so far."""
        with contextlib.suppress(BlockingIOError):
            while True:
                buf = os.read(self._fd, 4096)
                off = 0
                while off < len(buf):
                    _, mask, _, size = struct.unpack_from("iIII", buf, off)
                    if mask & IN_OPEN:
                        self._seen += 1
                    off += 16 + size
        return self._seen


@contextlib.contextmanager
def watch_opens(path: Path) -> Iterator[Opens]:
    """Count the opens of ``path`` (the file itself, not a symlink to it) in the block."""
    fd = _libc.inotify_init1(IN_NONBLOCK | IN_CLOEXEC)
    if fd < 0:
        raise OSError(ctypes.get_errno(), "inotify_init1")
    try:
        if _libc.inotify_add_watch(fd, str(path).encode(), IN_OPEN) < 0:
            raise OSError(ctypes.get_errno(), f"inotify_add_watch {path}")
        yield Opens(fd)
    finally:
        os.close(fd)
