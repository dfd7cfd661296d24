"""The API's partitions and disks: ``/1.0/partitions``, ``/1.0/disks``."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response

from fusuma.api import models as m
from fusuma.api.daemon import Daemon, not_busy
from fusuma.api.http import NamePath, valid_name
from fusuma.api.operations import Operation
from fusuma.api.roles import ADMIN, OPERATOR, VIEWER, RoleRoute, require
from fusuma.errors import SpecError, StateError
from fusuma.ops.context import Ctx
from fusuma.qemu.versions import SERIES_RE
from fusuma.state import partition_obj
from fusuma.state.roles import Role
from fusuma.views.disks import disks_data
from fusuma.views.host import partitions_data


def router(d: Daemon) -> APIRouter:
    r = APIRouter(route_class=RoleRoute)

    # -- partitions -------------------------------------------------------------------
    @r.get("/1.0/partitions", dependencies=[VIEWER], response_model=list[m.PartitionInfo])
    def list_partitions() -> list[dict[str, Any]]:
        return partitions_data(d.ctx())

    @r.get("/1.0/partitions/{name}", dependencies=[VIEWER], response_model=m.PartitionInfo)
    def get_partition(name: NamePath) -> dict[str, Any]:
        c = d.ctx()
        c.db.partition(valid_name("partition", name))
        return next(p for p in partitions_data(c) if p["name"] == name)

    @r.post("/1.0/partitions", dependencies=[ADMIN],
            status_code=202, responses=m.ACCEPTED, summary="Create a partition (operation)")
    def create_partition(spec: m.PartitionCreate) -> JSONResponse:
        c = d.ctx()
        if c.db.find_partition(spec.name) is not None:
            from fusuma.errors import ConflictError

            raise ConflictError(f"a partition named {spec.name!r} already exists.")
        from fusuma.spec import PartitionSpec

        pspec = PartitionSpec.model_validate(spec.model_dump())
        # A version `fusuma qemu list` shows, never a binary's path: refused here, before
        # the operation, so nothing named is run and no partition is made.
        c.parts.check_qemu(pspec.qemu)

        def work(op: Operation) -> Any:
            c = d.ctx()
            c.parts.create(pspec)
            return _get_partition(c, pspec.name)
        return d.submit("partition-create", f"create partition {spec.name}",
                        {"partitions": [f"/1.0/partitions/{spec.name}"]}, work)

    def _get_partition(c: Ctx, name: str) -> dict[str, Any]:
        return next(p for p in partitions_data(c) if p["name"] == name)

    @r.patch("/1.0/partitions/{name}", dependencies=[ADMIN], status_code=202, responses=m.ACCEPTED,
             summary="Resize a partition: cores, memory and/or memory overcommit (operation)")
    def resize_partition(name: NamePath, body: m.PartitionPatch) -> JSONResponse:
        c = d.ctx()
        c.db.partition(valid_name("partition", name))
        if body.cpus is None and body.memory_mib is None and body.memory_overcommit is None:
            raise SpecError("give cpus, memory_mib and/or memory_overcommit.")
        from fusuma.host.topology import parse_cpulist

        cpus = parse_cpulist(body.cpus) if isinstance(body.cpus, str) else body.cpus
        not_busy(c, partition_obj(name))

        def work(op: Operation) -> Any:
            c = d.ctx()
            c.parts.resize(name, cpus, body.memory_mib, body.memory_overcommit)
            return _get_partition(c, name)
        return d.submit("partition-resize", f"resize partition {name}",
                        {"partitions": [f"/1.0/partitions/{name}"]}, work)

    @r.post("/1.0/partitions/{name}/restart", dependencies=[OPERATOR], status_code=202,
            responses=m.ACCEPTED,
            summary="Start a new supervisor; it re-adopts the running VMs (operation)")
    def restart_partition(name: NamePath) -> JSONResponse:
        c = d.ctx()
        c.db.partition(valid_name("partition", name))
        not_busy(c, partition_obj(name))

        def work(op: Operation) -> Any:
            c = d.ctx()
            pid = c.parts.restart(name)
            return {"partition": name, "supervisor_pid": pid,
                    "running_vms": [v.name for v in c.db.vms(name)
                                    if v.state.value == "running"]}
        return d.submit("partition-restart", f"restart partition {name}",
                        {"partitions": [f"/1.0/partitions/{name}"]}, work)

    @r.delete("/1.0/partitions/{name}", dependencies=[ADMIN], status_code=202, responses=m.ACCEPTED,
              summary="Delete a partition (operation); force=true also deletes its VMs")
    def delete_partition(name: NamePath, force: bool = False) -> JSONResponse:
        c = d.ctx()
        c.db.partition(valid_name("partition", name))
        vms = c.db.vms(name)
        if vms and not force:
            raise StateError(f"partition {name!r} still has VM(s) "
                             f"{', '.join(v.name for v in vms)}; delete them first or use "
                             "force=true to stop and delete them.")
        not_busy(c, partition_obj(name))

        def work(op: Operation) -> Any:
            d.ctx().parts.delete(name, force=force)
            return {"deleted": f"/1.0/partitions/{name}"}
        return d.submit("partition-delete", f"delete partition {name}",
                        {"partitions": [f"/1.0/partitions/{name}"]}, work)

    @r.post("/1.0/partitions/{name}/maintain", dependencies=[OPERATOR], status_code=202,
            responses=m.ACCEPTED,
            summary="Restart the partition's hypervisor under its running VMs "
                    "(operation)")
    def maintain(name: NamePath, body: m.Maintain, request: Request) -> JSONResponse:
        c = d.ctx()
        c.db.partition(valid_name("partition", name))
        if body.qemu is not None and not SERIES_RE.match(body.qemu):
            # A path names a binary that root runs: an operator names versions only.
            require(request, Role.ADMIN, "naming a QEMU binary by path (not a version "
                                         "from `fusuma qemu list`)")
        via = body.via
        if via is not None:
            c.db.partition(via)
            if via == name:
                raise StateError("via must name another partition.")
        c.parts.check_qemu(body.qemu)
        if via is None:
            # A QEMU without cpr-transfer is refused now, with the sentence naming via.
            from fusuma.migration import inplace

            inplace.check_partition(name, inplace.partition_qemu(c.parts, name, body.qemu),
                                    switching=body.qemu is not None)
        not_busy(c, partition_obj(name))
        vms = [v.name for v in c.db.vms(name)]

        def work(op: Operation) -> Any:
            from fusuma.migration.maintain import maintain as do_maintain
            from fusuma.migration.maintain import maintain_in_place

            def report(s: str) -> None:
                d.ops.set_progress(op, s)

            c = d.ctx()
            res = (do_maintain(c.parts, name, via, body.qemu, progress=report)
                   if via is not None else
                   maintain_in_place(c.parts, name, body.qemu, progress=report))
            return {"partition": res.partition, "via": res.via,
                    "in_place": via is None, "qemu": res.qemu,
                    "supervisor_pid": res.supervisor_pid,
                    "moves": [mv.as_json() for mv in res.moves]}
        how = f"via {via}" if via is not None else "in place"
        return d.submit("partition-maintain", f"maintain partition {name} {how}",
                        {"partitions": [f"/1.0/partitions/{p}" for p in
                                        dict.fromkeys((name, via or name))],
                         "vms": [f"/1.0/vms/{v}" for v in vms]}, work)

    # -- disks ------------------------------------------------------------------------
    @r.get("/1.0/disks", dependencies=[VIEWER], response_model=list[m.DiskInfo])
    def list_disks() -> list[dict[str, Any]]:
        return disks_data(d.ctx())

    @r.get("/1.0/disks/{name}", dependencies=[VIEWER], response_model=m.DiskInfo)
    def get_disk(name: NamePath) -> dict[str, Any]:
        c = d.ctx()
        c.db.disk(valid_name("disk", name))
        return next(x for x in disks_data(c) if x["name"] == name)

    @r.post("/1.0/disks", dependencies=[ADMIN], status_code=201, response_model=m.DiskInfo)
    def add_disk(spec: m.DiskCreate, response: Response) -> dict[str, Any]:
        from fusuma.spec import DiskSpec

        c = d.ctx()
        c.parts.add_disk(DiskSpec.model_validate(spec.model_dump()))
        response.headers["Location"] = f"/1.0/disks/{spec.name}"
        return next(x for x in disks_data(c) if x["name"] == spec.name)

    @r.patch("/1.0/disks/{name}", dependencies=[ADMIN], response_model=m.DiskInfo,
             summary="Move a disk to another partition")
    def move_disk(name: NamePath, body: m.DiskPatch) -> dict[str, Any]:
        c = d.ctx()
        c.parts.move_disk(valid_name("disk", name), body.partition)
        return next(x for x in disks_data(c) if x["name"] == name)

    @r.delete("/1.0/disks/{name}", dependencies=[ADMIN], response_model=m.Deleted)
    def remove_disk(name: NamePath, delete_file: bool = False) -> dict[str, Any]:
        d.ctx().parts.remove_disk(valid_name("disk", name), delete_file=delete_file)
        return {"deleted": f"/1.0/disks/{name}"}

    return r
