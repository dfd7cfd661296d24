"""Templates of VMs that boot by firmware, without a VM: the template's disk layer and
its clones' own files (fusuma.images.layers), a clone's disk chain in QEMU's argv, the
refusals (one sentence each, nothing made)."""

from __future__ import annotations

import json
import os
import subprocess
from dataclasses import replace
from pathlib import Path

import pytest

from fusuma.errors import HostError, ImageError, SpecError, StateError, TemplateError
from fusuma.images import layers, seed, store
from fusuma.memshare import clones
from fusuma.paths import Paths
from fusuma.qemu.cmdline import build_argv
from fusuma.state import Database, VmRecord
from fusuma.state.db import TemplateRecord
from fusuma.vm import boot
from tests.unit.test_image_store import KEY, db, fw_cfg, paths, raw_image

__all__ = ["db", "paths"]     # fixtures


def info(path: Path) -> dict[str, object]:
    out = subprocess.run(["qemu-img", "info", "--output=json", "-U", str(path)],
                         capture_output=True, text=True, check=True).stdout
    return dict(json.loads(out))


def iso_text(iso: Path, name: str) -> str:
    """A file of a seed ISO, read back by isoinfo (what the guest's mount reads)."""
    return subprocess.run(["isoinfo", "-i", str(iso), "-J", "-x", f"/{name}"],
                          capture_output=True, text=True, check=True).stdout


@pytest.fixture
def saved_vm(tmp_path: Path, paths: Paths, db: Database) -> tuple[Path, VmRecord]:
    """A UEFI VM's files as a save leaves them: its overlay (with data of its own), its
    NVRAM, its seed and the seed's inputs."""
    base = store.import_image(paths, db, "a", str(raw_image(tmp_path / "a.raw")),
                              anywhere=True)
    rec = db.add_vm(VmRecord("v", "p0", 1, 256, image="a", boot="uefi"), paths.vm_uids)
    vdir = paths.vm_dir("v")
    vdir.mkdir(parents=True)
    store.create_overlay(base, vdir / store.DISK, 16 * 2**20, os.getuid())
    subprocess.run(["qemu-io", "-f", "qcow2", "-c", "write -P 0x5a 1M 64k",
                    str(vdir / store.DISK)], check=True, capture_output=True)
    (vdir / store.NVRAM).write_bytes(b"VARS" * 1024)
    said = seed.Seed("v-1", "v", ssh_keys=(KEY,), user_data="#!/bin/sh\ntrue\n")
    seed.write(said, vdir / store.SEED)
    seed.save_inputs(said, vdir / store.SEED_INPUTS)
    return vdir, rec


def test_a_template_keeps_the_disk_and_each_clone_gets_its_own_files(
        tmp_path: Path, paths: Paths, db: Database,
        saved_vm: tuple[Path, VmRecord]) -> None:
    vdir, _ = saved_vm
    tdir = tmp_path / "templates" / "t"
    tdir.mkdir(parents=True)
    copied = layers.freeze(vdir, tdir, uefi=True)
    layer = layers.layer_path(tdir)
    # The layer: the VM's overlay as it was (its data, its backing file, the base),
    # root's and read-only; the NVRAM and the seed's inputs beside it.
    assert 64 * 1024 <= copied < 2**20           # holes stay holes
    assert layer.read_bytes() == (vdir / store.DISK).read_bytes()
    assert (layer.stat().st_mode & 0o777, layer.stat().st_uid) == (0o400, 0)
    assert info(layer)["backing-filename"] == str(store.store_dir(paths) / "a.raw")
    assert (tdir / store.NVRAM).read_bytes() == b"VARS" * 1024
    kept = json.loads((tdir / store.SEED_INPUTS).read_text())
    assert kept["ssh_keys"] == [KEY]
    assert kept["iso_bytes"] == (vdir / store.SEED).stat().st_size

    ids = set()
    for name in ("c1", "c2"):
        crec = db.add_vm(VmRecord(name, "p0", 1, 256, image="a", boot="uefi",
                                  template="t"), paths.vm_uids)
        boot.prepare_clone(paths, crec, tdir, ["52:54:00:aa:bb:0" + name[1]])
        cdir = paths.vm_dir(name)
        ov = cdir / store.DISK
        got = info(ov)
        # Its overlay: on the layer, of the layer's size, owned by its QEMU's uid.
        assert got["backing-filename"] == str(layer)
        assert got["virtual-size"] == 16 * 2**20
        assert (ov.stat().st_mode & 0o777, ov.stat().st_uid) == (0o600, crec.uid)
        # Its guest reads the template's disk through it.
        out = subprocess.run(["qemu-io", "-r", "-f", "qcow2", "-c", "read -P 0x5a 1M 64k",
                              str(ov)], capture_output=True, text=True, check=True).stdout
        assert "read 65536/65536" in out
        assert (cdir / store.NVRAM).read_bytes() == b"VARS" * 1024
        assert (cdir / store.NVRAM).stat().st_uid == crec.uid
        # Its seed: a new instance id, its name, the template's keys and user-data,
        # its MAC; as large as the template's (what the guest's device has).
        meta = iso_text(cdir / store.SEED, "meta-data")
        assert f'local-hostname: "{name}"' in meta
        instance = meta.split('instance-id: "')[1].split('"')[0]
        assert instance.startswith(f"{name}-") and instance != "v-1"
        ids.add(instance)
        assert KEY in iso_text(cdir / store.SEED, "user-data")
        assert f"52:54:00:aa:bb:0{name[1]}" in iso_text(cdir / store.SEED, "network-config")
        assert (cdir / store.SEED).stat().st_size == kept["iso_bytes"]
        assert seed.load_inputs(cdir / store.SEED_INPUTS).instance_id == instance
        # It resumes its template's guest until that guest runs; then boots its disk.
        assert clones.resumes(paths, crec)
        layers.used(cdir)
        assert not clones.resumes(paths, crec)
        assert clones.resumes(paths, replace(crec, boot="kernel"))
        assert not clones.resumes(paths, replace(crec, template=None))
    assert len(ids) == 2
    # The layer was opened by no one for writing.
    assert layer.read_bytes() == (vdir / store.DISK).read_bytes()


def test_a_failed_clone_leaves_nothing(tmp_path: Path, paths: Paths, db: Database,
                                       saved_vm: tuple[Path, VmRecord]) -> None:
    vdir, _ = saved_vm
    tdir = tmp_path / "t"
    tdir.mkdir()
    layers.freeze(vdir, tdir, uefi=False)
    assert not (tdir / store.NVRAM).exists()
    crec = db.add_vm(VmRecord("c", "p0", 1, 256, image="a", boot="bios", template="t"),
                     paths.vm_uids)
    (tdir / store.SEED_INPUTS).chmod(0o600)
    kept = json.loads((tdir / store.SEED_INPUTS).read_text())
    (tdir / store.SEED_INPUTS).write_text(json.dumps({**kept, "iso_bytes": 2048}))
    with pytest.raises(ImageError, match="more than the 2048 its template's guest has"):
        boot.prepare_clone(paths, crec, tdir, [])
    assert not paths.vm_dir("c").exists()
    layers.layer_path(tdir).unlink()
    with pytest.raises(HostError, match=r"clone 'c': its files could not be made from "
                       r"template 't' \(No such file or directory\); nothing was kept"):
        boot.prepare_clone(paths, crec, tdir, [])
    assert not paths.vm_dir("c").exists()


def test_a_seed_from_an_older_fusuma_and_a_layer_not_qcow2_are_refused(
        tmp_path: Path, saved_vm: tuple[Path, VmRecord]) -> None:
    vdir, _ = saved_vm
    (vdir / store.SEED_INPUTS).unlink()
    with pytest.raises(TemplateError, match="written by an older fusuma"):
        layers.freeze(vdir, tmp_path, uefi=True)
    head = bytearray((vdir / store.DISK).read_bytes()[:32])
    head[24:32] = (2**60).to_bytes(8, "big")
    for data, says in ((b"\0" * 64, "is not a qcow2 image"),
                       (bytes(head), "impossible size")):
        bad = tmp_path / "bad"
        bad.write_bytes(data)
        fd = os.open(bad, os.O_RDONLY)
        try:
            with pytest.raises(ImageError, match=says):
                layers.qcow2_size(fd, "bad")
        finally:
            os.close(fd)


def test_a_clones_disk_chain_in_the_argv() -> None:
    cfg = fw_cfg()
    assert cfg.thin_disk is not None
    cfg = replace(cfg, thin_disk=replace(cfg.thin_disk, layer=Path("/h/templates/t/disk.qcow2"),
                                         layer_fd=14))
    argv = build_argv(cfg)
    drives = [argv[i + 1] for i, a in enumerate(argv) if a == "-drive"]
    assert drives[0] == (
        "file=/dev/fdset/1,format=qcow2,if=none,id=disk-fusuma-boot,file.locking=off,"
        "backing.driver=qcow2,backing.file.filename=/dev/fdset/3,"
        "backing.backing.driver=qcow2,backing.backing.file.filename=/dev/fdset/2")
    assert "fd=14,set=3,opaque=disk-fusuma-layer" in argv
    assert sorted(cfg.passed_fds()) == [10, 11, 12, 13, 14]


def test_a_clone_takes_its_templates_boot_options_and_an_image_its_templates(
        tmp_path: Path, paths: Paths, db: Database) -> None:
    with pytest.raises(SpecError, match="a clone of template 't' boots as its template's "
                       "guest did, with its disk, keys and user-data; leave out --boot, "
                       "--ssh-key"):
        boot.check_clone_fields("t", ["--boot", "--ssh-key"])
    boot.check_clone_fields("t", [])
    store.import_image(paths, db, "a", str(raw_image(tmp_path / "a.raw")), anywhere=True)
    db.add_template(TemplateRecord(name="t", ram_path="/r", state_path="/s",
                                   size_bytes=1, memory_mib=256, vcpus=1, machine="m",
                                   qemu_version="10.0.2", devices="{}", image="a",
                                   state_sha256="0", source_vm="v"), paths.template_gids)
    with pytest.raises(StateError, match=r"base of template\(s\) t; delete them first"):
        store.delete_image(db, "a")
    db.remove_template("t")
    store.delete_image(db, "a")
