"""The page cache VMs share through one base image: a real file whose pages this test
reads into the host's page cache (mincore is real and cheap), real processes that hold
it open (this one and a child) and one that does not."""

from __future__ import annotations

import json
import os
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest
from click.testing import CliRunner

from fusuma.cli import share as share_mod
from fusuma.memshare import bases
from fusuma.memshare.bases import BaseUser, base_use, bases_in_use, holds_file
from fusuma.memshare.footprint import resident_bytes
from fusuma.ops.context import Ctx
from fusuma.paths import Paths
from fusuma.state.records import ImageRecord
from fusuma.views import share as share_view
from tests.unit.memshare_fake import make_ksm

MIB = 2**20


def make_base(path: Path, size: int = 4 * MIB) -> ImageRecord:
    """A base file as the store keeps one (root's, 0444), out of the page cache."""
    with open(path, "wb") as f:
        f.write(os.urandom(size))
        f.flush()
        os.fsync(f.fileno())
    path.chmod(0o444)
    fd = os.open(path, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)
    return ImageRecord(name=path.stem, path=str(path), format="raw", virtual_size=size,
                       file_size=size, sha256="0" * 64, source="test")


def read_first(path: Path, nbytes: int) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.pread(fd, nbytes, 0)
    finally:
        os.close(fd)


@pytest.fixture
def holders(tmp_path: Path) -> Iterator[tuple[Path, list[int]]]:
    """A base file, and two live processes: the first holds it open, the second not."""
    base = tmp_path / "deb.raw"
    make_base(base)
    with open(base, "rb") as fh:
        held = subprocess.Popen(["sleep", "60"], stdin=fh)
    other = subprocess.Popen(["sleep", "60"], stdin=subprocess.DEVNULL)
    try:
        yield base, [held.pid, other.pid]
    finally:
        for p in (held, other):
            p.kill()
            p.wait()


def test_resident_bytes_counts_only_what_was_read(tmp_path: Path) -> None:
    rec = make_base(tmp_path / "b.raw")
    # Out of the cache after fsync + DONTNEED (the kernel may keep a page or two).
    assert resident_bytes(Path(rec.path)) <= 64 * 1024
    read_first(Path(rec.path), MIB)
    got = resident_bytes(Path(rec.path))
    # The MiB read, plus at most the readahead past it: never the whole file.
    assert MIB <= got < 4 * MIB
    # Measuring reads nothing in.
    assert resident_bytes(Path(rec.path)) == got


def test_base_use_counts_the_processes_that_hold_it_and_the_saving(
        holders: tuple[Path, list[int]]) -> None:
    base, (held, other) = holders
    rec = make_base_record(base)
    read_first(base, 2 * MIB)
    with open(base, "rb"):          # this process holds it too
        use = base_use(rec, [BaseUser("a", os.getpid(), "deb"), BaseUser("b", held, "deb"),
                             BaseUser("c", other, "deb"),
                             BaseUser("gone", 2**22 + 1, "deb")])
    assert use.error is None and use.vms == ("a", "b")
    assert use.resident_bytes is not None and use.resident_bytes >= 2 * MIB
    assert use.saved_bytes == use.resident_bytes          # (2 - 1) x resident
    assert use.file_bytes == 4 * MIB and use.virtual_size_bytes == 4 * MIB
    j = use.as_json()
    assert j["vms"] == 2 and j["vm_names"] == ["a", "b"]
    assert j["saved_bytes"] == use.resident_bytes
    # One VM alone shares nothing.
    alone = base_use(rec, [BaseUser("b", held, "deb")])
    assert alone.vms == ("b",) and alone.saved_bytes == 0


def make_base_record(base: Path) -> ImageRecord:
    size = base.stat().st_size
    return ImageRecord(name=base.stem, path=str(base), format="raw", virtual_size=size,
                       file_size=size, sha256="0" * 64, source="test")


def test_a_file_that_is_not_the_one_imported_is_not_counted(tmp_path: Path) -> None:
    rec = make_base(tmp_path / "b.raw")
    users = [BaseUser("a", os.getpid(), "b")]
    Path(rec.path).chmod(0o644)                            # writable: not the store's
    use = base_use(rec, users)
    assert use.resident_bytes is None and use.saved_bytes == 0
    assert use.error is not None and "writable" in use.error
    # A link put in its place is not followed.
    Path(rec.path).unlink()
    other = make_base(tmp_path / "other.raw")
    Path(rec.path).symlink_to(other.path)
    use = base_use(rec, users)
    assert use.resident_bytes is None and "not the file imported" in str(use.error)
    # Gone.
    Path(rec.path).unlink()
    assert "cannot read" in str(base_use(rec, users).error)


def test_bases_in_use_lists_only_images_with_running_vms(tmp_path: Path) -> None:
    a, b = make_base(tmp_path / "a.raw"), make_base(tmp_path / "b.raw")
    with open(a.path, "rb"):
        uses = bases_in_use([b, a], [BaseUser("v1", os.getpid(), "a")])
    assert [u.image for u in uses] == ["a"] and uses[0].vms == ("v1",)
    assert bases.bases_saved_bytes(uses) == 0


def test_holds_file_reads_the_kernels_fd_table(tmp_path: Path) -> None:
    rec = make_base(tmp_path / "a.raw")
    st = os.stat(rec.path)
    assert not holds_file(os.getpid(), st)
    with open(rec.path, "rb"):
        assert holds_file(os.getpid(), st)
    assert not holds_file(2**22 + 1, st)


def test_share_report_has_a_section_for_bases(tmp_path: Path,
                                              holders: tuple[Path, list[int]],
                                              monkeypatch: pytest.MonkeyPatch) -> None:
    base, (held, _) = holders
    ctx = Ctx(Paths(home=tmp_path / "home", runtime=tmp_path / "run",
                    shm=tmp_path / "shm", cache=tmp_path / "cache", cgroup_prefix="t"))
    monkeypatch.setenv("FUSUMA_KSM_ROOT", str(make_ksm(tmp_path / "ksm")))
    ctx.db.add_image(make_base_record(base))
    read_first(base, MIB)
    monkeypatch.setattr(share_view, "base_users", lambda c: [
        BaseUser("vm1", held, "deb"), BaseUser("vm2", os.getpid(), "deb")])
    with open(base, "rb"):
        res = CliRunner().invoke(share_mod.share, ["report", "--json"], obj=ctx)
        assert res.exit_code == 0, res.output
        data = json.loads(res.stdout)
        text = CliRunner().invoke(share_mod.share, ["report"], obj=ctx).output
    b = data["bases"]["deb"]
    assert b["vms"] == 2 and b["vm_names"] == ["vm1", "vm2"] and b["error"] is None
    assert b["resident_bytes"] >= MIB and b["saved_bytes"] == b["resident_bytes"]
    assert b["file_bytes"] == 4 * MIB
    assert data["savings_mib"]["bases"] == round(b["saved_bytes"] / MIB, 1)
    assert "saved by shared bases:" in text
    assert f"deb: 2 VM(s), file 4.0 MiB, cached {b['resident_mib']:.1f} MiB" in text


def test_base_users_are_running_vms_booted_from_imported_images(tmp_path: Path) -> None:
    from fusuma.state import PartitionRecord, VmRecord, VmState

    ctx = Ctx(Paths(home=tmp_path / "home", runtime=tmp_path / "run",
                    shm=tmp_path / "shm", cache=tmp_path / "cache", cgroup_prefix="t"))
    ctx.db.add_partition(PartitionRecord("p0", [0], 1024))
    ctx.db.add_vm(VmRecord(name="stopped", partition="p0", vcpus=1, memory_mib=256,
                           image="deb", boot="bios"))
    ctx.db.add_vm(VmRecord(name="kernel", partition="p0", vcpus=1, memory_mib=256,
                           state=VmState.RUNNING, pid=os.getpid()))
    assert share_view.base_users(ctx) == []
