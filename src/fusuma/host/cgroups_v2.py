"""cgroup v2 driver: one unified hierarchy with cpuset, cpu, memory and io.

Kernel rules this driver follows:

- A controller reaches a child only when every ancestor lists it in
  ``cgroup.subtree_control``, so fusuma enables ``+cpuset +cpu +memory +io`` from the
  mount down to each partition (the partition's leaves get them too).
- A cgroup with controllers enabled for its children may hold no process (the
  no-internal-process rule): processes live in the leaves only.
- Leaves inherit the partition's effective cpuset; nothing is written to them.
- ``cpuset.cpus.exclusive`` (kernel 6.7+) reserves CPUs against siblings' exclusive sets;
  it must be a subset of the parent's, so the parent claims all CPUs first. Best effort:
  fusuma refuses overlapping partitions itself before it gets here.
- ``cpu.weight`` is refused (EINVAL) while ``cpu.idle`` is 1 (kernel 5.15+), so the
  driver orders the two writes; ``cpu.max`` is "QUOTA PERIOD" or "max PERIOD".
- ``memory.max`` below current usage is accepted; the kernel reclaims and may OOM-kill.
"""

from __future__ import annotations

import logging
from pathlib import Path

from fusuma.errors import CgroupError
from fusuma.host.cgroups import (
    CPU_WEIGHT_MIN,
    CgroupDriver,
    CpuPolicy,
    CpuStat,
    Limits,
    parse_flat_keyed,
    parse_pressure_total,
)
from fusuma.host.topology import format_cpulist, parse_cpulist

LOG = logging.getLogger(__name__)

WANTED = ("cpuset", "cpu", "memory", "io")
_REQUIRED = ("cpuset", "memory")


class CgroupV2Driver(CgroupDriver):
    """fusuma's cgroups on the unified hierarchy mounted at ``mount``."""

    version = 2

    def __init__(self, mount: Path, prefix: str = "fusuma", *, exclusive: bool = True) -> None:
        super().__init__(prefix)
        self.mount = mount
        self.exclusive = exclusive

    def _hierarchies(self) -> list[Path]:
        return [self.mount]

    def _memory_root(self) -> Path:
        return self.mount

    def _ram_limit_file(self) -> str:
        return "memory.max"

    def _ram_usage_file(self) -> str:
        return "memory.current"

    def _prepare_ram_parent(self, path: Path) -> None:
        enabled = self._get(path / "cgroup.subtree_control").split()
        if "memory" not in enabled:
            self._set(path / "cgroup.subtree_control", "+memory",
                      f"the memory controller for the children of {path}")

    def _dir(self, *parts: str) -> Path:
        return self.mount.joinpath(self.prefix, *parts)

    def _enable_controllers(self, path: Path) -> None:
        """Let ``path``'s children use the wanted controllers it has."""
        available = set(self._get(path / "cgroup.controllers").split())
        for ctrl in _REQUIRED:
            if ctrl not in available:
                raise CgroupError(
                    f"cgroup {path} does not offer the {ctrl} controller; enable it in "
                    f"{path.parent / 'cgroup.subtree_control'} (or in the cgroup delegated "
                    "to fusuma) and try again"
                )
        for ctrl in WANTED:
            if ctrl not in available:
                self._warn_once(f"controller-{ctrl}", "cgroup %s does not offer the %s "
                                "controller; its limits are skipped", path, ctrl)
        enabled = {tok.lstrip("+") for tok in self._get(path / "cgroup.subtree_control").split()}
        missing = [c for c in WANTED if c in available and c not in enabled]
        if missing:
            self._set(path / "cgroup.subtree_control", " ".join(f"+{c}" for c in missing),
                      f"controllers for the children of {path}")

    # -- parent --------------------------------------------------------------------------

    def ensure_parent(self) -> None:
        made: list[Path] = []
        try:
            current = self.mount
            for part in self.prefix.split("/"):
                self._enable_controllers(current)
                current = current / part
                self._mkdirs([current], str(current.relative_to(self.mount)), made)
            self._enable_controllers(current)
            self._parent_cpuset(current)
        except BaseException:
            self._undo(made)
            raise

    def _parent_cpuset(self, path: Path) -> None:
        # At the root only cpuset.cpus.effective exists; it lists every online CPU.
        for name, source in (("cpuset.mems", "cpuset.mems.effective"),
                             ("cpuset.cpus", "cpuset.cpus.effective")):
            src = self.mount / source
            if src.exists():
                value = self._get(src)
                if self._get(path / name) != value:
                    self._set(path / name, value, f"{name} of the fusuma parent cgroup")
        exclusive = path / "cpuset.cpus.exclusive"
        if self.exclusive and exclusive.exists():
            cpus = self._get(path / "cpuset.cpus.effective") if (
                path / "cpuset.cpus.effective").exists() else self._get(path / "cpuset.cpus")
            if self._get(exclusive) != cpus:
                self._try_set(exclusive, cpus, "parent-exclusive",
                              f"exclusive CPUs for the fusuma parent {path}")

    # -- partition -----------------------------------------------------------------------

    def _set_io_weight(self, path: Path, weight: int | None) -> None:
        if weight is None:
            return
        if (path / "io.weight").exists():
            self._try_set(path / "io.weight", f"default {weight}", "io-weight", "io weight")
        else:
            # BFQ's own file takes 1..1000.
            self._try_set(path / "io.bfq.weight", str(min(weight, 1000)), "io-weight",
                          "io weight (neither io.weight nor io.bfq.weight)")

    def _set_exclusive(self, path: Path, cpus: list[int]) -> None:
        if self.exclusive:
            self._try_set(path / "cpuset.cpus.exclusive", format_cpulist(cpus),
                          "partition-exclusive", "exclusive CPUs for partitions")

    def _write_limits(self, group: str, limits: Limits) -> None:
        label = self._label(group)
        path = self._dir(group)
        # Exclusive first: when moving cores, the donor releases them before it shrinks.
        self._set_exclusive(path, limits.cpus)
        self._set(path / "cpuset.cpus", format_cpulist(limits.cpus), f"CPUs of {label}")
        self._set(path / "cpuset.mems", format_cpulist(limits.mems), f"memory nodes of {label}")
        self._set(path / "memory.max", str(limits.memory_bytes), f"memory limit of {label}")
        self._set_io_weight(path, limits.io_weight)

    def _apply_new(self, group: str, limits: Limits) -> None:
        self._write_limits(group, limits)
        self._enable_controllers(self._dir(group))

    def update(self, group: str, limits: Limits) -> None:
        self._require(group)
        self._write_limits(group, limits)
        LOG.info("updated cgroup %s: cpus=%s mems=%s memory=%d MiB", self._label(group),
                 format_cpulist(limits.cpus), format_cpulist(limits.mems),
                 limits.memory_bytes // (1024 * 1024))

    def _init_leaf(self, group: str, leaf: str) -> None:
        """Nothing to write: a v2 leaf inherits its partition's effective cpuset."""

    # -- readings ------------------------------------------------------------------------

    def memory_current(self, group: str) -> int:
        self._require(group)
        path = self._dir(group, "memory.current")
        text = self._get(path)
        try:
            return int(text)
        except ValueError as exc:
            raise CgroupError(f"{path} holds {text!r}, not a number of bytes") from exc

    def cpus(self, group: str) -> list[int]:
        self._require(group)
        return parse_cpulist(self._get(self._dir(group, "cpuset.cpus.effective")))

    # -- per-VM CPU policy (the governor's leaves) ---------------------------------------

    def _cpu_leaf(self, group: str, leaf: str) -> Path | None:
        path = self._leaf_dir(self.mount, group, leaf)
        if not (path / "cpu.weight").exists():
            self._warn_once("cpu-policy", "cpu policy: the cpu controller is not enabled for "
                            "%s; VM QoS classes have no effect", path.parent)
            return None
        return path

    def set_cpu(self, group: str, leaf: str, policy: CpuPolicy) -> None:
        path = self._cpu_leaf(group, leaf)
        if path is None:
            return
        label = self._label(group, leaf)
        fallback = policy.idle and not (path / "cpu.idle").exists()
        weight = CPU_WEIGHT_MIN if fallback else policy.weight
        self._set_weight_idle(path, "cpu.weight", str(weight), policy.idle, label)
        quota = str(policy.quota_us) if policy.quota_us is not None else "max"
        self._set(path / "cpu.max", f"{quota} {policy.period_us}", f"cpu quota of {label}")

    def cpu_stat(self, group: str, leaf: str) -> CpuStat:
        path = self._cpu_leaf(group, leaf)
        if path is None:
            return CpuStat(None, 0, 0, 0, None)
        stat = parse_flat_keyed(self._get(path / "cpu.stat"))
        pressure = None
        if (path / "cpu.pressure").exists():
            pressure = parse_pressure_total(self._get(path / "cpu.pressure"))
        usage = stat.get("usage_usec")
        return CpuStat(usage_ns=None if usage is None else usage * 1000,
                       nr_periods=stat.get("nr_periods", 0),
                       nr_throttled=stat.get("nr_throttled", 0),
                       throttled_ns=stat.get("throttled_usec", 0) * 1000,
                       pressure_some_us=pressure)

    def cpu_idle_supported(self, group: str, leaf: str) -> bool:
        path = self._cpu_leaf(group, leaf)
        return path is not None and (path / "cpu.idle").exists()
