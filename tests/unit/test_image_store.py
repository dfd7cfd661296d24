"""The image store without QEMU: imports of real qcow2 and raw files (qemu-img makes
them), every refusal leaving nothing behind, delete refused while a VM's disk is on an
image, thin disks, the cloud-init seed and the argv of a firmware boot."""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import re
import subprocess
from dataclasses import replace
from pathlib import Path

import pytest

from fusuma.errors import ConflictError, NotFoundError, SpecError, StateError
from fusuma.images import seed, store
from fusuma.paths import Paths
from fusuma.qemu import recorded
from fusuma.qemu.cmdline import (
    DeviceSetMismatch,
    ThinDisk,
    Uefi,
    VmConfig,
    build_argv,
    device_set,
)
from fusuma.state import Database, PartitionRecord, VmRecord
from fusuma.vm import boot
from tests.unit import test_storage

paths = test_storage.paths      # the same fixture: the state file and dirs in tmp_path


@pytest.fixture
def db(paths: Paths) -> Database:
    d = Database(paths.db)
    d.add_partition(PartitionRecord("p0", [0], 1024))
    return d


def qemu_img(*args: str) -> None:
    subprocess.run(["qemu-img", *args], check=True, capture_output=True)


def raw_image(path: Path, mib: int = 8) -> Path:
    with open(path, "wb") as f:
        f.write(b"\xeb\x63boot" + bytes(505) + b"\x55\xaa")   # a boot sector, then holes
        f.truncate(mib * 2**20)
        f.seek(3 * 2**20)
        f.write(b"data" * 1024)
    return path


def left_in_store(paths: Paths) -> list[str]:
    d = store.store_dir(paths)
    return sorted(p.name for p in d.iterdir()) if d.exists() else []


def test_import_raw_and_qcow2_read_only_with_their_checksum(tmp_path: Path, paths: Paths,
                                                             db: Database) -> None:
    src = raw_image(tmp_path / "a.raw")
    qemu_img("convert", "-O", "qcow2", str(src), str(tmp_path / "a.qcow2"))
    r = store.import_image(paths, db, "rawimg", str(src), anywhere=True)
    q = store.import_image(paths, db, "qimg", str(tmp_path / "a.qcow2"), anywhere=True)
    assert (r.format, r.virtual_size) == ("raw", 8 * 2**20)
    assert (q.format, q.virtual_size) == ("qcow2", 8 * 2**20)
    for rec, original in ((r, src), (q, tmp_path / "a.qcow2")):
        st = os.stat(rec.path)
        assert oct(st.st_mode & 0o777) == oct(0o444) and st.st_uid == os.getuid()
        assert rec.sha256 == hashlib.sha256(original.read_bytes()).hexdigest()
        assert store.sha256_of(Path(rec.path)) == rec.sha256
        assert store.verify(rec) is None
    # The raw copy keeps its holes: far fewer blocks than its size.
    assert os.stat(r.path).st_blocks * 512 < 1 * 2**20
    assert oct(store.store_dir(paths).stat().st_mode & 0o777) == oct(0o700)
    assert [i.name for i in db.images()] == ["qimg", "rawimg"]
    assert left_in_store(paths) == ["qimg.qcow2", "rawimg.raw"]


@pytest.mark.parametrize("make, says", [
    (lambda d: qemu_img("create", "-q", "-f", "qcow2", "-F", "raw", "-b",
                        str(raw_image(d / "b.raw")), str(d / "img")),
     "has a backing file"),
    (lambda d: qemu_img("create", "-q", "-f", "vmdk", str(d / "img"), "8M"),
     "is in format vmdk, which fusuma does not import"),
    (lambda d: qemu_img("create", "-q", "-f", "qcow2", "-o",
                        f"data_file={d / 'data.bin'}", str(d / "img"), "8M"),
     "keeps its data in an external file"),
])
def test_refused_imports_leave_nothing(tmp_path: Path, paths: Paths, db: Database,
                                       make: object, says: str) -> None:
    make(tmp_path)  # type: ignore[operator]
    with pytest.raises(SpecError, match=says):
        store.import_image(paths, db, "bad", str(tmp_path / "img"), anywhere=True)
    assert db.images() == [] and left_in_store(paths) == []


def test_a_raw_file_that_looks_like_qcow2_with_a_backing_file_is_refused(
        tmp_path: Path, paths: Paths, db: Database) -> None:
    """Probing the format of a "raw" image: a qcow2 header pointing at a host file is
    found as such, and refused."""
    qemu_img("create", "-q", "-f", "qcow2", "-F", "raw", "-b", "/etc/passwd",
             str(tmp_path / "x.raw"), "1M")
    with pytest.raises(SpecError, match=r"has a backing file \(/etc/passwd\)"):
        store.import_image(paths, db, "x", str(tmp_path / "x.raw"), anywhere=True)


def test_names_and_places(tmp_path: Path, paths: Paths, db: Database) -> None:
    src = raw_image(tmp_path / "a.raw")
    with pytest.raises(ConflictError, match="name of an image fusuma builds"):
        store.import_image(paths, db, "minimal", str(src), anywhere=True)
    with pytest.raises(SpecError, match="not allowed"):
        store.import_image(paths, db, "../x", str(src), anywhere=True)
    store.import_image(paths, db, "a", str(src), anywhere=True)
    with pytest.raises(ConflictError, match="already exists"):
        store.import_image(paths, db, "a", str(src), anywhere=True)
    # Over the API: only a file of its own inside a storage directory.
    with pytest.raises(SpecError, match="outside the storage directories"):
        store.import_image(paths, db, "b", str(src), anywhere=False)
    disks = paths.home / "disks"
    disks.mkdir(parents=True)
    (disks / "link.raw").symlink_to(src)
    with pytest.raises(SpecError, match="is a symbolic link"):
        store.import_image(paths, db, "b", str(disks / "link.raw"), anywhere=False)
    os.link(src, disks / "hard.raw")
    with pytest.raises(SpecError, match="hard links"):
        store.import_image(paths, db, "b", str(disks / "hard.raw"), anywhere=False)
    raw_image(disks / "ok.raw")
    assert store.import_image(paths, db, "b", str(disks / "ok.raw"),
                              anywhere=False).format == "raw"
    with pytest.raises(SpecError, match="not a regular file"):
        store.import_image(paths, db, "c", "/dev/null", anywhere=True)
    os.mkfifo(tmp_path / "fifo")     # never opened: the import would block on it
    with pytest.raises(SpecError, match="not a regular file"):
        store.import_image(paths, db, "c", str(tmp_path / "fifo"), anywhere=True)


def test_delete_is_refused_while_a_vm_is_on_it(tmp_path: Path, paths: Paths,
                                               db: Database) -> None:
    rec = store.import_image(paths, db, "a", str(raw_image(tmp_path / "a.raw")),
                             anywhere=True)
    for vm in ("v1", "v2"):
        db.add_vm(VmRecord(vm, "p0", 1, 256, image="a", boot="bios"))
    with pytest.raises(StateError, match=r"base of VM\(s\) v1, v2; delete them first"):
        store.delete_image(db, "a")
    db.remove_vm("v1")
    db.remove_vm("v2")
    store.delete_image(db, "a")
    assert not Path(rec.path).exists() and db.images() == []
    with pytest.raises(NotFoundError):
        store.delete_image(db, "a")


def test_thin_disk_on_the_base(tmp_path: Path, paths: Paths, db: Database) -> None:
    base = store.import_image(paths, db, "a", str(raw_image(tmp_path / "a.raw")),
                              anywhere=True)
    ov = tmp_path / "vm" / "disk.qcow2"
    store.create_overlay(base, ov, store.parse_size("16M"), os.getuid())
    info = json.loads(subprocess.run(["qemu-img", "info", "--output=json", "-U", str(ov)],
                                     capture_output=True, text=True, check=True).stdout)
    assert info["format"] == "qcow2" and info["virtual-size"] == 16 * 2**20
    assert info["backing-filename"] == base.path
    assert info["backing-filename-format"] == "raw"
    assert oct(ov.stat().st_mode & 0o777) == oct(0o600)
    with pytest.raises(SpecError, match="smaller than image 'a'"):
        store.create_overlay(base, tmp_path / "vm" / "small.qcow2", 2**20, os.getuid())
    with pytest.raises(ConflictError, match="exists already"):
        store.create_overlay(base, ov, None, os.getuid())
    os.chmod(base.path, 0o644)
    with pytest.raises(StateError, match="writable"):
        store.create_overlay(base, tmp_path / "vm" / "x.qcow2", None, os.getuid())


@pytest.mark.parametrize("text, size", [("8G", 8 * 2**30), ("512M", 512 * 2**20),
                                        ("1048576", 2**20), ("2GiB", 2 * 2**30)])
def test_sizes(text: str, size: int) -> None:
    assert store.parse_size(text) == size


@pytest.mark.parametrize("text", ["", "G", "-1G", "1.5G", "8X", "0"])
def test_bad_sizes(text: str) -> None:
    with pytest.raises(SpecError, match="is not a size"):
        store.parse_size(text)


KEY = "ssh-ed25519 AAAAC3NzaC1lZDI1NTE5AAAAIOMqqnkVzrm0SdG6UOoqKLsabgH5C9okWi0dh2l9GKJl me@h"


def test_seed_contents() -> None:
    s = seed.Seed("v1-abc", "v1", ssh_keys=(KEY,), user_data="#!/bin/sh\necho hi\n",
                  macs=("52:54:00:00:00:01",))
    assert seed.meta_data(s) == 'instance-id: "v1-abc"\nlocal-hostname: "v1"\n'
    ud = seed.user_data(s)
    assert ud.startswith("Content-Type: multipart/mixed")
    assert "text/cloud-config" in ud and "text/x-shellscript" in ud
    assert f'ssh_authorized_keys:\n  - "{KEY}"' in ud
    net = json.loads(seed.network_config(s) or "")
    assert net["ethernets"]["nic0"]["match"]["macaddress"] == "52:54:00:00:00:01"
    only_keys = seed.user_data(seed.Seed("i", "h", ssh_keys=(KEY,)))
    assert only_keys.startswith("#cloud-config\n")
    assert seed.network_config(seed.Seed("i", "h")) is None
    # A NIC on a network whose MTU is not 1500 (spanning hosts) gets it set.
    two = seed.Seed("i", "h", macs=("52:54:00:00:00:01", "52:54:00:00:00:02"),
                    mtus=(("52:54:00:00:00:02", 1450),))
    eth = json.loads(seed.network_config(two) or "")["ethernets"]
    assert "mtu" not in eth["nic0"]
    assert eth["nic1"] == {"match": {"macaddress": "52:54:00:00:00:02"},
                           "set-name": "eth1", "dhcp4": True, "mtu": 1450}


def test_keys_are_checked() -> None:
    assert seed.check_keys([f"# mine\n{KEY}\n\n"]) == [KEY]
    with pytest.raises(SpecError, match="is a private key"):
        seed.check_keys(["-----BEGIN OPENSSH PRIVATE KEY-----\nabc\n"])
    with pytest.raises(SpecError, match="not an SSH public key"):
        seed.check_keys(["hello"])


def test_seed_iso_is_labelled_cidata(tmp_path: Path) -> None:
    path = tmp_path / "seed.iso"
    seed.write(seed.Seed("v1-abc", "v1", ssh_keys=(KEY,)), path)
    head = path.read_bytes()[16 * 2048:17 * 2048]     # the primary volume descriptor
    assert head[1:6] == b"CD001" and head[40:46].lower() == b"cidata"
    assert oct(path.stat().st_mode & 0o777) == oct(0o400)


def fw_cfg(**kw: object) -> VmConfig:
    base: dict[str, object] = dict(
        name="vm0", vcpus=1, memory_mib=256, accel="tcg", kernel=None, initrd=None,
        append="", qmp_socket=Path("/r/qmp.sock"), qga_socket=Path("/r/qga.sock"),
        console_socket=Path("/r/console.sock"), console_log=Path("/h/console.log"),
        pidfile=Path("/r/qemu.pid"), ram_file=Path("/dev/shm/fusuma/vm0.ram"),
        thin_disk=ThinDisk(Path("/h/vms/vm0/disk.qcow2"), Path("/h/images/a.qcow2"),
                           "qcow2", fds=(10, 11), base_fd=12),
        seed=Path("/h/vms/vm0/seed.iso"), seed_fd=13)
    base.update(kw)
    return VmConfig(**base)  # type: ignore[arg-type]


def test_firmware_boot_argv() -> None:
    argv = build_argv(fw_cfg())
    assert "-kernel" not in argv and "-append" not in argv and "-initrd" not in argv
    drives = [argv[i + 1] for i, a in enumerate(argv) if a == "-drive"]
    assert drives == [
        "file=/dev/fdset/1,format=qcow2,if=none,id=disk-fusuma-boot,file.locking=off,"
        "backing.driver=qcow2,backing.file.filename=/dev/fdset/2",
        "file=/dev/fdset/3,format=raw,if=none,id=disk-fusuma-seed,readonly=on"]
    assert "fd=12,set=2,opaque=disk-fusuma-base" in argv
    # The boot disk is the first disk (no bootindex: the firmware boots the first).
    blk = [argv[i + 1] for i, a in enumerate(argv) if a == "-device"
           and argv[i + 1].startswith("virtio-blk-pci")]
    assert blk == ["virtio-blk-pci,drive=disk-fusuma-boot,serial=fusuma-boot",
                   "virtio-blk-pci,drive=disk-fusuma-seed,serial=fusuma-seed"]
    assert sorted(fw_cfg().passed_fds()) == [10, 11, 12, 13]
    # What a move's destination gets: the recorded set passes the allow-list.
    ds = device_set(fw_cfg(machine="pc-q35-7.2"))
    assert recorded.parse_device_set(ds.dumps()) == ds


def test_uefi_argv() -> None:
    argv = build_argv(fw_cfg(uefi=Uefi(Path("/usr/share/OVMF/OVMF_CODE_4M.fd"),
                                       Path("/h/vms/vm0/nvram.fd"), code_fd=20,
                                       vars_fds=(21, 22))))
    drives = [argv[i + 1] for i, a in enumerate(argv) if a == "-drive"]
    assert drives[:2] == [
        "if=pflash,format=raw,unit=0,readonly=on,file=/dev/fdset/1",
        "if=pflash,format=raw,unit=1,file=/dev/fdset/2,file.locking=off"]
    assert "fd=20,set=1,opaque=uefi-code" in argv and "fd=21,set=2,opaque=uefi-vars" in argv
    assert "fd=22,set=2,opaque=uefi-vars" in argv


def test_boot_follows_the_image(tmp_path: Path, paths: Paths, db: Database) -> None:
    assert boot.resolve(db, "minimal", None) == ("kernel", None)
    with pytest.raises(SpecError, match="--boot uefi needs an imported disk image"):
        boot.resolve(db, "minimal", "uefi")
    with pytest.raises(NotFoundError, match="there is no image named 'nope'"):
        boot.resolve(db, "nope", None)
    store.import_image(paths, db, "a", str(raw_image(tmp_path / "a.raw")), anywhere=True)
    assert boot.resolve(db, "a", None)[0] == "bios"
    assert boot.resolve(db, "a", "uefi")[0] == "uefi"
    with pytest.raises(SpecError, match="booted by firmware"):
        boot.resolve(db, "a", "kernel")
    with pytest.raises(SpecError, match="--ssh-key apply to a VM of an imported image"):
        boot.check_spec_fields("kernel", disk_size=None, ssh_keys=[KEY], user_data=None,
                               segments=[])


def test_host_moves_of_a_stopped_firmware_vm_or_a_clone_are_refused() -> None:
    kernel = VmRecord("k", "p0", 1, 256)
    boot.check_host_move(kernel, "h2", running=False)
    fw = VmRecord("f", "p0", 1, 256, image="a", boot="uefi")
    boot.check_host_move(fw, "h2", running=True)                 # its disk is mirrored
    with pytest.raises(StateError, match="start it, then move it to host 'h2'"):
        boot.check_host_move(fw, "h2", running=False)
    clone = VmRecord("c", "p0", 1, 256, image="a", boot="bios", template="t")
    with pytest.raises(StateError, match="clone of template 't', whose disk layer is a "
                       "file of this host"):
        boot.check_host_move(clone, "h2", running=True)
    # Snapshots are files of this host the move does not carry: refused, any boot.
    for rec in (kernel, fw):
        with pytest.raises(StateError, match=r"has snapshots \(before-upgrade\), which a "
                           "move to host 'h2' would not carry"):
            boot.check_host_move(rec, "h2", running=True, snapshots=["before-upgrade"])


UEFI = Uefi(Path("/usr/share/OVMF/OVMF_CODE_4M.fd"), Path("/h/vms/vm0/nvram.fd"),
            code_fd=20, vars_fds=(21, 22))


def test_the_firmware_is_recorded_and_a_destination_must_boot_the_same() -> None:
    bios = device_set(fw_cfg(machine="pc-q35-7.2"))
    uefi = device_set(fw_cfg(machine="pc-q35-7.2", uefi=UEFI))
    kernel = device_set(fw_cfg(machine="pc-q35-7.2", thin_disk=None, seed=None,
                               seed_fd=None))
    assert (bios.firmware, uefi.firmware, kernel.firmware) == ("bios", "uefi", None)
    # A kernel boot's record is what it was (no field); a firmware's passes the list.
    assert "firmware" not in kernel.as_json()
    for ds in (bios, uefi, kernel):
        assert recorded.parse_device_set(ds.dumps()) == ds
        assert type(ds).loads(ds.dumps()) == ds
    # A destination given the recorded set must have the same firmware: OVMF's pflash
    # devices are part of what the guest sees.
    argv = build_argv(fw_cfg(uefi=UEFI, devices=uefi, incoming="defer"))
    assert "if=pflash,format=raw,unit=1,file=/dev/fdset/2,file.locking=off" in argv
    with pytest.raises(DeviceSetMismatch, match="VM vm0 booted by uefi, and its "
                       "definition now boots by bios"):
        build_argv(fw_cfg(devices=uefi, incoming="defer"))
    with pytest.raises(DeviceSetMismatch, match="booted by bios, and its definition "
                       "now boots by uefi"):
        build_argv(fw_cfg(uefi=UEFI, devices=bios, incoming="defer"))
    # A set recorded before the field: no check (what the VM's record says is used).
    build_argv(fw_cfg(uefi=UEFI, devices=replace(uefi, firmware=None), incoming="defer"))


@pytest.mark.parametrize("firmware, says", [
    ("pflash", "firmware 'pflash' is not bios or uefi"),
    ("uefi,readonly=off", "firmware is longer than 8 characters"),
    (7, "firmware is int, not a string"),
])
def test_a_recorded_firmware_is_one_of_fusumas(firmware: object, says: str) -> None:
    d = device_set(fw_cfg(machine="pc-q35-7.2", uefi=UEFI)).as_json()
    d["firmware"] = firmware
    with pytest.raises(recorded.DeviceSetRefused, match=re.escape(says)):
        recorded.parse_device_set(json.dumps(d))


def test_a_recorded_firmware_needs_the_boot_disk() -> None:
    d = device_set(fw_cfg(machine="pc-q35-7.2", thin_disk=None, seed=None,
                          seed_fd=None)).as_json()
    d["firmware"] = "bios"
    with pytest.raises(recorded.DeviceSetRefused, match="it boots by bios but has no boot "
                       "disk"):
        recorded.parse_device_set(json.dumps(d))


def test_a_killed_import_leaves_no_record_and_its_copy_is_swept(
        tmp_path: Path, paths: Paths, db: Database) -> None:
    """An import killed mid-copy leaves a partial file and no record; the next import
    (or `image list`) removes it, never one a live import holds (its flock), whatever
    pid its name carries; an image file without a record (an import killed between
    its rename and its commit) goes too."""
    d = store.store_dir(paths)
    d.mkdir(parents=True)
    (d / f"{store.TMP_PREFIX}x-{os.getpid()}-1").write_bytes(b"partial")   # pid alive
    live = d / f"{store.TMP_PREFIX}y-1-1"
    live.write_bytes(b"busy")
    (d / "orphan.qcow2").write_bytes(b"renamed, never recorded")
    fd = os.open(live, os.O_RDONLY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        store.import_image(paths, db, "a", str(raw_image(tmp_path / "a.raw")),
                           anywhere=True)
        assert left_in_store(paths) == [live.name, "a.raw"]
        assert [i.name for i in db.images()] == ["a"]
    finally:
        os.close(fd)
    assert store.sweep(paths, db) == [live.name]
    assert left_in_store(paths) == ["a.raw"]


def test_api_import_names_only_files_in_storage_directories(paths: Paths) -> None:
    from fastapi.testclient import TestClient

    from fusuma.api.app import Limits, create_app
    from fusuma.api.server import LocalAuth

    client = TestClient(LocalAuth(Limits(create_app(paths)), "fusuma"),
                        raise_server_exceptions=False)
    r = client.post("/1.0/images/import", json={"name": "x", "path": "/etc/shadow"})
    assert r.status_code == 400 and "outside the storage directories" in r.json()["error"]
    r = client.post("/1.0/images/import", json={"name": "minimal", "path": "/x/y"})
    assert r.status_code == 409 and "an image fusuma builds" in r.json()["error"]
    r = client.get("/1.0/images/nope")
    assert r.status_code == 404 and "no imported image named 'nope'" in r.json()["error"]
    disks = paths.home / "disks"
    disks.mkdir(parents=True)
    raw_image(disks / "ok.raw")
    r = client.post("/1.0/images/import", json={"name": "ok", "path": str(disks / "ok.raw")})
    assert r.status_code == 202, r.text
    done = client.get(f"/1.0/operations/{r.json()['id']}/wait",
                      params={"timeout": 30}).json()
    assert done["status"] == "Success", done
    got = client.get("/1.0/images/ok").json()
    assert got["format"] == "raw" and got["source"] == str(disks / "ok.raw")
    assert client.delete("/1.0/images/ok").json() == {"deleted": "/1.0/images/ok"}


def test_a_firmware_boot_gets_the_larger_translation_cache_and_counts_it(
        monkeypatch: pytest.MonkeyPatch) -> None:
    from fusuma.qemu.cmdline import FIRMWARE_TCG_TB_MIB, TCG_TB_MIB, overhead_mib

    monkeypatch.delenv("FUSUMA_TCG_TB_MIB", raising=False)

    def accel(argv: list[str]) -> str:
        return argv[argv.index("-accel") + 1]
    assert accel(build_argv(fw_cfg())) == f"tcg,tb-size={FIRMWARE_TCG_TB_MIB}"
    assert FIRMWARE_TCG_TB_MIB > TCG_TB_MIB
    assert overhead_mib("tcg", firmware=True) - overhead_mib("tcg") == \
        FIRMWARE_TCG_TB_MIB - TCG_TB_MIB
    assert overhead_mib("kvm", firmware=True) == overhead_mib("kvm")
    monkeypatch.setenv("FUSUMA_TCG_TB_MIB", "64")       # the override wins for both
    assert accel(build_argv(fw_cfg())) == "tcg,tb-size=64"
    assert overhead_mib("tcg", firmware=True) == overhead_mib("tcg")
