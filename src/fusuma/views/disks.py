"""Disks and the partition (and VM) each belongs to."""

from __future__ import annotations

from fusuma.ops.context import Ctx


def disks_data(c: Ctx) -> list[dict[str, str | None]]:
    """What `disk list --json` prints."""
    users = {d: v.name for v in c.db.vms() for d in v.disks}
    return [{"name": d.name, "path": d.path, "partition": d.partition,
             "vm": users.get(d.name)} for d in c.db.disks()]
