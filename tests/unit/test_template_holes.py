"""A template's RAM file keeps its holes (fusuma.memshare.holes): zero pages punched,
holes recorded, what a private mapping's faults filled punched again, content never
changed. Files on tmpfs (/dev/shm, where templates live: there a fault on a hole of a
private mapping allocates a page in the file) and removed at the end."""

from __future__ import annotations

import hashlib
import mmap
import os
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from fusuma.errors import TemplateError
from fusuma.memshare import holes

MIB = 2**20
PAGE = holes.PAGE


@pytest.fixture
def shm_file() -> Iterator[Path]:
    path = Path(f"/dev/shm/fusuma-unit-holes-{uuid.uuid4().hex[:8]}")
    yield path
    path.unlink(missing_ok=True)


def make(path: Path, size: int, pages: dict[int, bytes]) -> int:
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    os.ftruncate(fd, size)
    for index, fill in pages.items():
        os.pwrite(fd, fill * PAGE, index * PAGE)
    return fd


def digest(fd: int) -> str:
    return hashlib.sha256(os.pread(fd, os.fstat(fd).st_size, 0)).hexdigest()


def test_zero_ranges_finds_runs_of_whole_zero_pages() -> None:
    chunk = b"\0" * PAGE + b"\0" * PAGE + b"\1" * PAGE + b"\0" * PAGE
    assert list(holes.zero_ranges(chunk, 10 * PAGE)) == [(10 * PAGE, 2 * PAGE),
                                                          (13 * PAGE, PAGE)]
    assert list(holes.zero_ranges(bytes(3 * PAGE), 0)) == [(0, 3 * PAGE)]
    assert list(holes.zero_ranges(b"\0" * (PAGE - 1) + b"\1", 0)) == []
    assert list(holes.zero_ranges(b"", 0)) == []


def test_a_new_template_loses_its_zero_pages_and_records_its_holes(
        shm_file: Path, tmp_path: Path) -> None:
    # Pages 0-3 data, 4-5 zeros written, 6 data, 7.. a hole.
    fd = make(shm_file, 64 * PAGE, {0: b"a", 1: b"b", 2: b"c", 3: b"d", 4: b"\0",
                                    5: b"\0", 6: b"e"})
    try:
        before = digest(fd)
        assert holes.allocated_bytes(fd) == 7 * PAGE
        assert holes.trim_new(fd, tmp_path) == 2 * PAGE
        assert holes.allocated_bytes(fd) == 5 * PAGE and digest(fd) == before
        assert holes.hole_extents(fd) == [(4 * PAGE, 6 * PAGE), (7 * PAGE, 64 * PAGE)]
        assert holes.load_record(tmp_path, 64 * PAGE) == holes.hole_extents(fd)
        assert oct(holes.record_path(tmp_path).stat().st_mode & 0o777) == "0o600"
    finally:
        os.close(fd)


def test_what_a_private_mapping_filled_is_punched_again(shm_file: Path,
                                                         tmp_path: Path) -> None:
    size = 4 * MIB
    fd = make(shm_file, size, {i: bytes([i % 250 + 1]) for i in range(0, 256, 2)})
    try:
        holes.trim_new(fd, tmp_path)
        made = holes.allocated_bytes(fd)
        before = digest(fd)
        ro = os.open(shm_file, os.O_RDONLY)
        m = mmap.mmap(ro, size, flags=mmap.MAP_PRIVATE,
                      prot=mmap.PROT_READ | mmap.PROT_WRITE)
        try:
            # A clone reads every page and writes some holes (copy-on-write): on tmpfs
            # both fill the file's holes, though the file's content stays the same.
            assert sum(m[i] for i in range(0, size, PAGE)) > 0
            for i in range(2 * MIB, 3 * MIB, PAGE):
                m[i] = 7
            assert holes.allocated_bytes(fd) == size
            assert holes.trim(str(shm_file), tmp_path) == size - made
            assert holes.allocated_bytes(fd) == made and digest(fd) == before
            # The clone's own pages stay its own; what it reads is still the template's.
            assert all(m[i] == 7 for i in range(2 * MIB, 3 * MIB, PAGE))
            assert m[PAGE] == 0 and m[2 * PAGE] == 3 and m[3 * MIB + PAGE] == 0
            assert holes.trim(str(shm_file), tmp_path) >= 0
            assert digest(fd) == before
        finally:
            m.close()
            os.close(ro)
    finally:
        os.close(fd)


def test_a_damaged_record_never_changes_the_content(shm_file: Path, tmp_path: Path) -> None:
    fd = make(shm_file, 16 * PAGE, {0: b"x", 1: b"y", 2: b"\0"})
    try:
        before = digest(fd)
        # A record that calls data pages holes: they are read first, so kept.
        holes.save_record(tmp_path, [(0, 16 * PAGE)])
        assert holes.trim(str(shm_file), tmp_path) == PAGE
        assert digest(fd) == before and holes.allocated_bytes(fd) == 2 * PAGE
        # An unusable record: the whole file is looked at, and the record made anew.
        holes.record_path(tmp_path).write_text("[1, 2")
        assert holes.load_record(tmp_path, 16 * PAGE) is None
        holes.trim(str(shm_file), tmp_path)
        assert holes.load_record(tmp_path, 16 * PAGE) == [(2 * PAGE, 16 * PAGE)]
        holes.save_record(tmp_path, [(PAGE + 1, 3 * PAGE)])
        assert holes.load_record(tmp_path, 16 * PAGE) is None
        holes.save_record(tmp_path, [(0, 17 * PAGE)])
        assert holes.load_record(tmp_path, 16 * PAGE) is None
    finally:
        os.close(fd)


def test_trim_of_a_missing_file_is_one_sentence(tmp_path: Path) -> None:
    with pytest.raises(TemplateError, match="cannot be opened to trim it"):
        holes.trim(str(tmp_path / "gone.template"), tmp_path)


def test_the_interval_comes_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(holes.TRIM_ENV, raising=False)
    assert holes.trim_every() == holes.TRIM_EVERY_S
    monkeypatch.setenv(holes.TRIM_ENV, "0")
    assert holes.trim_every() == 0
    monkeypatch.setenv(holes.TRIM_ENV, "2.5")
    assert holes.trim_every() == 2.5
    monkeypatch.setenv(holes.TRIM_ENV, "soon")
    assert holes.trim_every() == holes.TRIM_EVERY_S
