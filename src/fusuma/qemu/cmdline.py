"""Render a QEMU command line from a typed VM configuration, without starting QEMU.

Pure functions only: the argv is tested as data (tests/unit/test_cmdline.py).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

QGA_PORT_NAME = "org.qemu.guest_agent.0"
# TCG's translation cache defaults to 1 GiB on 64-bit hosts; bound it so a VM's host
# memory stays predictable and fits its partition's limit.
TCG_TB_MIB = 128


@dataclass(frozen=True)
class DiskConfig:
    name: str
    path: Path
    readonly: bool = False


@dataclass(frozen=True)
class VmConfig:
    """Everything QEMU needs to know about one VM."""

    name: str
    vcpus: int
    memory_mib: int
    accel: Literal["kvm", "tcg"]
    kernel: Path
    initrd: Path
    append: str
    qmp_socket: Path
    qga_socket: Path
    console_socket: Path
    console_log: Path
    pidfile: Path
    ram_file: Path | None            # None: private anonymous RAM
    disks: list[DiskConfig] = field(default_factory=list)
    incoming: str | None = None      # "defer" or a URI, for the destination of a migration


def overhead_mib(accel: str) -> int:
    """Host memory a VM's QEMU needs beyond guest RAM (used for admission checks)."""
    return 96 + (TCG_TB_MIB if accel == "tcg" else 0)


def build_argv(cfg: VmConfig, binary: str = "qemu-system-x86_64") -> list[str]:
    """Return the argv that starts ``cfg``."""
    argv = [binary, "-name", f"guest={cfg.name},debug-threads=on",
            "-nodefaults", "-no-user-config", "-display", "none"]
    if cfg.accel == "kvm":
        argv += ["-accel", "kvm", "-cpu", "host"]
    else:
        argv += ["-accel", f"tcg,tb-size={TCG_TB_MIB}", "-cpu", "max"]
    argv += ["-machine", "q35,memory-backend=ram0", "-smp", str(cfg.vcpus),
             "-m", f"{cfg.memory_mib}M"]
    if cfg.ram_file is not None:
        # A named shared file (not a memfd): another QEMU can map the same pages,
        # which is what zero-copy migration (x-ignore-shared) relies on.
        argv += ["-object", f"memory-backend-file,id=ram0,size={cfg.memory_mib}M,"
                 f"mem-path={cfg.ram_file},share=on"]
    else:
        argv += ["-object", f"memory-backend-ram,id=ram0,size={cfg.memory_mib}M"]
    argv += ["-kernel", str(cfg.kernel), "-initrd", str(cfg.initrd),
             "-append", f"{cfg.append} fusuma.name={cfg.name}"]
    argv += ["-chardev", f"socket,id=qmp0,path={cfg.qmp_socket},server=on,wait=off",
             "-mon", "chardev=qmp0,mode=control"]
    argv += ["-chardev", f"socket,id=con0,path={cfg.console_socket},server=on,wait=off,"
             f"logfile={cfg.console_log},logappend=on",
             "-serial", "chardev:con0"]
    argv += ["-device", "virtio-serial-pci,id=vser0",
             "-chardev", f"socket,id=qga0,path={cfg.qga_socket},server=on,wait=off",
             "-device", f"virtserialport,bus=vser0.0,chardev=qga0,name={QGA_PORT_NAME}"]
    for d in cfg.disks:
        ro = ",readonly=on" if d.readonly else ""
        argv += ["-drive", f"file={d.path},format=raw,if=none,id=disk-{d.name}{ro}",
                 "-device", f"virtio-blk-pci,drive=disk-{d.name},serial={d.name}"]
    argv += ["-pidfile", str(cfg.pidfile)]
    if cfg.incoming is not None:
        argv += ["-incoming", cfg.incoming]
    return argv
