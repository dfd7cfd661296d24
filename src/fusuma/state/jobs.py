"""Jobs: every long operation on a VM or partition, recorded before each step.

A job names its object (``vm:NAME`` or ``partition:NAME``), its kind, its current phase,
its peer (a move's destination) and its owner: the process doing it, identified by pid
*and* start time, so a reused pid is never taken for a live owner. At most one job per
object (the table's primary key): that is the operation lock, as Incus's
"instance is busy running a ... operation". A command that finds a job whose owner is
alive is refused with :func:`busy_sentence`; one whose owner is dead runs recovery first
(``fusuma.recovery``), which takes the job over and finishes or undoes it.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any


def vm_obj(name: str) -> str:
    return f"vm:{name}"


def partition_obj(name: str) -> str:
    return f"partition:{name}"


def start_time(pid: int) -> int | None:
    """The process's start time in clock ticks since boot (field 22 of stat)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = stat.rsplit(")", 1)[1].split()
    if fields[0] in ("Z", "X"):
        return None
    return int(fields[19])


@dataclass(frozen=True)
class JobOwner:
    pid: int
    start: int

    @classmethod
    def me(cls) -> JobOwner:
        pid = os.getpid()
        return cls(pid, start_time(pid) or 0)

    def alive(self) -> bool:
        return start_time(self.pid) == self.start


# What a job of each kind does, as the busy sentence says it.
DOING = {
    "start": "starting", "stop": "stopping", "kill": "being killed",
    "delete": "being deleted", "resize": "being resized", "maintain": "under maintenance",
    "recover": "being recovered", "template": "being made into a template",
}


@dataclass(frozen=True)
class Job:
    obj: str
    kind: str
    phase: str
    owner: JobOwner
    source: str | None = None
    peer: str | None = None
    started_at: float = field(default_factory=time.time)
    updated_at: float = field(default_factory=time.time)
    detail: dict[str, Any] = field(default_factory=dict)

    @property
    def name(self) -> str:
        return self.obj.split(":", 1)[1]

    @property
    def what(self) -> str:
        return "VM" if self.obj.startswith("vm:") else "partition"

    def doing(self) -> str:
        if self.kind == "migrate" and self.source == self.peer:
            return f"moving to a new QEMU in {self.peer}"     # in place (cpr-transfer)
        if self.kind == "migrate":
            return f"moving to {self.peer}"
        return DOING.get(self.kind, self.kind)


def busy_sentence(job: Job) -> str:
    since = time.strftime("%H:%M:%S", time.localtime(job.started_at))
    return (f"{job.what} {job.name!r} is busy: {job.doing()} (phase: {job.phase}) since "
            f"{since} by pid {job.owner.pid}; try again when it is done.")
