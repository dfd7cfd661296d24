"""Growing the disks of stopped VMs and a disk no VM has: no QEMU starts. A VM's thin
disk (qcow2, on an imported image) grows by ``qemu-img resize`` as the VM's own uid;
a registered raw disk by its file, through ``vm resize`` or ``disk resize`` (one
implementation). Bad input is one sentence, and changes nothing. (A running VM's disk
grows online: tests/integration/test_firmware_vms.py.)"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from tests.conftest import Host
from tests.unit.test_image_store import raw_image

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]

MIB = 2**20


def qcow2_info(path: Path) -> dict[str, object]:
    out = subprocess.run(["qemu-img", "info", "--output=json", "-U", str(path)],
                         capture_output=True, text=True, check=True, timeout=60).stdout
    return dict(json.loads(out))


def test_stopped_vms_disks_grow_and_bad_sizes_are_refused(host: Host,
                                                          tmp_path: Path) -> None:
    host.run("image", "import", "tiny", str(raw_image(tmp_path / "tiny.raw", mib=8)))
    host.run("partition", "create", "p0", "--cpus", host.core(0), "--memory", "512")
    host.run("vm", "create", "s0", "-p", "p0", "--image", "tiny", "--memory", "128")
    host.run("disk", "add", "d0", "-p", "p0", "--size-mib", "8")
    host.run("disk", "add", "d1", "-p", "p0", "--size-mib", "8")
    host.run("vm", "create", "k0", "-p", "p0", "--memory", "128", "--disk", "d0")
    overlay = host.home / "vms" / "s0" / "disk.qcow2"
    owner = overlay.stat().st_uid
    d0 = Path(next(d["path"] for d in host.run("disk", "list", "--json").json()
                   if d["name"] == "d0"))
    d1 = d0.with_name("d1.img")

    # A stopped VM's thin disk: qemu-img as its uid; still its file, clean.
    res = host.run("vm", "resize", "s0", "--disk-size", "64M", "--json").json()
    assert (res["drive"], res["old_size"], res["size"]) == ("disk-fusuma-boot", 8 * MIB,
                                                             64 * MIB)
    info = qcow2_info(overlay)
    assert info["virtual-size"] == 64 * MIB and info["backing-filename"]
    assert overlay.stat().st_uid == owner != 0
    check = subprocess.run(["qemu-img", "check", str(overlay)], capture_output=True,
                           text=True, timeout=60)
    assert check.returncode == 0, check
    # A registered raw disk of a stopped VM: by `vm resize` and by `disk resize`.
    res = host.run("vm", "resize", "k0", "--disk", "d0", "--disk-size", "16M",
                   "--json").json()
    assert (res["drive"], res["old_size"], res["size"]) == ("disk-d0", 8 * MIB, 16 * MIB)
    res = host.run("disk", "resize", "d0", "--size", "24M", "--json").json()
    assert (res["vm"], res["old_size"], res["size"]) == ("k0", 16 * MIB, 24 * MIB)
    assert d0.stat().st_size == 24 * MIB
    # A disk no VM has: its file.
    res = host.run("disk", "resize", "d1", "--size", "12M", "--json").json()
    assert (res["vm"], res["old_size"], res["size"]) == ("", 8 * MIB, 12 * MIB)
    assert d1.stat().st_size == 12 * MIB

    # Bad input: one sentence each, nothing changed.
    for args, says in (
            (("vm", "resize", "s0", "--disk-size", "32M"),
             "VM 's0''s disk is 67108864 bytes; a disk only grows"),
            (("vm", "resize", "s0", "--disk-size", "64M"), "a disk only grows"),
            (("vm", "resize", "s0", "--disk-size", "lots"),
             "disk size 'lots' is not a size; give one such as 8G or 512M"),
            (("vm", "resize", "k0", "--disk-size", "64M"),
             "VM 'k0' runs an image fusuma builds and has no thin disk; name one of its "
             "disks (--disk)"),
            (("vm", "resize", "k0", "--disk", "nope", "--disk-size", "64M"),
             "disk 'nope' is not attached to VM 'k0'; its disks: d0"),
            (("vm", "resize", "nope", "--disk-size", "64M"), "nope"),
            (("disk", "resize", "d0", "--size", "8M"),
             "disk 'd0' is 25165824 bytes; a disk only grows"),
            (("disk", "resize", "d1", "--size", "4M"),
             "disk 'd1' is 12582912 bytes; a disk only grows"),
            (("disk", "resize", "d1", "--size", "-4M"), "is not a size"),
            (("disk", "resize", "nope", "--size", "4M"), "nope")):
        err = host.fail(*args).err
        assert says in err and len(err.strip().splitlines()) == 1, (args, err)
    assert qcow2_info(overlay)["virtual-size"] == 64 * MIB
    assert (d0.stat().st_size, d1.stat().st_size) == (24 * MIB, 12 * MIB)
    assert [v["state"] for v in host.ps()["vms"]] == ["stopped", "stopped"]
