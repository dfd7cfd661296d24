"""Shared segments: the manager that creates, lists and deletes them."""

from __future__ import annotations

from typing import TYPE_CHECKING

from fusuma.ops.context import Ctx

if TYPE_CHECKING:
    from fusuma.memshare.segments import SegmentManager


def segment_manager(c: Ctx) -> SegmentManager:
    from fusuma.memshare.segments import SegmentManager

    return SegmentManager(c.paths, c.db)
