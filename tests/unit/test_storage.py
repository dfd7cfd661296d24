"""Storage directories and disk files: where a disk may be, which file it is, and which
file fusuma deletes (fusuma.host.storage, PartitionManager's disks, the spec's
``[[storage]]``). Real files, symlinks, hard links and device nodes; no VM."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest

from fusuma.apply import plan
from fusuma.errors import ConflictError, HostError, NotFoundError, SpecError, StateError
from fusuma.host import storage
from fusuma.partition.manager import PartitionManager
from fusuma.paths import Paths
from fusuma.spec import DiskSpec, dump_spec, parse_spec
from fusuma.state import Database, DiskRecord, PartitionRecord

ROOT = os.geteuid() == 0


@pytest.fixture
def paths(tmp_path: Path) -> Paths:
    return Paths(home=tmp_path / "home", runtime=tmp_path / "run", shm=tmp_path / "shm",
                 cache=tmp_path / "cache", cgroup_prefix="fusuma-unit")


@pytest.fixture
def parts(paths: Paths) -> PartitionManager:
    db = Database(paths.db)
    db.add_partition(PartitionRecord("p0", [0], 256))
    pm = PartitionManager(paths, db)
    pm.notice = lambda text: notices.append(text)
    notices.clear()
    return pm


notices: list[str] = []


def one_sentence(text: str) -> str:
    assert text.endswith(".") and ". " not in text.rstrip("."), text
    return text


# -- which directories ------------------------------------------------------------------
@pytest.mark.parametrize("bad, why", [
    ("/", "root directory"), ("/etc", "system directory /etc"),
    ("/dev/disks", "system directory /dev"), ("/usr/local/x", "system directory /usr"),
    ("/var", "system directory /var/lib/dpkg"), ("disks", "absolute"),
    ("/srv/../etc", "'..'")])
def test_system_trees_are_no_storage(paths: Paths, bad: str, why: str) -> None:
    with pytest.raises(SpecError) as err:
        storage.check_dir(paths, bad)
    assert why in one_sentence(str(err.value))


def test_fusuma_own_directories_are_no_storage(paths: Paths, tmp_path: Path) -> None:
    for bad in (tmp_path, paths.home, paths.home / "vms", paths.shm / "x", paths.cache):
        with pytest.raises(SpecError, match="overlaps fusuma's own directory"):
            storage.check_dir(paths, str(bad))
    with pytest.raises(ConflictError, match="default storage directory"):
        storage.check_dir(paths, str(storage.default_dir(paths)))
    assert storage.check_dir(paths, str(tmp_path / "disks")) == tmp_path / "disks"


def test_add_list_remove(parts: PartitionManager, tmp_path: Path) -> None:
    d = parts.add_storage(str(tmp_path / "srv" / "disks"))
    assert d.is_dir() and stat.S_IMODE(d.stat().st_mode) == 0o700
    assert parts.storage_dirs() == [storage.default_dir(parts.paths), d]
    with pytest.raises(ConflictError, match="already"):
        parts.add_storage(str(d))
    parts.add_disk(DiskSpec(name="d0", path=str(d / "d0.img"), partition="p0", size_mib=1))
    with pytest.raises(StateError) as err:
        parts.remove_storage(str(d))
    assert "holds disk(s) d0" in one_sentence(str(err.value))
    parts.remove_disk("d0", delete_file=True)
    assert parts.remove_storage(str(d)) == d and d.is_dir(), "its files stay"
    with pytest.raises(NotFoundError, match=str(storage.default_dir(parts.paths))):
        parts.remove_storage(str(d))
    with pytest.raises(StateError, match="default storage directory"):
        parts.remove_storage(str(storage.default_dir(parts.paths)))


# -- where a disk may be ----------------------------------------------------------------
def test_a_disk_outside_the_storage_directories_is_refused(parts: PartitionManager,
                                                            tmp_path: Path) -> None:
    srv = parts.add_storage(str(tmp_path / "srv"))
    outside = tmp_path / "elsewhere"
    outside.mkdir()
    (outside / "x.img").write_bytes(b"x" * 4096)
    # A symlinked directory inside a storage directory that leads out of it.
    (srv / "door").symlink_to(outside)
    for path in (outside / "x.img", srv / "door" / "x.img", outside / "new.img"):
        with pytest.raises(SpecError) as err:
            parts.add_disk(DiskSpec(name="d0", path=str(path), partition="p0", size_mib=1))
        said = one_sentence(str(err.value))
        assert f"({storage.default_dir(parts.paths)}, {srv})" in said, said
    assert parts.db.disks() == [] and not (outside / "new.img").exists()


def test_a_directory_swapped_after_the_check_leads_nowhere(parts: PartitionManager,
                                                          tmp_path: Path) -> None:
    """Between locate (the check) and the file's creation or pinning, a directory in
    the storage directory becomes a symlink out of it: nothing is made or taken there."""
    srv = parts.add_storage(str(tmp_path / "srv"))
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "x.img").write_bytes(b"x" * 4096)
    place = storage.locate(parts.paths, parts.db, str(srv / "sub" / "x.img"))
    assert place == storage.Place(srv, Path("sub/x.img"))
    (srv / "sub").symlink_to(outside)            # the swap
    with pytest.raises(SpecError, match="was moved while it was looked at"):
        storage.claim(place, None)
    (outside / "x.img").unlink()
    with pytest.raises(HostError, match="cannot create disk file"):
        storage.claim(place, 1)
    assert list(outside.iterdir()) == []


def test_default_directory_and_identity(parts: PartitionManager) -> None:
    path = storage.default_dir(parts.paths) / "d0.img"
    rec = parts.add_disk(DiskSpec(name="d0", path=str(path), partition="p0", size_mib=2))
    st = path.stat()
    assert (rec.created_file, rec.dev, rec.ino) == (True, st.st_dev, st.st_ino)
    assert parts.db.disk("d0") == rec and st.st_size == 2 * 2**20
    assert stat.S_IMODE(st.st_mode) == 0o600


@pytest.mark.parametrize("kind", ["symlink", "hard link", "fifo", "block device"])
def test_only_a_regular_file_of_its_own(parts: PartitionManager, tmp_path: Path,
                                        kind: str) -> None:
    srv = parts.add_storage(str(tmp_path / "srv"))
    real = srv / "real.img"
    real.write_bytes(b"x" * 4096)
    bad = srv / "bad.img"
    if kind == "symlink":
        bad.symlink_to(real)
    elif kind == "hard link":
        os.link(real, bad)
    elif kind == "fifo":
        os.mkfifo(bad)
    else:
        if not ROOT:
            pytest.skip("mknod needs root")
        os.mknod(bad, stat.S_IFBLK | 0o600, os.makedev(7, 0))
    with pytest.raises(SpecError) as err:
        parts.add_disk(DiskSpec(name="d0", path=str(bad), partition="p0", size_mib=1))
    want = {"symlink": "symbolic link", "hard link": "2 hard links", "fifo": "not a regular",
            "block device": "block device"}[kind]
    assert want in one_sentence(str(err.value))
    assert parts.db.disks() == []


def test_one_file_is_one_disk(parts: PartitionManager, tmp_path: Path) -> None:
    srv = parts.add_storage(str(tmp_path / "srv"))
    (srv / "a.img").write_bytes(b"x" * 4096)
    parts.add_disk(DiskSpec(name="a", path=str(srv / "a.img"), partition="p0"))
    alias = parts.add_storage(str(tmp_path / "alias"))
    alias.rmdir()
    alias.symlink_to(srv)          # the same file by another path
    with pytest.raises(ConflictError, match="the file of disk 'a' already"):
        parts.add_disk(DiskSpec(name="b", path=str(alias / "a.img"), partition="p0"))


# -- which file is deleted --------------------------------------------------------------
def test_delete_file_only_of_a_file_fusuma_made(parts: PartitionManager,
                                               tmp_path: Path) -> None:
    srv = parts.add_storage(str(tmp_path / "srv"))
    mine = srv / "mine.img"
    mine.write_bytes(b"precious")
    parts.add_disk(DiskSpec(name="mine", path=str(mine), partition="p0", size_mib=1))
    with pytest.raises(StateError) as err:
        parts.remove_disk("mine", delete_file=True)
    assert "fusuma did not create" in one_sentence(str(err.value))
    assert mine.read_bytes() == b"precious" and parts.db.find_disk("mine") is not None

    made = srv / "made.img"
    parts.add_disk(DiskSpec(name="made", path=str(made), partition="p0", size_mib=1))
    made.rename(srv / "made.orig")
    made.symlink_to(mine)            # swapped for a link to the user's file
    with pytest.raises(StateError, match="no longer the file fusuma created"):
        parts.remove_disk("made", delete_file=True)
    assert made.is_symlink() and mine.read_bytes() == b"precious"
    made.unlink()
    (srv / "made.orig").rename(made)
    parts.remove_disk("made", delete_file=True)
    assert not made.exists()


def test_removing_the_partition_keeps_a_swapped_file(parts: PartitionManager,
                                                    tmp_path: Path) -> None:
    srv = parts.add_storage(str(tmp_path / "srv"))
    made = srv / "made.img"
    parts.add_disk(DiskSpec(name="made", path=str(made), partition="p0", size_mib=1))
    made.rename(srv / "made.orig")
    made.write_bytes(b"someone else's")
    parts.drop_disk("made")
    assert made.read_bytes() == b"someone else's"
    assert parts.db.find_disk("made") is None
    assert "no longer the file fusuma created" in notices[-1]


# -- disks an older fusuma registered ----------------------------------------------------
def test_take_over(parts: PartitionManager, tmp_path: Path) -> None:
    srv = parts.add_storage(str(tmp_path / "srv"))
    (srv / "old.img").write_bytes(b"x" * 4096)
    db = parts.db
    db.add_disk(DiskRecord("old", str(srv / "old.img"), "p0"))
    got = storage.take_over(parts.paths, db, db.disk("old"))
    st = (srv / "old.img").stat()
    assert (got.dev, got.ino) == (st.st_dev, st.st_ino) == (db.disk("old").dev,
                                                           db.disk("old").ino)
    outside = tmp_path / "outside.img"
    outside.write_bytes(b"x" * 4096)
    db.add_disk(DiskRecord("far", str(outside), "p0"))
    with pytest.raises(StateError) as err:
        storage.take_over(parts.paths, db, db.disk("far"))
    assert "`fusuma storage add DIR`" in one_sentence(str(err.value))
    (srv / "dev").symlink_to(outside)
    db.add_disk(DiskRecord("link", str(srv / "dev"), "p0"))
    with pytest.raises(StateError, match="symbolic link"):
        storage.take_over(parts.paths, db, db.disk("link"))
    assert db.disk("far").dev is None and db.disk("link").dev is None


# -- the spec ---------------------------------------------------------------------------
def test_spec_storage(parts: PartitionManager, tmp_path: Path) -> None:
    srv = tmp_path / "srv"
    text = f"""
[[storage]]
path = "{srv}"

[[partition]]
name = "p0"
cpus = "0"
memory_mib = 512

[[disk]]
name = "d0"
path = "{srv}/d0.img"
partition = "p0"
size_mib = 8
"""
    spec = parse_spec(text, "host.toml")
    assert parse_spec(dump_spec(spec), "again") == spec
    assert plan(parts.db, parts, spec, "host.toml").add_storage == [str(srv)]
    with pytest.raises(SpecError, match=r"host.toml: storage\[1\].path: .* listed twice"):
        parse_spec(text.replace("[[partition]]", f'[[storage]]\npath = "{srv}"\n\n'
                                                 "[[partition]]"), "host.toml")
    outside = parse_spec(text.replace(f'path = "{srv}/d0', f'path = "{tmp_path}/d0'),
                         "host.toml")
    with pytest.raises(SpecError) as err:
        plan(parts.db, parts, outside, "host.toml")
    assert str(err.value).startswith("host.toml: disk[0].path: disk path ")
    assert "outside the storage directories" in str(err.value)
    system = parse_spec(text.replace(f'path = "{srv}"', 'path = "/etc"'), "host.toml")
    with pytest.raises(SpecError, match=r"host.toml: storage\[0\].path: .*/etc"):
        plan(parts.db, parts, system, "host.toml")
    assert parts.db.storage_dirs() == [] and not srv.exists(), "a plan changes nothing"
