"""A user's own disk image, booted by firmware, kept whole by every kind of move on one
host: a Debian disk with cloud-init, extlinux and GRUB, built from Debian packages
(fusuma.images.diskimage, cached in FUSUMA_CACHE) and imported like any user's image.

Two guests on the one read-only base, one booted by OVMF and one by SeaBIOS, boot at
once and once for the whole module (a Debian with systemd and cloud-init takes minutes
under TCG); the tests run against them in order. The module's fusuma runs in a network
namespace of its own (fusuma's networks are never made in the machine's namespace), so
that the SeaBIOS guest has a NIC on a managed network:

1. The image and the boot: cloud-init gives each its hostname and the SSH key and runs
   the user-data; each booted by the firmware it asked for, under its own uid; the thin
   disk grows online; a template of a VM on QEMU 7.2, and deleting the image they use,
   are refused; both QEMUs hold the base's one inode, and `share report` counts its
   cached pages shared by the two. Bad input to ``vm create`` first: one
   sentence each, nothing made.
2. Every move keeps them whole: zero-copy, copy (the UEFI one), ``maintain --via``
   (which also takes both from QEMU 7.2 to 10.0, their machine type kept) and
   ``maintain --in-place`` (cpr-transfer, 10.0 to 10.0). Before the moves each guest
   writes a file, and the UEFI one an EFI variable (which OVMF stores in the VM's NVRAM
   file). After each move, for each guest moved:

   - it was not rebooted (its boot id), and one QEMU runs it, a new one;
   - that QEMU holds the same overlay, base, seed, and NVRAM and OVMF code (their
     inodes: the kernel's view), on the machine type the guest booted with;
   - the file reads back intact with the guest's page cache dropped (so from the disk,
     through the new QEMU), and the guest writes another (it has the disk read-write);
   - the EFI variable reads back through the firmware, and the NVRAM file's bytes are
     what they were before the first move.

   Then the destination QEMU of a zero-copy move of the UEFI guest is killed before the
   stream: the guest runs on in its QEMU, its data and NVRAM as they were.
   Snapshots of the UEFI guest keep its NVRAM: EFI variables the guest writes after a
   snapshot are gone after its restore (the NVRAM file's bytes and the firmware's word),
   running (``--memory``) and stopped (a disk snapshot, then ``--memory`` into the
   stopped VM, with no boot).
3. A template of the UEFI guest (on QEMU 10.0 by then) and two clones of it, running
   at once: each on an overlay of its own on the template's read-only layer, with its
   own NVRAM and a seed with a new instance id (the host's view); in the first,
   cloud-init runs its per-instance steps again (hostname, SSH host keys) and the
   template's data and EFI variable are there; it moves by copy; refusals;
   ``qemu-img check`` of the overlays and the layer.
4. The SeaBIOS guest with its NIC (its lease, after every move above): a template of
   it and a clone with its own MAC, lease and instance id, answering the gateway.
5. The end: each guest stopped, ``qemu-img check`` finds its overlay clean, the variable
   is in the NVRAM file, the base's checksum is unchanged, and the image is deleted."""

from __future__ import annotations

import hashlib
import json
import os
import re
import secrets
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import pytest

from fusuma.images import diskimage, store
from tests import netns
from tests.conftest import FULL_OS_BOOT_S, FUSUMA, Host, _tear_down
from tests.integration.test_cpr import need_qemu_10
from tests.integration.test_templates import ready_events

pytestmark = [pytest.mark.integration, pytest.mark.timeout(1800)]

KEY = "ssh-ed25519 AAAAC3NzaC1lZDI1NTE5AAAAIOMqqnkVzrm0SdG6UOoqKLsabgH5C9okWi0dh2l9GKJl t@fz"
USER_DATA = """#!/bin/sh
echo "user-data ran on $(hostname)" > /var/lib/fusuma-user-data
echo FUSUMA-USER-DATA-DONE > /dev/ttyS0
"""
# Two guests on the one base, one by each firmware, booted at once, both in p0: this
# worker's core (tests.conftest.core); its p1 is the other worker's guests' core, and
# two full boots there beside them left this worker's core idle (suite timelines).
VMS = {"vu": ("uefi", "p0"), "vb": ("bios", "p0")}
NIC_VM = "vb"             # the SeaBIOS guest has a NIC on the module's network
# A vendor GUID of the test's own, for the EFI variable the guest writes.
VAR = "/sys/firmware/efi/efivars/FusumaMark-5f0c2a7e-8d1b-4e6f-9a3c-2b7d1e0f4a59"
MARK = "/var/tmp/fusuma-mark"
# Each kind of move: the commands, and the partition each guest is in after them.
# vb (SeaBIOS) goes to p1 and back, so both are in p0 for 7.2 -> 10.0 and cpr-transfer.
KINDS = [
    ("zero-copy", [["migrate", "vu", "--to", "p1"], ["migrate", "vb", "--to", "p1"],
                   ["migrate", "vb", "--to", "p0"]],
     {"vu": "p1", "vb": "p0"}),
    ("copy", [["migrate", "vu", "--to", "p0", "--mode", "copy"]], {"vu": "p0"}),
    ("via", [["maintain", "p0", "--via", "p1", "--qemu", "10.0"]], {"vu": "p0", "vb": "p0"}),
    ("in-place", [["maintain", "p0", "--in-place"]], {"vu": "p0", "vb": "p0"}),
]


@pytest.fixture(scope="module")
def disk_image() -> Path:
    cache = Path(os.environ.get("FUSUMA_CACHE", "/var/cache/fusuma"))
    return diskimage.build(cache)


@dataclass
class Booted:
    """The module's two guests, booted on the imported image."""

    host: Host
    imported: dict[str, object]
    base: Path
    import_s: float
    boot_s: float
    token: str = ""          # the EFI variable's and the moves' files' (test 2)


LAN = "10.124.7"


@pytest.fixture(scope="module")
def module_host(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Host]:
    """The module's fusuma namespace (conftest's), run in a network namespace of the
    module's own, where its managed network, bridge, taps and dnsmasq live."""
    with netns.netns() as ns:
        h = Host(tmp_path_factory.mktemp("shared"))
        h.wrap = netns.wrap(ns)
        try:
            yield h
        finally:
            _tear_down(h)


@pytest.fixture(scope="module")
def booted(module_host: Host, disk_image: Path,
           tmp_path_factory: pytest.TempPathFactory) -> Iterator[Booted]:
    host = module_host
    need_qemu_10(host)
    t0 = time.monotonic()
    imported = host.run("image", "import", "deb", str(disk_image), "--json").json()
    import_s = time.monotonic() - t0
    host.run("partition", "create", "p0", "--cpus", host.core(0), "--memory", "2048")
    host.run("partition", "create", "p1", "--cpus", host.core(1), "--memory", "2048")
    tmp = tmp_path_factory.mktemp("seed")
    key = tmp / "id.pub"
    key.write_text(KEY + "\n")
    ud = tmp / "user-data"
    ud.write_text(USER_DATA)
    # Bad input: one sentence each, nothing made.
    priv = tmp / "id"
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

    host.run("network", "create", "lan0", "--subnet", f"{LAN}.0/24")
    t0 = time.monotonic()
    for vm, (fw, part) in VMS.items():
        t = time.monotonic()
        nic = ["--nic", "lan0"] if vm == NIC_VM else []
        host.run("vm", "create", vm, "-p", part, "--image", "deb", "--memory", "384",
                 "--boot", fw, "--disk-size", "3G", "--ssh-key", str(key),
                 "--user-data", str(ud), *nic)
        assert time.monotonic() - t < 10          # a thin disk: made in no time
    with ThreadPoolExecutor(len(VMS)) as pool:     # both boot at once
        list(pool.map(lambda vm: host.run("vm", "start", vm, "--wait", "--timeout",
                                          str(FULL_OS_BOOT_S), timeout=FULL_OS_BOOT_S + 60), VMS))
    boot_s = time.monotonic() - t0
    yield Booted(host, imported, Path(str(imported["path"])), import_s, boot_s)


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


def sh(host: Host, vm: str, script: str) -> str:
    """``script`` run by the guest's shell through the guest agent (its stdout)."""
    return host.run("vm", "exec", vm, "--", "/bin/sh", "-c", script, timeout=120).out


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def qemus_of(vm: str) -> list[int]:
    """Every QEMU process running guest ``vm`` (the kernel's view)."""
    out = []
    for name in os.listdir("/proc"):
        if name.isdigit():
            try:
                argv = Path(f"/proc/{name}/cmdline").read_bytes().split(b"\0")
            except OSError:
                continue
            if f"guest={vm},debug-threads=on".encode() in argv:
                out.append(int(name))
    return out


def marked(host: Host, vm: str) -> str:
    """The guest's check of its file, read from its disk (page cache dropped)."""
    return sh(host, vm, f"sync; echo 3 > /proc/sys/vm/drop_caches; sha256sum -c "
                        f"{MARK}.sum").strip()


def test_an_import_killed_mid_copy_leaves_nothing(module_host: Host,
                                                  disk_image: Path) -> None:
    """``image import`` killed -9 while it copies and hashes the file: no image is
    registered, and the next image command removes its partial copy from the store
    (a later import of that name works). Runs before the guests boot, on the module's
    host."""
    from tests.integration.phasekill import finish, kill_when

    host = module_host
    t0 = time.monotonic()
    images = host.home / "images"
    before = sorted(os.listdir(images)) if images.exists() else []
    size = disk_image.stat().st_size
    cli = subprocess.Popen([*FUSUMA, "image", "import", "half", str(disk_image)],
                           env=host.env, text=True, stdout=subprocess.PIPE,
                           stderr=subprocess.PIPE)

    def copying() -> bool:
        parts = list(images.glob(".import-half-*")) if images.exists() else []
        return len(parts) == 1 and 0 < parts[0].stat().st_size < size

    kill_when(cli.pid, copying, cli)
    finish(cli)
    assert [i["name"] for i in host.run("image", "list", "--json").json()
            if i["name"] == "half"] == []
    assert sorted(os.listdir(images)) == before          # `image list` swept it
    host.fail("image", "show", "half")
    host.run("image", "import", "half", str(disk_image))
    assert sorted(os.listdir(images)) == sorted([*before, "half.qcow2"])
    host.run("image", "delete", "half")
    assert sorted(os.listdir(images)) == before
    print(f"\nimport killed mid-copy: {time.monotonic() - t0:.1f} s")


def test_imported_image_boots_by_bios_and_uefi_with_cloud_init_on_a_shared_base(
        booted: Booted, disk_image: Path) -> None:
    host, imported, base = booted.host, booted.imported, booted.base
    st = base.stat()
    assert (st.st_mode & 0o777, st.st_uid) == (0o444, 0)
    assert imported["format"] == "qcow2" and imported["virtual_size"] == diskimage.SIZE
    assert imported["sha256"] == store.sha256_of(disk_image) == store.sha256_of(base)
    for vm in VMS:
        assert (host.home / "vms" / vm / "disk.qcow2").stat().st_mode & 0o777 == 0o600
    assert (host.home / "vms" / "vu" / "nvram.fd").stat().st_mode & 0o777 == 0o600
    assert not (host.home / "vms" / "vb" / "nvram.fd").exists()

    deadline = time.monotonic() + 300
    pids = []
    for vm, (fw, _) in VMS.items():
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
        assert efi == (fw == "uefi")
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
    # A template of a VM on QEMU 7.2 is refused (a clone maps the template's RAM
    # read-only, QEMU >= 8.2); the VM runs on. (Test 3 makes one on 10.0.)
    err = host.fail("template", "create", "t", "--from", "vb").err
    assert "cannot map a template's RAM read-only (QEMU >= 8.2)" in err, err
    assert host.vm("vb")["state"] == "running" and not (host.home / "templates" / "t"
                                                         ).exists()
    # Both QEMUs read the one base file (its inode), and it is unchanged.
    assert all(holds_inode(pid, st) for pid in pids)
    # share report: the two share the base's cached pages (mincore), one copy saved.
    shared = host.run("share", "report", "--json").json()["bases"]["deb"]
    assert (shared["vms"], shared["vm_names"], shared["error"]) == (2, ["vb", "vu"], None)
    assert 0 < shared["resident_bytes"] <= st.st_size + 4096
    assert shared["saved_bytes"] == shared["resident_bytes"]
    err = host.fail("image", "delete", "deb").err
    assert "base of VM(s) vb, vu; delete them first" in err
    assert store.sha256_of(base) == imported["sha256"]
    print(f"\nimport {booted.import_s:.1f} s; two VMs (SeaBIOS, OVMF) created and booted "
          f"to the agent together in {booted.boot_s:.1f} s")


def test_every_move_keeps_a_firmware_vm_its_disk_nvram_and_seed(booted: Booted) -> None:
    host = booted.host
    files: dict[str, dict[str, Path]] = {}
    inodes: dict[str, dict[str, os.stat_result]] = {}
    machine, boot_id = {}, {}
    for vm, (fw, _) in VMS.items():
        vdir = host.home / "vms" / vm
        files[vm] = {"overlay": vdir / "disk.qcow2", "base": booted.base,
                     "seed": vdir / "seed.iso"}
        if fw == "uefi":
            files[vm]["nvram"] = vdir / "nvram.fd"
        inodes[vm] = {k: p.stat() for k, p in files[vm].items()}
        first = host.vm(vm)
        machine[vm] = first["machine"]
        assert machine[vm] and machine[vm].startswith("pc-q35-"), first
        if fw == "uefi":
            fds = [Path(f"/proc/{first['pid']}/fd", fd).resolve()
                   for fd in os.listdir(f"/proc/{first['pid']}/fd")]
            inodes[vm]["ovmf code"] = next(p for p in fds if "OVMF_CODE" in p.name).stat()
        # Each guest writes a file (synced to its disk): what every move must keep.
        boot_id[vm] = sh(host, vm, "cat /proc/sys/kernel/random/boot_id").strip()
        sh(host, vm, f"head -c 4194304 /dev/urandom > {MARK} && sha256sum {MARK} > "
                     f"{MARK}.sum && sync")
    # The UEFI guest writes an EFI variable, which OVMF stores in the NVRAM file
    # (systemd mounts efivarfs; its module loads on the first mount). Attributes
    # NON_VOLATILE | BOOTSERVICE_ACCESS | RUNTIME_ACCESS, then the data.
    token = secrets.token_hex(8)
    sh(host, "vu", "mountpoint -q /sys/firmware/efi/efivars || mount -t efivarfs "
                   "efivarfs /sys/firmware/efi/efivars")
    sh(host, "vu", f"printf '\\007\\000\\000\\000FUSUMA-{token}' > {VAR}")
    assert sh(host, "vu", f"cat {VAR} | tail -c +5") == f"FUSUMA-{token}"
    nvram_file = files["vu"]["nvram"]
    nvram = sha256(nvram_file)
    assert f"FUSUMA-{token}".encode() in nvram_file.read_bytes()

    timings = {}
    for kind, commands, where in KINDS:
        before = {vm: host.vm(vm)["pid"] for vm in where}
        t = time.monotonic()
        for argv in commands:
            host.run(*argv, "--json", timeout=400)
        timings[kind] = time.monotonic() - t
        for vm, part in where.items():
            after = host.vm(vm)
            pid = after["pid"]
            # One QEMU runs the guest: a new one, in the partition the move names.
            assert (after["state"], after["partition"]) == ("running", part), after
            assert pid != before[vm] and qemus_of(vm) == [pid], (kind, vm, qemus_of(vm))
            if kind in ("via", "in-place"):
                assert after["qemu"].startswith("10.0"), after
            # The machine type the guest booted with, on QEMU 7.2 and 10.0 alike.
            assert after["machine"] == machine[vm]
            argv_now = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
            assert any(a.startswith(f"{machine[vm]},".encode()) for a in argv_now)
            # The same files: the overlay, its base, the seed, the NVRAM, OVMF's code.
            for what, st in inodes[vm].items():
                assert holds_inode(pid, st), f"after {kind}, {vm}'s QEMU lacks its {what}"
            assert {k: (p.stat().st_dev, p.stat().st_ino) for k, p in files[vm].items()} \
                == {k: (inodes[vm][k].st_dev, inodes[vm][k].st_ino) for k in files[vm]}
            # The same guest, not rebooted; its disk's data intact; it writes more.
            assert sh(host, vm, "cat /proc/sys/kernel/random/boot_id").strip() == \
                boot_id[vm]
            assert marked(host, vm) == f"{MARK}: OK", (kind, vm)
            sh(host, vm, f"echo {kind}-{token} > {MARK}-{kind} && sync")
        # The firmware reads the variable back; the NVRAM file is as it was.
        assert sh(host, "vu", f"cat {VAR} | tail -c +5") == f"FUSUMA-{token}", kind
        assert sha256(nvram_file) == nvram, f"the NVRAM changed in the {kind} move"

    # A kill: the destination QEMU of a zero-copy move, after it opened the files and
    # before the stream (the CLI holds there): the move goes back, the guest runs on
    # in its QEMU with its disk and NVRAM as they were.
    src = host.vm("vu")["pid"]
    proc = subprocess.Popen([*host.wrap, *FUSUMA, "migrate", "vu", "--to", "p1"],
                            env={**host.env, "FUSUMA_FAULT_SLEEP_BEFORE_STREAM": "3"},
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 60
        while not (dest := [p for p in qemus_of("vu") if p != src]):
            assert time.monotonic() < deadline and proc.poll() is None, proc.poll()
            time.sleep(0.05)
        time.sleep(0.5)
        os.kill(dest[0], signal.SIGKILL)
        _, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode != 0 and "p0" in err, err
    vm_now = host.vm("vu")
    assert (vm_now["partition"], vm_now["state"], vm_now["pid"]) == ("p0", "running", src)
    assert qemus_of("vu") == [src]
    assert marked(host, "vu") == f"{MARK}: OK"
    assert sha256(nvram_file) == nvram

    for vm in VMS:
        moved = [kind for kind, _, parts in KINDS if vm in parts]
        got = sh(host, vm, "sync; echo 3 > /proc/sys/vm/drop_caches; cat " +
                 " ".join(f"{MARK}-{kind}" for kind in moved))
        assert got.split() == [f"{kind}-{token}" for kind in moved], (vm, got)
    booted.token = token
    print("\nmoves (s): "
          + ", ".join(f"{k} {v:.1f}" for k, v in timings.items()))


# Two more variables of the test's vendor GUID: one written between two snapshots, one
# after both.
SNAP_VAR = VAR.replace("FusumaMark-", "FusumaSnap-")
LATER_VAR = VAR.replace("FusumaMark-", "FusumaLater-")


def efi_write(host: Host, vm: str, path: str, text: str) -> None:
    """The guest writes EFI variable ``path`` (NON_VOLATILE | BOOTSERVICE_ACCESS |
    RUNTIME_ACCESS, then ``text``): OVMF stores it in the VM's NVRAM file."""
    sh(host, vm, f"printf '\\007\\000\\000\\000{text}' > {path}")


def test_a_snapshot_of_a_uefi_vm_keeps_its_nvram(booted: Booted) -> None:
    """The UEFI guest's NVRAM is in its snapshots: a ``--memory`` snapshot m1, then the
    guest writes a variable and a disk snapshot d1 is taken (each keeps a copy of the
    NVRAM file as it was), then the guest writes another. Restoring m1 into the running
    guest makes the NVRAM file m1's again, byte for byte (QEMU's state holds the flash
    and writes it back when the guest runs on), and the firmware reads m1's variables,
    not the later ones. Stopped, d1's restore puts d1's NVRAM in place of the file (the
    file OVMF reads at the next boot), and m1 restored into the stopped VM starts its
    QEMU from m1's NVRAM and loads its RAM: the same boot, m1's variables. Deleting the
    snapshots removes their copies."""
    host, token = booted.host, booted.token
    t0 = time.monotonic()
    if not token:           # run alone (-k): the variable the moves' test writes
        token = booted.token = secrets.token_hex(8)
        sh(host, "vu", "mountpoint -q /sys/firmware/efi/efivars || mount -t efivarfs "
                       "efivarfs /sys/firmware/efi/efivars")
        efi_write(host, "vu", VAR, f"FUSUMA-{token}")
    vdir = host.home / "vms" / "vu"
    nvram, copies = vdir / "nvram.fd", vdir / "snapshots"
    boot_id = sh(host, "vu", "cat /proc/sys/kernel/random/boot_id").strip()
    at_m1 = nvram.read_bytes()
    assert f"FUSUMA-{token}".encode() in at_m1
    host.run("vm", "snapshot", "create", "vu", "m1", "--memory", timeout=600)
    assert (copies / "m1.nvram.fd").read_bytes() == at_m1
    x, y = secrets.token_hex(8), secrets.token_hex(8)
    efi_write(host, "vu", SNAP_VAR, f"SNAP-{x}")
    at_d1 = nvram.read_bytes()
    assert f"SNAP-{x}".encode() in at_d1 and at_d1 != at_m1
    made = host.run("vm", "snapshot", "create", "vu", "d1", "--json", timeout=300).json()
    assert (made["memory"], made["frozen"]) == (False, True), made
    assert (copies / "d1.nvram.fd").read_bytes() == at_d1
    efi_write(host, "vu", LATER_VAR, f"LATER-{y}")
    assert f"LATER-{y}".encode() in nvram.read_bytes()

    # m1 into the running guest: the file and the firmware as at m1, the same boot.
    host.run("vm", "snapshot", "restore", "vu", "m1", timeout=600)
    assert host.vm("vu")["state"] == "running"
    assert nvram.read_bytes() == at_m1
    assert sh(host, "vu", "cat /proc/sys/kernel/random/boot_id").strip() == boot_id
    assert sh(host, "vu", f"cat {VAR} | tail -c +5") == f"FUSUMA-{token}"
    assert sh(host, "vu", f"cat {SNAP_VAR} {LATER_VAR} 2>/dev/null; true") == ""
    # It writes on after the load: the flash is the file's again.
    efi_write(host, "vu", LATER_VAR, f"LATER-{y}")
    assert f"LATER-{y}".encode() in nvram.read_bytes()

    # Stopped: d1's NVRAM in place of the file (what OVMF reads at the next boot),
    # the VM's own (its uid's, 0600).
    uid = nvram.stat().st_uid
    host.run("vm", "stop", "vu", "--timeout", "60", timeout=120)
    host.run("vm", "snapshot", "restore", "vu", "d1", timeout=300)
    st = nvram.stat()
    assert (st.st_uid, st.st_mode & 0o777) == (uid, 0o600) and uid != 0
    assert nvram.read_bytes() == at_d1 and host.vm("vu")["state"] == "stopped"
    # m1 into the stopped VM: its QEMU started from m1's NVRAM, its RAM loaded (with a
    # new vmgenid: a new generation, not a new boot).
    host.run("vm", "snapshot", "restore", "vu", "m1", timeout=600)
    assert host.vm("vu")["state"] == "running" and nvram.read_bytes() == at_m1
    assert sh(host, "vu", "cat /proc/sys/kernel/random/boot_id").strip() == boot_id
    assert sh(host, "vu", f"cat {VAR} | tail -c +5") == f"FUSUMA-{token}"
    for name in ("m1", "d1"):
        host.run("vm", "snapshot", "delete", "vu", name, timeout=300)
    assert host.run("vm", "snapshot", "list", "vu", "--json").json() == []
    assert list(copies.iterdir()) == []
    print(f"\nNVRAM in snapshots of the UEFI guest: {time.monotonic() - t0:.1f} s")


def failed_modules(host: Host, vm: str) -> set[str]:
    """The cloud-init modules that reported an error: the ``errors`` of each stage in
    cloud-init's own status file (what ``cloud-init status --long`` prints; reading the
    file is instant, while that command is a Python start that took over 60 s in a
    loaded TCG guest)."""
    said = json.loads(sh(host, vm, "cat /run/cloud-init/status.json"))
    return {m for stage in said["v1"].values() if isinstance(stage, dict)
            for err in stage.get("errors") or []
            for m in re.findall(r"^\('([\w-]+)', ", str(err))}


def clone_ready(host: Host, vm: str, deadline: float) -> dict[str, object]:
    """The clone-ready event of clone ``vm`` (after its cloud-init stages)."""
    while True:
        got = [e for e in ready_events(host) if e["vm"] == vm]
        if got:
            return got[-1]
        assert time.monotonic() < deadline, f"{vm}: no clone-ready event"
        time.sleep(1)


def test_a_template_of_a_firmware_vm_gives_clones_their_own_disk_nvram_and_instance(
        booted: Booted) -> None:
    """A template of the UEFI guest: it keeps the disk as it was (a read-only layer)
    and the NVRAM; two clones start from its RAM, each on an overlay of its own, with
    its own NVRAM and seed (its own instance id); in the first, cloud-init runs its
    per-instance steps again for the new instance id (hostname, new SSH host keys) and
    the template's data and EFI variable are there; it moves by copy; the template is
    refused deletion while a clone uses it; a clone's deletion removes its files;
    ``qemu-img check`` is clean."""
    host, token = booted.host, booted.token
    t_start = time.monotonic()
    home = host.home
    vu_id = json.loads((home / "vms" / "vu" / "seed.json").read_text())["instance_id"]
    vu_key = sh(host, "vu", "cat /etc/ssh/ssh_host_ed25519_key.pub").split()[1]
    at_boot = failed_modules(host, "vu")
    t = host.run("template", "create", "t", "--from", "vu", "--json").json()
    assert host.vm("vu")["state"] == "stopped" and t["image"] == "deb"
    tdir = home / "templates" / "t"
    layer = tdir / "disk.qcow2"
    assert (t["boot"], t["disk_layer"]) == ("uefi", str(layer))
    assert (layer.stat().st_mode & 0o777, layer.stat().st_uid) == (0o400, 0)
    assert f"FUSUMA-{token}".encode() in (tdir / "nvram.fd").read_bytes()
    err = host.fail("image", "delete", "deb").err
    assert "base of template(s) t; delete them first" in err, err
    # p1 (empty) onto QEMU 10.0, where a clone can move by copy.
    host.run("maintain", "p1", "--via", "p0", "--qemu", "10.0", timeout=120)

    clones_ = ("c1", "c2")
    ids = {}
    for c in clones_:
        t0 = time.monotonic()
        host.run("vm", "create", c, "-p", "p0", "--template", "t")
        made_s = time.monotonic() - t0
        cdir = home / "vms" / c
        ids[c] = json.loads((cdir / "seed.json").read_text())["instance_id"]
        assert ids[c].startswith(f"{c}-") and (cdir / "clone-fresh").exists()
        assert made_s < 10, made_s
    err = host.fail("vm", "create", "c3", "-p", "p0", "--template", "t", "--boot",
                    "bios").err
    assert "leave out --boot" in err and not (home / "vms" / "c3").exists()
    assert ids["c1"] != ids["c2"]
    for c in clones_:
        host.run("vm", "start", c)
    # Two QEMUs read the one layer and the one base; each its own overlay, NVRAM, and
    # seed, which holds its own instance id.
    pids = {c: host.vm(c)["pid"] for c in clones_}
    assert pids["c1"] != pids["c2"]
    for c, pid in pids.items():
        assert holds_inode(pid, layer.stat()) and holds_inode(pid, booted.base.stat())
        for f in ("disk.qcow2", "nvram.fd", "seed.iso"):
            assert holds_inode(pid, (home / "vms" / c / f).stat()), (c, f)
        assert ids[c].encode() in (home / "vms" / c / "seed.iso").read_bytes(), c
    # What c2 adds is the above (a second clone's own files and instance, beside the
    # first): it stops now, so that c1's cloud-init has the core to itself. c1 shows
    # the steps in the guest, which would be the same in c2 (two clones given their
    # identities at once: tests/integration/test_templates.py).
    host.run("vm", "stop", "c2", "--timeout", "60", timeout=120)
    assert qemus_of("c2") == []
    deadline = time.monotonic() + 900
    for c in clones_[:1]:
        ev = clone_ready(host, c, deadline)
        assert float(str(ev["restore_ms"])) < 5000, ev
        assert ev["error"] is None and ev["cloud_init_exit"] in (0, 1), ev
        # A module that fails (the image has no locales: `locale`) fails as it did at
        # the template's own boot, and no other.
        failed = failed_modules(host, c)
        assert failed <= at_boot, (c, failed, at_boot)
        assert (ev["cloud_init_exit"] == 1) == bool(failed), ev
        # Its disk is its own from now on (a later start boots it).
        assert not (home / "vms" / c / "clone-fresh").exists()
        # cloud-init ran for the new instance id: its hostname, new SSH host keys.
        got = sh(host, c, "hostname; cat /var/lib/cloud/data/instance-id; "
                          "cut -d' ' -f2 /etc/ssh/ssh_host_ed25519_key.pub").split()
        assert got[:2] == [c, ids[c]], got
        assert got[2] != vu_key, "the clone kept its template's SSH host key"
        assert sh(host, c, "ls /var/lib/cloud/instances").split() == sorted([vu_id, ids[c]])
        assert sh(host, c, "cloud-init query v1.instance_id").strip() == ids[c]
        # Its user-data (a per-instance script) ran again, under its name.
        assert sh(host, c, "cat /var/lib/fusuma-user-data") == f"user-data ran on {c}\n"
        # The template's disk and EFI variable, read from the clone's disk and firmware.
        assert marked(host, c) == f"{MARK}: OK"
        assert sh(host, c, f"cat {VAR} | tail -c +5") == f"FUSUMA-{token}"
        sh(host, c, f"echo {c}-{token} > {MARK}-clone && sync")
    # A clone moves by copy (its RAM is private), with its files.
    host.run("migrate", "c1", "--to", "p1", "--mode", "copy", timeout=400)
    after = host.vm("c1")
    assert (after["partition"], after["state"]) == ("p1", "running")
    assert qemus_of("c1") == [after["pid"]] and holds_inode(after["pid"], layer.stat())
    assert sh(host, "c1", f"sync; echo 3 > /proc/sys/vm/drop_caches; cat {MARK}-clone"
              ).strip() == f"c1-{token}"
    assert sh(host, "c1", "hostname").strip() == "c1"
    err = host.fail("template", "delete", "t").err
    assert "used by VM(s) c1, c2" in err, err
    for c in clones_:
        if host.vm(c)["state"] == "running":
            host.run("vm", "stop", c, "--timeout", "60", timeout=120)
        check = subprocess.run(["qemu-img", "check", "-f", "qcow2",
                                str(home / "vms" / c / "disk.qcow2")],
                               capture_output=True, text=True, timeout=120)
        assert check.returncode == 0 and "No errors were found" in check.stdout, check
        host.run("vm", "delete", c)
        assert not (home / "vms" / c).exists()
    check = subprocess.run(["qemu-img", "check", "-f", "qcow2", str(layer)],
                           capture_output=True, text=True, timeout=120)
    assert check.returncode == 0 and "No errors were found" in check.stdout, check
    host.run("template", "delete", "t")
    assert not tdir.exists()
    print(f"\ntemplate and two clones of a UEFI guest, cloud-init included: "
          f"{time.monotonic() - t_start:.1f} s")


def test_a_template_of_the_guest_with_a_nic_gives_a_clone_its_own_mac_lease_and_instance(
        booted: Booted) -> None:
    """A template of the SeaBIOS guest (the template test above has OVMF's), whose NIC is
    on the module's managed network, and a clone of it: the clone's guest has its own
    MAC (the template's was changed by the identity step) and the lease dnsmasq gives
    that MAC (the address fusuma recorded; the image's dhclient asked), a new cloud-init
    instance id, and answers the gateway through the bridge's filter, which drops any
    frame with the template's MAC. (Two clones of one template, each with its own MAC
    and address: tests/integration/test_networks.py.)"""
    host = booted.host
    t0 = time.monotonic()
    tnic = host.vm(NIC_VM)["nics"][0]
    # The guest has its lease (cloud-init's config, the image's dhclient), after every
    # kind of move above.
    deadline = time.monotonic() + 120
    while f"inet {tnic['ip']}/24" not in sh(host, NIC_VM, "ip -4 -o addr; true"):
        assert time.monotonic() < deadline, sh(host, NIC_VM, "ip addr; true")
        time.sleep(2)
    host.run("template", "create", "tn", "--from", NIC_VM)
    c = "n1"
    host.run("vm", "create", c, "-p", "p0", "--template", "tn", "--nic", "lan0")
    host.run("vm", "start", c)
    ev = clone_ready(host, c, time.monotonic() + 600)
    assert ev["error"] is None and ev["cloud_init_exit"] in (0, 1), ev
    nic = host.vm(c)["nics"][0]
    mac, ip = nic["mac"], nic["ip"]
    assert mac != tnic["mac"] and ip != tnic["ip"], (nic, tnic)
    # The guest's NIC has the clone's MAC and the clone's lease.
    got = sh(host, c, f"for x in /sys/class/net/*; do [ \"$(cat $x/address)\" = "
                      f"{mac} ] && ip -4 -o addr show dev ${{x##*/}}; done; true")
    assert f"inet {ip}/24" in got, (c, got)
    assert tnic["mac"] not in sh(host, c, "cat /sys/class/net/*/address")
    # A new instance: cloud-init ran for the clone's id.
    seed_id = json.loads((host.home / "vms" / c / "seed.json").read_text())["instance_id"]
    assert sh(host, c, "cat /var/lib/cloud/data/instance-id").strip() == seed_id
    assert sh(host, c, "hostname").strip() == c
    # It reaches the gateway (the bridge's address, in the module's namespace: its
    # dnsmasq's DNS port) and answers it (its sshd's banner, from that namespace),
    # through the bridge's filter, which passes only the clone's MAC and address.
    probe = ("import socket, sys; c = socket.create_connection((sys.argv[1], "
             "int(sys.argv[2])), 10); c.settimeout(10); "
             "print(c.recv(8).decode() if len(sys.argv) > 3 else 'connected')")
    got = sh(host, c, f"python3 -c \"{probe}\" {LAN}.1 53")
    assert got.strip() == "connected", (c, got)
    banner = subprocess.run([*host.wrap, sys.executable, "-c", probe, ip, "22", "banner"],
                            capture_output=True, text=True, timeout=60)
    assert banner.stdout.startswith("SSH-2.0"), (c, banner)
    assert f"{LAN}.1 " in sh(host, c, "cat /proc/net/arp")
    # The clone and the template go; the guests themselves are the next test's.
    host.run("vm", "stop", c, "--timeout", "60", timeout=120)
    host.run("vm", "delete", c)
    host.run("template", "delete", "tn")
    assert not (host.home / "vms" / c).exists()
    assert not (host.home / "templates" / "tn").exists()
    print(f"\ntemplate of the SeaBIOS guest with a NIC, a clone: "
          f"{time.monotonic() - t0:.1f} s")


def test_the_end_each_disk_is_clean_and_the_image_goes(booted: Booted) -> None:
    host, imported, token = booted.host, booted.imported, booted.token
    for vm in VMS:
        if host.vm(vm)["state"] == "running":
            host.run("vm", "stop", vm, "--timeout", "60", timeout=120)
        assert qemus_of(vm) == []
        overlay = host.home / "vms" / vm / "disk.qcow2"
        check = subprocess.run(["qemu-img", "check", "-f", "qcow2", str(overlay)],
                               capture_output=True, text=True, timeout=120)
        assert check.returncode == 0 and "No errors were found" in check.stdout, check
        if vm == "vu":      # the variable is in the NVRAM file the VM keeps
            nvram = host.home / "vms" / vm / "nvram.fd"
            assert f"FUSUMA-{token}".encode() in nvram.read_bytes()
        host.run("vm", "delete", vm)
    # The base is as it was imported; with no VM on it, the image goes.
    assert store.sha256_of(booted.base) == imported["sha256"]
    assert booted.base.stat().st_mode & 0o777 == 0o444
    host.run("image", "delete", "deb")
    assert not booted.base.exists()

