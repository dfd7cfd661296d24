"""cgroup v2 under systemd: fusuma's cgroups inside the units systemd delegated to it.

Layout (``S`` is the prefix's slice, see fusuma.host.systemd)::

    S/fusuma-supervisor@INST.service/      the partition: limits are unit properties
    S/fusuma-supervisor@INST.service/supervisor, vm.NAME
                                           threaded leaves: per-VM cpu policy
    S/fusuma-ram@PREFIX.service/keeper     the holder's keeper process
    S/fusuma-ram@PREFIX.service/STEM       one memory cgroup per guest RAM file

fusuma writes only below the units' own cgroups; the units' attributes (cpuset, memory
and I/O limits) go through systemd. A threaded cgroup's ``cgroup.procs`` cannot be read
(EOPNOTSUPP): its processes are found from ``cgroup.threads``.
"""

from __future__ import annotations

import errno
import logging
import time
from pathlib import Path

from fusuma.errors import CgroupError
from fusuma.host.cgroups.base import RAM_STEM_RE, check_name
from fusuma.host.cgroups.v2 import CgroupV2Driver
from fusuma.host.limits import Limits
from fusuma.host.systemd import KEEPER, Units, slice_path
from fusuma.host.topology import format_cpulist, parse_cpulist

LOG = logging.getLogger(__name__)

# Controllers that work on threaded cgroups; the only ones enabled below a partition.
THREADED = ("cpu", "cpuset")
_KEEPER_WAIT_S = 10.0


def _tgid(tid: int) -> int | None:
    try:
        for line in Path(f"/proc/{tid}/status").read_text().splitlines():
            if line.startswith("Tgid:"):
                return int(line.split()[1])
    except (OSError, ValueError, IndexError):
        pass
    return None


class CgroupSystemdDriver(CgroupV2Driver):
    """fusuma's cgroups on a systemd host (cgroup v2), through ``units``."""

    def __init__(self, mount: Path, prefix: str, units: Units, *,
                 exclusive: bool = True) -> None:
        # Cpuset partitions need every ancestor up to the root: systemd's slices.
        super().__init__(mount, prefix, exclusive=exclusive, partition="off")
        self.units = units

    # -- where things are ----------------------------------------------------------------
    def _slice_dir(self) -> Path:
        return self.mount / slice_path(self.units.slice)

    def _unit_dir(self, unit: str) -> Path:
        return self.mount / self.units.cgroup(unit)

    def _parent_dirs(self) -> list[Path]:
        return [self._slice_dir()]

    def _group_dirs(self, group: str) -> list[Path]:
        return [self._unit_dir(self.units.supervisor(group))]

    def _dir(self, *parts: str) -> Path:
        if not parts or not parts[0]:
            return self._slice_dir()
        return self._group_dirs(parts[0])[0].joinpath(*parts[1:])

    def _label(self, group: str, leaf: str | None = None) -> str:
        unit = self.units.supervisor(group) if group else self.units.slice
        return f"{unit}/{leaf}" if leaf else unit

    def _leaf_dir(self, mount: Path, group: str, leaf: str) -> Path:
        check_name("leaf", leaf)
        path = self._dir(group, leaf)
        if not path.is_dir():
            raise CgroupError(f"cgroup {self._label(group, leaf)} does not exist; create the "
                              "leaf first")
        return path

    def _ram_root(self) -> Path:
        return self._unit_dir(self.units.ram)

    def _ram_dir(self, stem: str) -> Path:
        if not RAM_STEM_RE.match(stem):
            raise CgroupError(f"{stem!r} is not a RAM file's name")
        return self._ram_root() / stem

    def groups(self) -> list[str]:
        top = self._slice_dir()
        if not top.is_dir():
            return []
        names = (self.units.partition_of(p.name) for p in top.iterdir() if p.is_dir())
        return sorted(n for n in names if n)

    # -- partitions: unit properties -----------------------------------------------------
    def ensure_parent(self) -> None:
        """Install fusuma's unit files (the slice appears with its first unit)."""
        self.installed = self.units.install()

    def create(self, group: str, limits: Limits) -> None:
        check_name("partition", group)
        if self.exists(group):
            raise CgroupError(f"cgroup {self._label(group)} already exists; delete it before "
                              "creating a partition of that name")
        self.ensure_parent()
        self.units.write_limits(self.units.supervisor(group), limits)
        self.notice(f"fusuma: notice: partition {group!r} holds cores "
                    f"{format_cpulist(limits.cpus)} with a plain cpuset (AllowedCPUs= of "
                    f"{self.units.supervisor(group)}): systemd owns the slices above it, "
                    "so the kernel's cpuset partitions are out of reach and other services "
                    "may run on those cores (keep them off with `systemctl set-property "
                    "system.slice AllowedCPUs=...`).")

    def update(self, group: str, limits: Limits) -> None:
        self._require(group)
        unit = self.units.supervisor(group)
        self.units.set_limits(unit, limits)
        got = parse_cpulist(self._get(self._dir(group, "cpuset.cpus")))
        if got != sorted(limits.cpus):
            raise CgroupError(f"systemd did not give {unit} cores "
                              f"{format_cpulist(limits.cpus)} (its cpuset.cpus is "
                              f"{format_cpulist(got) or 'empty'}); see `systemctl status "
                              f"{unit}`")
        LOG.info("updated %s: cpus=%s memory=%d MiB", unit, format_cpulist(limits.cpus),
                 limits.memory_bytes >> 20)

    def _apply_new(self, group: str, limits: Limits) -> None:
        raise AssertionError("a systemd partition's cgroup is made by systemd")

    def delete(self, group: str) -> None:
        check_name("partition", group)
        unit = self.units.supervisor(group)
        left = self.pids(group)
        if left:
            raise CgroupError(f"cannot delete cgroup {unit}: processes "
                              f"{', '.join(map(str, left))} are still in it; stop them first")
        top = self._dir(group)
        if top.is_dir():
            for path in self._walk_dirs(top):
                if path == top:
                    continue
                try:
                    self._remove_dir(path)
                except OSError as exc:
                    raise CgroupError(f"cannot remove cgroup {path}: "
                                      f"{exc.strerror or exc}") from exc
        self.units.forget(unit)
        if not self.units.wait_gone(top):
            LOG.warning("systemd left the empty cgroup %s of %s behind", top, unit)
        LOG.info("deleted %s", unit)

    def _init_leaf(self, group: str, leaf: str) -> None:
        """Make the leaf threaded and give it the thread-mode controllers (see
        fusuma.host.systemd: a unit restart must find its cgroup able to take a process)."""
        top = self._dir(group)
        path = top / leaf
        available = set(self._get(top / "cgroup.controllers").split())
        if "cpuset" not in available:
            raise CgroupError(
                f"systemd did not delegate the cpuset controller to {self._label(group)} "
                f"(it offers: {' '.join(sorted(available)) or 'none'}), so the partition "
                "cannot be held to its cores; give the unit Delegate=yes on a kernel with "
                "cpusets, or set FUSUMA_SYSTEMD=0")
        if self._get(path / "cgroup.type") != "threaded":
            self._set(path / "cgroup.type", "threaded",
                      f"thread mode for {self._label(group, leaf)}")
        enabled = set(self._get(top / "cgroup.subtree_control").split())
        missing = [c for c in THREADED if c in available and c not in enabled]
        if missing:
            self._set(top / "cgroup.subtree_control", " ".join(f"+{c}" for c in missing),
                      f"controllers for the VMs of {self._label(group)}")

    def _procs_below(self, top: Path) -> set[int]:
        pids: set[int] = set()
        for path in self._walk_dirs(top):
            try:
                pids.update(int(t) for t in (path / "cgroup.procs").read_text().split())
                continue
            except FileNotFoundError:
                continue
            except OSError as exc:
                if exc.errno != errno.EOPNOTSUPP:
                    raise CgroupError(f"cannot read {path / 'cgroup.procs'}: "
                                      f"{exc.strerror or exc}") from exc
            try:
                tids = [int(t) for t in (path / "cgroup.threads").read_text().split()]
            except OSError as exc:
                raise CgroupError(f"cannot read {path / 'cgroup.threads'}: "
                                  f"{exc.strerror or exc}") from exc
            pids.update(p for p in map(_tgid, tids) if p is not None)
        return pids

    # -- guest RAM: the holder unit -------------------------------------------------------
    def _ensure_ram_unit(self) -> None:
        root = self._ram_root()
        if not self.units.active(self.units.ram):
            self.ensure_parent()
            self.units.write_ram()
            self.units.start(self.units.ram)
        deadline = time.monotonic() + _KEEPER_WAIT_S
        while True:
            try:
                parked = bool((root / KEEPER / "cgroup.procs").read_text().split()) and \
                    not (root / "cgroup.procs").read_text().split()
            except OSError:
                parked = False
            if parked:
                break
            if time.monotonic() > deadline:
                raise CgroupError(f"the keeper of {self.units.ram} did not move into "
                                  f"{root / KEEPER} in {_KEEPER_WAIT_S:.0f} s; see "
                                  f"`systemctl status {self.units.ram}`")
            time.sleep(0.05)
        self._prepare_ram_parent(root)

    def create_ram_group(self, stem: str, limit_bytes: int) -> None:
        self._ensure_ram_unit()
        super().create_ram_group(stem, limit_bytes)

    def ram_groups(self) -> list[str]:
        top = self._ram_root()
        if not top.is_dir():
            return []
        return sorted(p.name for p in top.iterdir() if p.is_dir() and p.name != KEEPER)

    def delete_ram_group(self, stem: str) -> None:
        path = self._ram_dir(stem)
        try:
            if path.is_dir():
                self._remove_dir(path)
        except OSError as exc:
            raise CgroupError(f"cannot remove cgroup {path}: {exc.strerror or exc}") from exc

    def remove_parent_if_empty(self) -> None:
        """Stop the RAM holder once no RAM group and no partition is left (systemd then
        removes its cgroup and, when nothing else runs in it, the slice's)."""
        if self.ram_groups() or self.groups():
            return
        if self.units.active(self.units.ram) or self._ram_root().exists():
            self.units.forget(self.units.ram)
