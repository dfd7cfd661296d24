"""Choose QEMU's accelerator: KVM where the host can run stock guest kernels on it, TCG
otherwise, with one line saying why when fusuma falls back.

A PVM host (module ``kvm_pvm``) exposes a working ``/dev/kvm`` that only runs guests built
for PVM, so an openable ``/dev/kvm`` alone is not proof that KVM will boot our guests.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Literal

from fusuma.errors import HostError, SpecError
from fusuma.frozen import frozen

LOG = logging.getLogger(__name__)

_TCG_SUFFIX = "using TCG (software emulation, slower)"


@frozen
class AccelChoice:
    """The accelerator to pass to QEMU and, on a fallback, the one line to tell the user."""

    name: Literal["kvm", "tcg"]
    notice: str | None = None


def _kvm_problem(dev: Path, sysfs: Path) -> str | None:
    """Why /dev/kvm cannot run stock guests, or None when it can."""
    if not dev.exists():
        return f"{dev} does not exist (the kvm module is not loaded or there is no VT-x/AMD-V)"
    if (sysfs / "module/kvm_pvm").exists():
        return f"{dev} is a PVM nested hypervisor (kvm_pvm) that cannot run stock guest kernels"
    try:
        fd = os.open(dev, os.O_RDWR | os.O_CLOEXEC)
    except OSError as exc:
        return f"{dev} cannot be opened read-write ({exc.strerror})"
    os.close(fd)
    return None


def _cpu_flags(cpuinfo: Path) -> set[str] | None:
    """The x86 ``flags`` of the first CPU, or None when cpuinfo has no such line (non-x86)."""
    try:
        text = cpuinfo.read_text()
    except OSError:
        return None
    for line in text.splitlines():
        key, sep, value = line.partition(":")
        if sep and key.strip() == "flags":
            return set(value.split())
    return None


def _no_hw_virt(sysfs: Path, cpuinfo: Path) -> str | None:
    """Why the CPU has no usable hardware virtualization, or None when it seems to have it.

    Only x86 is judged this way: other architectures have no vmx/svm flags, and there an
    openable /dev/kvm is the best evidence we have.
    """
    flags = _cpu_flags(cpuinfo)
    if flags is None or flags & {"vmx", "svm"}:
        return None
    if (sysfs / "module/kvm_intel").exists() or (sysfs / "module/kvm_amd").exists():
        return None
    return "the CPU has no vmx/svm flag and neither kvm_intel nor kvm_amd is loaded"


def probe_accel(
    requested: str = "auto",
    *,
    dev: Path = Path("/dev/kvm"),
    sysfs: Path = Path("/sys"),
    cpuinfo: Path = Path("/proc/cpuinfo"),
) -> AccelChoice:
    """Resolve ``--accel auto|kvm|tcg`` to the accelerator QEMU will use."""
    mode = requested.strip().lower()
    if mode == "tcg":
        return AccelChoice("tcg")
    if mode not in ("auto", "kvm"):
        raise SpecError(f"unknown accelerator {requested!r}; use auto, kvm or tcg")
    problem = _kvm_problem(dev, sysfs)
    if mode == "kvm":
        if problem is not None:
            raise HostError(f"--accel kvm was asked for but {problem}; use --accel tcg")
        return AccelChoice("kvm")
    if problem is None:
        problem = _no_hw_virt(sysfs, cpuinfo)
    if problem is not None:
        notice = f"fusuma: {problem}; {_TCG_SUFFIX}"
        LOG.info("accelerator: tcg (%s)", problem)
        return AccelChoice("tcg", notice)
    LOG.info("accelerator: kvm")
    return AccelChoice("kvm")
