"""The operation holding an object (a job), as ``--json`` and the API show it."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from fusuma.state import Job


def job_json(j: Job) -> dict[str, Any]:
    """The operation holding an object: what it does, its phase, since when, by which
    pid, and whether that pid still lives (a dead one is being recovered)."""
    return {"kind": j.kind, "phase": j.phase, "peer": j.peer, "since": j.started_at,
            "owner_pid": j.owner.pid, "owner_alive": j.owner.alive()}
