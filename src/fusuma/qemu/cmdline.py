"""Render a QEMU command line from a typed VM configuration, without starting QEMU.

Pure functions only: the argv is tested as data (tests/unit/test_cmdline.py).

QEMU runs under a uid of its own behind a seccomp sandbox (fusuma.qemu.privilege), so
files it may not open itself are opened by the supervisor and passed as descriptors;
a config then carries the fd numbers beside the paths, and the argv names the fds:
``/proc/self/fd/N`` where QEMU opens a path with plain open() (memory-backend-file,
-kernel, -initrd: the magic link needs no directory traversal, only the file's own
permission), an fdset (``-add-fd`` + ``/dev/fdset/K``) where QEMU uses qemu_open()
(-drive, a chardev's logfile: QEMU dups the fd, no permission check at all).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

QGA_PORT_NAME = "org.qemu.guest_agent.0"
# TCG's translation cache defaults to 1 GiB on 64-bit hosts; bound it so a VM's host
# memory stays small and predictable. 32 MiB holds the code of an idle or apache2-
# serving Debian guest: against 128 MiB it saved 90 MiB of host memory per VM with no
# loss of requests/s (`fusuma bench dcss --modes none --loads apache2`, 273-277 vs
# 220-253 requests/s). FUSUMA_TCG_TB_MIB overrides it.
TCG_TB_MIB = 32
# QEMU's seccomp filter: no obsolete syscalls, no set*id (fusuma drops privileges before
# exec; QEMU's -runas would need them), no fork/exec, no scheduler or affinity changes
# (the supervisor pins threads from outside).
SANDBOX = "on,obsolete=deny,elevateprivileges=deny,spawn=deny,resourcecontrol=deny"


def tcg_tb_mib() -> int:
    """The TCG translation cache size: FUSUMA_TCG_TB_MIB, else TCG_TB_MIB."""
    try:
        value = int(os.environ.get("FUSUMA_TCG_TB_MIB", TCG_TB_MIB))
    except ValueError:
        return TCG_TB_MIB
    return value if 1 <= value <= 2048 else TCG_TB_MIB


@dataclass(frozen=True)
class DiskConfig:
    name: str
    path: Path
    readonly: bool = False
    # Descriptors of the image opened for QEMU, one per access mode it may ask for:
    # its block layer opens a read-write image read-only first, then read-write, and
    # takes from the fdset the fd of the matching mode.
    fds: tuple[int, ...] = ()


@dataclass(frozen=True)
class SegmentConfig:
    """A shared segment: a read-only virtio-pmem device backed by ``path``."""

    name: str
    path: Path
    size_bytes: int       # the file's size, a multiple of 2 MiB
    mount: str            # where the guest mounts it
    fd: int | None = None  # the file opened read-only for QEMU


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
    segments: list[SegmentConfig] = field(default_factory=list)
    mergeable: bool = False          # private RAM: let KSM merge it (madvise MERGEABLE)
    ports: list[tuple[int, int]] = field(default_factory=list)   # (host, guest) tcp
    # False on a migration's destination: the source still holds the host ports, so
    # they are added (hostfwd_add) once the source has gone.
    bind_ports: bool = True
    usr_disk: Path | None = None     # Debian image: its /usr on a read-only virtio-blk
    # Files opened for QEMU by the supervisor (None: QEMU opens the path itself).
    ram_fd: int | None = None
    kernel_fd: int | None = None
    initrd_fd: int | None = None
    console_log_fd: int | None = None
    usr_disk_fd: int | None = None

    def passed_fds(self) -> list[int]:
        """Every descriptor the argv names: QEMU must inherit exactly these."""
        fds = [self.ram_fd, self.kernel_fd, self.initrd_fd, self.console_log_fd,
               self.usr_disk_fd, *(s.fd for s in self.segments)]
        return [fd for fd in fds if fd is not None] + [fd for d in self.disks
                                                       for fd in d.fds]


NET_ID = "net0"
MACHINE_OPTS = "sata=off,smbus=off,vmport=off,i8042=off"


def hostfwd(host: int, guest: int) -> str:
    """The hostfwd rule for one forward (also what HMP ``hostfwd_add`` takes)."""
    return f"tcp:127.0.0.1:{host}-:{guest}"

def fd_path(fd: int | None, path: Path) -> str:
    """What QEMU opens with plain open(): the inherited fd's magic link, or the path."""
    return f"/proc/self/fd/{fd}" if fd is not None else str(path)


class _FdSets:
    """Numbers fdsets in argv order and renders their ``-add-fd`` options."""

    def __init__(self) -> None:
        self.argv: list[str] = []
        self.count = 0

    def path(self, fds: int | tuple[int, ...] | None, opaque: str, path: Path) -> str:
        """``/dev/fdset/K`` holding ``fds``, or ``path`` when there are none."""
        if fds is None or fds == ():
            return str(path)
        self.count += 1
        for fd in (fds,) if isinstance(fds, int) else fds:
            self.argv += ["-add-fd", f"fd={fd},set={self.count},opaque={opaque}"]
        return f"/dev/fdset/{self.count}"


def overhead_mib(accel: str) -> int:
    """Host memory a VM's QEMU needs beyond guest RAM (used for admission checks)."""
    return 96 + (tcg_tb_mib() if accel == "tcg" else 0)


def build_argv(cfg: VmConfig, binary: str = "qemu-system-x86_64") -> list[str]:
    """Return the argv that starts ``cfg``."""
    argv = [binary, "-name", f"guest={cfg.name},debug-threads=on",
            "-nodefaults", "-no-user-config", "-display", "none", "-sandbox", SANDBOX]
    fdsets = _FdSets()
    fdsets_at = len(argv)
    if cfg.accel == "kvm":
        argv += ["-accel", "kvm", "-cpu", "host"]
    else:
        argv += ["-accel", f"tcg,tb-size={tcg_tb_mib()}", "-cpu", "max"]
    mem = f"{cfg.memory_mib}M"
    if cfg.segments:
        # virtio-pmem devices live in the device-memory region above RAM.
        extra = sum(seg.size_bytes for seg in cfg.segments)
        mem += f",slots={len(cfg.segments)},maxmem={cfg.memory_mib * 2**20 + extra}"
    # No SATA controller, SMBus, VMware port or PS/2 controller: the guest uses none of
    # them, and every device is state to save and load in a migration's downtime.
    argv += ["-machine", f"q35,{MACHINE_OPTS},memory-backend=ram0", "-smp", str(cfg.vcpus),
             "-m", mem]
    if cfg.ram_file is not None:
        # A named shared file (not a memfd): another QEMU can map the same pages,
        # which is what zero-copy migration (x-ignore-shared) relies on.
        argv += ["-object", f"memory-backend-file,id=ram0,size={cfg.memory_mib}M,"
                 f"mem-path={fd_path(cfg.ram_fd, cfg.ram_file)},share=on,merge=off"]
    else:
        merge = "on" if cfg.mergeable else "off"
        argv += ["-object", f"memory-backend-ram,id=ram0,size={cfg.memory_mib}M,"
                 f"merge={merge}"]
    segs = "".join(f" fusuma.seg={seg.name}:{seg.mount}" for seg in cfg.segments)
    if cfg.segments:
        # Device memory sits above 4 GiB, so the guest kernel would set up a 64 MiB
        # SWIOTLB bounce buffer (zeroed, so it costs host memory) for devices that
        # cannot reach it; no device DMAs there, so it is not needed.
        segs += " swiotlb=noforce"
    argv += ["-kernel", fd_path(cfg.kernel_fd, cfg.kernel),
             "-initrd", fd_path(cfg.initrd_fd, cfg.initrd),
             "-append", f"{cfg.append} fusuma.name={cfg.name}{segs}"]
    argv += ["-chardev", f"socket,id=qmp0,path={cfg.qmp_socket},server=on,wait=off",
             "-mon", "chardev=qmp0,mode=control"]
    logfile = fdsets.path(cfg.console_log_fd, "console-log", cfg.console_log)
    argv += ["-chardev", f"socket,id=con0,path={cfg.console_socket},server=on,wait=off,"
             f"logfile={logfile},logappend=on",
             "-serial", "chardev:con0"]
    argv += ["-device", "virtio-serial-pci,id=vser0",
             "-chardev", f"socket,id=qga0,path={cfg.qga_socket},server=on,wait=off",
             "-device", f"virtserialport,bus=vser0.0,chardev=qga0,name={QGA_PORT_NAME}"]
    for seg in cfg.segments:
        # share=on: every VM maps the same host pages (and x-ignore-shared skips them
        # in a zero-copy migration); readonly=on: no guest can change them.
        argv += ["-object", f"memory-backend-file,id=seg-{seg.name},"
                 f"mem-path={fd_path(seg.fd, seg.path)},"
                 f"size={seg.size_bytes},share=on,readonly=on,merge=off",
                 "-device", f"virtio-pmem-pci,memdev=seg-{seg.name},id=pmem-{seg.name}"]
    if cfg.usr_disk is not None:
        usr = fdsets.path(cfg.usr_disk_fd, "disk-fusuma-usr", cfg.usr_disk)
        argv += ["-drive", f"file={usr},format=raw,if=none,id=disk-fusuma-usr,readonly=on",
                 "-device", "virtio-blk-pci,drive=disk-fusuma-usr,serial=fusuma-usr"]
    if cfg.ports:
        fwd = "".join(f",hostfwd={hostfwd(h, g)}" for h, g in cfg.ports) \
            if cfg.bind_ports else ""
        argv += ["-netdev", f"user,id={NET_ID}{fwd}",
                 "-device", f"virtio-net-pci,netdev={NET_ID},romfile="]
    for d in cfg.disks:
        ro = ",readonly=on" if d.readonly else ""
        image = fdsets.path(d.fds, f"disk-{d.name}", d.path)
        argv += ["-drive", f"file={image},format=raw,if=none,id=disk-{d.name}{ro}",
                 "-device", f"virtio-blk-pci,drive=disk-{d.name},serial={d.name}"]
    argv += ["-pidfile", str(cfg.pidfile)]
    argv[fdsets_at:fdsets_at] = fdsets.argv
    if cfg.incoming is not None:
        # -S: a move's destination stays paused when the stream completes, until the
        # move's outcome is recorded ("forward"), so a source is never resumed after
        # its destination has run (fusuma.migration.supervisor_ops).
        argv += ["-S", "-incoming", cfg.incoming]
    return argv
