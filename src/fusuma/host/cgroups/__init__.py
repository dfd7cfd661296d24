"""cgroups for partitions: the driver for this host (cgroup v1, v2, or v2 under systemd).

The package, bottom up:

    files.py    cgroupfs primitives (write without creating, rmdir that waits)
    base.py     the drivers' interface (:class:`CgroupDriver`) and the types they share
    v1.py       cgroup v1: cpuset, cpu, memory and blkio at their own mount points
    v2.py       cgroup v2: one unified hierarchy, cpuset partitions
    systemd.py  cgroup v2 inside the units systemd delegated (fusuma.host.systemd)
    __init__    this module: finds the mounts and picks the driver (:func:`detect`,
                :func:`for_paths`); it imports the drivers, they import only base

A partition's :class:`Limits` live in fusuma.host.limits (the systemd units use them
too); every public name is importable from ``fusuma.host.cgroups``.
"""

from __future__ import annotations

import logging
import re
from pathlib import Path
from typing import TYPE_CHECKING

from fusuma.errors import HostError
from fusuma.frozen import frozen
from fusuma.host import systemd as sd
from fusuma.host.cgroups.base import (
    CONTROL_HEADROOM,
    CPU_PERIOD_US,
    CPU_WEIGHT_DEFAULT,
    CPU_WEIGHT_MAX,
    CPU_WEIGHT_MIN,
    HELD_EXCLUSIVE,
    HELD_PARTITION_ISOLATED,
    HELD_PARTITION_ROOT,
    HELD_SHARED,
    RAM_GROUP,
    RAM_STEM_RE,
    CgroupDriver,
    CpuPolicy,
    CpuStat,
    check_name,
    parse_flat_keyed,
    parse_pressure_total,
)
from fusuma.host.cgroups.systemd import CgroupSystemdDriver
from fusuma.host.cgroups.v1 import CgroupV1Driver
from fusuma.host.cgroups.v2 import CgroupV2Driver
from fusuma.host.limits import IO_WEIGHT_MAX, IO_WEIGHT_MIN, Limits

if TYPE_CHECKING:
    from fusuma.paths import Paths

__all__ = [
    "CONTROL_HEADROOM",
    "CPU_PERIOD_US",
    "CPU_WEIGHT_DEFAULT",
    "CPU_WEIGHT_MAX",
    "CPU_WEIGHT_MIN",
    "HELD_EXCLUSIVE",
    "HELD_PARTITION_ISOLATED",
    "HELD_PARTITION_ROOT",
    "HELD_SHARED",
    "IO_WEIGHT_MAX",
    "IO_WEIGHT_MIN",
    "RAM_GROUP",
    "RAM_STEM_RE",
    "V1_CONTROLLERS",
    "CgroupDriver",
    "CgroupMount",
    "CgroupSystemdDriver",
    "CgroupV1Driver",
    "CgroupV2Driver",
    "CpuPolicy",
    "CpuStat",
    "Limits",
    "check_name",
    "detect",
    "for_paths",
    "parse_flat_keyed",
    "parse_mountinfo",
    "parse_pressure_total",
]

LOG = logging.getLogger(__name__)

# -- detection ---------------------------------------------------------------------------

V1_CONTROLLERS = ("cpuset", "cpu", "memory", "blkio")


@frozen
class CgroupMount:
    """One cgroup filesystem mount from mountinfo."""

    mountpoint: Path
    fstype: str  # "cgroup" (v1) or "cgroup2"
    options: frozenset[str]  # super options; for v1 these name the controllers


def _unescape(field: str) -> str:
    # mountinfo escapes space, tab, newline and backslash as \ooo.
    return re.sub(r"\\([0-7]{3})", lambda m: chr(int(m.group(1), 8)), field)


def parse_mountinfo(text: str) -> list[CgroupMount]:
    """The cgroup and cgroup2 mounts listed in a ``/proc/PID/mountinfo`` text."""
    mounts: list[CgroupMount] = []
    for line in text.splitlines():
        left, sep, right = line.partition(" - ")
        if not sep:
            continue
        fields = left.split()
        tail = right.split()
        if len(fields) < 5 or len(tail) < 3 or tail[0] not in ("cgroup", "cgroup2"):
            continue
        mounts.append(CgroupMount(Path(_unescape(fields[4])), tail[0],
                                  frozenset(tail[2].split(","))))
    return mounts


def _mounts_from_root(root: Path) -> list[CgroupMount]:
    """Guess the mounts from the usual layout under ``root`` when mountinfo is unreadable."""
    mounts: list[CgroupMount] = []
    for candidate in (root, root / "unified"):
        if (candidate / "cgroup.controllers").exists():
            mounts.append(CgroupMount(candidate, "cgroup2", frozenset()))
    if root.is_dir():
        for child in sorted(root.iterdir()):
            if child.is_dir() and (child / "cgroup.procs").exists() and child.name != "unified":
                mounts.append(CgroupMount(child, "cgroup", frozenset(child.name.split(","))))
    return mounts


def _v2_controllers(mount: Path) -> set[str]:
    try:
        return set((mount / "cgroup.controllers").read_text().split())
    except OSError:
        return set()


def for_paths(paths: Paths) -> CgroupDriver:
    """The driver for the fusuma namespace ``paths`` describes (its prefix and settings)."""
    return detect(prefix=paths.cgroup_prefix, exclusive=paths.cpu_exclusive,
                  partition=paths.cpu_partition, systemd=paths.systemd)


def detect(
    prefix: str = "fusuma",
    root: Path = Path("/sys/fs/cgroup"),
    mountinfo: Path = Path("/proc/self/mountinfo"),
    *,
    exclusive: bool = True,
    partition: str = "auto",
    systemd: str = "auto",
) -> CgroupDriver:
    """Pick the driver for this host: v2 when a cgroup2 mount offers ``cpuset``, else v1.
    On v2 with systemd as PID 1 (``systemd``: FUSUMA_SYSTEMD), the systemd driver:
    fusuma's cgroups inside its delegated units.

    ``exclusive=False`` skips exclusive cpusets (v1 makes an exclusive root-level parent
    that owns every CPU, which locks other root-level cpusets such as Docker's out).
    ``partition``: FUSUMA_CPU_PARTITION (cgroup v2 cpuset partitions).
    """
    try:
        mounts = parse_mountinfo(mountinfo.read_text())
    except OSError:
        LOG.debug("cannot read %s; looking for cgroup mounts under %s", mountinfo, root)
        mounts = []
    if not mounts:
        mounts = _mounts_from_root(root)
    for mount in mounts:
        if mount.fstype == "cgroup2" and "cpuset" in _v2_controllers(mount.mountpoint):
            LOG.debug("cgroup v2 with cpuset at %s", mount.mountpoint)
            if sd.wanted(systemd, unified=mount.mountpoint == root):
                return CgroupSystemdDriver(mount.mountpoint, prefix, sd.Units(prefix),
                                           exclusive=exclusive)
            return CgroupV2Driver(mount.mountpoint, prefix, exclusive=exclusive,
                                  partition=partition)
    sd.wanted(systemd, unified=False)    # FUSUMA_SYSTEMD=1 says why it cannot be
    v1: dict[str, Path] = {}
    for mount in mounts:
        if mount.fstype != "cgroup":
            continue
        for ctrl in V1_CONTROLLERS:
            if ctrl in mount.options:
                v1.setdefault(ctrl, mount.mountpoint)
    if "cpuset" in v1 and "memory" in v1:
        LOG.debug("cgroup v1: %s", ", ".join(f"{c}={p}" for c, p in sorted(v1.items())))
        return CgroupV1Driver(v1, prefix, exclusive=exclusive)
    unified = [m for m in mounts if m.fstype == "cgroup2" and m.mountpoint == root]
    if unified and not v1:
        offered = " ".join(sorted(_v2_controllers(root))) or "none"
        raise HostError(
            f"the cgroup v2 hierarchy at {root} does not offer the cpuset controller (it "
            f"offers: {offered}), so partitions cannot be held to their cores; use a "
            "kernel with CONFIG_CPUSETS and make sure no cgroup v1 hierarchy binds cpuset"
        )
    raise HostError(
        "no usable cgroup cpuset and memory controllers: neither a cgroup2 mount offers "
        "cpuset nor are v1 cpuset and memory hierarchies mounted; mount cgroup2 at "
        "/sys/fs/cgroup (or the v1 cpuset and memory hierarchies) and try again"
    )
