"""Disks and the partition (and VM) each belongs to."""

from __future__ import annotations

from typing import Any

from fusuma.ops.context import Ctx


def disks_data(c: Ctx) -> list[dict[str, str | None]]:
    """What `disk list --json` prints."""
    users = {d: v.name for v in c.db.vms() for d in v.disks}
    return [{"name": d.name, "path": d.path, "partition": d.partition,
             "vm": users.get(d.name)} for d in c.db.disks()]


def storage_data(c: Ctx) -> list[dict[str, Any]]:
    """What `storage list --json` prints: each storage directory, whether it is the
    default one and shared, the disks whose files lie in it and the VMs placed there
    (``vm create --storage``)."""
    from fusuma.host import storage
    from fusuma.images.store import placed_in

    default = storage.default_dir(c.paths)
    disks = c.db.disks()
    shared = set(c.db.shared_storage_dirs())
    vms = [(v.name, placed_in(c.paths, v.name)) for v in c.db.vms()]
    return [{"path": str(d), "default": d == default, "shared": str(d) in shared,
             "disks": [x.name for x in disks if storage.holds(x.path, d)],
             "vms": [n for n, p in vms if p is not None and p.parent == d]}
            for d in storage.declared(c.paths, c.db)]
