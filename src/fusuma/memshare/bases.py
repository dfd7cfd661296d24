"""The page cache that VMs on one imported image share: DCSS's idea at the disk level.

A VM made from an imported image boots from a qcow2 overlay of its own on the image's
one read-only file (the base, fusuma.images.store). QEMU reads the base through the
host's page cache (its default cache mode; no O_DIRECT), so a block of the base that
any of its VMs read is in the host's memory once, whoever reads it next.

For each base in use this module reports:

- ``file_bytes``: the base file's size on the host;
- ``resident_bytes``: how much of it is in the page cache now, from the kernel:
  ``mincore`` over a read-only mapping of the file that is never touched, as
  ``fincore`` does, so measuring reads nothing in;
- ``vms``: the running VMs using it, each counted only when its QEMU process holds the
  base's inode open (``/proc/PID/fd``: the kernel's view, not the record's);
- ``saved_bytes`` = (n - 1) x ``resident_bytes`` for n such VMs (0 when n <= 1).

What the saving means, exactly: with a full copy of the image per VM instead of one
shared base, each copy is a different file with page-cache pages of its own. If each of
the n VMs had read from its copy what has been read from the shared base, the host
would hold n x ``resident_bytes`` where it holds ``resident_bytes`` now. That is exact
when the VMs read the same blocks (guests booting the same OS read mostly the same
blocks) and an upper bound when they read different parts of the image, since the
kernel cannot say which VM read which page (QEMU reads the file, it does not map it).
Page-cache pages are reclaimable: the kernel drops them under memory pressure, so the
saving is of memory that would otherwise be taken from other uses, not of a guarantee.

The base's path comes from fusuma's own record, and the file is checked to be the one
imported (root's, read-only, its size) before it is opened, without following a link;
nothing a guest or a QEMU says is used.
"""

from __future__ import annotations

import os
import stat
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

from fusuma.errors import HostError
from fusuma.frozen import frozen
from fusuma.images.store import verify
from fusuma.memshare.footprint import resident_bytes_fd
from fusuma.state.records import ImageRecord


@frozen
class BaseUser:
    """A running VM whose thin disk is an overlay of imported image ``image``."""

    vm: str
    pid: int
    image: str


@frozen
class BaseUse:
    """One base in use: its size, its cached pages and the VMs that share them.
    ``error`` says why its pages could not be counted (the file is not the one
    imported, or unreadable); ``resident_bytes`` is then None."""

    image: str
    path: str
    file_bytes: int
    virtual_size_bytes: int
    resident_bytes: int | None
    vms: tuple[str, ...]
    error: str | None = None

    @property
    def saved_bytes(self) -> int:
        """(n - 1) x resident bytes for n VMs sharing it (see the module's docstring)."""
        if self.resident_bytes is None:
            return 0
        return max(0, len(self.vms) - 1) * self.resident_bytes

    def as_json(self) -> dict[str, Any]:
        return {"path": self.path, "file_bytes": self.file_bytes,
                "virtual_size_bytes": self.virtual_size_bytes,
                "resident_bytes": self.resident_bytes,
                "resident_mib": None if self.resident_bytes is None
                else round(self.resident_bytes / 2**20, 1),
                "vms": len(self.vms), "vm_names": list(self.vms),
                "saved_bytes": self.saved_bytes,
                "saved_mib": round(self.saved_bytes / 2**20, 1), "error": self.error}


def holds_file(pid: int, st: os.stat_result, procfs: Path = Path("/proc")) -> bool:
    """Whether process ``pid`` has the file ``st`` (device and inode) open."""
    fds = procfs / str(pid) / "fd"
    try:
        names = os.listdir(fds)
    except OSError:        # gone, or not ours to read
        return False
    for name in names:
        try:
            got = os.stat(fds / name)
        except OSError:    # closed meanwhile
            continue
        if (got.st_dev, got.st_ino) == (st.st_dev, st.st_ino):
            return True
    return False


def _open_base(rec: ImageRecord) -> int:
    """The base file of ``rec`` open read-only, checked to be the file imported."""
    why = verify(rec)
    if why is not None:
        raise HostError(why)
    try:
        fd = os.open(rec.path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NOCTTY)
    except OSError as exc:
        raise HostError(f"cannot open {rec.path}: {exc.strerror}") from exc
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode) or st.st_size != rec.file_size:
        os.close(fd)
        raise HostError(f"{rec.path} is not the file imported")
    return fd


def base_use(rec: ImageRecord, users: Iterable[BaseUser],
             procfs: Path = Path("/proc")) -> BaseUse:
    """The page-cache sharing of base ``rec`` among ``users`` (those recorded on it;
    only those whose QEMU holds the file count)."""
    users = list(users)

    def holding(st: os.stat_result | None) -> tuple[str, ...]:
        if st is None:
            return ()
        return tuple(sorted(u.vm for u in users if holds_file(u.pid, st, procfs)))

    try:
        fd = _open_base(rec)
    except HostError as exc:
        # Its pages are not counted; the VMs holding whatever is at its path still are.
        try:
            st: os.stat_result | None = os.stat(rec.path, follow_symlinks=False)
        except OSError:
            st = None
        return BaseUse(rec.name, rec.path, rec.file_size, rec.virtual_size, None,
                       holding(st), str(exc))
    try:
        st = os.fstat(fd)
        vms = holding(st)
        resident = resident_bytes_fd(fd, rec.path)
    except HostError as exc:
        return BaseUse(rec.name, rec.path, rec.file_size, rec.virtual_size, None,
                       holding(st), str(exc))
    finally:
        os.close(fd)
    return BaseUse(rec.name, rec.path, st.st_size, rec.virtual_size, resident, vms)


def bases_in_use(images: Sequence[ImageRecord], users: Sequence[BaseUser],
                 procfs: Path = Path("/proc")) -> list[BaseUse]:
    """Each imported image that a running VM is recorded on, by name."""
    by_image: dict[str, list[BaseUser]] = {}
    for u in users:
        by_image.setdefault(u.image, []).append(u)
    return [base_use(rec, by_image[rec.name], procfs)
            for rec in sorted(images, key=lambda r: r.name) if rec.name in by_image]


def bases_json(uses: Sequence[BaseUse]) -> dict[str, dict[str, Any]]:
    return {u.image: u.as_json() for u in uses}


def bases_saved_bytes(uses: Sequence[BaseUse]) -> int:
    return sum(u.saved_bytes for u in uses)
