"""Backups without a VM: the chain's layout, the manifest written last and read back
checked, bad destinations refused with nothing changed, and the one QMP transaction a
backup sends (fusuma.images.backup, fusuma.supervisor.backups)."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
from pathlib import Path

import pytest

from fusuma.errors import ConflictError, NotFoundError, SpecError, StateError
from fusuma.images import backup as bk
from fusuma.qemu.cmdline import BOOT_DRIVE
from fusuma.state import VmRecord
from fusuma.supervisor.backups import Target, drives, filled, plan


def _config() -> bk.VmConfig:
    return bk.VmConfig(name="db0", partition="p0", memory_mib=384, vcpus=1, boot="uefi",
                       image="deb", image_sha256="a" * 64, machine="pc-q35-7.2",
                       qos="burstable", networks=["lan0"])


def _point(chain_dir: Path, incremental: bool, payload: bytes,
           last: bk.Manifest | None = None) -> bk.Manifest:
    """A point as the supervisor writes it, with a plain file for the disk."""
    pt, prev = bk.begin(chain_dir, incremental=incremental)
    assert (prev is None) == (not incremental)
    fd = os.open("boot.qcow2", os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600,
                 dir_fd=pt.dir_fd)
    os.write(fd, payload)
    os.close(fd)
    rfd = os.open("boot.qcow2", os.O_RDONLY, dir_fd=pt.dir_fd)
    digest, size = bk.digest_fd(rfd)
    os.close(rfd)
    previous = [] if prev is None else [*prev.previous, bk.read_point(chain_dir,
                                                                       prev.point)[1]]
    m = bk.Manifest(chain=(prev.chain if prev else "c" * 32), point=pt.number,
                    kind="incremental" if prev else "full", taken_at=1.0, seconds=0.5,
                    vm=_config(), disks=[bk.DiskEntry(BOOT_DRIVE, "boot.qcow2", 2**30,
                                                      digest, size)],
                    nvram=None, bitmap=bk.bitmap_name("c" * 32, pt.number),
                    previous=previous, frozen=True)
    bk.commit(pt, m)
    pt.close()
    return m


def test_a_chain_is_written_point_by_point_and_read_back_checked(tmp_path: Path) -> None:
    chain = tmp_path / "b"
    _point(chain, False, b"full" * 1000)
    _point(chain, True, b"incr")
    assert sorted(p.name for p in chain.iterdir()) == ["0001", "0002"]
    assert (chain / "0001").stat().st_mode & 0o777 == 0o700
    assert bk.points(chain) == [1, 2]
    c = bk.load_chain(chain)
    assert [m.kind for m in c.manifests] == ["full", "incremental"]
    assert c.last.previous == [bk.read_point(chain, 1)[1]]
    assert bk.load_chain(chain, 1).last.point == 1
    # The manifest is the last thing written: no temporary file is left.
    assert sorted(os.listdir(chain / "0002")) == ["boot.qcow2", "manifest.json"]


def test_a_point_without_its_manifest_does_not_exist_and_is_swept(tmp_path: Path) -> None:
    chain = tmp_path / "b"
    _point(chain, False, b"x")
    pt, _ = bk.begin(chain, incremental=True)        # killed before its manifest
    pt.close()
    assert bk.points(chain) == [1]
    assert bk.load_chain(chain).last.point == 1
    assert bk.sweep(chain) == ["0002"]
    assert not (chain / "0002").exists()


def test_bad_destinations_get_one_sentence_and_nothing_changes(tmp_path: Path) -> None:
    other = tmp_path / "other"
    other.mkdir()
    (other / "keep.txt").write_text("mine")
    for incremental in (False, True):
        with pytest.raises(ConflictError, match="exists and is not a backup"):
            bk.begin(other, incremental=incremental)
    assert os.listdir(other) == ["keep.txt"]
    afile = tmp_path / "file"
    afile.write_text("x")
    with pytest.raises(ConflictError, match="exists and is not a backup"):
        bk.begin(afile, incremental=False)
    with pytest.raises(NotFoundError, match="take a full backup first"):
        bk.begin(tmp_path / "none", incremental=True)
    assert not (tmp_path / "none").exists()
    chain = tmp_path / "b"
    _point(chain, False, b"x")
    with pytest.raises(ConflictError, match="holds a backup already; add --incremental"):
        bk.begin(chain, incremental=False)
    assert os.listdir(chain) == ["0001"]
    link = tmp_path / "link"
    link.symlink_to(chain)
    with pytest.raises(SpecError, match="symbolic link"):
        bk.begin(link, incremental=True)


def test_a_corrupt_manifest_or_a_changed_file_is_one_sentence(tmp_path: Path) -> None:
    chain = tmp_path / "b"
    _point(chain, False, b"full")
    _point(chain, True, b"incr")
    (chain / "0002" / "boot.qcow2").write_bytes(b"INCR")
    with pytest.raises(bk.CorruptManifest, match="is not the file the backup wrote"):
        bk.load_chain(chain)
    assert bk.load_chain(chain, 1).last.point == 1
    man = chain / "0001" / "manifest.json"
    d = json.loads(man.read_text())
    d["disks"][0]["file"] = "../../etc/passwd"
    man.write_text(json.dumps(d))
    with pytest.raises(bk.CorruptManifest, match=r"manifest .*0001/manifest.json is "
                                                  r"corrupt"):
        bk.load_chain(chain, 1)
    man.write_text("{not json")
    with pytest.raises(bk.CorruptManifest, match="is corrupt"):
        bk.load_chain(chain)
    assert os.listdir(chain / "0001")      # nothing removed by reading


def test_a_replaced_earlier_point_breaks_the_chain(tmp_path: Path) -> None:
    chain = tmp_path / "b"
    _point(chain, False, b"full")
    _point(chain, True, b"incr")
    man = chain / "0001" / "manifest.json"
    d = json.loads(man.read_text())
    d["seconds"] = 9.0                   # a valid manifest, but not the one 0002 follows
    man.write_text(json.dumps(d))
    with pytest.raises(bk.CorruptManifest, match="does not follow the points before it"):
        bk.load_chain(chain)


def test_targets_are_qcow2_made_by_root_for_the_vm_uid(tmp_path: Path) -> None:
    chain = tmp_path / "b"
    pt, _ = bk.begin(chain, incremental=False)
    fd = bk.create_target(pt, "boot.qcow2", 2**30, 4242, "../0001/boot.qcow2")
    st = os.fstat(fd)
    os.close(fd)
    assert (st.st_uid, st.st_mode & 0o777) == (4242, 0o600)
    info = json.loads(subprocess.run(
        ["qemu-img", "info", "--output=json", str(pt.path / "boot.qcow2")],
        capture_output=True, text=True, check=True).stdout)
    assert (info["format"], info["virtual-size"], info["backing-filename"]) == \
        ("qcow2", 2**30, "../0001/boot.qcow2")
    with pytest.raises(FileExistsError):
        bk.create_target(pt, "boot.qcow2", 2**30, 4242, None)
    bk.abandon(pt)
    assert not chain.exists()


def test_one_transaction_holds_every_disk_its_bitmap_and_its_job() -> None:
    ts = [Target(BOOT_DRIVE, "boot.qcow2", "n0", "j0"),
          Target("disk-d", "disk-d.qcow2", "n1", "j1")]
    full = plan(ts, "fusuma-backup-c-0001", None, 0)
    # The raw disk gets no bitmap (a raw file cannot keep one).
    assert [a["type"] for a in full] == ["block-dirty-bitmap-add", "blockdev-backup",
                                         "blockdev-backup"]
    assert full[0]["data"] == {"node": BOOT_DRIVE, "name": "fusuma-backup-c-0001",
                               "persistent": True}
    assert full[1]["data"] == {"job-id": "j0", "device": BOOT_DRIVE, "target": "n0",
                               "compress": True, "auto-dismiss": False, "sync": "full"}
    inc = plan(ts, "fusuma-backup-c-0002", "fusuma-backup-c-0001", 2**20)
    # The previous point's bitmap is read, never cleared by QEMU (bitmap-mode never):
    # fusuma deletes it only once the new point's manifest is written.
    assert inc[1]["data"] == {"job-id": "j0", "device": BOOT_DRIVE, "target": "n0",
                              "compress": True, "auto-dismiss": False, "sync": "bitmap",
                              "bitmap": "fusuma-backup-c-0001", "bitmap-mode": "never",
                              "speed": 2**20}
    # The raw disk, whole in an incremental point too.
    assert inc[2]["data"] == {"job-id": "j1", "device": "disk-d", "target": "n1",
                              "compress": True, "auto-dismiss": False, "sync": "full",
                              "speed": 2**20}


def test_which_disks_a_backup_copies() -> None:
    kernel = VmRecord(name="k", partition="p0", vcpus=1, memory_mib=256)
    with pytest.raises(StateError, match="no disk of its own to back up"):
        drives(kernel)
    raw = VmRecord(name="r", partition="p0", vcpus=1, memory_mib=256, image="deb",
                   boot="bios", disks=["data", "logs"])
    assert drives(raw) == [(BOOT_DRIVE, "boot.qcow2"), ("disk-data", "disk-data.qcow2"),
                           ("disk-logs", "disk-logs.qcow2")]
    ok = VmRecord(name="v", partition="p0", vcpus=1, memory_mib=256, image="deb",
                  boot="uefi")
    assert drives(ok) == [(BOOT_DRIVE, "boot.qcow2")]


def test_a_raw_disk_entry_names_its_disk_only_when_whole() -> None:
    e = bk.DiskEntry(drive="disk-data", file="disk-data.qcow2", virtual_size=2**20,
                     sha256="0" * 64)
    assert bk.raw_disk_of(e) == "data"
    for bad in (dataclasses.replace(e, drive="disk-other"),
                dataclasses.replace(e, backing="../0001/disk-data.qcow2"),
                dataclasses.replace(e, drive=BOOT_DRIVE, file="boot.qcow2")):
        assert bk.raw_disk_of(bad) is None, bad


def test_the_api_names_backups_never_paths(tmp_path: Path) -> None:
    from fusuma.paths import Paths
    from fusuma.state import Database

    paths = Paths(home=tmp_path / "home", runtime=tmp_path / "run", shm=tmp_path / "shm",
                  cache=tmp_path / "cache", cgroup_prefix="fusuma-unit-backups")
    db = Database(tmp_path / "state.db")
    assert bk.locate(paths, db, "nightly", anywhere=False) == tmp_path / "home" / \
        "backups" / "nightly"
    with pytest.raises(SpecError, match="over the API a backup is a name"):
        bk.locate(paths, db, "/etc/x", anywhere=False)
    with pytest.raises(SpecError, match="outside the storage directories"):
        bk.locate(paths, db, "/etc/x", anywhere=True)


def _io(path: Path, *cmds: str, fmt: str = "qcow2") -> None:
    argv = ["qemu-io", "-f", fmt]
    for c in cmds:
        argv += ["-c", c]
    subprocess.run([*argv, str(path)], check=True, capture_output=True)


def test_a_restore_flattens_every_point_onto_the_image(tmp_path: Path) -> None:
    """What the restored disk reads is what the chain's last point reads: data of the
    full point, of each incremental, and zeros the guest wrote over the image's data
    (``convert -B`` alone would copy only the top point's clusters)."""
    chain = tmp_path / "b"
    size = 64 * 2**20
    base = tmp_path / "base.raw"
    subprocess.run(["qemu-img", "create", "-q", "-f", "raw", str(base), str(size)],
                   check=True)
    _io(base, f"write -P 0x77 0 {size}", fmt="raw")
    sums: list[str] = []
    steps = [["write -P 0x11 0 8M", "write -z 8M 56M"],        # the full point
             ["write -P 0x22 16M 4M"],                        # what changed since
             ["write -z 0 1M", "write -P 0x33 32M 1M"]]
    for n, cmds in enumerate(steps, 1):
        pt, _ = bk.begin(chain, incremental=n > 1)
        backing = None if n == 1 else f"../{bk.point_name(n - 1)}/boot.qcow2"
        os.close(bk.create_target(pt, "boot.qcow2", size, 0, backing))
        _io(pt.path / "boot.qcow2", *cmds)
        fd = os.open("boot.qcow2", os.O_RDONLY, dir_fd=pt.dir_fd)
        digest, fsize = bk.digest_fd(fd)
        os.close(fd)
        m = bk.Manifest(chain="c" * 32, point=n, kind="full" if n == 1 else "incremental",
                        taken_at=1.0, seconds=0.1, vm=_config(),
                        disks=[bk.DiskEntry(BOOT_DRIVE, "boot.qcow2", size, digest, fsize,
                                            backing)],
                        nvram=None, bitmap=bk.bitmap_name("c" * 32, n), previous=sums[:],
                        frozen=False)
        bk.commit(pt, m)
        pt.close()
        sums.append(bk.read_point(chain, n)[1])
    c = bk.load_chain(chain)
    bk.check_backing(c)
    out = tmp_path / "restored.qcow2"
    bk.flatten(c, BOOT_DRIVE, out, base, "raw", 4242)
    assert out.stat().st_uid == 4242 and out.stat().st_mode & 0o777 == 0o600
    _io(out, "read -P 0 0 1M", "read -P 0x11 1M 7M", "read -P 0 8M 8M",
        "read -P 0x22 16M 4M", "read -P 0 20M 12M", "read -P 0x33 32M 1M",
        "read -P 0 33M 31M")
    info = json.loads(subprocess.run(["qemu-img", "info", "--output=json", str(out)],
                                     capture_output=True, text=True, check=True).stdout)
    assert info["backing-filename"] == str(base)
    # A file whose header names another backing file than its manifest: refused.
    top = chain / "0003" / "boot.qcow2"
    subprocess.run(["qemu-img", "rebase", "-u", "-b", "/etc/passwd", "-F", "raw",
                    str(top)], check=True)
    with pytest.raises(bk.CorruptManifest, match="is not the qcow2 its manifest"):
        bk.check_backing(bk.load_chain(chain, verify_files=False))


def test_a_full_filesystem_at_fusumas_own_write_is_the_same_one_sentence(
        tmp_path: Path) -> None:
    """The NVRAM's copy into a destination the block job has already filled fails with
    ENOSPC in the supervisor itself (seen in a CI run as "internal supervisor error:
    OSError(28, ...)"): it is the sentence a full filesystem gets, naming the
    directory and its free room; any other error is left as it is."""
    small = tmp_path / "small"
    small.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64k", "fusuma-test-full",
                    str(small)], check=True)
    try:
        with pytest.raises(OSError) as got:
            (small / "nvram.fd").write_bytes(b"\0" * 2**20)
        full = filled(got.value, "vm0", small / "b")
        assert isinstance(full, StateError)
        text = str(full)
        assert text.startswith(f"VM 'vm0': the backup into {small / 'b'} filled its "
                               "filesystem (0 MiB free of 0 MiB)"), text
        assert "nothing of it was kept and the VM runs on" in text
        assert filled(OSError(13, "Permission denied"), "vm0", small / "b") is None
        assert filled(ValueError("x"), "vm0", small / "b") is None
    finally:
        subprocess.run(["umount", str(small)], check=False)

