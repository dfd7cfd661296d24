"""Every kind of move on one host keeps a VM that boots by firmware whole: its thin disk
(a qcow2 overlay on a read-only base), its NVRAM and its cloud-init seed.

One guest, booted once by OVMF from a thin disk on the Debian image the tests build
(fusuma.images.diskimage), is moved by zero-copy, copy, ``maintain --via`` (which also
takes it from QEMU 7.2 to 10.0, its machine type kept) and ``maintain --in-place``
(cpr-transfer, 10.0 to 10.0). Before the moves the guest writes a file and an EFI
variable (which OVMF stores in the VM's NVRAM file). After each move:

- the guest was not rebooted (its boot id), and one QEMU runs it, a new one;
- that QEMU holds the same overlay, base, NVRAM, seed and OVMF code (their inodes: the
  kernel's view), on the machine type the guest booted with;
- the file reads back intact with the guest's page cache dropped (so from the disk,
  through the new QEMU), and the guest writes another (it has the disk read-write);
- the EFI variable reads back through the firmware, and the NVRAM file's bytes are
  what they were before the first move.

At the end the guest is stopped and ``qemu-img check`` finds the overlay clean, and
the variable is in the NVRAM file. Under TCG the boot takes about a minute; it happens
once."""

from __future__ import annotations

import hashlib
import os
import secrets
import subprocess
import time
from pathlib import Path

import pytest

from fusuma.images import diskimage
from tests.conftest import Host
from tests.integration.test_cpr import need_qemu_10
from tests.integration.test_disk_images import holds_inode

pytestmark = [pytest.mark.integration, pytest.mark.timeout(900)]

VM = "fw"
# A vendor GUID of the test's own, for the EFI variable the guest writes.
VAR = "/sys/firmware/efi/efivars/FusumaMark-5f0c2a7e-8d1b-4e6f-9a3c-2b7d1e0f4a59"
MARK = "/var/tmp/fusuma-mark"


@pytest.fixture(scope="module")
def disk_image() -> Path:
    cache = Path(os.environ.get("FUSUMA_CACHE", "/var/cache/fusuma"))
    return diskimage.build(cache)


def sh(host: Host, script: str) -> str:
    """``script`` run by the guest's shell through the guest agent (its stdout)."""
    return host.run("vm", "exec", VM, "--", "/bin/sh", "-c", script, timeout=120).out


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


def test_every_move_keeps_a_firmware_vm_its_disk_nvram_and_seed(
        host: Host, disk_image: Path) -> None:
    need_qemu_10(host)
    imported = host.run("image", "import", "deb", str(disk_image), "--json").json()
    host.run("partition", "create", "p0", "--cpus", "0", "--memory", "1600")
    host.run("partition", "create", "p1", "--cpus", "1", "--memory", "1600")
    t0 = time.monotonic()
    host.run("vm", "create", VM, "-p", "p0", "--image", "deb", "--memory", "384",
             "--boot", "uefi")
    host.run("vm", "start", VM, "--wait", "--timeout", "400", timeout=450)
    boot_s = time.monotonic() - t0
    vdir = host.home / "vms" / VM
    files = {"overlay": vdir / "disk.qcow2", "base": Path(imported["path"]),
             "nvram": vdir / "nvram.fd", "seed": vdir / "seed.iso"}
    inodes = {k: p.stat() for k, p in files.items()}
    first = host.vm(VM)
    machine = first["machine"]
    assert machine and machine.startswith("pc-q35-"), first
    code = next(Path(f"/proc/{first['pid']}/fd", fd).resolve()
                for fd in os.listdir(f"/proc/{first['pid']}/fd")
                if "OVMF_CODE" in str(Path(f"/proc/{first['pid']}/fd", fd).resolve()))
    inodes["ovmf code"] = code.stat()

    # The guest writes a file (synced to its disk) and an EFI variable (OVMF writes it
    # to the NVRAM file): what every move must keep.
    token = secrets.token_hex(8)
    boot_id = sh(host, "cat /proc/sys/kernel/random/boot_id").strip()
    sh(host, f"head -c 4194304 /dev/urandom > {MARK} && sha256sum {MARK} > {MARK}.sum "
             "&& sync")
    sh(host, f"printf '\\007\\000\\000\\000FUSUMA-{token}' > {VAR}")
    assert sh(host, f"tail -c +5 {VAR}") == f"FUSUMA-{token}"
    nvram = sha256(files["nvram"])
    assert f"FUSUMA-{token}".encode() in files["nvram"].read_bytes()

    kinds = [("zero-copy", ["migrate", VM, "--to", "p1"], "p1"),
             ("copy", ["migrate", VM, "--to", "p0", "--mode", "copy"], "p0"),
             ("via", ["maintain", "p0", "--via", "p1", "--qemu", "10.0"], "p0"),
             ("in-place", ["maintain", "p0", "--in-place"], "p0")]
    timings = {}
    for kind, argv, where in kinds:
        before = host.vm(VM)
        t = time.monotonic()
        host.run(*argv, "--json", timeout=400)
        timings[kind] = time.monotonic() - t
        after = host.vm(VM)
        pid = after["pid"]
        # One QEMU runs the guest: a new one, in the partition the move names.
        assert (after["state"], after["partition"]) == ("running", where), after
        assert pid != before["pid"] and qemus_of(VM) == [pid], (kind, qemus_of(VM))
        if kind in ("via", "in-place"):
            assert after["qemu"].startswith("10.0"), after
        # The machine type the guest booted with, on QEMU 7.2 and 10.0 alike.
        assert after["machine"] == machine
        argv_now = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        assert any(a.startswith(f"{machine},".encode()) for a in argv_now), argv_now
        # The same files: the overlay, its base, the NVRAM, the seed, OVMF's code.
        for what, st in inodes.items():
            assert holds_inode(pid, st), f"after {kind}, QEMU {pid} does not hold the {what}"
        # The same guest, not rebooted; its disk's data intact (read from the disk);
        # it writes more; the firmware reads its variable back; the NVRAM is unchanged.
        assert sh(host, "cat /proc/sys/kernel/random/boot_id").strip() == boot_id
        got = sh(host, f"sync; echo 3 > /proc/sys/vm/drop_caches; sha256sum -c "
                       f"{MARK}.sum")
        assert got.strip() == f"{MARK}: OK", (kind, got)
        sh(host, f"echo {kind}-{token} > {MARK}-{kind} && sync")
        assert sh(host, f"tail -c +5 {VAR}") == f"FUSUMA-{token}", kind
        assert sha256(files["nvram"]) == nvram, f"the NVRAM changed in the {kind} move"
        assert {k: (p.stat().st_dev, p.stat().st_ino) for k, p in files.items()} == \
            {k: (inodes[k].st_dev, inodes[k].st_ino) for k in files}

    got = sh(host, "sync; echo 3 > /proc/sys/vm/drop_caches; cat " +
             " ".join(f"{MARK}-{kind}" for kind, _, _ in kinds))
    assert got.split() == [f"{kind}-{token}" for kind, _, _ in kinds]
    host.run("vm", "stop", VM, "--timeout", "60", timeout=120)
    assert qemus_of(VM) == []
    check = subprocess.run(["qemu-img", "check", "-f", "qcow2", str(files["overlay"])],
                           capture_output=True, text=True, timeout=120)
    assert check.returncode == 0 and "No errors were found" in check.stdout, check
    assert f"FUSUMA-{token}".encode() in files["nvram"].read_bytes()
    host.run("vm", "delete", VM)
    host.run("image", "delete", "deb")
    print(f"\nUEFI boot to the agent {boot_s:.1f} s; moves (s): " +
          ", ".join(f"{k} {v:.1f}" for k, v in timings.items()))
