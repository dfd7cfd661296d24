"""A user's own disk image, booted by firmware: a Debian disk with cloud-init and
extlinux and GRUB, built from Debian packages (fusuma.images.diskimage, cached in
FUSUMA_CACHE), imported like any user's image. Two VMs on the one read-only base boot
at the same time, one by SeaBIOS and one by OVMF; cloud-init gives each its hostname,
the SSH key and runs the user-data; the base's checksum is unchanged and both QEMUs
hold its one inode.

Under TCG a Debian with systemd and cloud-init takes about a minute to boot: the two
guests boot together, once, and every check runs against them."""

from __future__ import annotations

import os
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from fusuma.images import diskimage, store
from tests.conftest import Host

pytestmark = [pytest.mark.integration, pytest.mark.timeout(900)]

KEY = "ssh-ed25519 AAAAC3NzaC1lZDI1NTE5AAAAIOMqqnkVzrm0SdG6UOoqKLsabgH5C9okWi0dh2l9GKJl t@fz"
USER_DATA = """#!/bin/sh
echo "user-data ran on $(hostname)" > /var/lib/fusuma-user-data
echo FUSUMA-USER-DATA-DONE > /dev/ttyS0
"""
VMS = {"vb": "bios", "vu": "uefi"}


@pytest.fixture(scope="module")
def disk_image() -> Path:
    cache = Path(os.environ.get("FUSUMA_CACHE", "/var/cache/fusuma"))
    return diskimage.build(cache)


def holds_inode(pid: int, st: os.stat_result) -> bool:
    """Whether process ``pid`` has the file ``st`` open (the kernel's view)."""
    for fd in Path(f"/proc/{pid}/fd").iterdir():
        try:
            s = fd.stat()
        except OSError:
            continue
        if (s.st_dev, s.st_ino) == (st.st_dev, st.st_ino):
            return True
    return False


def guest_file(host: Host, vm: str, path: str, deadline: float) -> str:
    """A file's text in the guest, once it exists (cloud-init's final stage runs after
    the agent answers)."""
    while True:
        res = host.run("vm", "exec", vm, "--", "/bin/cat", path, check=False, timeout=60)
        if res.code == 0 or time.monotonic() > deadline:
            return res.out
        time.sleep(2)


def test_imported_image_boots_by_bios_and_uefi_with_cloud_init_on_a_shared_base(
        host: Host, disk_image: Path, tmp_path: Path) -> None:
    t0 = time.monotonic()
    imported = host.run("image", "import", "deb", str(disk_image), "--json").json()
    import_s = time.monotonic() - t0
    base = Path(imported["path"])
    st = base.stat()
    assert (st.st_mode & 0o777, st.st_uid) == (0o444, 0)
    assert imported["format"] == "qcow2" and imported["virtual_size"] == diskimage.SIZE
    assert imported["sha256"] == store.sha256_of(disk_image) == store.sha256_of(base)
    key = tmp_path / "id.pub"
    key.write_text(KEY + "\n")
    ud = tmp_path / "user-data"
    ud.write_text(USER_DATA)
    host.run("partition", "create", "p0", "--cpus", "0-1", "--memory", "1200")

    # Bad input: one sentence each, nothing made.
    priv = tmp_path / "id"
    priv.write_text("-----BEGIN OPENSSH PRIVATE KEY-----\nb3Blbn\n")
    for args, says in (
            (("--boot", "kernel"), "is an imported disk image, booted by firmware"),
            (("--ssh-key", str(priv)), "SSH key 1 is a private key"),
            (("--disk-size", "1G"), "disk size 1G is smaller than image 'deb'"),
            (("--image", "nope"), "there is no image named 'nope'")):
        err = host.fail("vm", "create", "bad", "-p", "p0", "--image", "deb", *args).err
        assert says in err, err
    assert "bad" not in [v["name"] for v in host.ps()["vms"]]
    assert not (host.home / "vms" / "bad").exists()

    t_create = time.monotonic()
    for vm, boot in VMS.items():
        t = time.monotonic()
        host.run("vm", "create", vm, "-p", "p0", "--image", "deb", "--memory", "384",
                 "--boot", boot, "--disk-size", "3G", "--ssh-key", str(key),
                 "--user-data", str(ud))
        assert time.monotonic() - t < 10
        disk = host.home / "vms" / vm / "disk.qcow2"
        assert disk.stat().st_mode & 0o777 == 0o600
    assert (host.home / "vms" / "vu" / "nvram.fd").stat().st_mode & 0o777 == 0o600
    assert not (host.home / "vms" / "vb" / "nvram.fd").exists()
    with ThreadPoolExecutor(len(VMS)) as pool:     # both boot at once
        list(pool.map(lambda vm: host.run("vm", "start", vm, "--wait", "--timeout", "400",
                                          timeout=450), VMS))
    boot_s = time.monotonic() - t_create

    deadline = time.monotonic() + 300
    pids = []
    for vm in VMS:
        v = host.vm(vm)
        pids.append(v["pid"])
        # cloud-init: the hostname, the key for the image's default user, the user-data.
        assert host.run("vm", "exec", vm, "--", "/bin/hostname").out.strip() == vm
        assert guest_file(host, vm, "/var/lib/fusuma-user-data", deadline) == \
            f"user-data ran on {vm}\n"
        keys = guest_file(host, vm, "/home/debian/.ssh/authorized_keys", deadline)
        assert KEY in keys
        # The thin disk is 3G; QEMU runs as the VM's own uid, which owns its disk.
        size = host.run("vm", "exec", vm, "--", "/bin/cat", "/sys/block/vda/size").out
        assert int(size) * 512 == 3 * 2**30
        uid = int(next(line.split()[1] for line in
                       Path(f"/proc/{v['pid']}/status").read_text().splitlines()
                       if line.startswith("Uid:")))
        assert uid != 0 and (host.home / "vms" / vm / "disk.qcow2").stat().st_uid == uid
        # The guest booted by the firmware asked for.
        efi = host.run("vm", "exec", vm, "--", "/usr/bin/test", "-d", "/sys/firmware/efi",
                       check=False).code == 0
        assert efi == (VMS[vm] == "uefi")
        if efi:
            assert (host.home / "vms" / vm / "nvram.fd").stat().st_uid == uid
        # The serial console (fusuma's console log) shows the user-data's line too.
        log = host.home / "vms" / vm / "console.log"
        while "FUSUMA-USER-DATA-DONE" not in log.read_text(errors="replace"):
            assert time.monotonic() < deadline, log.read_text(errors="replace")[-2000:]
            time.sleep(1)
    # The thin disk grows online; the guest sees it at once. It never shrinks.
    res = host.run("vm", "resize", "vb", "--disk-size", "4G", "--json").json()
    assert (res["old_size"], res["size"]) == (3 * 2**30, 4 * 2**30)
    size = host.run("vm", "exec", "vb", "--", "/bin/cat", "/sys/block/vda/size").out
    assert int(size) * 512 == 4 * 2**30
    assert "a disk only grows" in host.fail("vm", "resize", "vb", "--disk-size", "2G").err
    # A template of a firmware VM is refused (its clones would need thin disks, NVRAM
    # and seeds of their own); the VM runs on. (Moves: tests/integration/
    # test_firmware_moves.py.)
    err = host.fail("template", "create", "t", "--from", "vb").err
    assert "boots by firmware from a thin disk on image 'deb', and a template" in err, err
    assert host.vm("vb")["state"] == "running"
    # Both QEMUs read the one base file (its inode), and it is unchanged.
    assert all(holds_inode(pid, st) for pid in pids)
    err = host.fail("image", "delete", "deb").err
    assert "base of VM(s) vb, vu; delete them first" in err
    for vm in VMS:
        host.run("vm", "stop", vm, "--timeout", "60", timeout=120)
        host.run("vm", "delete", vm)
    assert store.sha256_of(base) == imported["sha256"]
    assert base.stat().st_mode & 0o777 == 0o444
    host.run("image", "delete", "deb")
    assert not base.exists()
    print(f"\nimport {import_s:.1f} s; two VMs created and booted to the agent "
          f"together in {boot_s:.1f} s")
