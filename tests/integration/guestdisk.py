"""A guest's file read from its disk image itself, where the guest cannot be asked
(its QEMU was killed, or the disk was reverted under it): the guest names the file's
extents (``filefrag``) while it runs, and the test reads those bytes with ``qemu-img
dd`` through the qcow2 and its base."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

from tests.conftest import Host
from tests.integration.test_firmware_vms import sh


def extents(host: Host, vm: str, path: str) -> list[tuple[int, int]]:
    """(byte offset in the disk, length) of each extent of the guest's file ``path``."""
    root = sh(host, vm, "findmnt -n -o SOURCE /").strip().rsplit("/", 1)[1]
    start = int(sh(host, vm, f"cat /sys/class/block/{root}/start")) * 512
    bs = int(sh(host, vm, f"stat -f -c %S {path}"))
    out = []
    for line in sh(host, vm, f"filefrag -v -b{bs} {path}").splitlines():
        m = re.match(r"\s*\d+:\s+\d+\.\.\s*\d+:\s+(\d+)\.\.\s*\d+:\s+(\d+):", line)
        if m:
            out.append((start + int(m.group(1)) * bs, int(m.group(2)) * bs))
    assert out, f"no extents of {path}"
    return out


def read_disk(disk: Path, where: list[tuple[int, int]], size: int, tmp: Path) -> bytes:
    """The bytes at ``where`` in the qcow2 ``disk`` (through its base), cut to
    ``size``."""
    data = b""
    for off, length in where:
        assert off % 512 == 0 and length % 512 == 0
        out = tmp / "dd.raw"
        # qemu-img 7.2's dd counts ``count`` from the input's start, not from ``skip``.
        subprocess.run(["qemu-img", "dd", "-U", "-f", "qcow2", "-O", "raw", "bs=512",
                        f"skip={off // 512}", f"count={(off + length) // 512}",
                        f"if={disk}", f"of={out}"], check=True, capture_output=True)
        data += out.read_bytes()
        out.unlink()
    assert len(data) >= size, len(data)
    return data[:size]
