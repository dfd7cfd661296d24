"""cgroups for partitions: one interface, a driver for cgroup v2 and one for cgroup v1.

Layout, the same in both versions (``prefix`` is ``fusuma`` unless told otherwise)::

    <prefix>/                      parent: all host cpus and mems
    <prefix>/<partition>/          limits: cpuset (exclusive where the kernel allows),
                                   memory limit, I/O weight
    <prefix>/<partition>/supervisor        leaf: the partition's supervisor
    <prefix>/<partition>/vm.<name>         leaf: one QEMU process

Processes live only in leaves because cgroup v2's no-internal-process rule forbids
processes in a cgroup whose children have controllers enabled; the governor later puts
per-VM QoS on the ``vm.*`` leaves, and the ``supervisor`` leaf gets the control weight
(:meth:`CgroupDriver.set_control_cpu`), above any VM's, so that a guaranteed VM busy on
the partition's only core cannot keep the partition's supervisor waiting.

This module is the drivers' interface and the types they share; the drivers (v1, v2,
systemd) import it and nothing else of the package, and the package's ``__init__``
picks one. The drivers take their mount points as parameters, so the unit tests run
them against a fake directory tree; the two filesystem hooks that differ on a fake tree
(``_make_dir``, ``_remove_dir``, see fusuma.host.cgroups.files) are methods a test can
replace.
"""

from __future__ import annotations

import abc
import contextlib
import logging
import os
import re
import subprocess
from collections.abc import Callable
from pathlib import Path

from fusuma.errors import CgroupError, SpecError
from fusuma.frozen import frozen
from fusuma.host.cgroups.files import CgroupFiles
from fusuma.host.limits import Limits

LOG = logging.getLogger(__name__)

_NAME = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.:-]{0,127}\Z")


# What keeps a partition's cores to itself (`fusuma ps`: cores_held_by), strongest first:
# the kernel took them out of the rest of the host (a cgroup v2 cpuset partition), it
# refuses other cpusets beside them (v1 cpu_exclusive, v2 cpuset.cpus.exclusive), or
# only fusuma's own bookkeeping keeps partitions apart (other processes may run there).
HELD_PARTITION_ROOT = "cpuset partition root"
HELD_PARTITION_ISOLATED = "cpuset partition isolated"
HELD_EXCLUSIVE = "exclusive cpuset"
HELD_SHARED = "shared"

# The cgroup below the prefix that holds one memory cgroup per guest RAM file. A name
# with a dot: partition names cannot have one, so it never collides with a partition.
RAM_GROUP = "guest.ram"
RAM_STEM_RE = re.compile(r"^[a-z0-9][a-z0-9_-]{0,31}(\.[0-9a-f]{8})?\Z")


# CPU weight on cgroup v2's ``cpu.weight`` scale; v1 drivers convert to ``cpu.shares``.
CPU_WEIGHT_MIN = 1
CPU_WEIGHT_DEFAULT = 100
CPU_WEIGHT_MAX = 10000
CPU_PERIOD_US = 100_000
# The control path's leaves (``set_control_cpu``) outweigh a VM at the highest weight by
# this factor in both versions: v1 cpu.shares 262144 (the kernel's most) against 102400
# (10000 x 10.24); v2 cpu.weight 10000 (its most) against 3906, as each VM leaf's
# cpu.weight there is its weight divided by this (weights count only between siblings,
# so dividing every VM leaf's alike changes nothing between VMs).
CONTROL_HEADROOM = 2.56


@frozen
class CpuPolicy:
    """How the scheduler treats one leaf (a VM's QEMU) against its siblings.

    ``weight`` uses cgroup v2's scale (1..10000, default 100). ``quota_us`` per
    ``period_us`` caps the leaf's CPU time (None: no cap). ``idle`` asks for the
    SCHED_IDLE-like ``cpu.idle`` group (runs only on CPU nobody else wants); where the
    kernel has no ``cpu.idle`` the driver falls back to the minimal weight.
    """

    weight: int = CPU_WEIGHT_DEFAULT
    quota_us: int | None = None
    period_us: int = CPU_PERIOD_US
    idle: bool = False

    def __post_init__(self) -> None:
        if not CPU_WEIGHT_MIN <= self.weight <= CPU_WEIGHT_MAX:
            raise SpecError(f"cpu weight {self.weight} is out of range; use "
                            f"{CPU_WEIGHT_MIN}..{CPU_WEIGHT_MAX}")
        if not 1000 <= self.period_us <= 1_000_000:
            raise SpecError(f"cpu period {self.period_us} us is out of range; use "
                            "1000..1000000")
        if self.quota_us is not None and self.quota_us < 1000:
            raise SpecError(f"cpu quota {self.quota_us} us is below the kernel's minimum "
                            "of 1000 us")


@frozen
class CpuStat:
    """A leaf's CPU counters; ``None`` where this kernel or hierarchy has no such file."""

    usage_ns: int | None
    nr_periods: int
    nr_throttled: int
    throttled_ns: int
    pressure_some_us: int | None   # PSI ``cpu.pressure`` "some" total


def parse_pressure_total(text: str) -> int | None:
    """The ``total=`` of the ``some`` line of a PSI file, in microseconds."""
    for line in text.splitlines():
        if line.startswith("some "):
            for tok in line.split()[1:]:
                key, _, value = tok.partition("=")
                if key == "total" and value.isdigit():
                    return int(value)
    return None


def parse_flat_keyed(text: str) -> dict[str, int]:
    """A ``key value`` per line file such as ``cpu.stat``; non-numbers are skipped."""
    out: dict[str, int] = {}
    for line in text.splitlines():
        parts = line.split()
        if len(parts) == 2 and parts[1].lstrip("-").isdigit():
            out[parts[0]] = int(parts[1])
    return out


def check_name(kind: str, name: str) -> None:
    """Refuse a group or leaf name that is not a single safe path component."""
    if not _NAME.match(name) or name in (".", ".."):
        raise SpecError(
            f"{kind} name {name!r} is not allowed; use letters, digits, '_', '.', ':' or '-' "
            "(at most 128 characters, not starting with '.' or '-')"
        )


class CgroupDriver(CgroupFiles, abc.ABC):
    """Creates, changes and removes fusuma's cgroups in one cgroup hierarchy layout."""

    version: int

    def __init__(self, prefix: str) -> None:
        super().__init__()
        parts = prefix.strip("/").split("/")
        for part in parts:
            check_name("cgroup prefix", part)
        self.prefix = "/".join(parts)
        # Where a notice for the user goes (the partition manager prints it on stderr).
        self.notice: Callable[[str], None] = lambda text: LOG.warning("%s", text)
        # Partitions other than the one being changed whose cpuset the kernel reset
        # (a cpuset partition made or undone): their threads need pinning again.
        self.disturbed: set[str] = set()
        # Files ensure_parent() installed on the host (the systemd driver's unit files).
        self.installed: list[Path] = []

    # -- the hierarchies this driver writes to ------------------------------------------

    @abc.abstractmethod
    def _hierarchies(self) -> list[Path]:
        """Mount points of every hierarchy fusuma uses (one in v2, one per mount in v1)."""

    def _parent_dirs(self) -> list[Path]:
        return [h / self.prefix for h in self._hierarchies()]

    def _group_dirs(self, group: str) -> list[Path]:
        return [h / self.prefix / group for h in self._hierarchies()]

    def _label(self, group: str, leaf: str | None = None) -> str:
        return "/".join(p for p in (self.prefix, group, leaf) if p)

    # -- version-specific steps ----------------------------------------------------------

    @abc.abstractmethod
    def ensure_parent(self) -> None:
        """Create the fusuma parent cgroup with all host cpus and mems; idempotent."""

    @abc.abstractmethod
    def _apply_new(self, group: str, limits: Limits) -> None:
        """Write the limits of a freshly made partition cgroup."""

    @abc.abstractmethod
    def update(self, group: str, limits: Limits) -> None:
        """Change a partition's limits; to move cores, shrink the donor first."""

    @abc.abstractmethod
    def _init_leaf(self, group: str, leaf: str) -> None:
        """Make a freshly made leaf usable (v1 cpusets start empty)."""

    @abc.abstractmethod
    def memory_current(self, group: str) -> int:
        """Bytes of memory charged to the partition and its leaves."""

    @abc.abstractmethod
    def cpus(self, group: str) -> list[int]:
        """The CPUs the partition's processes may actually run on."""

    @abc.abstractmethod
    def set_cpu(self, group: str, leaf: str, policy: CpuPolicy) -> None:
        """Give leaf ``prefix/group/leaf`` this CPU weight, quota and idle flag."""

    @abc.abstractmethod
    def set_control_cpu(self, group: str, leaf: str) -> None:
        """Give leaf ``prefix/group/leaf`` the control weight: the highest this hierarchy
        takes (v1 ``cpu.shares`` 262144, v2 ``cpu.weight`` 10000), :data:`CONTROL_HEADROOM`
        times a VM's at weight 10000 in both, no quota, not idle. For the control path
        (the supervisor, a moving VM's paused QEMU): what it asks for it gets within one
        scheduler slice, and what it does not ask for costs the VMs nothing."""

    @abc.abstractmethod
    def cpu_stat(self, group: str, leaf: str) -> CpuStat:
        """The leaf's CPU usage, throttling and pressure counters."""

    @abc.abstractmethod
    def cpu_idle_supported(self, group: str, leaf: str) -> bool:
        """True when the kernel offers ``cpu.idle`` for the leaf."""

    def cores_held_by(self, group: str) -> str:
        """What keeps the partition's cores to itself: one of the ``HELD_*`` sentences."""
        return HELD_SHARED

    def _leaf_dir(self, mount: Path, group: str, leaf: str) -> Path:
        check_name("leaf", leaf)
        path = mount / self.prefix / group / leaf
        if not path.is_dir():
            raise CgroupError(f"cgroup {self._label(group, leaf)} does not exist in "
                              f"{mount}; create the leaf first")
        return path

    def _set_weight_idle(self, path: Path, weight_file: str, weight: str,
                         idle: bool, label: str) -> None:
        """Write weight and ``cpu.idle`` in the order the kernel accepts: it refuses a
        weight (EINVAL) while the group is idle."""
        idle_file = path / "cpu.idle"
        has_idle = idle_file.exists()
        was_idle = has_idle and self._get(idle_file) == "1"
        if idle and has_idle:
            if not was_idle:
                self._set(path / weight_file, weight, f"cpu weight of {label}")
                self._set(idle_file, "1", f"idle scheduling of {label}")
            return
        if was_idle:
            self._set(idle_file, "0", f"idle scheduling of {label}")
        if idle:
            self._warn_once("cpu-idle", "cpu.idle does not exist on this kernel; best-effort "
                            "VMs get the minimal cpu weight instead")
        self._set(path / weight_file, weight, f"cpu weight of {label}")

    # -- shared operations ---------------------------------------------------------------

    def exists(self, group: str) -> bool:
        """True when the partition cgroup exists in any hierarchy."""
        check_name("partition", group)
        return any(d.is_dir() for d in self._group_dirs(group))

    def _require(self, group: str) -> None:
        if not self.exists(group):
            raise CgroupError(f"cgroup {self._label(group)} does not exist; create it first")

    def create(self, group: str, limits: Limits) -> None:
        """Create partition cgroup ``prefix/group`` with its limits; nothing is left on error."""
        check_name("partition", group)
        if self.exists(group):
            raise CgroupError(
                f"cgroup {self._label(group)} already exists; delete it before creating "
                "a partition of that name"
            )
        if not all(d.is_dir() for d in self._parent_dirs()):
            self.ensure_parent()
        made: list[Path] = []
        try:
            self._mkdirs(self._group_dirs(group), self._label(group), made)
            self._apply_new(group, limits)
        except BaseException:
            self._undo(made)
            raise
        LOG.info("created cgroup %s (v%d)", self._label(group), self.version)

    def create_leaf(self, group: str, leaf: str) -> None:
        """Create ``prefix/group/leaf`` for processes; idempotent (a restarted supervisor
        calls it again for its own leaf)."""
        check_name("leaf", leaf)
        self._require(group)
        made: list[Path] = []
        try:
            self._mkdirs([d / leaf for d in self._group_dirs(group)],
                         self._label(group, leaf), made)
            self._init_leaf(group, leaf)
        except BaseException:
            self._undo(made)
            raise

    def delete_leaf(self, group: str, leaf: str) -> None:
        """Remove ``prefix/group/leaf`` in every hierarchy; refuses while processes
        remain in it, and a leaf that is already gone is not an error."""
        check_name("leaf", leaf)
        dirs = [d / leaf for d in self._group_dirs(group)]
        left = sorted({p for d in dirs if d.is_dir() for p in self._procs_below(d)})
        if left:
            raise CgroupError(f"cannot delete cgroup {self._label(group, leaf)}: processes "
                              f"{', '.join(map(str, left))} are still in it")
        for path in dirs:
            if path.is_dir():
                try:
                    self._remove_dir(path)
                except OSError as exc:
                    raise CgroupError(f"cannot remove cgroup {path}: "
                                      f"{exc.strerror or exc}") from exc

    @property
    def separate_memory(self) -> bool:
        """Whether a process's memory cgroup can differ from its cpu/cpuset cgroup (v1:
        the memory controller is a hierarchy of its own). Then a QEMU charges its guest
        RAM, faulted lazily, to the RAM file's group wherever its partition is."""
        return False

    def attach(self, group: str, leaf: str, pid: int, *, ram_stem: str | None = None
               ) -> None:
        """Move process ``pid`` with all its threads into the leaf, in every hierarchy;
        with ``ram_stem`` (only where :attr:`separate_memory`), its memory hierarchy's
        membership is the RAM group of that file instead."""
        check_name("leaf", leaf)
        label = self._label(group, leaf)
        dirs = [d / leaf for d in self._group_dirs(group)]
        if ram_stem is not None:
            if not self.separate_memory:
                raise CgroupError("this host's cgroups cannot put a process's memory in a "
                                  "group apart from its partition")
            mem = self._memory_root()
            dirs = [self._ram_dir(ram_stem) if d.is_relative_to(mem) else d for d in dirs]
        missing = [d for d in dirs if not d.is_dir()]
        if missing:
            raise CgroupError(f"cgroup {label} does not exist in {missing[0].parent}; "
                              "create the leaf before attaching a process")
        for path in dirs:
            try:
                self._write(path / "cgroup.procs", str(pid))
            except OSError as exc:
                raise CgroupError(
                    f"cannot move process {pid} into cgroup {label} ({path}): "
                    f"{exc.strerror or exc}"
                ) from exc
        LOG.debug("attached pid %d to %s", pid, label)

    def pids(self, group: str) -> list[int]:
        """Every process in the partition and its leaves, in any hierarchy."""
        check_name("partition", group)
        pids: set[int] = set()
        for path in self._group_dirs(group):
            if path.is_dir():
                pids |= self._procs_below(path)
        return sorted(pids)

    def groups(self) -> list[str]:
        """Names of the partition cgroups under the prefix (not the RAM groups')."""
        names: set[str] = set()
        for parent in self._parent_dirs():
            if parent.is_dir():
                names.update(p.name for p in parent.iterdir() if p.is_dir()
                             and p.name != RAM_GROUP)
        return sorted(names)

    # -- guest RAM: charged to a memory cgroup of its own per RAM file --------------------
    # A shared RAM file's pages are charged to the memory cgroup of whoever allocates
    # them. fusuma allocates each file's pages itself (fallocate) from a process in
    # ``prefix/guest.ram/STEM`` (STEM: the file's name without ``.ram``), limited to the
    # file's size, before its QEMU starts; QEMU's faults then find the pages and charge
    # nothing. So guest RAM is counted once, where it belongs, and a zero-copy move (the
    # file changes QEMU, not owner) changes no partition's counter. The kernel does not
    # move charges between cgroups any more (6.x), so this is the one way to get it right.

    @abc.abstractmethod
    def _memory_root(self) -> Path:
        """The mount of the hierarchy with the memory controller."""

    @abc.abstractmethod
    def _ram_limit_file(self) -> str:
        """memory.limit_in_bytes (v1) or memory.max (v2)."""

    @abc.abstractmethod
    def _ram_usage_file(self) -> str:
        """memory.usage_in_bytes (v1) or memory.current (v2)."""

    def _prepare_ram_parent(self, path: Path) -> None:  # v1: nothing to do
        """Make ``prefix/guest.ram`` usable for children (v2: enable memory there)."""

    def _ram_dir(self, stem: str) -> Path:
        if not RAM_STEM_RE.match(stem):
            raise CgroupError(f"{stem!r} is not a RAM file's name")
        return self._memory_root() / self.prefix / RAM_GROUP / stem

    def create_ram_group(self, stem: str, limit_bytes: int) -> None:
        """``prefix/guest.ram/STEM`` limited to ``limit_bytes`` (idempotent)."""
        path = self._ram_dir(stem)
        if not all(d.is_dir() for d in self._parent_dirs()):
            self.ensure_parent()
        made: list[Path] = []
        try:
            if not path.parent.is_dir():
                self._mkdirs([path.parent], f"{self.prefix}/{RAM_GROUP}", made)
                self._prepare_ram_parent(path.parent)
            self._mkdirs([path], f"{self.prefix}/{RAM_GROUP}/{stem}", made)
            self._set(path / self._ram_limit_file(), str(limit_bytes),
                      f"the RAM limit of {stem}")
        except BaseException:
            self._undo(made)
            raise

    def charge_ram(self, stem: str, ram: Path, size_bytes: int) -> None:
        """Allocate RAM file ``ram`` (``size_bytes``) from a process in its RAM group."""
        procs = self._ram_dir(stem) / "cgroup.procs"

        def join() -> None:
            with open(procs, "w") as f:
                f.write(str(os.getpid()))
        try:
            subprocess.run(["fallocate", "--length", str(size_bytes), str(ram)], check=True,
                           capture_output=True, text=True, preexec_fn=join, timeout=600)
        except FileNotFoundError as exc:
            raise CgroupError("fallocate (util-linux) is missing; install util-linux.") \
                from exc
        except subprocess.CalledProcessError as exc:
            said = exc.stderr or ""
            if exc.returncode < 0:
                said = (f"the kernel ended it (signal {-exc.returncode}): out of memory in "
                        "that cgroup or on the host")
            raise CgroupError(f"cannot allocate the RAM file {ram} ({size_bytes >> 20} MiB) "
                              f"in cgroup {self.prefix}/{RAM_GROUP}/{stem}: "
                              f"{said.strip()}") from exc
        except subprocess.SubprocessError as exc:
            said = str(exc)
            raise CgroupError(f"cannot allocate the RAM file {ram} ({size_bytes >> 20} MiB) "
                              f"in cgroup {self.prefix}/{RAM_GROUP}/{stem}: "
                              f"{said.strip()}") from exc

    def ram_charged(self, stem: str) -> int | None:
        """Bytes charged to the RAM group of ``stem`` (None when it has none)."""
        try:
            return int(self._read(self._ram_dir(stem) / self._ram_usage_file()))
        except (OSError, ValueError, CgroupError):
            return None

    def ram_pressure(self, stem: str) -> dict[str, float | None]:
        """What the memory governor reads of the RAM group of ``stem``: its usage and
        limit (bytes), its failures to charge (v1 ``memory.failcnt``; v2 the ``max``
        count of ``memory.events``) and its PSI ``some avg10`` (%, v2 only). None for
        each value the kernel does not give."""
        d = self._ram_dir(stem)
        out: dict[str, float | None] = {"usage": None, "limit": None, "fails": None,
                                        "psi": None}
        for key, name in (("usage", self._ram_usage_file()),
                          ("limit", self._ram_limit_file())):
            with contextlib.suppress(OSError, ValueError, CgroupError):
                out[key] = float(int(self._read(d / name)))
        with contextlib.suppress(OSError, ValueError, CgroupError):
            if self.version == 1:
                out["fails"] = float(int(self._read(d / "memory.failcnt")))
            else:
                out["fails"] = float(parse_flat_keyed(
                    self._read(d / "memory.events")).get("max", 0))
        with contextlib.suppress(OSError, ValueError, CgroupError):
            for line in self._read(d / "memory.pressure").splitlines():
                if line.startswith("some "):
                    fields = dict(f.split("=", 1) for f in line.split()[1:])
                    out["psi"] = float(fields["avg10"])
        return out

    def ram_peak(self, stem: str) -> int | None:
        """The most bytes the RAM group of ``stem`` has held (v1
        memory.max_usage_in_bytes, v2 memory.peak; None when unknown)."""
        try:
            return int(self._read(self._ram_dir(stem) / self._ram_peak_file()))
        except (OSError, ValueError, CgroupError):
            return None

    def ram_shmem(self, stem: str) -> int | None:
        """Bytes of shmem (the RAM file's pages) charged to the RAM group of ``stem``;
        the rest of its usage is the QEMUs' own memory where they sit in it (v1)."""
        try:
            stat = parse_flat_keyed(self._read(self._ram_dir(stem) / "memory.stat"))
        except (OSError, ValueError, CgroupError):
            return None
        return stat.get("shmem")

    def reset_ram_peak(self, stem: str) -> None:
        """Start the RAM group's high-water mark afresh from its usage now (v1; the v2
        kernel resets memory.peak only per open file): after a move, whose two QEMUs'
        own memory would otherwise stand in it. Best effort."""
        if self.version != 1:
            return
        with contextlib.suppress(OSError, CgroupError):
            self._write(self._ram_dir(stem) / "memory.max_usage_in_bytes", "0")

    def _ram_peak_file(self) -> str:
        return "memory.max_usage_in_bytes" if self.version == 1 else "memory.peak"

    def ram_groups(self) -> list[str]:
        top = self._memory_root() / self.prefix / RAM_GROUP
        return sorted(p.name for p in top.iterdir() if p.is_dir()) if top.is_dir() else []

    def delete_ram_group(self, stem: str) -> None:
        """Remove a RAM group (its file is gone); then ``guest.ram`` when it is empty."""
        path = self._ram_dir(stem)
        try:
            if path.is_dir():
                self._remove_dir(path)
            if path.parent.is_dir() and not any(p.is_dir() for p in path.parent.iterdir()):
                self._remove_dir(path.parent)
        except OSError as exc:
            raise CgroupError(f"cannot remove cgroup {path}: {exc.strerror or exc}") from exc

    def sweep_ram_groups(self, shm: Path) -> list[str]:
        """Remove the RAM groups whose file no longer exists in ``shm``; returns them."""
        gone = [s for s in self.ram_groups() if not (shm / f"{s}.ram").exists()]
        for stem in gone:
            try:
                self.delete_ram_group(stem)
            except CgroupError as exc:
                LOG.warning("%s", exc)
        return gone

    def delete(self, group: str) -> None:
        """Remove the partition's leaves, then the partition, in every hierarchy.

        Refuses while processes remain; a group that is already gone is not an error.
        """
        check_name("partition", group)
        label = self._label(group)
        left = self.pids(group)
        if left:
            raise CgroupError(
                f"cannot delete cgroup {label}: processes {', '.join(map(str, left))} "
                "are still in it; stop them first"
            )
        for top in self._group_dirs(group):
            if not top.is_dir():
                continue
            for path in self._walk_dirs(top):
                try:
                    self._remove_dir(path)
                except OSError as exc:
                    raise CgroupError(
                        f"cannot remove cgroup {path}: {exc.strerror or exc}"
                    ) from exc
        LOG.info("deleted cgroup %s", label)

    def remove_parent_if_empty(self) -> None:
        """Remove the prefix cgroup when no partition and no process is left in it."""
        for parent in self._parent_dirs():
            if not parent.is_dir():
                continue
            ram = parent / RAM_GROUP
            if ram.is_dir() and not any(p.is_dir() for p in ram.iterdir()):
                with contextlib.suppress(OSError):
                    self._remove_dir(ram)
            if any(p.is_dir() for p in parent.iterdir()):
                LOG.debug("keeping %s: it still has partitions", parent)
                continue
            if self._procs_below(parent):
                LOG.warning("keeping %s: processes are still in it", parent)
                continue
            try:
                self._remove_dir(parent)
            except OSError as exc:
                raise CgroupError(f"cannot remove cgroup {parent}: {exc.strerror or exc}"
                                  ) from exc

