"""Shared segments: the manager that creates, lists and deletes them, and who may
build one from a host directory."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from fusuma.errors import SpecError
from fusuma.ops.context import Ctx

if TYPE_CHECKING:
    from fusuma.memshare.segments import Progress, SegmentManager
    from fusuma.state.records import SegmentRecord

FROM_DIR_REFUSED = ("from_dir is refused here: a segment from a host directory is built "
                    "only by root's CLI (`fusuma segment create NAME --from DIR`), since "
                    "every VM that attaches it reads that directory's files; build one "
                    "from an image's root (from_image) here, or have root build it.")


def segment_manager(c: Ctx) -> SegmentManager:
    from fusuma.memshare.segments import SegmentManager

    return SegmentManager(c.paths, c.db)


def check_source(c: Ctx, from_dir: Path | None) -> None:
    """Refuse a directory as a segment's source unless the caller may name host paths
    (root's CLI): over the API, a directory such as /root would reach every guest."""
    if from_dir is not None and not c.host_paths:
        raise SpecError(FROM_DIR_REFUSED)


def create(c: Ctx, name: str, *, from_dir: Path | None = None,
           from_image: str | None = None, progress: Progress | None = None
           ) -> SegmentRecord:
    """Build segment ``name`` (``fusuma.memshare.segments``), from a directory only
    for root's CLI."""
    check_source(c, from_dir)
    return segment_manager(c).create(name, from_dir=from_dir, from_image=from_image,
                                     progress=progress)
