"""Guest images in the cache, built or not."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from fusuma.ops.context import Ctx

if TYPE_CHECKING:
    from fusuma.images import GuestImage


def image_json(img: GuestImage) -> dict[str, Any]:
    return {"kind": img.kind, "kernel": str(img.kernel), "initrd": str(img.initrd),
            "kernel_version": img.kernel_version, "digest": img.digest,
            "append": img.append}


def images_data(c: Ctx) -> list[dict[str, Any]]:
    """What `image list --json` prints: every kind, built or not."""
    from fusuma.errors import ImageError
    from fusuma.images import KINDS, find_image

    out: list[dict[str, Any]] = []
    for kind in sorted(KINDS):
        try:
            out.append({**image_json(find_image(c.paths.cache, kind=kind)), "built": True})
        except ImageError as exc:
            out.append({"kind": kind, "built": False, "hint": str(exc)})
    return out
