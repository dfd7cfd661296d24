"""A firmware VM's files on shared storage (fusuma.vm.shared, fusuma.host.storage's
shared directories): where they are made and deleted, the token that proves two hosts
see one directory, and every refusal in one sentence with nothing made. Real files and
qemu-img; no VM."""

from __future__ import annotations

import os
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from fusuma.apply import plan
from fusuma.cluster import hostmove
from fusuma.cluster.resources import VmView
from fusuma.errors import ConflictError, NotFoundError, SpecError, StateError
from fusuma.host import storage
from fusuma.images import store
from fusuma.partition.manager import PartitionManager
from fusuma.paths import Paths
from fusuma.spec import VmSpec, parse_spec
from fusuma.state import Database, VmRecord
from fusuma.supervisor import rpc
from fusuma.supervisor.moves.source import capabilities
from fusuma.vm import boot, shared
from fusuma.vm.manager import VmManager
from tests.unit import test_hostmove as hm
from tests.unit.test_image_store import db, paths, raw_image  # noqa: F401 (fixtures)
from tests.unit.test_storage import one_sentence


def base_image(tmp_path: Path, paths: Paths, db: Database) -> Any:  # noqa: F811
    return store.import_image(paths, db, "deb", str(raw_image(tmp_path / "a.raw")),
                              anywhere=True)


def shared_dir(tmp_path: Path, paths: Paths, db: Database) -> Path:  # noqa: F811
    return storage.add(paths, db, str(tmp_path / "nfs"), shared=True)


def placed_vm(tmp_path: Path, paths: Paths, db: Database,  # noqa: F811
              name: str = "f") -> tuple[VmRecord, Path]:
    base = base_image(tmp_path, paths, db)
    d = shared_dir(tmp_path, paths, db)
    rec = VmRecord(name, "p0", 1, 256, image="deb", boot="bios", uid=os.getuid())
    boot.prepare(paths, rec, base, None, [], None, [], db=db, storage_dir=str(d))
    return rec, d


def test_storage_add_shared_is_recorded(tmp_path: Path, paths: Paths,  # noqa: F811
                                        db: Database) -> None:  # noqa: F811
    one = storage.add(paths, db, str(tmp_path / "local"))
    two = storage.add(paths, db, str(tmp_path / "nfs"), shared=True)
    assert db.storage_dirs() == [str(one), str(two)]
    assert db.shared_storage_dirs() == [str(two)]


def test_a_vms_files_go_in_its_place_and_its_delete_removes_them(
        tmp_path: Path, paths: Paths, db: Database) -> None:  # noqa: F811
    _, d = placed_vm(tmp_path, paths, db)
    where = d / "vm-f"
    assert store.placed_in(paths, "f") == where
    assert store.disk_path(paths, "f") == where / store.DISK
    assert store.nvram_path(paths, "f") == where / store.NVRAM
    assert store.seed_path(paths, "f") == where / store.SEED
    assert sorted(p.name for p in where.iterdir()) == [store.DISK, store.SEED]
    # Not in its own directory: only the pointer and the seed's inputs are.
    assert sorted(p.name for p in paths.vm_dir("f").iterdir()) == \
        [store.SEED_INPUTS, store.PLACED]
    assert store.probe(store.disk_path(paths, "f"), "qcow2").virtual_size == 8 * 2**20
    boot.remove(paths, "f")
    assert not where.exists() and not paths.vm_dir("f").exists()
    assert list(d.iterdir()) == []


def test_a_vm_whose_place_exists_is_refused_and_nothing_is_made(
        tmp_path: Path, paths: Paths, db: Database) -> None:  # noqa: F811
    base = base_image(tmp_path, paths, db)
    d = shared_dir(tmp_path, paths, db)
    (d / "vm-g").mkdir()
    (d / "vm-g" / store.DISK).write_bytes(b"another host's")
    rec = VmRecord("g", "p0", 1, 256, image="deb", boot="bios", uid=os.getuid())
    with pytest.raises(ConflictError) as exc:
        boot.prepare(paths, rec, base, None, [], None, [], db=db, storage_dir=str(d))
    assert str(exc.value) == (f"{d}/vm-g exists already (a VM named 'g' on another host, "
                              "or one deleted while its host was down); pick another name "
                              "or remove it.")
    one_sentence(str(exc.value))
    assert (d / "vm-g" / store.DISK).read_bytes() == b"another host's"
    assert not paths.vm_dir("g").exists()


@pytest.mark.parametrize("which, kind, says", [
    ("missing", NotFoundError, "storage directory {d} is missing (is its file system "
     "mounted?); mount it or pick another shared directory."),
    ("local", SpecError, "storage directory {d} is not declared shared; a VM's files go "
     "only in a directory other hosts see too (`fusuma storage add DIR --shared`, as root "
     "on each host)."),
    ("undeclared", NotFoundError, "{d} is not a shared storage directory of this host "
     "(they are: {nfs}); root declares one with `fusuma storage add DIR --shared`."),
])
def test_a_storage_that_is_not_a_shared_directory_is_refused(
        tmp_path: Path, paths: Paths, db: Database, which: str,  # noqa: F811
        kind: type[Exception], says: str) -> None:
    nfs = shared_dir(tmp_path, paths, db)
    d = tmp_path / which
    if which == "missing":
        storage.add(paths, db, str(d), shared=True)
        d.rmdir()
    elif which == "local":
        storage.add(paths, db, str(d))
    with pytest.raises(kind) as exc:
        storage.shared_dir(paths, db, str(d))
    assert str(exc.value) == says.format(d=d, nfs=nfs)
    one_sentence(str(exc.value))


def manager(paths: Paths, db: Database) -> VmManager:  # noqa: F811
    return VmManager(paths, db, PartitionManager(paths, db))


@pytest.mark.parametrize("fields, says", [
    ({"image": "minimal", "storage": "/srv/nfs"},
     "--storage apply to a VM of an imported image (cloud-init and a thin disk); "
     "fusuma's own images have neither (their disks are registered disks, `fusuma disk "
     "add`)."),
    ({"image": "deb", "storage": "/srv/nowhere"},
     "/srv/nowhere is not a shared storage directory of this host (they are: none); "
     "root declares one with `fusuma storage add DIR --shared`."),
    ({"image": "deb", "storage": "nfs"}, "storage directory 'nfs' must be an absolute path."),
])
def test_vm_create_refuses_a_storage_it_cannot_use_and_makes_nothing(
        tmp_path: Path, paths: Paths, db: Database,  # noqa: F811
        fields: dict[str, Any], says: str) -> None:
    base_image(tmp_path, paths, db)
    vms = manager(paths, db)
    with pytest.raises((SpecError, NotFoundError)) as exc:
        vms.create(VmSpec(name="f", partition="p0", **fields))
    assert str(exc.value) == says
    assert db.find_vm("f") is None and not paths.vm_dir("f").exists()


def test_a_clone_takes_no_storage() -> None:
    with pytest.raises(SpecError, match=r"leave out --storage\.$"):
        boot.check_clone_fields("t0", ["--storage"])


def test_a_stopped_vm_on_shared_storage_does_not_move_between_hosts() -> None:
    rec = VmRecord("f", "p0", 1, 256, image="deb", boot="bios")
    with pytest.raises(StateError) as exc:
        boot.check_host_move(rec, "h1", running=False, placed=True)
    assert str(exc.value) == ("VM 'f' is stopped, and a stopped VM on shared storage does "
                              "not move between hosts: start it, then move it to host 'h1' "
                              "(its disk stays where it is).")
    boot.check_host_move(rec, "h1", running=True, placed=True)


def test_storage_remove_is_refused_while_a_vm_is_placed_there(
        tmp_path: Path, paths: Paths, db: Database) -> None:  # noqa: F811
    base = base_image(tmp_path, paths, db)
    d = shared_dir(tmp_path, paths, db)
    rec = db.add_vm(VmRecord("f", "p0", 1, 256, image="deb", boot="bios"), paths.vm_uids)
    boot.prepare(paths, replace(rec, uid=os.getuid()), base, None, [], None, [], db=db,
                 storage_dir=str(d))
    parts = PartitionManager(paths, db)
    with pytest.raises(StateError, match=f"^storage directory {d} holds the files of VM"
                       r"\(s\) f; delete them first \(`fusuma vm delete`\).$"):
        parts.remove_storage(str(d))
    boot.remove(paths, "f")
    db.remove_vm("f")
    parts.remove_storage(str(d))


# -- the token ------------------------------------------------------------------------
def test_the_destination_reads_the_sources_token_in_its_own_shared_directory(
        tmp_path: Path, paths: Paths, db: Database) -> None:  # noqa: F811
    where = shared.place(paths, db, "f", str(shared_dir(tmp_path, paths, db)))
    carried = shared.mark(paths, "f")
    assert carried.path == str(where) and len(carried.token) == 64
    assert (where / store.MOVE_TOKEN).stat().st_mode & 0o777 == 0o600
    assert shared.check_carried(carried.as_record()) == carried
    assert shared.check_here(db, "f", carried, "h1") == where
    # Each move writes a fresh token: the older one no longer passes.
    again = shared.mark(paths, "f")
    assert again.token != carried.token
    with pytest.raises(StateError, match="reads another move token there"):
        shared.check_here(db, "f", carried, "h1")


def test_a_directory_that_only_looks_the_same_is_refused(
        tmp_path: Path, paths: Paths,  # noqa: F811
                                                          db: Database) -> None:  # noqa: F811
    # The source's directory, and the destination's own of the same path: two file
    # systems (here: the token rewritten behind the source's back, then removed).
    d = shared_dir(tmp_path, paths, db)
    where = shared.place(paths, db, "f", str(d))
    carried = shared.mark(paths, "f")
    (where / store.MOVE_TOKEN).write_text("0" * 64)
    with pytest.raises(StateError) as exc:
        shared.check_here(db, "f", carried, "h1")
    assert str(exc.value) == (f"VM 'f''s files are in {where} on its host, and host h1 "
                              "reads another move token there: the directory is not the "
                              "same one on both hosts, so the move is refused.")
    (where / store.MOVE_TOKEN).unlink()
    with pytest.raises(StateError) as exc:
        shared.check_here(db, "f", carried, "h1")
    assert str(exc.value) == (f"VM 'f''s files are in {where} on its host, and host h1 "
                              "cannot read the move's token there (No such file or "
                              "directory): the directory is not the same one on both "
                              "hosts, so the move is refused.")
    one_sentence(str(exc.value))
    # A token that is a symlink to the right text elsewhere is not followed.
    (tmp_path / "t").write_text(carried.token)
    (where / store.MOVE_TOKEN).symlink_to(tmp_path / "t")
    with pytest.raises(StateError, match="cannot read the move's token there"):
        shared.check_here(db, "f", carried, "h1")


def test_a_place_outside_this_hosts_shared_directories_is_refused(
        tmp_path: Path, paths: Paths, db: Database) -> None:  # noqa: F811
    local = storage.add(paths, db, str(tmp_path / "local"))
    (local / "vm-f").mkdir()
    (local / "vm-f" / store.MOVE_TOKEN).write_text("a" * 64)
    carried = shared.CarriedPlace(str(local / "vm-f"), "a" * 64)
    with pytest.raises(StateError) as exc:
        shared.check_here(db, "f", carried, "h2")
    assert str(exc.value) == (f"VM 'f''s files are in {local}/vm-f on its host, which is "
                              "not in a directory host h2 declared shared (`fusuma storage "
                              "add DIR --shared` there, for a directory it sees too): it "
                              "moves only to a host that shares its storage.")
    one_sentence(str(exc.value))
    for bad in (str(local / "vm-g"), f"{local}/x/../vm-f"):
        with pytest.raises(StateError, match=r"not in a directory vm-f of a storage "
                           r"directory\.$"):
            shared.check_here(db, "f", shared.CarriedPlace(bad, "a" * 64), "h2")


@pytest.mark.parametrize("record, says", [
    ("x", "no fields"),
    ({"path": "relative/vm-f", "token": "a" * 64}, "no absolute path"),
    ({"path": "/srv/nfs/vm-f", "token": "A" * 64}, "no token"),
    ({"path": "/srv/nfs/vm-f", "token": "a" * 63}, "no token"),
    ({"path": "/srv/nfs/vm-f"}, "no token"),
])
def test_a_carried_place_is_checked(record: object, says: str) -> None:
    with pytest.raises(StateError, match=f"names shared storage with {says}$"):
        shared.check_carried(record)


def test_detach_leaves_the_files_for_the_other_host(
        tmp_path: Path, paths: Paths,  # noqa: F811
                                                    db: Database) -> None:  # noqa: F811
    where = shared.place(paths, db, "f", str(shared_dir(tmp_path, paths, db)))
    (where / store.DISK).write_bytes(b"disk")
    assert shared.detach(paths, "f") == where
    assert store.placed_in(paths, "f") is None
    shared.remove(paths, "f")           # no longer this host's: nothing removed
    assert (where / store.DISK).read_bytes() == b"disk"


def test_a_destination_on_shared_storage_keeps_its_images_inactive_until_forward() -> None:
    assert capabilities("copy", 4, late_block=True)["late-block-activate"] is True
    assert capabilities("copy", 4)["late-block-activate"] is False   # named off


def test_a_destination_that_does_not_share_the_directory_refuses_and_makes_nothing(
        tmp_path: Path) -> None:
    import base64
    import zlib

    thin = {"image": "deb", "sha256": "a" * 64, "virtualSize": 2**30,
            "seed": base64.b64encode(zlib.compress(b"iso")).decode(),
            "seedInputs": {"instance_id": "i", "hostname": "vm0"}}
    place = {"path": str(tmp_path / "nfs" / "vm-vm0"), "token": "b" * 64}
    move = {**hm.MID_MOVE, "phase": "Preparing",
            "record": {"machine": "pc-q35-7.2", boot.CARRIED_DISK: thin,
                       shared.CARRIED_PLACE: place}}
    a, here = hm.world("h1", move, None)
    a.owners.owned.clear()
    created: list[Any] = []
    here.create = created.append  # type: ignore[attr-defined]
    hostmove.step(a, a, VmView(a.kube.get(None, "vm0")))  # type: ignore[arg-type]
    assert created == [] and "vm0" not in here.db.vms
    assert not any(isinstance(r, rpc.RemoteIncoming) for r in here.sent)
    m = hm.recorded(a)
    assert (m["decision"], m["decidedBy"], m["phase"]) == ("back", "h1", "Failed")
    assert m["message"] == (f"VM 'vm0''s files are in {place['path']} on its host, which "
                            "is not in a directory host h1 declared shared (`fusuma "
                            "storage add DIR --shared` there, for a directory it sees "
                            "too): it moves only to a host that shares its storage.")


def test_the_host_spec_declares_a_shared_directory(tmp_path: Path, paths: Paths,  # noqa: F811
                                                   db: Database) -> None:  # noqa: F811
    parts = PartitionManager(paths, db)
    text = (f'[[storage]]\npath = "{tmp_path}/nfs"\nshared = true\n'
            f'[[storage]]\npath = "{tmp_path}/local"\n')
    p = plan(db, parts, parse_spec(text, "h.toml"), "h.toml")
    assert p.add_storage == [f"{tmp_path}/nfs", f"{tmp_path}/local"]
    assert p.shared_storage == {f"{tmp_path}/nfs"}
    assert p.describe()[:2] == [f"declare shared storage directory {tmp_path}/nfs",
                                f"declare storage directory {tmp_path}/local"]
    storage.add(paths, db, str(tmp_path / "nfs"))          # declared, not shared
    with pytest.raises(SpecError) as exc:
        plan(db, parts, parse_spec(text, "h.toml"), "h.toml")
    assert str(exc.value) == (f"h.toml: storage[0].shared: {tmp_path}/nfs is declared not "
                              "shared on this host already; remove it (`fusuma storage "
                              "remove`) and declare it again to change that.")

