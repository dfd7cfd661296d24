"""The API's backups: ``POST /1.0/vms/{name}/backups`` (back a running VM up) and
``POST /1.0/backups/{backup}/restore`` (a new VM from a backup), both operations.

A backup is named, never a path: it is kept in FUSUMA_HOME/backups/NAME (no role may
name a host path that root then writes or reads; root's CLI may also use storage
directories)."""

from __future__ import annotations

import dataclasses
from typing import Annotated, Any

from fastapi import APIRouter
from fastapi.responses import JSONResponse
from pydantic import Field, field_validator

from fusuma.api import models as m
from fusuma.api.daemon import Daemon, not_busy
from fusuma.api.http import NamePath, valid_name
from fusuma.api.operations import Operation
from fusuma.api.roles import OPERATOR, RoleRoute
from fusuma.spec import Name, _name_field
from fusuma.state import vm_obj


class BackupRequest(m._Req):
    """Back up into backup ``backup`` (a name): a full backup into a new one, or with
    ``incremental`` a point on its last one; ``max_bandwidth_mib`` limits the copy."""

    backup: Name
    incremental: bool = False
    max_bandwidth_mib: Annotated[int, Field(ge=1, le=1 << 20)] | None = None

    _check = field_validator("backup")(_name_field)


class RestoreRequest(m._Req):
    """Make VM ``vm`` from the backup (its last point, or ``point``), in ``partition``
    (default: the backed-up VM's), and start it with ``start``."""

    vm: Name
    partition: Name | None = None
    point: Annotated[int, Field(ge=1, le=9999)] | None = None
    start: bool = False

    _check = field_validator("vm")(_name_field)

    @field_validator("partition")
    @classmethod
    def _check_partition(cls, v: str | None) -> str | None:
        return None if v is None else _name_field(v)


def router(d: Daemon) -> APIRouter:
    r = APIRouter(route_class=RoleRoute)

    @r.post("/1.0/vms/{name}/backups", dependencies=[OPERATOR], status_code=202,
            responses=m.ACCEPTED,
            summary="Back up a running VM's disk, fully or incrementally (operation)")
    def backup_vm(name: NamePath, body: BackupRequest) -> JSONResponse:
        from fusuma.vm.backups import backup

        c = d.ctx()
        c.db.vm(valid_name("VM", name))
        not_busy(c, vm_obj(name))

        def work(op: Operation) -> Any:
            def progress(phase: str, detail: dict[str, Any]) -> None:
                total = int(detail.get("total") or 0)
                done = int(detail.get("done") or 0)
                d.ops.set_progress(op, f"copy {100 * done // total}%"
                                   if phase == "copy" and total else phase)
            res = backup(d.ctx().vms, name, body.backup, incremental=body.incremental,
                         max_bandwidth=(body.max_bandwidth_mib or 0) * 2**20,
                         progress=progress)
            return dataclasses.asdict(res)
        return d.submit("vm-backup", f"back up VM {name} into {body.backup}",
                        {"vms": [f"/1.0/vms/{name}"]}, work)

    @r.post("/1.0/backups/{backup}/restore", dependencies=[OPERATOR], status_code=202,
            responses=m.ACCEPTED, summary="Make a new VM from a backup (operation)")
    def restore_backup(backup: NamePath, body: RestoreRequest) -> JSONResponse:
        from fusuma.vm.backups import restore

        valid_name("backup", backup)

        def work(op: Operation) -> Any:
            res = restore(d.ctx().vms, backup, body.vm, body.partition, point=body.point,
                          start=body.start, say=lambda s: d.ops.set_progress(op, s))
            return dataclasses.asdict(res)
        return d.submit("vm-restore", f"restore backup {backup} as VM {body.vm}",
                        {"vms": [f"/1.0/vms/{body.vm}"]}, work)

    return r
