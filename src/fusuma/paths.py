"""Where fusuma keeps its state, sockets, guest RAM files and image cache.

All four roots can be moved with environment variables, which is how tests run in a
temporary directory without touching the host's real fusuma:

- ``FUSUMA_HOME``        state DB, per-VM and per-partition logs (default /var/lib/fusuma)
- ``FUSUMA_RUNTIME_DIR`` UNIX sockets and pidfiles (default /run/fusuma)
- ``FUSUMA_SHM_DIR``     shared guest-RAM files (default /dev/shm/fusuma)
- ``FUSUMA_CACHE``       built guest images (default /var/cache/fusuma)
- ``FUSUMA_CGROUP_PREFIX`` name of fusuma's parent cgroup (default "fusuma")
- ``FUSUMA_CPU_EXCLUSIVE`` "0" to skip the kernel's exclusive cpusets (default "1").
  fusuma always refuses overlapping partitions itself; the kernel flag also keeps
  every other cgroup off the partitions' cores, which on cgroup v1 means only one
  fusuma prefix at a time can hold cores. Tests turn it off so that several test
  namespaces (or a test run beside `make demo`) can coexist.
- ``FUSUMA_UID_BASE``    first id of fusuma's two id ranges (default 1879048192,
  0x70000000): VMs' QEMU uids from base + 1 to base + 65535, templates' gids from
  base + 65536 to base + 131071 (fusuma.qemu.privilege; why this default:
  :data:`DEFAULT_UID_BASE`)
- ``FUSUMA_CPU_PARTITION`` cgroup v2: hold partitions' cores with the kernel's cpuset
  partitions: "auto" (default: where the kernel and the layout allow, else plain cpusets
  with a notice), "root" or "isolated" (those or refuse), "off" (fusuma.host.cgroups.v2)
- ``FUSUMA_SYSTEMD``     "auto" (default: supervisors run as systemd units when PID 1 is
  systemd on a cgroup v2 host), "1" (require it) or "0" (never; fusuma.host.systemd)
- ``FUSUMA_CONSOLE_LOG_MAX`` the most one file of a VM's console log holds, in bytes or
  with K, M or G (default 16M, at least 64K); one older file is kept besides
  (fusuma.qemu.consolelog)

Permissions (least privilege): the shm dir and the log dirs (``vms/<vm>``,
``partitions/<p>``) are 0700; the runtime dir and its ``vms``, ``partitions`` and ``networks`` are
0711 (others may pass through to a socket they are given, never list); each VM's run
dir is 0700 and owned by the uid its QEMU runs as. :func:`ensure_dir` creates a
directory or fixes the mode and owner of an existing one.

Ownership: the shm and runtime dirs (and every directory above them) must be root's and
not writable by other users (an ancestor may be, with the sticky bit, as /tmp and
/dev/shm are): /dev/shm is emptied at boot, and a local user who makes
``/dev/shm/fusuma`` first would own what fusuma then puts there. fusuma refuses such a
directory with one sentence (:func:`check_root_owned`) and never changes a directory
another user made.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import pwd
import stat
from collections.abc import Iterator, Mapping
from pathlib import Path

from fusuma.errors import HostError
from fusuma.frozen import frozen

# sockaddr_un.sun_path is 108 bytes including the NUL.
MAX_SOCKET_PATH = 107
# Directory modes: private to its owner, or passable (x) but not listable by others.
PRIVATE_DIR = 0o700
PASSABLE_DIR = 0o711
# fusuma's ids start at 0x70000000: the first 64K-aligned id above systemd's container
# range (524288…1879048191, where systemd-nspawn --private-users=pick and machined
# allocate) and below its foreign range (0x7FFE0000…, mountfsd) and 2^31 (ids above it
# break devpts and setfsuid), the range systemd's UIDS-GIDS.md lists as unused. It is
# also clear of Incus' default idmap (1000000 + 10^9, inside the container range) and of
# podman's --userns=auto (2147483647 up); 64K-aligned, as systemd recommends, so the
# upper 16 bits name the range. 1500000000, the default before, lay in the container
# range: state files made with it keep their ids (LEGACY_UID_BASE).
DEFAULT_UID_BASE = 0x7000_0000
VM_IDS = 65536               # VMs' QEMU uids: base + 1 … base + 65535
TEMPLATE_IDS = 65536         # templates' gids: base + 65536 … base + 131071
UID_SPAN = VM_IDS + TEMPLATE_IDS
# Before ids were kept in the state file, VM n (its rowid) ran as base + n and template
# n's gid was base + 65536 - n, with base FUSUMA_UID_BASE or this.
LEGACY_UID_BASE = 1_500_000_000
# uid_t is 32 bits and (uid_t)-1 means "no change": the range must stay below it.
MAX_UID = 2**32 - 2
CONSOLE_LOG_MAX = 16 * 2**20
MIN_CONSOLE_LOG_MAX = 64 * 1024


def uid_base_from_env(env: Mapping[str, str]) -> int | None:
    """FUSUMA_UID_BASE from ``env`` (None when unset); a HostError when it cannot start
    fusuma's two ranges."""
    raw = env.get("FUSUMA_UID_BASE")
    if raw is None:
        return None
    try:
        base = int(raw)
    except ValueError:
        base = -1
    if not 1 <= base <= MAX_UID - UID_SPAN:
        raise HostError(f"FUSUMA_UID_BASE={raw!r} is not a usable uid; give the first id "
                        f"of a free range of {UID_SPAN} (default {DEFAULT_UID_BASE}).")
    return base


def vm_uids(base: int) -> range:
    return range(base + 1, base + VM_IDS)


def template_gids(base: int) -> range:
    return range(base + VM_IDS, base + UID_SPAN)


def legacy_uid_base(env: Mapping[str, str] | None = None) -> int:
    """The base the records of a state file from before kept ids were made with:
    FUSUMA_UID_BASE when set, else the default of then (LEGACY_UID_BASE)."""
    base = uid_base_from_env(os.environ if env is None else env)
    return LEGACY_UID_BASE if base is None else base


def parse_size(text: str) -> int:
    """Bytes from "16M", "512K", "1G" or a plain number; ValueError otherwise."""
    t = text.strip().upper().removesuffix("B").removesuffix("I")
    unit = {"K": 2**10, "M": 2**20, "G": 2**30}.get(t[-1:], 1)
    return int(t[:-1] if unit > 1 else t) * unit


def console_log_max(raw: str | None) -> int:
    """FUSUMA_CONSOLE_LOG_MAX, checked (HostError with the fix)."""
    if raw is None:
        return CONSOLE_LOG_MAX
    try:
        size = parse_size(raw)
    except ValueError:
        size = -1
    if size < MIN_CONSOLE_LOG_MAX:
        raise HostError(f"FUSUMA_CONSOLE_LOG_MAX={raw!r} is not a size of at least 64K; "
                        "give bytes or a number with K, M or G (default 16M).")
    return size


@contextlib.contextmanager
def exclusive(path: Path, mode: int = 0o600) -> Iterator[None]:
    """Hold an exclusive ``flock`` on the file ``path`` (made with ``mode`` if
    missing) for the block: one holder at a time, across processes."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, mode)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)


def ensure_dir(path: Path, mode: int, owner: int | None = None) -> Path:
    """Make ``path`` a directory with exactly ``mode`` (and uid = gid = ``owner`` if given).

    Missing parents are created under the process's umask. An existing directory with
    another mode or owner is fixed. The directory is opened with O_NOFOLLOW and changed
    through that fd, so a symlink planted where a VM's uid may write never makes root
    chmod or chown something else."""
    try:
        path.mkdir(mode=mode, parents=True)
    except FileExistsError:
        pass
    except OSError as exc:
        raise HostError(f"cannot create directory {path}: {exc.strerror}.") from exc
    try:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError as exc:
        raise HostError(f"{path} must be a directory, not a symlink or a file "
                        f"({exc.strerror}); remove it and retry.") from exc
    try:
        st = os.fstat(fd)
        if owner is not None and (st.st_uid, st.st_gid) != (owner, owner):
            os.fchown(fd, owner, owner)
        if stat.S_IMODE(st.st_mode) != mode:
            os.fchmod(fd, mode)
    except OSError as exc:
        raise HostError(f"cannot set mode {mode:o} on {path}: {exc.strerror}.") from exc
    finally:
        os.close(fd)
    return path


def _who(uid: int) -> str:
    try:
        return f"{pwd.getpwuid(uid).pw_name} (uid {uid})"
    except KeyError:
        return f"uid {uid}"


def check_root_owned(path: Path, what: str, env: str) -> None:
    """Refuse ``path`` (fusuma's ``what`` directory, set by ``env``) unless it, if it
    exists, and every existing directory above it belong to root and no other user can
    write them (above it, a world-writable directory with the sticky bit is fine: others
    cannot rename root's entries there). A symlink on the way must be root's too. Only
    looks: nothing is created or changed."""
    for p in (path, *path.parents):
        try:
            link = os.lstat(p)
            st = os.stat(p) if stat.S_ISLNK(link.st_mode) else link
        except FileNotFoundError:
            continue
        except OSError as exc:
            raise HostError(f"cannot check the {what} {path}: {p}: {exc.strerror}.") from exc
        mode = stat.S_IMODE(st.st_mode)
        where = "" if p == path else f" is below {p}, which"
        fix = (f"check what is in it, remove it (`rm -r {p}`) and retry, or set {env} to "
               "a directory root owns" if p == path else
               f"set {env} to a directory below root-owned ones")
        for owner in {link.st_uid, st.st_uid}:
            if owner != 0:
                raise HostError(f"the {what} {path}{where} belongs to {_who(owner)} with "
                                f"mode {mode:04o}, not to root, so that user could read or "
                                f"swap fusuma's files there; {fix}.")
        writable = mode & stat.S_IWOTH or (mode & stat.S_IWGRP and st.st_gid != 0)
        if writable and (p == path or not mode & stat.S_ISVTX):
            raise HostError(f"the {what} {path}{where} is writable by other users (owner "
                            f"root, group {st.st_gid}, mode {mode:04o}), so they could "
                            f"plant or swap fusuma's files there; `chmod go-w {p}` if "
                            f"root made it on purpose, else {fix}.")


@frozen
class Paths:
    """Resolved fusuma directories for one host namespace."""

    home: Path
    runtime: Path
    shm: Path
    cache: Path
    cgroup_prefix: str
    cpu_exclusive: bool = True
    uid_base: int = DEFAULT_UID_BASE
    # The base the records of a state file from before kept ids were made with.
    legacy_uid_base: int = LEGACY_UID_BASE
    cpu_partition: str = "auto"
    systemd: str = "auto"
    console_log_max: int = CONSOLE_LOG_MAX

    @classmethod
    def from_env(cls) -> Paths:
        env = os.environ
        uid_base = uid_base_from_env(env)
        return cls(
            home=Path(env.get("FUSUMA_HOME", "/var/lib/fusuma")),
            runtime=Path(env.get("FUSUMA_RUNTIME_DIR", "/run/fusuma")),
            shm=Path(env.get("FUSUMA_SHM_DIR", "/dev/shm/fusuma")),
            cache=Path(env.get("FUSUMA_CACHE", "/var/cache/fusuma")),
            cgroup_prefix=env.get("FUSUMA_CGROUP_PREFIX", "fusuma"),
            cpu_exclusive=env.get("FUSUMA_CPU_EXCLUSIVE", "1") != "0",
            uid_base=uid_base if uid_base is not None else DEFAULT_UID_BASE,
            legacy_uid_base=uid_base if uid_base is not None else LEGACY_UID_BASE,
            cpu_partition=env.get("FUSUMA_CPU_PARTITION", "auto"),
            systemd=env.get("FUSUMA_SYSTEMD", "auto"),
            console_log_max=console_log_max(env.get("FUSUMA_CONSOLE_LOG_MAX")),
        )

    @property
    def vm_uids(self) -> range:
        """The uids VMs' QEMUs run as (one each, held by the VM's record)."""
        return vm_uids(self.uid_base)

    @property
    def template_gids(self) -> range:
        """The groups that may read templates' RAM files (one each)."""
        return template_gids(self.uid_base)

    @property
    def qemu_uids(self) -> tuple[range, ...]:
        """Every uid a QEMU of this namespace may run as: the VM range, and the range
        of records made before ids were kept (their QEMUs keep their uids)."""
        legacy = range(self.legacy_uid_base, self.legacy_uid_base + VM_IDS)
        return (self.vm_uids,) if legacy == range(self.uid_base, self.uid_base + VM_IDS) \
            else (self.vm_uids, legacy)

    @property
    def db(self) -> Path:
        return self.home / "state.db"

    def vm_dir(self, vm: str) -> Path:
        """Logs and per-VM files that outlive the QEMU process."""
        return self.home / "vms" / vm

    def vm_run_dir(self, vm: str) -> Path:
        """Sockets and pidfile of a VM's QEMU."""
        return self.runtime / "vms" / vm

    def partition_dir(self, partition: str) -> Path:
        return self.home / "partitions" / partition

    def supervisor_socket(self, partition: str) -> Path:
        return self.runtime / "partitions" / f"{partition}.sock"

    def supervisor_pidfile(self, partition: str) -> Path:
        return self.runtime / "partitions" / f"{partition}.pid"

    def network_dir(self, network: str) -> Path:
        """A network's files that outlive its processes: dnsmasq's leases, the log of
        its keeper (fusuma.network.keeper). 0700."""
        return self.home / "networks" / network

    def network_run_dir(self, network: str) -> Path:
        """A network's dnsmasq configuration, hosts and pid files, and its keeper's
        pidfile: 0711 like the runtime dir, the files 0644, so that dnsmasq, once it
        has dropped to its own user, can read its hosts file again on SIGHUP."""
        return self.runtime / "networks" / network

    @property
    def segments_dir(self) -> Path:
        """Shared segments: ``<name>.erofs`` files that VMs map as virtio-pmem."""
        return self.home / "segments"

    def segment_file(self, name: str) -> Path:
        return self.segments_dir / f"{name}.erofs"

    def ram_file(self, vm: str) -> Path:
        return self.shm / f"{vm}.ram"

    def as_env(self) -> dict[str, str]:
        """The environment that makes a child process see the same roots (absolute:
        fusuma's children run in ``/``, fusuma.spawn)."""
        return {
            "FUSUMA_HOME": os.path.abspath(self.home),
            "FUSUMA_RUNTIME_DIR": os.path.abspath(self.runtime),
            "FUSUMA_SHM_DIR": os.path.abspath(self.shm),
            "FUSUMA_CACHE": os.path.abspath(self.cache),
            "FUSUMA_CGROUP_PREFIX": self.cgroup_prefix,
            "FUSUMA_CPU_EXCLUSIVE": "1" if self.cpu_exclusive else "0",
            "FUSUMA_UID_BASE": str(self.uid_base),
            "FUSUMA_CPU_PARTITION": self.cpu_partition,
            "FUSUMA_SYSTEMD": self.systemd,
            "FUSUMA_CONSOLE_LOG_MAX": str(self.console_log_max),
        }

    def check_owned(self) -> None:
        """Refuse a shm or runtime directory another user made or may write
        (:func:`check_root_owned`), before anything is created there."""
        check_root_owned(self.runtime, "runtime directory", "FUSUMA_RUNTIME_DIR")
        check_root_owned(self.shm, "shared-memory directory", "FUSUMA_SHM_DIR")

    def ensure_shm(self) -> Path:
        """The shm dir, root's and 0700 (refused if another user made it)."""
        check_root_owned(self.shm, "shared-memory directory", "FUSUMA_SHM_DIR")
        return ensure_dir(self.shm, PRIVATE_DIR)

    def ensure_parents(self) -> None:
        """Create missing ancestors of the state and runtime roots as 0711 (passable,
        not listable): under umask 077 they would be 0700, and VMs' QEMUs (uids of their
        own) must pass through to their run dirs, which often share a parent with
        FUSUMA_HOME. (RAM files, images and logs reach QEMU as open fds: the shm and
        cache roots need no such path.) First, the shm and runtime dirs are checked
        (:meth:`check_owned`): every command refuses a directory another user made."""
        self.check_owned()
        for root in (self.home, self.runtime):
            missing = [p for p in root.parents if not p.exists()]
            for d in reversed(missing):
                ensure_dir(d, PASSABLE_DIR)

    def ensure_runtime(self) -> None:
        """The runtime dir and its ``vms`` and ``partitions``: 0711, owned by root.

        Each VM's QEMU (its own uid) must walk down to its run dir: the parents fusuma
        creates are 0711 too, and an existing parent others cannot pass is refused."""
        self.ensure_parents()
        for parent in self.runtime.parents:
            if not os.stat(parent).st_mode & stat.S_IXOTH:
                raise HostError(
                    f"the runtime directory {self.runtime} is below {parent}, which other "
                    "users cannot pass, so the VMs' QEMUs (each under a uid of its own) "
                    f"cannot reach their sockets; `chmod o+x {parent}` or set "
                    "FUSUMA_RUNTIME_DIR elsewhere (default /run/fusuma).")
        for d in (self.runtime, self.runtime / "vms", self.runtime / "partitions",
                  self.runtime / "networks"):
            ensure_dir(d, PASSABLE_DIR)
