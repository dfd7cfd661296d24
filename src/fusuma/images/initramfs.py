"""An in-memory initramfs tree written as a ``newc`` cpio archive.

Written in Python rather than with ``cpio`` so the archive can hold device nodes and
root-owned files without privileges, and is byte-for-byte reproducible (mtime 0,
sorted entries).
"""

from __future__ import annotations

import stat
from dataclasses import dataclass
from pathlib import PurePosixPath
from typing import Protocol


class Writable(Protocol):
    """Anything with a binary ``write`` (a file, a GzipFile, a BytesIO)."""

    def write(self, data: bytes, /) -> object: ...


@dataclass(frozen=True)
class Entry:
    """One archive member: a directory, file, symlink or character device."""

    mode: int                   # full st_mode including the file type bits
    data: bytes = b""           # file contents, or the symlink target
    rdev: tuple[int, int] = (0, 0)


class Tree:
    """Paths inside the guest (absolute, '/'-separated) mapped to entries."""

    def __init__(self) -> None:
        self.entries: dict[str, Entry] = {}

    def _parents(self, path: str) -> None:
        for parent in reversed(PurePosixPath(path).parents):
            if str(parent) != "/" and str(parent) not in self.entries:
                self.entries[str(parent)] = Entry(stat.S_IFDIR | 0o755)

    def mkdir(self, path: str, mode: int = 0o755) -> None:
        self._parents(path)
        self.entries[path] = Entry(stat.S_IFDIR | mode)

    def file(self, path: str, data: bytes, mode: int = 0o644) -> None:
        self._parents(path)
        self.entries[path] = Entry(stat.S_IFREG | mode, data)

    def symlink(self, path: str, target: str) -> None:
        self._parents(path)
        self.entries[path] = Entry(stat.S_IFLNK | 0o777, target.encode())

    def chardev(self, path: str, major: int, minor: int, mode: int = 0o600) -> None:
        self._parents(path)
        self.entries[path] = Entry(stat.S_IFCHR | mode, rdev=(major, minor))

    def __contains__(self, path: str) -> bool:
        return path in self.entries

    def write_cpio(self, out: Writable) -> None:
        """Write the tree as newc cpio; parents sort before their children."""
        for ino, path in enumerate(sorted(self.entries), start=1):
            entry = self.entries[path]
            _member(out, path.lstrip("/"), entry, ino)
        _member(out, "TRAILER!!!", Entry(0), 0)

    def size(self) -> int:
        return sum(len(e.data) for e in self.entries.values())


def _pad(out: Writable, length: int) -> None:
    out.write(b"\0" * (-length % 4))


def _member(out: Writable, name: str, entry: Entry, ino: int) -> None:
    raw_name = name.encode() + b"\0"
    nlink = 2 if stat.S_ISDIR(entry.mode) else 1
    fields = (ino, entry.mode, 0, 0, nlink, 0, len(entry.data), 0, 0,
              entry.rdev[0], entry.rdev[1], len(raw_name), 0)
    header = b"070701" + b"".join(b"%08x" % f for f in fields)
    out.write(header + raw_name)
    _pad(out, len(header) + len(raw_name))
    out.write(entry.data)
    _pad(out, len(entry.data))
