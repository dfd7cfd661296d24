"""Guest images: those fusuma builds (in the cache, built or not) and those imported
into the image store."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from fusuma.ops.context import Ctx

if TYPE_CHECKING:
    from fusuma.images import GuestImage
    from fusuma.state.records import ImageRecord


def image_json(img: GuestImage) -> dict[str, Any]:
    return {"kind": img.kind, "kernel": str(img.kernel), "initrd": str(img.initrd),
            "kernel_version": img.kernel_version, "digest": img.digest,
            "append": img.append}


def imported_json(rec: ImageRecord, users: list[str]) -> dict[str, Any]:
    """An imported image as `image show NAME --json` prints it."""
    return {"name": rec.name, "kind": "imported", "boot": "bios|uefi",
            "format": rec.format, "virtual_size": rec.virtual_size,
            "file_size": rec.file_size, "sha256": rec.sha256, "path": rec.path,
            "source": rec.source, "created_at": rec.created_at, "vms": users}


def imported_data(c: Ctx, name: str) -> dict[str, Any]:
    return imported_json(c.db.imported(name), c.db.users_of_image(name))


def images_data(c: Ctx) -> list[dict[str, Any]]:
    """What `image list --json` prints: every kind fusuma builds, built or not, then
    every imported image."""
    from fusuma.errors import ImageError
    from fusuma.images import KINDS, find_image

    out: list[dict[str, Any]] = []
    for kind in sorted(KINDS):
        try:
            out.append({**image_json(find_image(c.paths.cache, kind=kind)), "built": True})
        except ImageError as exc:
            out.append({"kind": kind, "built": False, "hint": str(exc)})
    for row in out:
        row["name"] = row["kind"]
        row["boot"] = "kernel"
    out += [{**imported_json(rec, c.db.users_of_image(rec.name)), "built": True}
            for rec in c.db.images()]
    return out
