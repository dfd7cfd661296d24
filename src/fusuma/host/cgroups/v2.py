"""cgroup v2 driver: one unified hierarchy with cpuset, cpu, memory and io.

Kernel rules this driver follows:

- A controller reaches a child only when every ancestor lists it in
  ``cgroup.subtree_control``, so fusuma enables ``+cpuset +cpu +memory +io`` from the
  mount down to each partition (the partition's leaves get all but cpuset, see below).
- A cgroup with controllers enabled for its children may hold no process (the
  no-internal-process rule): processes live in the leaves only.
- Leaves share the partition's cpuset (cpuset is not enabled below it); nothing is
  written to them.
- ``cpuset.cpus.exclusive`` (kernel 6.7+) reserves CPUs against siblings' exclusive sets;
  it must be a subset of the parent's, so the parent claims all CPUs first. Best effort:
  fusuma refuses overlapping partitions itself before it gets here.
- ``cpu.weight`` is refused (EINVAL) while ``cpu.idle`` is 1 (kernel 5.15+), so the
  driver orders the two writes; ``cpu.max`` is "QUOTA PERIOD" or "max PERIOD".
- ``memory.max`` below current usage is accepted; the kernel reclaims and may OOM-kill.

cpuset partitions (``cpuset.cpus.partition``, Linux 5.11+; ``isolated`` 6.1+) take a
partition's cores out of the rest of the host: nothing outside it is scheduled there.
The rules, as the kernel applies them (6.1; checked in a Debian 12 guest):

- A partition root's parent must itself be one, so the fusuma parent becomes a root
  holding the union of its partitions' cores, and each partition a root (or
  ``isolated``: no load balancing, for pinned vCPUs) holding its own.
- The root cgroup keeps at least one CPU for the processes in it ("Parent unable to
  distribute cpu downstream"): partitions that cover every core cannot be roots.
- A child root may take all its parent's CPUs (the parent then has none of its own;
  members below it, such as the RAM groups, run on the nearest ancestor's CPUs).
- CPUs move in order: the donor shrinks before the receiver grows, and the parent grows
  before a child takes a new CPU and shrinks only after.
- A refused partition reads ``root invalid (REASON)``; fusuma then undoes every
  partition and falls back to plain cpusets with a notice, unless FUSUMA_CPU_PARTITION
  asked for partitions explicitly (then the change is refused).
"""

from __future__ import annotations

import logging
from pathlib import Path

from fusuma.errors import CgroupError
from fusuma.host.cgroups.base import (
    CONTROL_HEADROOM,
    CPU_PERIOD_US,
    CPU_WEIGHT_MAX,
    CPU_WEIGHT_MIN,
    HELD_EXCLUSIVE,
    HELD_PARTITION_ISOLATED,
    HELD_PARTITION_ROOT,
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

WANTED = ("cpuset", "cpu", "memory", "io")
# Below a partition: its leaves share its cpuset (no cpuset of their own), because the
# kernel (6.1) refuses to make a cgroup a cpuset partition while processes sit in
# children that have cpusets ("Parent unable to distribute cpu downstream").
LEAF_WANTED = ("cpu", "memory", "io")
_REQUIRED = ("cpuset", "memory")
PARTITION_FILE = "cpuset.cpus.partition"
# FUSUMA_CPU_PARTITION: auto = cpuset partitions where the kernel and the layout allow,
# else plain cpusets with a notice; root / isolated = those or refuse; off = never.
PARTITION_MODES = ("auto", "root", "isolated", "off")


class _Refused(Exception):
    """The kernel marked a cpuset partition invalid; the text is its reason."""


class CgroupV2Driver(CgroupDriver):
    """fusuma's cgroups on the unified hierarchy mounted at ``mount``."""

    version = 2

    def __init__(self, mount: Path, prefix: str = "fusuma", *, exclusive: bool = True,
                 partition: str = "auto") -> None:
        super().__init__(prefix)
        if partition not in PARTITION_MODES:
            raise CgroupError(f"FUSUMA_CPU_PARTITION={partition!r} is not a mode; use one "
                              f"of {', '.join(PARTITION_MODES)}")
        self.mount = mount
        self.exclusive = exclusive
        self.partition_mode = partition if exclusive else "off"

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

    def _enable_controllers(self, path: Path, wanted: tuple[str, ...] = WANTED) -> None:
        """Let ``path``'s children use the ``wanted`` controllers it has."""
        available = set(self._get(path / "cgroup.controllers").split())
        for ctrl in _REQUIRED:
            if ctrl not in available:
                raise CgroupError(
                    f"cgroup {path} does not offer the {ctrl} controller; enable it in "
                    f"{path.parent / 'cgroup.subtree_control'} (or in the cgroup delegated "
                    "to fusuma) and try again"
                )
        for ctrl in wanted:
            if ctrl not in available:
                self._warn_once(f"controller-{ctrl}", "cgroup %s does not offer the %s "
                                "controller; its limits are skipped", path, ctrl)
        enabled = {tok.lstrip("+") for tok in self._get(path / "cgroup.subtree_control").split()}
        missing = [c for c in wanted if c in available and c not in enabled]
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
        # At the root only cpuset.cpus.effective exists; it lists every online CPU. A
        # parent that is a cpuset partition holds its partitions' cores (_settle).
        names: tuple[tuple[str, str], ...] = (("cpuset.mems", "cpuset.mems.effective"),
                                              ("cpuset.cpus", "cpuset.cpus.effective"))
        if self._is_partition(path):
            names = names[:1]
        for name, source in names:
            src = self.mount / source
            if src.exists():
                value = self._get(src)
                if self._get(path / name) != value:
                    self._set(path / name, value, f"{name} of the fusuma parent cgroup")
        exclusive = path / "cpuset.cpus.exclusive"
        if self.exclusive and exclusive.exists() and not self._is_partition(path):
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
        target = {g: self._own_cpus(g) for g in self.groups() if g != group}
        target[group] = sorted(limits.cpus)
        self._settle(target, group)
        self._set(path / "cpuset.mems", format_cpulist(limits.mems), f"memory nodes of {label}")
        self._set(path / "memory.max", str(limits.memory_bytes), f"memory limit of {label}")
        self._set_io_weight(path, limits.io_weight)

    def _apply_new(self, group: str, limits: Limits) -> None:
        self._write_limits(group, limits)
        self._enable_controllers(self._dir(group), LEAF_WANTED)

    def update(self, group: str, limits: Limits) -> None:
        self._require(group)
        self._write_limits(group, limits)
        LOG.info("updated cgroup %s: cpus=%s mems=%s memory=%d MiB", self._label(group),
                 format_cpulist(limits.cpus), format_cpulist(limits.mems),
                 limits.memory_bytes // (1024 * 1024))

    def _init_leaf(self, group: str, leaf: str) -> None:
        """Nothing to write: a v2 leaf inherits its partition's effective cpuset."""

    def delete(self, group: str) -> None:
        super().delete(group)
        # The cores come back to the fusuma parent: it gives them back to the host, and
        # the partitions left may now be roots (or no longer need the parent to be one).
        try:
            self._settle({g: self._own_cpus(g) for g in self.groups()}, None)
        except CgroupError as exc:
            LOG.warning("after deleting %s: %s", self._label(group), exc)

    # -- cpuset partitions ---------------------------------------------------------------

    def _own_cpus(self, group: str) -> list[int]:
        path = self._dir(group, "cpuset.cpus")
        return parse_cpulist(self._get(path)) if path.exists() else []

    def _prstate(self, path: Path) -> str:
        """``member``, ``root``, ``isolated`` or ``root invalid (...)``; "" without one."""
        f = path / PARTITION_FILE
        return self._get(f) if f.exists() else ""

    def _is_partition(self, path: Path) -> bool:
        return self._prstate(path).startswith(("root", "isolated"))

    def _host_cpus(self) -> list[int]:
        """The CPUs outside every other cpuset partition: the root's own plus the ones
        the fusuma parent holds."""
        cpus = set(parse_cpulist(self._get(self.mount / "cpuset.cpus.effective")))
        parent = self._dir()
        if self._is_partition(parent):
            cpus |= set(parse_cpulist(self._get(parent / "cpuset.cpus")))
        return sorted(cpus)

    def _partition_kind(self) -> str:
        return "isolated" if self.partition_mode == "isolated" else "root"

    def _why_no_partitions(self, union: list[int]) -> str:
        """Why the kernel would refuse partitions holding ``union``; "" when it would not."""
        if self.partition_mode == "off":
            return "FUSUMA_CPU_EXCLUSIVE=0 or FUSUMA_CPU_PARTITION=off"
        if not (self._dir() / PARTITION_FILE).exists():
            return ("this kernel has no cgroup v2 cpuset partitions (no "
                    f"{PARTITION_FILE}; Linux 5.11 or later has them)")
        host = self._host_cpus()
        held = [c for c in union if c not in host]
        if held:
            return (f"core(s) {format_cpulist(held)} are held by another cpuset partition "
                    "on this host")
        if set(union) >= set(host):
            return (f"the partitions cover every core ({format_cpulist(host)}) and the "
                    "kernel keeps at least one for the rest of the host; leave a core out "
                    "of fusuma's partitions")
        return ""

    def _settle(self, target: dict[str, list[int]], changing: str | None) -> None:
        """Give each partition in ``target`` its CPUs, held by cpuset partitions where
        the kernel allows it, else by plain cpusets (with a notice in auto mode).
        ``changing``: the partition being made or resized (the others' threads get
        pinned again by the caller when the kernel reset them: ``disturbed``)."""
        union = sorted(set().union(*target.values())) if target else []
        why = self._why_no_partitions(union) if union else "no partitions"
        explicit = self.partition_mode in ("root", "isolated")
        if why and explicit and union:
            raise CgroupError(f"cannot hold cores {format_cpulist(union)} with cpuset "
                              f"partitions: {why} (FUSUMA_CPU_PARTITION="
                              f"{self.partition_mode}; auto falls back to plain cpusets)")
        if not why:
            try:
                self._settle_partitions(target, union, changing)
                return
            except _Refused as exc:
                why = str(exc)
                LOG.warning("%s; falling back to plain cpusets", why)
                self._settle_plain(target, changing)
                if explicit:
                    raise CgroupError(f"cannot hold cores {format_cpulist(union)} with "
                                      f"cpuset partitions: {why}") from None
        else:
            self._settle_plain(target, changing)
        if changing is not None and self.partition_mode == "auto":
            held = HELD_EXCLUSIVE if self.cores_held_by(changing) == HELD_EXCLUSIVE \
                else "a plain cpuset (other processes may run there)"
            self.notice(f"fusuma: notice: partition {changing!r} holds its cores with "
                        f"{held}, not a cpuset partition: {why}.")

    def _settle_plain(self, target: dict[str, list[int]], changing: str | None) -> None:
        parent = self._dir()
        if self._is_partition(parent):
            for group in self.groups():
                path = self._dir(group)
                if self._prstate(path) not in ("", "member"):
                    self._set(path / PARTITION_FILE, "member",
                              f"the end of cpuset partition {self._label(group)}")
                    if group != changing:
                        self.disturbed.add(group)
            self._set(parent / PARTITION_FILE, "member",
                      f"the end of cpuset partition {self._label('')}")
            self._parent_cpuset(parent)
        if changing is None:
            return
        path = self._dir(changing)
        # Exclusive first: when moving cores, the donor releases them before it shrinks.
        self._set_exclusive(path, target[changing])
        self._set(path / "cpuset.cpus", format_cpulist(target[changing]),
                  f"CPUs of {self._label(changing)}")

    def _check_partition(self, path: Path, label: str) -> None:
        state = self._prstate(path)
        if "invalid" in state:
            reason = state.partition("(")[2].rstrip(")") or state
            raise _Refused(f"the kernel refused cpuset partition {label}: {reason}")

    def _settle_partitions(self, target: dict[str, list[int]], union: list[int],
                           changing: str | None) -> None:
        parent = self._dir()
        plabel = self._label("")
        kind = self._partition_kind()
        if not self._is_partition(parent):
            # cpuset.cpus.exclusive (6.7+) would stand for a partition's cpus: clear it,
            # children first (each must stay inside its parent's).
            for group in self.groups():
                self._clear_exclusive(self._dir(group))
            self._clear_exclusive(parent)
            self._set(parent / "cpuset.cpus", format_cpulist(union), f"CPUs of {plabel}")
            self._set(parent / PARTITION_FILE, "root", f"cpuset partition {plabel}")
            self._check_partition(parent, plabel)
        else:
            have = parse_cpulist(self._get(parent / "cpuset.cpus"))
            grown = sorted(set(have) | set(union))
            if grown != have:
                self._set(parent / "cpuset.cpus", format_cpulist(grown), f"CPUs of {plabel}")
                self._check_partition(parent, plabel)
        # Donors first, so that a core moving between partitions is free when taken.
        for group in sorted(target, key=lambda g: not set(target[g]) <= set(self._own_cpus(g))):
            path = self._dir(group)
            label = self._label(group)
            if self._own_cpus(group) != target[group]:
                self._set(path / "cpuset.cpus", format_cpulist(target[group]),
                          f"CPUs of {label}")
            if self._prstate(path) != kind:
                self._clear_exclusive(path)
                self._set(path / PARTITION_FILE, kind, f"cpuset partition {label}")
                if group != changing:
                    self.disturbed.add(group)
            self._check_partition(path, label)
        if parse_cpulist(self._get(parent / "cpuset.cpus")) != union:
            self._set(parent / "cpuset.cpus", format_cpulist(union), f"CPUs of {plabel}")
            self._check_partition(parent, plabel)

    def _clear_exclusive(self, path: Path) -> None:
        f = path / "cpuset.cpus.exclusive"
        if f.exists() and self._get(f):
            self._set(f, "", f"exclusive CPUs of {path}")

    def cores_held_by(self, group: str) -> str:
        self._require(group)
        path = self._dir(group)
        state = self._prstate(path)
        if state == "root":
            return HELD_PARTITION_ROOT
        if state == "isolated":
            return HELD_PARTITION_ISOLATED
        exclusive = path / "cpuset.cpus.exclusive"
        if exclusive.exists() and self._get(exclusive):
            return HELD_EXCLUSIVE
        return HELD_SHARED

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
        weight = CPU_WEIGHT_MIN if fallback else vm_leaf_weight(policy.weight)
        self._set_weight_idle(path, "cpu.weight", str(weight), policy.idle, label)
        quota = str(policy.quota_us) if policy.quota_us is not None else "max"
        self._set(path / "cpu.max", f"{quota} {policy.period_us}", f"cpu quota of {label}")

    def set_control_cpu(self, group: str, leaf: str) -> None:
        # cpu.weight stops at 10000: the VM leaves' weights are divided by
        # CONTROL_HEADROOM (vm_leaf_weight), so that this stays above a boosted VM's.
        path = self._cpu_leaf(group, leaf)
        if path is None:
            return
        label = self._label(group, leaf)
        self._set_weight_idle(path, "cpu.weight", str(CPU_WEIGHT_MAX), False, label)
        self._set(path / "cpu.max", f"max {CPU_PERIOD_US}", f"cpu quota of {label}")

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


def vm_leaf_weight(weight: int) -> int:
    """``cpu.weight`` of a VM's leaf for a weight on fusuma's scale (1..10000): divided
    by :data:`CONTROL_HEADROOM` (10000 -> 3906, 1000 -> 391, 100 -> 39), so that the
    control leaf's 10000 stays that far above a VM's highest, as v1's 262144 shares
    stay above 102400. An older supervisor wrote the weight itself; adoption rewrites
    each leaf (``Governor.apply_class``)."""
    return max(CPU_WEIGHT_MIN, round(weight / CONTROL_HEADROOM))
