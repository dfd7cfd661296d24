"""Firmware for VMs that boot from a disk: SeaBIOS (QEMU's own default, found in its
data directories) and OVMF for UEFI, from Debian's ``ovmf`` package. OVMF's code is
shared read-only by every VM; each VM gets its own copy of the variables template
(its NVRAM), kept with the VM's state."""

from __future__ import annotations

import os
from pathlib import Path

from fusuma.errors import HostError

# Code and variables must come in matching pairs (the 4 MiB build first: Debian's
# default since bookworm). The non-secure-boot builds: they need no SMM, which TCG
# would have to emulate too.
OVMF_PAIRS = (
    ("OVMF_CODE_4M.fd", "OVMF_VARS_4M.fd"),
    ("OVMF_CODE.fd", "OVMF_VARS.fd"),
)


def ovmf_dir() -> Path:
    return Path(os.environ.get("FUSUMA_OVMF_DIR", "/usr/share/OVMF"))


def ovmf() -> tuple[Path, Path]:
    """OVMF's code and variables template, both readable by every user (QEMU runs as
    the VM's own uid); else one sentence saying what to install."""
    d = ovmf_dir()
    for code, vars_ in OVMF_PAIRS:
        c, v = d / code, d / vars_
        if c.is_file() and v.is_file():
            for f in (c, v):
                if f.stat().st_mode & 0o004 == 0:
                    raise HostError(f"UEFI firmware file {f} is not readable by other "
                                    "users; `chmod a+r` it.")
            return c, v
    raise HostError(f"UEFI boot needs OVMF, which is not in {d}: apt-get install ovmf.")
