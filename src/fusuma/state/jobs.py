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

import enum
import os
import time
from dataclasses import field
from pathlib import Path
from typing import Any

from fusuma.frozen import frozen


def vm_obj(name: str) -> str:
    return f"vm:{name}"


def partition_obj(name: str) -> str:
    return f"partition:{name}"


def identity_obj(name: str) -> str:
    """The object of a clone's identity step, apart from the VM's own: the VM stays
    usable (its agent's lock orders the two) while a supervisor still owes it its own
    hostname, machine-id and MAC."""
    return f"identity:{name}"


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


@frozen
class JobOwner:
    pid: int
    start: int

    @classmethod
    def me(cls) -> JobOwner:
        pid = os.getpid()
        return cls(pid, start_time(pid) or 0)

    def alive(self) -> bool:
        return start_time(self.pid) == self.start


class JobKind(enum.StrEnum):
    """What a job does. Stored as its value; equal to it as a string."""

    START = "start"
    STOP = "stop"
    KILL = "kill"
    TEMPLATE = "template"       # saving a running VM into a template
    MIGRATE = "migrate"         # a move inside the host (between partitions, in place)
    DELETE = "delete"
    RESIZE = "resize"
    MAINTAIN = "maintain"
    RECOVER = "recover"
    HOST_MOVE = "host-move"     # a move between hosts, the source's half
    HOST_MOVE_IN = "host-move-in"   # ... and the destination's
    IDENTITY = "identity"       # a clone's own identity, given once it runs
    BACKUP = "backup"           # a running VM's disks copied into a backup point
    SNAPSHOT = "snapshot"       # a snapshot taken, restored or deleted
    RESTORE = "restore"         # a new VM made from a backup


#: Jobs a partition's supervisor owns and recovers itself (the CLI, the API daemon and
#: the agent own the others).
LOCAL_JOBS = frozenset({JobKind.START, JobKind.STOP, JobKind.KILL, JobKind.TEMPLATE,
                        JobKind.IDENTITY, JobKind.BACKUP, JobKind.SNAPSHOT})


class Decision(enum.StrEnum):
    """A move's outcome, recorded once (``Database.decide``) before either QEMU acts
    on it: the guest runs on at the destination, or at its source."""

    FORWARD = "forward"
    BACK = "back"


class MovePhase(enum.StrEnum):
    """A move's phases, each recorded before its step (``fusuma.migration``)."""

    PREPARE = "prepare"         # the destination QEMU is being started
    PREPARED = "prepared"       # ... and waits for the stream
    STREAMING = "streaming"     # the source streams
    STREAMED = "streamed"       # the stream completed: the guest is paused at both
    SWITCHED = "switched"       # the guest runs at the destination
    RELEASED = "released"       # the source QEMU has ended


# What a job of each kind does, as the busy sentence says it.
DOING: dict[str, str] = {
    JobKind.START: "starting", JobKind.STOP: "stopping", JobKind.KILL: "being killed",
    JobKind.DELETE: "being deleted", JobKind.RESIZE: "being resized",
    JobKind.MAINTAIN: "under maintenance", JobKind.RECOVER: "being recovered",
    JobKind.TEMPLATE: "being made into a template",
    JobKind.SNAPSHOT: "busy with a snapshot",
    JobKind.BACKUP: "being backed up", JobKind.RESTORE: "being restored from a backup",
}


@frozen
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
        return "partition" if self.obj.startswith("partition:") else "VM"

    def doing(self) -> str:
        if self.kind == JobKind.MIGRATE and self.source == self.peer:
            return f"moving to a new QEMU in {self.peer}"     # in place (cpr-transfer)
        if self.kind == JobKind.MIGRATE:
            return f"moving to {self.peer}"
        return DOING.get(self.kind, self.kind)


def busy_sentence(job: Job) -> str:
    since = time.strftime("%H:%M:%S", time.localtime(job.started_at))
    return (f"{job.what} {job.name!r} is busy: {job.doing()} (phase: {job.phase}) since "
            f"{since} by pid {job.owner.pid}; try again when it is done.")
