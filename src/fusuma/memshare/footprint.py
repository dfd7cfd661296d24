"""Host memory a set of QEMU processes uses, each shared tmpfs file counted once.

Summing the processes' PSS splits a page among the processes that map it, so a shared
file's mapped pages count once among them; but a page of a tmpfs file is host memory
whether anyone maps it or not (a template's RAM that no clone touched, a RAM file's
pages a guest has not handed back). So::

    host = sum over the processes of (anonymous PSS + page-cache PSS
                                      + PSS of shared memory that is no tmpfs file)
         + sum over the tmpfs files, once each, of their allocated blocks

The tmpfs files are those the processes map (guest RAM files, a template's RAM: found in
smaps, told apart by device and inode) and every file below the given shm directories
(``st_blocks * 512``). Anonymous PSS comes from smaps_rollup: it covers the
copy-on-write copies a clone makes of a private file mapping and splits pages that KSM
merged among their users.

Disk files the VMs read (a segment, an image's read-only root disk) count by what the
processes map (page-cache PSS: a segment's DAX pages once among its users); the rest
of their page cache is readahead and pages read once by QEMU, which the kernel drops
first: ``cached`` reports it (resident pages, mincore) beside the total, not in it.

Errors: NotFoundError when a process ended meanwhile, HostError when a file cannot be
read (fusuma.errors).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from fusuma.errors import HostError
from fusuma.frozen import frozen
from fusuma.memshare.smaps import DELETED, Mapping, pss_split, read_smaps

TMPFS = "tmpfs"


@frozen
class FileMemory:
    """A file and what it holds in memory: a tmpfs file its allocated blocks, a disk
    file its resident page-cache pages."""

    path: str
    kib: int

    @property
    def mib(self) -> float:
        return round(self.kib / 1024, 1)

    def as_json(self) -> dict[str, Any]:
        return {"path": self.path, "mib": self.mib}


@frozen
class ProcessMemory:
    """One process: ``own_kib`` is what it costs beyond the tmpfs files; ``private_kib``
    its pages no other process maps (Private_Clean + Private_Dirty); ``exec_anon_kib``
    its executable anonymous memory (under TCG: QEMU's translation buffer)."""

    pid: int
    own_kib: int
    pss_kib: int
    private_kib: int
    exec_anon_kib: int


@frozen
class Footprint:
    processes: tuple[ProcessMemory, ...]
    files: tuple[FileMemory, ...]        # tmpfs: in the total, once each
    cached: tuple[FileMemory, ...] = ()  # disk files' page cache: beside the total

    @property
    def own_kib(self) -> int:
        return sum(p.own_kib for p in self.processes)

    @property
    def files_kib(self) -> int:
        return sum(f.kib for f in self.files)

    @property
    def total_kib(self) -> int:
        return self.own_kib + self.files_kib

    @property
    def total_mib(self) -> float:
        return round(self.total_kib / 1024, 1)

    def as_json(self) -> dict[str, Any]:
        return {"total_mib": self.total_mib, "processes_mib": round(self.own_kib / 1024, 1),
                "tmpfs_files": [f.as_json() for f in self.files],
                "page_cache": [f.as_json() for f in self.cached]}


def tmpfs_devices(mountinfo: Path = Path("/proc/self/mountinfo")) -> set[int]:
    """Device numbers of the tmpfs mounts (``st_dev`` of the files in them)."""
    devs: set[int] = set()
    try:
        text = mountinfo.read_text()
    except OSError as exc:
        raise HostError(f"cannot read {mountinfo}: {exc.strerror}.") from exc
    for line in text.splitlines():
        fields = line.split()
        if " - " not in line or len(fields) < 3:
            continue
        if line.split(" - ", 1)[1].split()[0] == TMPFS:
            major, _, minor = fields[2].partition(":")
            devs.add(os.makedev(int(major), int(minor)))
    return devs


_PROT_READ = 1
_MAP_SHARED = 1


def _libc() -> ctypes.CDLL:
    libc = ctypes.CDLL(ctypes.util.find_library("c") or None, use_errno=True)
    libc.mmap.restype = ctypes.c_void_p
    libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int,
                          ctypes.c_int, ctypes.c_long]
    libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
    libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t,
                             ctypes.POINTER(ctypes.c_ubyte)]
    return libc


def resident_bytes(path: Path) -> int:
    """Bytes of ``path`` in the host's page cache (mincore over a mapping that is never
    touched, so measuring reads nothing in)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    except OSError as exc:
        raise HostError(f"cannot open {path} to count its cached pages: "
                        f"{exc.strerror}.") from exc
    try:
        return resident_bytes_fd(fd, path)
    finally:
        os.close(fd)


# mincore sets the low bit of a page's byte when it is resident; the others are undefined.
_LOW_BIT = bytes(i & 1 for i in range(256))


def resident_bytes_fd(fd: int, what: Path | str) -> int:
    """Bytes of the file open as ``fd`` (named ``what`` in errors) in the host's page
    cache: mincore over a read-only shared mapping that is never touched."""
    page = os.sysconf("SC_PAGE_SIZE")
    size = os.fstat(fd).st_size
    if size == 0:
        return 0
    libc = _libc()
    addr = libc.mmap(None, size, _PROT_READ, _MAP_SHARED, fd, 0)
    if addr is None or addr == ctypes.c_void_p(-1).value:
        raise HostError(f"cannot map {what}: {os.strerror(ctypes.get_errno())}.")
    try:
        vec = (ctypes.c_ubyte * ((size + page - 1) // page))()
        if libc.mincore(addr, size, vec) != 0:
            raise HostError(f"mincore on {what} failed: "
                            f"{os.strerror(ctypes.get_errno())}.")
        return bytes(vec).translate(_LOW_BIT).count(1) * page
    finally:
        libc.munmap(addr, size)


def drop_cache(path: Path) -> None:
    """Ask the kernel to drop ``path``'s clean page-cache pages that nothing maps, so
    that what is resident afterwards is what readers brought in since."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    except OSError:
        return
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


class _TmpfsFiles:
    """The tmpfs files seen so far, by (device, inode)."""

    def __init__(self, tmpfs: set[int]) -> None:
        self.tmpfs = tmpfs
        self.found: dict[tuple[int, int], str] = {}
        self._stat: dict[str, os.stat_result | None] = {}

    def _st(self, path: str) -> os.stat_result | None:
        if path not in self._stat:
            try:
                self._stat[path] = os.stat(path)
            except OSError:
                self._stat[path] = None
        return self._stat[path]

    def add(self, path: str) -> bool:
        """Count ``path`` if it is a tmpfs file; whether it is one."""
        st = self._st(path)
        if st is None or st.st_dev not in self.tmpfs:
            return False
        self.found.setdefault((st.st_dev, st.st_ino), path)
        return True

    def maps(self, m: Mapping) -> bool:
        """Whether ``m`` maps a tmpfs file (which then counts). An unlinked file cannot
        be found by its path: its pages stay in the process's PSS."""
        return m.path.startswith("/") and m.path == m.file_path and self.add(m.path)

    def counted(self) -> tuple[FileMemory, ...]:
        out = []
        for path in self.found.values():
            st = self._st(path)
            out.append(FileMemory(path, 0 if st is None else st.st_blocks * 512 // 1024))
        return tuple(sorted(out, key=lambda f: f.path))


def _other_shmem(m: Mapping) -> bool:
    """Shared memory that is no countable tmpfs file: memfd and SysV segments, shared
    anonymous memory ("/dev/zero (deleted)", "[anon_shmem:...]"), an unlinked file."""
    p = m.file_path
    return (p.startswith(("/memfd:", "/SYSV", "[anon_shmem"))
            or (m.shared and p in ("/dev/zero", ""))
            or (m.path.endswith(DELETED) and p.startswith("/dev/shm/")))


def process_memory(pid: int, files: _TmpfsFiles,
                   procfs: Path = Path("/proc")) -> ProcessMemory:
    """One process's part of the footprint; tmpfs files it maps join ``files``."""
    maps = read_smaps(pid, procfs)
    split = pss_split(pid, maps, procfs)
    other_shmem = private = exec_anon = 0
    for m in maps:
        private += m.kib.get("Private_Clean", 0) + m.kib.get("Private_Dirty", 0)
        if not m.path and m.perms[2] == "x" and not m.shared:
            exec_anon += m.pss_kib
        # A tmpfs file's pages are shmem, left out of `own` (copies a private mapping
        # made are anonymous and stay in split.anon_kib); other shmem is the process's.
        if not files.maps(m) and _other_shmem(m):
            other_shmem += max(0, m.pss_kib - m.kib.get("Anonymous", 0))
    own = split.anon_kib + split.file_kib + other_shmem
    return ProcessMemory(pid=pid, own_kib=own, pss_kib=split.pss_kib, private_kib=private,
                         exec_anon_kib=exec_anon)


def measure(pids: Iterable[int], shm_dirs: Iterable[Path] = (),
            disk_files: Iterable[Path] = (), procfs: Path = Path("/proc"),
            tmpfs: set[int] | None = None) -> Footprint:
    """The footprint of ``pids`` with every tmpfs file they map or that lies below
    ``shm_dirs`` counted once; ``disk_files``' page cache is reported beside it."""
    files = _TmpfsFiles(tmpfs_devices() if tmpfs is None else tmpfs)
    for d in shm_dirs:
        try:
            entries = sorted(d.rglob("*"))
        except OSError:
            continue
        for p in entries:
            if p.is_file() and not p.is_symlink():
                files.add(str(p))
    procs = tuple(process_memory(pid, files, procfs) for pid in pids)
    cached = tuple(FileMemory(str(f), resident_bytes(f) // 1024) for f in
                   dict.fromkeys(disk_files) if f.exists())
    return Footprint(processes=procs, files=files.counted(), cached=cached)
