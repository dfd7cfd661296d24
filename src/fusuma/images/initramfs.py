"""An in-memory initramfs tree written as a ``newc`` cpio archive.

Written in Python rather than with ``cpio`` so the archive can hold device nodes and
root-owned files without privileges, and is byte-for-byte reproducible (mtime 0,
sorted entries).
"""

from __future__ import annotations

import os
import stat
from collections.abc import Callable
from pathlib import Path, PurePosixPath
from typing import Protocol

from fusuma.frozen import frozen


class Writable(Protocol):
    """Anything with a binary ``write`` (a file, a GzipFile, a BytesIO)."""

    def write(self, data: bytes, /) -> object: ...


@frozen
class Entry:
    """One archive member: a directory, file, symlink or character device."""

    mode: int                   # full st_mode including the file type bits
    data: bytes = b""           # file contents, or the symlink target
    rdev: tuple[int, int] = (0, 0)
    uid: int = 0
    gid: int = 0


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

    def add_host_tree(self, src: Path, dest: str = "/",
                      skip: Callable[[str], bool] = lambda _: False) -> None:
        """Copy the directory ``src`` into the tree under ``dest``, keeping modes,
        owners and symlinks. Guest paths for which ``skip`` is true are left out (a
        skipped directory is not descended into). Device nodes, fifos and sockets are
        left out: the guest's devtmpfs provides devices."""
        base = PurePosixPath(dest)
        for dirpath, dirnames, filenames in os.walk(src):
            rel = PurePosixPath(os.path.relpath(dirpath, src))
            for name in sorted(dirnames + filenames):
                host = Path(dirpath) / name
                guest = str(base / rel / name)
                if skip(guest):
                    if name in dirnames:
                        dirnames.remove(name)
                    continue
                st = host.lstat()
                perm = stat.S_IMODE(st.st_mode)
                uid, gid = st.st_uid, st.st_gid
                if stat.S_ISLNK(st.st_mode):
                    self._parents(guest)
                    self.entries[guest] = Entry(stat.S_IFLNK | 0o777,
                                                os.readlink(host).encode(), uid=uid, gid=gid)
                    if name in dirnames:
                        dirnames.remove(name)   # os.walk does not follow it anyway
                elif stat.S_ISDIR(st.st_mode):
                    self._parents(guest)
                    self.entries[guest] = Entry(stat.S_IFDIR | perm, uid=uid, gid=gid)
                elif stat.S_ISREG(st.st_mode):
                    self._parents(guest)
                    self.entries[guest] = Entry(stat.S_IFREG | perm, host.read_bytes(),
                                                uid=uid, gid=gid)

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
    fields = (ino, entry.mode, entry.uid, entry.gid, nlink, 0, len(entry.data), 0, 0,
              entry.rdev[0], entry.rdev[1], len(raw_name), 0)
    header = b"070701" + b"".join(b"%08x" % f for f in fields)
    out.write(header + raw_name)
    _pad(out, len(header) + len(raw_name))
    out.write(entry.data)
    _pad(out, len(entry.data))
