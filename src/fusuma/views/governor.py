"""What each partition's CPU governor is doing, and why (asked of its supervisor)."""

from __future__ import annotations

from typing import Any

from fusuma.ops.context import Ctx
from fusuma.supervisor import rpc


def status_data(c: Ctx, partition: str | None, limit: int) -> dict[str, Any]:
    """What `governor status --json` prints."""
    names = [partition] if partition else [p.name for p in c.db.partitions()]
    if partition:
        c.db.partition(partition)      # an unknown name is one clear sentence
    return {"partitions": [c.parts.client(n).send(rpc.GovernorStatus(limit=limit),
                                                  timeout=10.0).status for n in names]}
