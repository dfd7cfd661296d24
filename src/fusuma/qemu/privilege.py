"""Least privilege for QEMU: every VM's QEMU runs under an unprivileged uid of its own.

Like Firecracker's jailer, fusuma reserves a range of uids: ``FUSUMA_UID_BASE`` (default
0x70000000, see fusuma.paths) + 1 to + 65535. Each VM's record holds one of them, no
other record's (fusuma.state.ids: the lowest free one when it is defined), and its QEMU
runs as uid = gid = that, with no supplementary group but ``kvm`` when it uses
/dev/kvm. So one VM's QEMU can open no other VM's RAM file, disk or
sockets, nor read another QEMU's /proc files.

The supervisor (root) drops to that uid in the child between fork and exec
(:func:`drop_to`), after the steps that need root: joining the VM's cgroup and KSM
merge-any. QEMU's ``-runas`` is not used: it changes uid inside QEMU, which the seccomp
sandbox's ``elevateprivileges=deny`` forbids.

What QEMU needs but may not reach by path is opened here, by root, and passed as
descriptors (:func:`open_for_qemu`): the RAM file (0600, owned by the VM's uid), each
disk (the file registered, checked by device and inode: ``fusuma.host.storage``), the
write end of the console log's FIFO (fusuma.qemu.consolelog), segments, kernel and
initrd. By path QEMU opens only its run dir (0700, owned by its uid) and its own binary,
firmware and library trees, which must be readable and executable by other users.
"""

from __future__ import annotations

import grp
import logging
import os
import stat
from dataclasses import dataclass, field, replace
from pathlib import Path
from types import TracebackType

from fusuma.errors import HostError, StateError
from fusuma.host import storage
from fusuma.paths import Paths
from fusuma.qemu import consolelog
from fusuma.qemu.cmdline import DiskConfig, ThinDisk, Uefi, VmConfig
from fusuma.state import VmRecord

LOG = logging.getLogger(__name__)

KVM_DEVICE = Path("/dev/kvm")
RAM_MODE = 0o600


def uid_for(paths: Paths, rec: VmRecord) -> int:
    """The uid (and gid) the QEMU of ``rec`` runs as: the one its record holds, from
    FUSUMA_UID_BASE's VM range (``Paths.vm_uids``, fusuma.state.ids)."""
    if rec.uid <= 0:
        raise StateError(f"VM {rec.name!r} has no uid yet (its record was not stored); "
                         "define it with `fusuma vm create` first.")
    return rec.uid


def groups_for(accel: str, kvm_group: str = "kvm") -> list[int]:
    """Supplementary groups of a VM's QEMU: ``kvm`` if it uses /dev/kvm, else none."""
    if accel != "kvm":
        return []
    try:
        return [grp.getgrnam(kvm_group).gr_gid]
    except KeyError:
        return []


def check_kvm_access(groups: list[int], device: Path = KVM_DEVICE) -> None:
    """Refuse KVM when a QEMU with ``groups`` (and no uid of the device's) cannot open it."""
    try:
        st = device.stat()
    except OSError as exc:
        raise HostError(f"cannot use {device}: {exc.strerror}.") from exc
    mode = stat.S_IMODE(st.st_mode)
    if mode & 0o006 == 0o006 or (st.st_gid in groups and mode & 0o060 == 0o060):
        return
    raise HostError(f"{device} (mode {mode:04o}, gid {st.st_gid}) cannot be opened by "
                    "the unprivileged uid a VM's QEMU runs as; give it to group kvm with "
                    "mode 0660 (Debian's udev rule does) or start the VM with --accel tcg.")


def drop_to(uid: int, groups: list[int]) -> None:
    """Become ``uid``/gid ``uid`` with ``groups``, for good (real, effective and saved).

    Runs in the child between fork and exec: async-signal-safe enough for the
    single-threaded supervisor, and the last step before exec."""
    os.setgroups(groups)
    os.setresgid(uid, uid, uid)
    os.setresuid(uid, uid, uid)


@dataclass
class QemuFiles:
    """Descriptors opened for one QEMU. The supervisor closes its copies once QEMU
    has inherited them (``subprocess.Popen(pass_fds=...)``)."""

    fds: list[int] = field(default_factory=list)
    # The read end of the console FIFO: the supervisor's, not QEMU's (take_console).
    console: int | None = None

    def add(self, fd: int) -> int:
        self.fds.append(fd)
        return fd

    def take_console(self) -> int | None:
        """The console FIFO's read end, now the caller's to close."""
        fd, self.console = self.console, None
        return fd

    def close(self) -> None:
        while self.fds:
            os.close(self.fds.pop())
        fd = self.take_console()
        if fd is not None:
            os.close(fd)

    def __enter__(self) -> QemuFiles:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.close()


def open_ram_file(path: Path, uid: int, *, create: bool) -> int:
    """Open a VM's shared RAM file read-write, as a regular file 0600 owned by ``uid``.

    ``create``: a new file (O_EXCL), else the existing one, never created by accident
    (a zero-copy destination must map the source's pages, not a new empty file). A
    file from before fusuma ran QEMU unprivileged is given to ``uid``."""
    flags = os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC
    if create:
        flags |= os.O_CREAT | os.O_EXCL
    try:
        fd = os.open(path, flags, RAM_MODE)
    except FileExistsError as exc:
        raise HostError(f"the RAM file {path} already exists, so another QEMU may still "
                        "map it; end that QEMU (`fusuma ps`) before starting this one."
                        ) from exc
    except OSError as exc:
        raise HostError(f"cannot {'create' if create else 'open'} the RAM file {path}: "
                        f"{exc.strerror}.") from exc
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise HostError(f"the RAM file {path} is not a regular file; remove it.")
        if (st.st_uid, st.st_gid) != (uid, uid):
            os.fchown(fd, uid, uid)
        if stat.S_IMODE(st.st_mode) != RAM_MODE:
            os.fchmod(fd, RAM_MODE)
    except BaseException as exc:
        os.close(fd)
        if isinstance(exc, OSError):
            raise HostError(f"cannot give the RAM file {path} to uid {uid}: "
                            f"{exc.strerror}.") from exc
        raise
    return fd


def create_ram_file(path: Path, uid: int) -> None:
    """A new, empty RAM file for ``uid`` (QEMU sizes it); it must not exist yet."""
    os.close(open_ram_file(path, uid, create=True))


def _open(vm: str, what: str, path: Path, flags: int, mode: int = 0o600) -> int:
    try:
        return os.open(path, flags | os.O_CLOEXEC, mode)
    except OSError as exc:
        raise HostError(f"VM {vm}: cannot open {what} {path}: {exc.strerror}.") from exc


def _open_public(vm: str, what: str, path: Path) -> int:
    """Open a file every VM may read (kernel, initrd, segment).

    QEMU reopens it through /proc/self/fd, which checks the file's own mode: a root-owned
    file without read permission for others (an image built under umask 077) is made
    readable, as it holds nothing private (Debian packages, an erofs of shared files)."""
    fd = _open(vm, what, path, os.O_RDONLY)
    try:
        st = os.fstat(fd)
        mode = stat.S_IMODE(st.st_mode)
        if mode & 0o004 == 0:
            if st.st_uid != 0:
                raise HostError(f"VM {vm}: {what} {path} is not readable by other users "
                                f"(mode {mode:04o}); `chmod a+r` it.")
            os.fchmod(fd, mode | 0o444)
            LOG.info("made %s %s readable by other users (was %04o)", what, path, mode)
    except BaseException:
        os.close(fd)
        raise
    return fd


def _open_disk(vm: str, files: QemuFiles, disk: DiskConfig) -> tuple[int, ...]:
    """Open a disk's file as registered: the path without following a symlink, checked
    against the recorded device and inode before that inode is opened (by
    ``/proc/self/fd``), so a file swapped since registration is never opened."""
    pinned = storage.check_registered(disk.name, disk.path, disk.dev, disk.ino)
    try:
        modes = (os.O_RDONLY,) if disk.readonly else (os.O_RDWR, os.O_RDONLY)
        out = []
        for mode in modes:
            try:
                out.append(files.add(storage.reopen(pinned, mode)))
            except OSError as exc:
                raise HostError(f"VM {vm}: cannot open disk {disk.name!r} {disk.path}: "
                                f"{exc.strerror}.") from exc
        return tuple(out)
    finally:
        os.close(pinned)


def open_for_qemu(cfg: VmConfig, uid: int, *, new_ram: bool) -> tuple[VmConfig, QemuFiles]:
    """Open what ``cfg`` names for a QEMU running as ``uid``; return the config with the
    fds filled in (build_argv then names them) and the open files.

    ``new_ram``: create the RAM file (the caller removed any old one), else open the
    existing one (a migration's destination). On failure nothing stays open."""
    files = QemuFiles()
    try:
        ram_fd = None
        if cfg.ram_file is not None:
            ram_fd = files.add(open_ram_file(cfg.ram_file, uid, create=new_ram))
        kernel_fd = None if cfg.kernel is None else files.add(
            _open_public(cfg.name, "kernel", cfg.kernel))
        initrd_fd = None if cfg.initrd is None else files.add(
            _open_public(cfg.name, "initrd", cfg.initrd))
        if cfg.console_fifo is not None:
            try:
                files.console, writer = consolelog.open_pipe(cfg.console_fifo)
            except OSError as exc:
                raise HostError(f"VM {cfg.name}: cannot make the console FIFO "
                                f"{cfg.console_fifo}: {exc}.") from exc
            log_fd = files.add(writer)
        else:
            log_fd = files.add(_open(cfg.name, "console log", cfg.console_log,
                                     os.O_WRONLY | os.O_APPEND | os.O_CREAT
                                     | os.O_NOFOLLOW))
        segments = [replace(s, fd=files.add(_open_public(cfg.name, f"segment {s.name!r}",
                                                         s.path)))
                    for s in cfg.segments]
        disks = [replace(d, fds=_open_disk(cfg.name, files, d)) for d in cfg.disks]
        root_fd = None if cfg.root_disk is None else files.add(
            _open(cfg.name, "root image", cfg.root_disk, os.O_RDONLY))
        thin, uefi, seed_fd = _open_boot(cfg, files)
    except BaseException:
        files.close()
        raise
    return replace(cfg, ram_fd=ram_fd, kernel_fd=kernel_fd, initrd_fd=initrd_fd,
                   console_log_fd=log_fd, segments=segments, disks=disks,
                   root_disk_fd=root_fd, thin_disk=thin, uefi=uefi, seed_fd=seed_fd), files


def _open_private(vm: str, what: str, path: Path, flags: int) -> int:
    """Open a VM's own file (its thin disk, NVRAM, seed), never through a symlink."""
    return _open(vm, what, path, flags | os.O_NOFOLLOW)


def _open_boot(cfg: VmConfig, files: QemuFiles) -> tuple[ThinDisk | None, Uefi | None,
                                                        int | None]:
    """Open a firmware boot's files: the thin disk (read-write and read-only, as disks)
    and its base (read-only), OVMF's code (public) and the VM's NVRAM, the seed."""
    thin = cfg.thin_disk
    if thin is not None:
        fds = tuple(files.add(_open_private(cfg.name, "thin disk", thin.path, mode))
                    for mode in (os.O_RDWR, os.O_RDONLY))
        base_fd = files.add(_open(cfg.name, "base image", thin.base,
                                  os.O_RDONLY | os.O_NOFOLLOW))
        layer_fd = None if thin.layer is None else files.add(
            _open(cfg.name, "template's disk layer", thin.layer, os.O_RDONLY | os.O_NOFOLLOW))
        thin = replace(thin, fds=fds, base_fd=base_fd, layer_fd=layer_fd)
    uefi = cfg.uefi
    if uefi is not None:
        uefi = replace(uefi, code_fd=files.add(_open_public(cfg.name, "UEFI firmware",
                                                            uefi.code)),
                       vars_fds=tuple(files.add(_open_private(
                           cfg.name, "UEFI variables", uefi.vars, mode))
                           for mode in (os.O_RDWR, os.O_RDONLY)))
    seed_fd = None if cfg.seed is None else files.add(
        _open_private(cfg.name, "cloud-init seed", cfg.seed, os.O_RDONLY))
    return thin, uefi, seed_fd
