"""What a partition may use: its CPUs, memory nodes, memory limit and I/O weight.

A module of its own, below both users: the cgroup drivers (fusuma.host.cgroups) write
these limits into cgroup files, the systemd units (fusuma.host.systemd) into unit
properties, and the cgroup package itself uses the units, so neither can own the type.
"""

from __future__ import annotations

from fusuma.errors import SpecError
from fusuma.frozen import frozen

IO_WEIGHT_MIN = 1
IO_WEIGHT_MAX = 10000


@frozen
class Limits:
    """What a partition cgroup may use.

    ``io_weight`` follows cgroup v2's ``io.weight`` scale (1..10000, default 100); it is
    best effort: where the kernel offers no weight file the driver warns once and goes on.
    """

    cpus: list[int]
    mems: list[int]
    memory_bytes: int
    io_weight: int | None = None

    def __post_init__(self) -> None:
        if not self.cpus:
            raise SpecError("a partition needs at least one CPU")
        if not self.mems:
            raise SpecError("a partition needs at least one memory node")
        if self.memory_bytes <= 0:
            raise SpecError(f"memory limit must be positive, not {self.memory_bytes} bytes")
        if self.io_weight is not None and not (
            IO_WEIGHT_MIN <= self.io_weight <= IO_WEIGHT_MAX
        ):
            raise SpecError(
                f"io weight {self.io_weight} is out of range; "
                f"use {IO_WEIGHT_MIN}..{IO_WEIGHT_MAX}"
            )
