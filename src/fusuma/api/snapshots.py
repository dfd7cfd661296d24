"""The API's VM snapshots: ``/1.0/vms/{name}/snapshots``. Reading them is a viewer's;
taking, restoring and deleting one is an operator's (it touches only the VM's own disk,
never a host path). The work runs as an operation, as the CLI's does
(fusuma.vm.snapshots)."""

from __future__ import annotations

from typing import Annotated, Any

from fastapi import APIRouter
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field

from fusuma.api import models as m
from fusuma.api.daemon import Daemon, not_busy
from fusuma.api.http import NamePath, valid_name
from fusuma.api.operations import Operation
from fusuma.api.roles import OPERATOR, VIEWER, RoleRoute
from fusuma.spec import Name
from fusuma.state import vm_obj


class SnapshotCreate(BaseModel):
    """A snapshot to take of the VM: ``memory`` its RAM and device state too (running
    VMs only)."""

    model_config = ConfigDict(extra="forbid", strict=True)
    name: Name
    memory: bool = False


class SnapshotInfo(BaseModel):
    """A snapshot, as `fusuma vm snapshot list --json` shows it."""

    model_config = ConfigDict(extra="forbid")
    vm: str
    name: str
    memory: bool
    disks: list[str]
    created_at: float
    created: str
    running: bool
    frozen: bool
    vmstate_bytes: Annotated[int | None, Field(description="A memory snapshot: the "
                                               "bytes of its RAM and device state.")]


def router(d: Daemon) -> APIRouter:
    r = APIRouter(route_class=RoleRoute)

    def _path(vm: str, snap: str = "") -> list[str]:
        return [f"/1.0/vms/{vm}"] + ([f"/1.0/vms/{vm}/snapshots/{snap}"] if snap else [])

    @r.get("/1.0/vms/{name}/snapshots", dependencies=[VIEWER],
           response_model=list[SnapshotInfo], summary="A VM's snapshots, oldest first")
    def list_snapshots(name: NamePath) -> list[dict[str, Any]]:
        from fusuma.vm import snapshots

        return snapshots.list_(d.ctx().db, valid_name("VM", name))

    @r.get("/1.0/vms/{name}/snapshots/{snapshot}", dependencies=[VIEWER],
           response_model=SnapshotInfo, summary="One snapshot of a VM")
    def get_snapshot(name: NamePath, snapshot: NamePath) -> dict[str, Any]:
        from fusuma.vm import snapshots

        c = d.ctx()
        return snapshots.snapshot_json(c.db.snapshot(valid_name("VM", name),
                                                     valid_name("snapshot", snapshot)))

    @r.post("/1.0/vms/{name}/snapshots", dependencies=[OPERATOR], status_code=202,
            responses=m.ACCEPTED, summary="Take a snapshot of a VM (operation)")
    def create_snapshot(name: NamePath, body: SnapshotCreate) -> JSONResponse:
        from fusuma.vm import snapshots

        c = d.ctx()
        c.db.vm(valid_name("VM", name))
        valid_name("snapshot", body.name)
        not_busy(c, vm_obj(name))

        def work(op: Operation) -> Any:
            return snapshots.create(d.ctx().vms, name, body.name, body.memory)
        return d.submit("vm-snapshot", f"snapshot {body.name} of VM {name}",
                        {"vms": _path(name, body.name)}, work)

    @r.post("/1.0/vms/{name}/snapshots/{snapshot}/restore", dependencies=[OPERATOR],
            status_code=202, responses=m.ACCEPTED,
            summary="Bring a VM back to one of its snapshots (operation)")
    def restore_snapshot(name: NamePath, snapshot: NamePath) -> JSONResponse:
        import dataclasses

        from fusuma.vm import snapshots

        c = d.ctx()
        c.db.snapshot(valid_name("VM", name), valid_name("snapshot", snapshot))
        not_busy(c, vm_obj(name))

        def work(op: Operation) -> Any:
            return dataclasses.asdict(snapshots.restore(d.ctx().vms, name, snapshot))
        return d.submit("vm-snapshot-restore", f"restore VM {name} to snapshot {snapshot}",
                        {"vms": _path(name, snapshot)}, work)

    @r.delete("/1.0/vms/{name}/snapshots/{snapshot}", dependencies=[OPERATOR],
              status_code=202, responses=m.ACCEPTED,
              summary="Delete a snapshot of a VM (operation)")
    def delete_snapshot(name: NamePath, snapshot: NamePath) -> JSONResponse:
        from fusuma.vm import snapshots

        c = d.ctx()
        c.db.snapshot(valid_name("VM", name), valid_name("snapshot", snapshot))
        not_busy(c, vm_obj(name))

        def work(op: Operation) -> Any:
            snapshots.delete(d.ctx().vms, name, snapshot)
            return {"deleted": f"/1.0/vms/{name}/snapshots/{snapshot}"}
        return d.submit("vm-snapshot-delete", f"delete snapshot {snapshot} of VM {name}",
                        {"vms": _path(name, snapshot)}, work)

    return r
