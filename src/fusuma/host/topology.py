"""Host CPU and memory topology: kernel cpulist strings and the resources partitions share.

fusuma keeps a slice of the host's memory for the host itself (the kernel, the CLI, the
partition supervisors, QEMU's own overhead), so partitions are sized against
``HostInfo.memory_available_for_partitions_mib`` rather than the raw total.
"""

from __future__ import annotations

import logging
import re
from pathlib import Path

from fusuma.errors import HostError, SpecError
from fusuma.frozen import frozen

LOG = logging.getLogger(__name__)

_RANGE = re.compile(r"^(\d+)(?:-(\d+))?\Z")
_MIN_RESERVE_MIB = 1024


def parse_cpulist(text: str) -> list[int]:
    """Parse a kernel cpulist such as ``"0-3,5"`` into sorted, unique numbers.

    An empty string (an unset cpuset) is an empty list.
    """
    stripped = text.strip()
    if not stripped:
        return []
    result: set[int] = set()
    for item in stripped.split(","):
        match = _RANGE.match(item.strip())
        if match is None:
            raise SpecError(
                f"{text.strip()!r} is not a CPU list; write numbers and ranges like '0-3,5'"
            )
        first = int(match.group(1))
        last = int(match.group(2)) if match.group(2) is not None else first
        if last < first:
            raise SpecError(
                f"range {item.strip()!r} in CPU list {text.strip()!r} runs backwards; "
                f"write it as '{last}-{first}'"
            )
        result.update(range(first, last + 1))
    return sorted(result)


def format_cpulist(numbers: list[int]) -> str:
    """Render numbers as a compact kernel cpulist: ``[0, 1, 2, 5]`` becomes ``"0-2,5"``."""
    if any(n < 0 for n in numbers):
        raise SpecError(f"CPU and node numbers cannot be negative: {sorted(numbers)}")
    parts: list[str] = []
    values = sorted(set(numbers))
    i = 0
    while i < len(values):
        j = i
        while j + 1 < len(values) and values[j + 1] == values[j] + 1:
            j += 1
        parts.append(str(values[i]) if i == j else f"{values[i]}-{values[j]}")
        i = j + 1
    return ",".join(parts)


def host_reserve_mib(total_mib: int) -> int:
    """Memory kept back for the host itself: 10% of the total, at least 1 GiB."""
    return max(_MIN_RESERVE_MIB, total_mib // 10)


@frozen
class HostInfo:
    """CPUs, NUMA nodes and memory of the host."""

    cpus: list[int]
    mems: list[int]
    memory_total_mib: int
    memory_reserved_mib: int
    # The SMT threads of each physical core that has more than one (sysfs
    # thread_siblings_list), e.g. ((0, 4), (1, 5), ...); empty without SMT.
    siblings: tuple[tuple[int, ...], ...] = ()

    @property
    def memory_available_for_partitions_mib(self) -> int:
        """Memory partitions may claim together: the total minus the host's reserve."""
        return max(0, self.memory_total_mib - self.memory_reserved_mib)

    def core_of(self, cpu: int) -> tuple[int, ...]:
        """The SMT threads of the physical core that runs ``cpu`` (itself alone without
        SMT)."""
        return next((g for g in self.siblings if cpu in g), (cpu,))

    def whole_cores(self, cpus: list[int]) -> list[int]:
        """``cpus`` with every SMT sibling of each added: whole physical cores."""
        return sorted({t for c in cpus for t in self.core_of(c)})

    def split_cores(self, cpus: list[int]) -> list[tuple[int, ...]]:
        """The physical cores of which ``cpus`` holds some threads but not all."""
        return sorted({self.core_of(c) for c in cpus if not set(self.core_of(c)) <= set(cpus)})


def _read(path: Path) -> str:
    try:
        return path.read_text()
    except OSError as exc:
        raise HostError(f"cannot read {path}: {exc.strerror}; is sysfs/procfs mounted?") from exc


def _memtotal_mib(meminfo: Path) -> int:
    for line in _read(meminfo).splitlines():
        if line.startswith("MemTotal:"):
            fields = line.split()
            try:
                kib = int(fields[1])
            except (IndexError, ValueError) as exc:
                raise HostError(f"cannot parse the MemTotal line of {meminfo}: {line!r}") from exc
            return kib // 1024
    raise HostError(f"{meminfo} has no MemTotal line; cannot size the host's memory")


def smt_siblings(sysfs: Path, cpus: list[int]) -> tuple[tuple[int, ...], ...]:
    """The SMT thread groups of the online CPUs (groups of one left out). A CPU without
    a topology directory (some virtual machines) counts as a core of its own; a topology
    file that exists but cannot be read is an error, not a guess."""
    groups: set[tuple[int, ...]] = set()
    for cpu in cpus:
        f = sysfs / f"devices/system/cpu/cpu{cpu}/topology/thread_siblings_list"
        if not f.exists():
            continue
        try:
            threads = tuple(t for t in parse_cpulist(_read(f)) if t in cpus)
        except SpecError as exc:
            raise HostError(f"cannot parse {f}: {exc}") from exc
        if len(threads) > 1:
            groups.add(threads)
    return tuple(sorted(groups))


def siblings_text(group: tuple[int, ...]) -> str:
    """``core of threads 0,4``: how messages name a physical core."""
    return f"the physical core of threads {format_cpulist(list(group))}"


def host_info(sysfs: Path = Path("/sys"), procfs: Path = Path("/proc")) -> HostInfo:
    """Read online CPUs, online NUMA nodes and total memory from sysfs and procfs."""
    cpu_online = sysfs / "devices/system/cpu/online"
    try:
        cpus = parse_cpulist(_read(cpu_online))
    except SpecError as exc:
        raise HostError(f"cannot parse {cpu_online}: {exc}") from exc
    node_online = sysfs / "devices/system/node/online"
    if node_online.exists():
        try:
            mems = parse_cpulist(_read(node_online)) or [0]
        except SpecError as exc:
            raise HostError(f"cannot parse {node_online}: {exc}") from exc
    else:
        # Kernels built without CONFIG_NUMA have no node directory: one node, number 0.
        mems = [0]
    total = _memtotal_mib(procfs / "meminfo")
    info = HostInfo(cpus=cpus, mems=mems, memory_total_mib=total,
                    memory_reserved_mib=host_reserve_mib(total),
                    siblings=smt_siblings(sysfs, cpus))
    LOG.debug("host: cpus=%s mems=%s memory=%d MiB (reserve %d MiB)", format_cpulist(cpus),
              format_cpulist(mems), total, info.memory_reserved_mib)
    return info
