"""Growing a stopped VM's disks without QEMU: a qcow2 by qemu-img as the VM's uid, a
registered raw file by its length, only the file registered, never smaller."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

from fusuma.errors import HostError, ImageError, SpecError
from fusuma.host import storage
from fusuma.images import snapshots

UID = 65534        # nobody: not root, as a VM's QEMU uid


def test_a_qcow2_grows_as_the_vms_uid(tmp_path: Path) -> None:
    os.chmod(tmp_path, 0o700)                    # the uid cannot walk to it: a descriptor
    base = tmp_path / "base.raw"
    subprocess.run(["qemu-img", "create", "-q", "-f", "raw", str(base), "8M"], check=True)
    disk = tmp_path / "disk.qcow2"
    subprocess.run(["qemu-img", "create", "-q", "-f", "qcow2", "-F", "raw", "-b", str(base),
                    str(disk)], check=True)
    os.chown(disk, UID, UID)
    disk.chmod(0o600)
    assert snapshots.size_of(disk, UID) == 8 * 2**20
    snapshots.grow(disk, UID, 64 * 2**20)
    assert snapshots.size_of(disk, UID) == 64 * 2**20
    assert disk.stat().st_uid == UID
    with pytest.raises(ImageError, match=r"qemu-img resize on .* failed"):
        snapshots.grow(disk, UID, 32 * 2**20)     # qemu-img itself never shrinks
    assert snapshots.size_of(disk, UID) == 64 * 2**20
    os.chown(disk, 0, 0)                         # not the VM's file: it cannot
    with pytest.raises(ImageError, match="failed"):
        snapshots.size_of(disk, UID)


def test_a_registered_raw_disk_grows_only_as_registered(tmp_path: Path) -> None:
    f = tmp_path / "d.img"
    f.write_bytes(b"x" * 4096)
    st = f.stat()
    assert storage.grow("d", f, st.st_dev, st.st_ino, 2**20) == 4096
    assert f.stat().st_size == 2**20 and f.read_bytes()[:4096] == b"x" * 4096
    with pytest.raises(SpecError, match="disk 'd' is 1048576 bytes; a disk only grows"):
        storage.grow("d", f, st.st_dev, st.st_ino, 2**20)
    other = tmp_path / "o.img"
    other.write_bytes(b"")
    os.replace(other, f)                          # another file at the registered path
    with pytest.raises(HostError, match="is another file than the one registered"):
        storage.grow("d", f, st.st_dev, st.st_ino, 2**21)
    assert f.stat().st_size == 0
