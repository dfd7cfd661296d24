"""Shared segments, with their size and the VMs that attach them."""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

from fusuma.ops.context import Ctx
from fusuma.ops.segments import segment_manager

if TYPE_CHECKING:
    from fusuma.state.db import SegmentRecord


def segment_json(c: Ctx, s: SegmentRecord) -> dict[str, Any]:
    mgr = segment_manager(c)
    return {"name": s.name, "path": s.path, "size_mib": round(s.size_bytes / 2**20, 1),
            "source": s.source, "used_by": mgr.users(s.name),
            "created_at": time.strftime("%Y-%m-%dT%H:%M:%S%z",
                                        time.localtime(s.created_at))}


def segments_data(c: Ctx) -> list[dict[str, Any]]:
    """What `segment list --json` prints."""
    return [segment_json(c, s) for s in segment_manager(c).all()]
