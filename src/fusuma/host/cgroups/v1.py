"""cgroup v1 driver: cpuset, cpu, memory and blkio, each at its own mount point.

Kernel rules this driver follows (checked on 6.18):

- A new cpuset starts with empty ``cpuset.cpus``/``cpuset.mems`` and takes no process
  until both are written, leaves included.
- ``cpuset.cpu_exclusive=1`` is refused (EACCES) unless the parent is exclusive too, so
  the fusuma parent is made exclusive. Being exclusive with every CPU, it keeps any other
  root-level cpuset from getting CPUs at all; ``exclusive=False`` turns this off.
- No sibling, exclusive or not, may list a CPU of an exclusive sibling (EINVAL), and a
  child's CPUs must stay inside its parent's, so cores move in steps: the donor shrinks
  first (the caller), then the receiver grows to old+new, its leaves follow, and the
  partition finally settles on the new set.
- Lowering ``memory.limit_in_bytes`` below current usage fails with EBUSY after reclaim.
- ``cpu.shares`` (2..262144, default 1024) is cpu.weight x 10.24, so a VM's highest
  weight (10000) is 102400 and the control path's leaves (262144) stay above it; the
  kernel refuses
  a new value (EINVAL) while ``cpu.idle`` is 1, so the driver orders the two writes.
  ``cpu.cfs_quota_us`` -1 means no cap.
- Block I/O weight is ``blkio.bfq.weight`` (1..1000, BFQ only) on current kernels;
  legacy CFQ ``blkio.weight`` (10..1000) is used where it still exists.
"""

from __future__ import annotations

import errno
import logging
from pathlib import Path

from fusuma.errors import CgroupError
from fusuma.host.cgroups.base import (
    CPU_WEIGHT_MIN,
    HELD_EXCLUSIVE,
    HELD_SHARED,
    CgroupDriver,
    CpuPolicy,
    CpuStat,
    parse_flat_keyed,
    parse_pressure_total,
)
from fusuma.host.limits import Limits
from fusuma.host.topology import format_cpulist, parse_cpulist

LOG = logging.getLogger(__name__)


class CgroupV1Driver(CgroupDriver):
    """fusuma's cgroups on the v1 hierarchies; ``mounts`` maps controller to mount point."""

    version = 1

    def __init__(self, mounts: dict[str, Path], prefix: str = "fusuma", *,
                 exclusive: bool = True) -> None:
        super().__init__(prefix)
        for required in ("cpuset", "memory"):
            if required not in mounts:
                raise CgroupError(f"the v1 {required} controller is not mounted; mount it "
                                  f"(mount -t cgroup -o {required} ...) and try again")
        self.mounts = dict(mounts)
        self.exclusive = exclusive
        for optional in ("cpu", "blkio"):
            if optional not in mounts:
                LOG.warning("the v1 %s controller is not mounted; its limits are skipped",
                            optional)

    def _hierarchies(self) -> list[Path]:
        unique: list[Path] = []
        for path in self.mounts.values():
            if path not in unique:
                unique.append(path)
        return unique

    def _memory_root(self) -> Path:
        return self.mounts["memory"]

    @property
    def separate_memory(self) -> bool:
        mem = self.mounts["memory"]
        return all(self.mounts.get(c) != mem for c in ("cpu", "cpuset", "blkio"))

    def _ram_limit_file(self) -> str:
        return "memory.limit_in_bytes"

    def _ram_usage_file(self) -> str:
        return "memory.usage_in_bytes"

    def _cpuset(self, *parts: str) -> Path:
        return self.mounts["cpuset"].joinpath(self.prefix, *parts)

    def _memory(self, group: str) -> Path:
        return self.mounts["memory"] / self.prefix / group

    # -- parent --------------------------------------------------------------------------

    def ensure_parent(self) -> None:
        root = self.mounts["cpuset"]
        cpus = self._get(root / "cpuset.cpus")
        mems = self._get(root / "cpuset.mems")
        made: list[Path] = []
        try:
            # Every level of a multi-part prefix needs its own cpus, mems and flag.
            levels = self.prefix.split("/")
            for depth in range(1, len(levels) + 1):
                sub = "/".join(levels[:depth])
                self._mkdirs([h / sub for h in self._hierarchies()], sub, made)
                self._parent_level(root / sub, cpus, mems)
        except BaseException:
            self._undo(made)
            raise

    def _parent_level(self, path: Path, cpus: str, mems: str) -> None:
        for name, value in (("cpuset.mems", mems), ("cpuset.cpus", cpus)):
            if self._get(path / name) != value:
                try:
                    self._write(path / name, value)
                    LOG.debug("%s <- %s", path / name, value)
                except OSError as exc:
                    raise CgroupError(
                        f"cannot give the fusuma parent cgroup {path} {name}={value}: "
                        f"{exc.strerror or exc}; another cgroup beside it may hold those "
                        "CPUs exclusively"
                    ) from exc
        if self.exclusive and self._get(path / "cpuset.cpu_exclusive") != "1":
            self._try_set(path / "cpuset.cpu_exclusive", "1", "parent-exclusive",
                          f"exclusive cpusets disabled (cannot make {path} exclusive, "
                          "a cgroup beside it shares CPUs)")

    def _parent_is_exclusive(self) -> bool:
        try:
            return self._read(self._cpuset("cpuset.cpu_exclusive")) == "1"
        except OSError:
            return False

    # -- partition -----------------------------------------------------------------------

    def _set_cpus(self, path: Path, cpus: list[int], label: str) -> None:
        value = format_cpulist(cpus)
        try:
            self._write(path / "cpuset.cpus", value)
            LOG.debug("%s <- %s", path / "cpuset.cpus", value)
        except OSError as exc:
            hint = ("another partition holds some of them exclusively; shrink it first"
                    if exc.errno == errno.EINVAL else
                    "a leaf still uses CPUs outside the new set"
                    if exc.errno == errno.EBUSY else "the kernel refused")
            raise CgroupError(f"cannot give CPUs {value} to cgroup {label}: "
                              f"{exc.strerror or exc}; {hint}") from exc

    def _set_memory(self, group: str, limit: int) -> None:
        path = self._memory(group) / "memory.limit_in_bytes"
        try:
            self._write(path, str(limit))
        except OSError as exc:
            hint = ("its processes already use more; stop a VM or choose a larger limit"
                    if exc.errno == errno.EBUSY else "the kernel refused")
            raise CgroupError(
                f"cannot set the memory limit of cgroup {self._label(group)} to "
                f"{limit // (1024 * 1024)} MiB: {exc.strerror or exc}; {hint}"
            ) from exc

    def _set_io_weight(self, group: str, weight: int | None) -> None:
        if weight is None:
            return
        if "blkio" not in self.mounts:
            self._warn_once("io-weight", "io weight: the v1 blkio controller is not mounted; "
                            "carrying on without it")
            return
        path = self.mounts["blkio"] / self.prefix / group
        if (path / "blkio.bfq.weight").exists():
            self._try_set(path / "blkio.bfq.weight", str(min(max(weight, 1), 1000)),
                          "io-weight", "io weight")
        else:
            self._try_set(path / "blkio.weight", str(min(max(weight, 10), 1000)),
                          "io-weight", "io weight (neither blkio.bfq.weight nor blkio.weight)")

    def _apply_new(self, group: str, limits: Limits) -> None:
        label = self._label(group)
        path = self._cpuset(group)
        self._set(path / "cpuset.mems", format_cpulist(limits.mems), f"memory nodes of {label}")
        self._set_cpus(path, limits.cpus, label)
        if self.exclusive:
            if self._parent_is_exclusive():
                self._set(path / "cpuset.cpu_exclusive", "1", f"exclusive CPUs for {label}")
            else:
                self._warn_once("partition-exclusive", "the parent cpuset %s is not exclusive, "
                                "so partitions' CPUs are not kernel-exclusive",
                                self._cpuset())
        self._set_memory(group, limits.memory_bytes)
        self._set_io_weight(group, limits.io_weight)

    def _leaves(self, group: str) -> list[Path]:
        path = self._cpuset(group)
        return sorted(p for p in path.iterdir() if p.is_dir())

    def update(self, group: str, limits: Limits) -> None:
        self._require(group)
        label = self._label(group)
        path = self._cpuset(group)
        old_cpus = parse_cpulist(self._get(path / "cpuset.cpus"))
        old_mems = parse_cpulist(self._get(path / "cpuset.mems"))
        old_memory = int(self._get(self._memory(group) / "memory.limit_in_bytes"))
        mems = format_cpulist(limits.mems)
        # Memory first: lowering it is what usually fails (EBUSY), and it is easy to undo.
        self._set_memory(group, limits.memory_bytes)
        try:
            # Grow to old+new so the leaves may move, move them, then settle on new.
            union_mems = sorted(set(old_mems) | set(limits.mems))
            union_cpus = sorted(set(old_cpus) | set(limits.cpus))
            self._set(path / "cpuset.mems", format_cpulist(union_mems),
                      f"memory nodes of {label}")
            self._set_cpus(path, union_cpus, label)
            for leaf in self._leaves(group):
                self._set(leaf / "cpuset.mems", mems, f"memory nodes of {label}/{leaf.name}")
                self._set_cpus(leaf, limits.cpus, f"{label}/{leaf.name}")
            self._set_cpus(path, limits.cpus, label)
            self._set(path / "cpuset.mems", mems, f"memory nodes of {label}")
        except CgroupError:
            try:
                self._set_memory(group, old_memory)
            except CgroupError as exc:
                LOG.warning("could not restore the memory limit of %s: %s", label, exc)
            raise
        self._set_io_weight(group, limits.io_weight)
        LOG.info("updated cgroup %s: cpus=%s mems=%s memory=%d MiB", label,
                 format_cpulist(limits.cpus), mems, limits.memory_bytes // (1024 * 1024))

    def _init_leaf(self, group: str, leaf: str) -> None:
        label = self._label(group, leaf)
        path = self._cpuset(group)
        for name in ("cpuset.mems", "cpuset.cpus"):
            self._set(path / leaf / name, self._get(path / name), f"{name} of {label}")

    # -- readings ------------------------------------------------------------------------

    def memory_current(self, group: str) -> int:
        self._require(group)
        path = self._memory(group) / "memory.usage_in_bytes"
        text = self._get(path)
        try:
            return int(text)
        except ValueError as exc:
            raise CgroupError(f"{path} holds {text!r}, not a number of bytes") from exc

    def cpus(self, group: str) -> list[int]:
        self._require(group)
        return parse_cpulist(self._get(self._cpuset(group, "cpuset.effective_cpus")))

    def cores_held_by(self, group: str) -> str:
        self._require(group)
        try:
            exclusive = self._read(self._cpuset(group, "cpuset.cpu_exclusive")) == "1"
        except OSError:
            exclusive = False
        return HELD_EXCLUSIVE if exclusive else HELD_SHARED

    # -- per-VM CPU policy (the governor's leaves) ---------------------------------------

    def _cpu_leaf(self, group: str, leaf: str) -> Path | None:
        if "cpu" not in self.mounts:
            self._warn_once("cpu-policy", "cpu policy: the v1 cpu controller is not mounted; "
                            "VM QoS classes have no effect")
            return None
        return self._leaf_dir(self.mounts["cpu"], group, leaf)

    def set_cpu(self, group: str, leaf: str, policy: CpuPolicy) -> None:
        path = self._cpu_leaf(group, leaf)
        if path is None:
            return
        label = self._label(group, leaf)
        fallback = policy.idle and not (path / "cpu.idle").exists()
        shares = shares_for_weight(CPU_WEIGHT_MIN if fallback else policy.weight)
        self._set_weight_idle(path, "cpu.shares", str(shares), policy.idle, label)
        self._set(path / "cpu.cfs_period_us", str(policy.period_us), f"cpu period of {label}")
        quota = str(policy.quota_us) if policy.quota_us is not None else "-1"
        self._set(path / "cpu.cfs_quota_us", quota, f"cpu quota of {label}")

    def set_control_cpu(self, group: str, leaf: str) -> None:
        path = self._cpu_leaf(group, leaf)
        if path is None:
            return
        label = self._label(group, leaf)
        self._set_weight_idle(path, "cpu.shares", str(SHARES_MAX), False, label)
        self._set(path / "cpu.cfs_quota_us", "-1", f"cpu quota of {label}")

    def cpu_stat(self, group: str, leaf: str) -> CpuStat:
        path = self._cpu_leaf(group, leaf)
        if path is None:
            return CpuStat(None, 0, 0, 0, None)
        stat = parse_flat_keyed(self._get(path / "cpu.stat"))
        usage = None
        if (path / "cpuacct.usage").exists():     # cpu and cpuacct mounted together
            usage = int(self._get(path / "cpuacct.usage"))
        pressure = None
        if (path / "cpu.pressure").exists():
            pressure = parse_pressure_total(self._get(path / "cpu.pressure"))
        return CpuStat(usage_ns=usage, nr_periods=stat.get("nr_periods", 0),
                       nr_throttled=stat.get("nr_throttled", 0),
                       throttled_ns=stat.get("throttled_time", 0),
                       pressure_some_us=pressure)

    def cpu_idle_supported(self, group: str, leaf: str) -> bool:
        path = self._cpu_leaf(group, leaf)
        return path is not None and (path / "cpu.idle").exists()


SHARES_MIN = 2
SHARES_MAX = 262144


def shares_for_weight(weight: int) -> int:
    """v1 ``cpu.shares`` for a cgroup v2 weight: the defaults match (100 -> 1024) and the
    minimal weight is the minimal share."""
    if weight <= CPU_WEIGHT_MIN:
        return SHARES_MIN
    return max(SHARES_MIN, min(SHARES_MAX, round(weight * 1024 / 100)))
