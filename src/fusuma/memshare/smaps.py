"""A process's memory map from ``/proc/PID/smaps``, one record per mapping.

The DCSS paper judged how much of a process could be shared by summing its resident
pages per mapping mode (``r-xp``, ``r--p``, ``rw-p``, ...): whatever is resident in a
mapping that is not writable could come from one shared copy. ``analyze`` computes
that table; ``segment_usage`` says how much of each shared segment file a process has
resident (RSS) and what its fair part of it is (PSS).

Every size here is in KiB, as the kernel prints it.
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterable
from dataclasses import field
from pathlib import Path
from typing import Any

from fusuma.errors import HostError, NotFoundError
from fusuma.frozen import frozen

DELETED = " (deleted)"
# A template's RAM file (fusuma.memshare.templates): ``<shm>/<T>.template``.
TEMPLATE_SUFFIX = ".template"

# "start-end perms offset major:minor inode [path]"; the path may contain spaces.
_HEADER = re.compile(r"^([0-9a-f]+)-([0-9a-f]+)\s+([r-][w-][x-][sp])\s+([0-9a-f]+)\s+"
                     r"(\S+)\s+(\d+)\s*(.*)$")


@frozen
class Mapping:
    """One mapping; ``kib`` holds every ``Name: N kB`` line (Rss, Pss, Shared_Clean,
    Private_Dirty, Anonymous, KSM, Swap, ... and, in smaps_rollup, Pss_Anon/File/Shmem)."""

    start: int
    end: int
    perms: str
    offset: int
    path: str = ""        # a file, a pseudo-name like "[heap]", or "" (anonymous)
    kib: dict[str, int] = field(default_factory=dict)
    vm_flags: tuple[str, ...] = ()

    @property
    def rss_kib(self) -> int:
        return self.kib.get("Rss", 0)

    @property
    def pss_kib(self) -> int:
        return self.kib.get("Pss", 0)

    @property
    def writable(self) -> bool:
        return self.perms[1] == "w"

    @property
    def shared(self) -> bool:
        return self.perms[3] == "s"

    @property
    def file_path(self) -> str:
        """The path without the " (deleted)" the kernel appends to unlinked files."""
        return self.path.removesuffix(DELETED)


def parse_smaps(text: str) -> list[Mapping]:
    """Parse smaps (or smaps_rollup, which is one pseudo-mapping) text."""
    out: list[Mapping] = []
    head: re.Match[str] | None = None
    kib: dict[str, int] = {}
    flags: tuple[str, ...] = ()

    def close() -> None:
        if head is not None:
            out.append(Mapping(start=int(head[1], 16), end=int(head[2], 16), perms=head[3],
                               offset=int(head[4], 16), path=head[7], kib=kib,
                               vm_flags=flags))

    for line in text.splitlines():
        m = _HEADER.match(line)
        if m:
            close()
            head, kib, flags = m, {}, ()
            continue
        name, _, rest = line.partition(":")
        if name == "VmFlags":
            flags = tuple(rest.split())
            continue
        parts = rest.split()
        if len(parts) == 2 and parts[1] == "kB" and parts[0].isdigit():
            kib[name] = int(parts[0])
    close()
    return out


def by_mode(mappings: Iterable[Mapping]) -> dict[str, int]:
    """Resident KiB per mapping mode, largest first; modes with nothing resident (guard
    pages, "---p") are kept with 0 so that the table shows every mode the process has."""
    modes: dict[str, int] = {}
    for m in mappings:
        modes[m.perms] = modes.get(m.perms, 0) + m.rss_kib
    return dict(sorted(modes.items(), key=lambda kv: (-kv[1], kv[0])))


def shareable_fraction(modes: dict[str, int]) -> float:
    """Fraction of resident KiB in mappings that are not writable (0.0 if none)."""
    total = sum(modes.values())
    if total == 0:
        return 0.0
    return sum(kib for mode, kib in modes.items() if mode[1] != "w") / total


@frozen
class ModeAnalysis:
    """The paper's Table 4 for one process."""

    pid: int
    comm: str
    by_mode: dict[str, int]
    total_rss_kib: int
    shareable_fraction: float

    def as_json(self) -> dict[str, Any]:
        return {"pid": self.pid, "comm": self.comm, "by_mode": dict(self.by_mode),
                "total_rss_kib": self.total_rss_kib,
                "shareable_fraction": round(self.shareable_fraction, 4)}


def _read(path: Path, pid: int) -> str:
    try:
        return path.read_text()
    except (FileNotFoundError, ProcessLookupError) as exc:
        raise NotFoundError(f"no process with pid {pid}: {path} does not exist; check "
                            "the pid with `fusuma ps` or `ps`.") from exc
    except PermissionError as exc:
        raise HostError(f"cannot read {path}: permission denied; run fusuma as root or "
                        "as the owner of the process.") from exc
    except OSError as exc:
        raise HostError(f"cannot read {path}: {exc.strerror or exc}.") from exc


def read_smaps(pid: int, procfs: Path = Path("/proc")) -> list[Mapping]:
    """The mappings of ``pid``; NotFoundError if it does not exist."""
    return parse_smaps(_read(procfs / str(pid) / "smaps", pid))


def read_comm(pid: int, procfs: Path = Path("/proc")) -> str:
    return _read(procfs / str(pid) / "comm", pid).strip()


def analyze(pid: int, procfs: Path = Path("/proc")) -> ModeAnalysis:
    """Resident pages of ``pid`` by mapping mode and the fraction that could be shared."""
    comm = read_comm(pid, procfs)
    modes = by_mode(read_smaps(pid, procfs))
    return ModeAnalysis(pid=pid, comm=comm, by_mode=modes, total_rss_kib=sum(modes.values()),
                        shareable_fraction=shareable_fraction(modes))


@frozen
class SegmentUse:
    """What one process has of one segment file: pages resident in its mappings (RSS)
    and its fair part of them (PSS: each page divided by the number of mappers)."""

    name: str
    rss_kib: int
    pss_kib: int
    mappings: int

    def as_json(self) -> dict[str, Any]:
        return {"rss_mib": round(self.rss_kib / 1024, 1),
                "pss_mib": round(self.pss_kib / 1024, 1), "mappings": self.mappings}


def segment_usage(mappings: Iterable[Mapping],
                  segment_files: dict[str, Path]) -> dict[str, SegmentUse]:
    """RSS and PSS of each segment that the process maps, keyed by segment name.

    A mapping belongs to a segment when its path is the segment's file, as given or
    with symlinks resolved (the kernel prints the resolved path), also after the file
    was replaced (" (deleted)"). Segments that are not mapped are left out.
    """
    by_path: dict[str, str] = {}
    for name, file in segment_files.items():
        by_path[str(file)] = name
        by_path.setdefault(os.path.realpath(file), name)
    found: dict[str, list[Mapping]] = {}
    for m in mappings:
        seg = by_path.get(m.file_path)
        if seg is not None:
            found.setdefault(seg, []).append(m)
    return {name: SegmentUse(name=name, rss_kib=sum(m.rss_kib for m in ms),
                             pss_kib=sum(m.pss_kib for m in ms), mappings=len(ms))
            for name, ms in sorted(found.items())}


@frozen
class TemplateUse:
    """What a clone has of its template's RAM file: the template's pages it maps
    (RSS, and PSS: its fair part of pages all clones share), apart from the pages it
    has written, which are its own copies (anonymous pages of the same mapping)."""

    name: str
    rss_kib: int
    pss_kib: int
    copied_kib: int

    def as_json(self) -> dict[str, Any]:
        return {"name": self.name, "rss_mib": round(self.rss_kib / 1024, 1),
                "pss_mib": round(self.pss_kib / 1024, 1),
                "copied_mib": round(self.copied_kib / 1024, 1)}


def template_usage(mappings: Iterable[Mapping]) -> TemplateUse | None:
    """The template file a clone maps privately (None: the process is no clone).

    In a private file mapping the pages the process wrote are anonymous copies, its
    own (PSS = RSS unless KSM merged them); the rest of the mapping's PSS is the
    template file's pages, shared with the other clones."""
    found = [m for m in mappings if m.file_path.endswith(TEMPLATE_SUFFIX) and not m.shared]
    if not found:
        return None
    copied = sum(m.kib.get("Anonymous", 0) for m in found)
    rss = sum(m.rss_kib for m in found)
    pss = sum(m.pss_kib for m in found)
    return TemplateUse(name=Path(found[0].file_path).name.removesuffix(TEMPLATE_SUFFIX),
                       rss_kib=max(0, rss - copied), pss_kib=max(0, pss - copied),
                       copied_kib=copied)


@frozen
class PssSplit:
    """A process's PSS split by page kind, as smaps_rollup reports it.

    ``source`` is "smaps_rollup" when the kernel gave the split (Linux >= 5.8) and
    "smaps-estimate" when it was estimated from the per-mapping smaps (older kernels).
    """

    rss_kib: int
    pss_kib: int
    anon_kib: int
    file_kib: int
    shmem_kib: int
    source: str


def _is_shmem(m: Mapping) -> bool:
    # tmpfs/memfd/SysV files and shared anonymous memory (shown as "/dev/zero (deleted)"
    # or, when named, "[anon_shmem:...]") are shmem pages; other files are page cache.
    p = m.file_path
    return (p.startswith(("/dev/shm/", "/memfd:", "/SYSV", "[anon_shmem"))
            or (m.shared and p in ("/dev/zero", "")))


def estimate_pss_split(mappings: Iterable[Mapping]) -> PssSplit:
    """The split of PSS into anon/file/shmem from per-mapping smaps, for kernels whose
    smaps_rollup lacks Pss_Anon/Pss_File/Pss_Shmem.

    Anonymous pages of a mapping (private, or copies of a private file mapping) get the
    mapping's PSS in proportion of its ``Anonymous`` RSS; that is exact unless pages of
    one mapping are shared unevenly (KSM, fork).
    """
    rss = pss = anon = file = shmem = 0
    for m in mappings:
        rss += m.rss_kib
        pss += m.pss_kib
        if _is_shmem(m):
            shmem += m.pss_kib
            continue
        a = m.pss_kib * m.kib.get("Anonymous", 0) // m.rss_kib if m.rss_kib else 0
        anon += a
        file += m.pss_kib - a
    return PssSplit(rss_kib=rss, pss_kib=pss, anon_kib=anon, file_kib=file,
                    shmem_kib=shmem, source="smaps-estimate")


def pss_split(pid: int, mappings: list[Mapping] | None = None,
              procfs: Path = Path("/proc")) -> PssSplit:
    """The kernel's split from smaps_rollup, else an estimate from ``mappings`` (read
    from smaps when not given)."""
    path = procfs / str(pid) / "smaps_rollup"
    if path.exists() or not (procfs / str(pid)).exists():
        rollup = parse_smaps(_read(path, pid))
    else:
        rollup = []          # Linux < 4.14 has no smaps_rollup
    if rollup and all(k in rollup[0].kib for k in ("Pss_Anon", "Pss_File", "Pss_Shmem")):
        k = rollup[0].kib
        return PssSplit(rss_kib=k.get("Rss", 0), pss_kib=k.get("Pss", 0),
                        anon_kib=k["Pss_Anon"], file_kib=k["Pss_File"],
                        shmem_kib=k["Pss_Shmem"], source="smaps_rollup")
    return estimate_pss_split(mappings if mappings is not None else read_smaps(pid, procfs))
