"""The holes of a template's RAM file, and keeping them holes while clones run.

A template's RAM file lives on tmpfs (the shm dir). Each clone maps it privately
(copy-on-write), and on tmpfs a fault on a hole of a private mapping allocates a page *in
the shared file*: a read fault maps that new zero page, a write fault (the copy-on-write of
a page the guest allocates) first allocates it, then copies it into the clone's own memory
and leaves it in the file, mapped by nobody. (A private anonymous mapping would map the
kernel's one zero page instead; a regular file's hole gets a page-cache page.) So a
template grew toward its full RAM size as its clones ran, although none of them wrote it.

fusuma undoes that growth (it cannot stop the kernel from allocating it):

- when a template is made, every page of its RAM file that holds only zeros is punched
  (``fallocate(PUNCH_HOLE)``): it reads as zeros either way, and takes no memory as a
  hole; the file's holes are then recorded beside its state (``holes``);
- while clones of the template run, their supervisor punches again, every
  :data:`TRIM_EVERY_S`, the pages of those recorded holes that clones filled. A page in a
  recorded hole is punched only if it holds zeros (read first), so a damaged record can
  never change what the file holds.

Punching never changes the file's content, only where it lives: a clone's own copies
(anonymous memory) stay; a clone that still maps a punched page read-only faults on its
next access and gets a zero page again. The file is read-only for every QEMU (clones open
it read-only and map it privately); only root punches it.
"""

from __future__ import annotations

import errno
import functools
import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from fusuma.errors import TemplateError

PAGE = os.sysconf("SC_PAGE_SIZE")
CHUNK = 1 << 20                  # bytes read at a time while looking for zero pages
HOLES_NAME = "holes"             # the record, in the template's directory
# How often a supervisor with running clones of a template punches what they filled
# (seconds). FUSUMA_TEMPLATE_TRIM_S overrides it; "0" turns trimming off altogether
# (what fusuma did before: benchmarks measure both side by side).
TRIM_EVERY_S = 10.0
TRIM_ENV = "FUSUMA_TEMPLATE_TRIM_S"
_FALLOC_FL_KEEP_SIZE = 0x01
_FALLOC_FL_PUNCH_HOLE = 0x02
_ZERO_PAGE = bytes(PAGE)

Extents = list[tuple[int, int]]


def trim_every() -> float:
    """Seconds between two trims of a template with running clones; 0: never trim."""
    raw = os.environ.get(TRIM_ENV, "")
    try:
        return max(0.0, float(raw)) if raw else TRIM_EVERY_S
    except ValueError:
        return TRIM_EVERY_S


def allocated_bytes(fd: int) -> int:
    """What the file at ``fd`` takes (its allocated blocks), in bytes."""
    return os.fstat(fd).st_blocks * 512


def next_data(fd: int, pos: int) -> int | None:
    """Where the file's next data at or after ``pos`` begins; None: only holes follow."""
    try:
        return os.lseek(fd, pos, os.SEEK_DATA)
    except OSError as exc:
        if exc.errno == errno.ENXIO:
            return None
        raise


def data_extents(fd: int, start: int = 0, end: int | None = None) -> Iterator[tuple[int, int]]:
    """The allocated (data) ranges of the file at ``fd`` within [start, end), in order."""
    stop = os.fstat(fd).st_size if end is None else end
    pos = start
    while pos < stop:
        data = next_data(fd, pos)
        if data is None or data >= stop:
            return
        hole = min(os.lseek(fd, data, os.SEEK_HOLE), stop)
        yield data, hole
        pos = hole


def hole_extents(fd: int) -> Extents:
    """The holes of the file at ``fd``: the complement of its data extents."""
    size = os.fstat(fd).st_size
    out: Extents = []
    pos = 0
    for data, end in data_extents(fd):
        if data > pos:
            out.append((pos, data))
        pos = end
    if pos < size:
        out.append((pos, size))
    return out


@functools.cache
def _libc() -> Any:
    """libc, for fallocate(2) with its flags (os has no such call): loaded by the first
    punch, not by every process that imports this module."""
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    libc.fallocate.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_int64, ctypes.c_int64]
    return libc


def punch(fd: int, offset: int, length: int) -> None:
    import ctypes

    if _libc().fallocate(fd, _FALLOC_FL_PUNCH_HOLE | _FALLOC_FL_KEEP_SIZE, offset,
                       length) != 0:
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err))


def zero_ranges(chunk: bytes, base: int) -> Iterator[tuple[int, int]]:
    """The runs of whole zero pages in ``chunk`` (which starts at file offset ``base``,
    page-aligned), as (offset, length) in the file."""
    if chunk.count(0) == len(chunk):
        if chunk:
            yield base, len(chunk)
        return
    run = -1
    for i in range(0, len(chunk), PAGE):
        if chunk[i:i + PAGE] == _ZERO_PAGE:
            if run < 0:
                run = i
        elif run >= 0:
            yield base + run, i - run
            run = -1
    if run >= 0:
        yield base + run, len(chunk) - run


def punch_zero_pages(fd: int, within: Extents | None = None) -> int:
    """Punch every page of the file at ``fd`` that holds only zeros, in the extents
    ``within`` (page-aligned; None: the whole file); returns the bytes it took before.
    Holes are skipped with ``SEEK_DATA`` (never ``SEEK_HOLE``, which walks every page of
    a long run of data: a trim of many small holes that clones filled would take
    quadratic time); a chunk read may span a hole, which reads as zeros and is punched
    again at no cost."""
    before = allocated_bytes(fd)
    size = os.fstat(fd).st_size
    for lo, hi in ([(0, size)] if within is None else within):
        pos, end = lo, min(hi, size)
        while pos < end:
            data = next_data(fd, pos)
            if data is None or data >= end:
                break
            data = max(pos, data - data % PAGE)
            n = min(CHUNK, end - data)
            for off, length in zero_ranges(os.pread(fd, n, data), data):
                punch(fd, off, length)
            pos = data + n
    return max(0, before - allocated_bytes(fd))


def record_path(template_dir: Path) -> Path:
    return template_dir / HOLES_NAME


def save_record(template_dir: Path, holes: Extents) -> None:
    """Write the holes record (root's, 0600), replacing any."""
    path = record_path(template_dir)
    tmp = path.with_suffix(".tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW | os.O_CLOEXEC,
                 0o600)
    with os.fdopen(fd, "w") as f:
        json.dump({"page": PAGE, "holes": holes}, f, separators=(",", ":"))
    os.replace(tmp, path)


def load_record(template_dir: Path, size: int) -> Extents | None:
    """The recorded holes, or None if there is no usable record (then a trim looks at the
    whole file)."""
    try:
        raw = json.loads(record_path(template_dir).read_text())
        holes = [(int(a), int(b)) for a, b in raw["holes"]]
    except (OSError, ValueError, KeyError, TypeError):
        return None
    if any(not (0 <= a < b <= size) or a % PAGE for a, b in holes):
        return None
    return holes


def trim_new(fd: int, template_dir: Path) -> int:
    """A new template: punch all its zero pages, then record its holes; returns the
    bytes freed."""
    freed = punch_zero_pages(fd)
    save_record(template_dir, hole_extents(fd))
    return freed


def trim(ram_path: str, template_dir: Path) -> int:
    """Punch the pages clones filled in the holes of a template's RAM file (the whole
    file's zero pages when its holes were never recorded); returns the bytes freed."""
    try:
        fd = os.open(ram_path, os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError as exc:
        raise TemplateError(f"the template's RAM file {ram_path} cannot be opened to "
                            f"trim it ({exc.strerror}).") from exc
    try:
        holes = load_record(template_dir, os.fstat(fd).st_size)
        if holes is None:
            return trim_new(fd, template_dir)
        return punch_zero_pages(fd, holes)
    finally:
        os.close(fd)
