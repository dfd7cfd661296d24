"""The API's VMs: ``/1.0/vms`` (define, change, start, stop, move, exec, trim)."""

from __future__ import annotations

import dataclasses
from typing import Any

from fastapi import APIRouter, Query, Request
from fastapi.responses import JSONResponse

from fusuma.api import models as m
from fusuma.api.daemon import Daemon, not_busy
from fusuma.api.http import NamePath, NameQuery, valid_name
from fusuma.api.operations import Operation
from fusuma.api.roles import OPERATOR, VIEWER, RoleRoute, require
from fusuma.errors import FusumaError, StateError
from fusuma.ops.context import Ctx
from fusuma.state import vm_obj
from fusuma.state.roles import Role
from fusuma.views.host import job_json, ps_data
from fusuma.views.networks import vm_nics

# Host ports below this only root's services may bind (net.ipv4.ip_unprivileged_port_start).
PRIVILEGED_PORTS = 1024


def router(d: Daemon) -> APIRouter:
    r = APIRouter(route_class=RoleRoute)

    # -- VMs --------------------------------------------------------------------------
    def _vm_json(c: Ctx, name: str) -> dict[str, Any]:
        from fusuma.vm.view import VmView

        data = VmView(c.db.vm(name), c.paths.segments_dir, d.sampler.memory).as_json()
        job = c.db.find_job(vm_obj(name))

        data["job"] = job_json(job) if job else None
        data["nics"] = vm_nics(c.db, c.db.vm(name))
        return data

    @r.get("/1.0/vms", dependencies=[VIEWER], response_model=list[m.VmInfo] | list[str],
           summary="VMs (of one partition with ?partition=); recursion=0 gives URLs")
    def list_vms(partition: NameQuery = None,
                 recursion: int = Query(1, ge=0, le=1)) -> Any:
        c = d.ctx()
        if partition is not None:
            c.db.partition(valid_name("partition", partition))
        if recursion == 0:
            return JSONResponse([f"/1.0/vms/{v.name}" for v in c.db.vms(partition)])

        vms: list[dict[str, Any]] = ps_data(c, vms_only=True,
                                            memory=d.sampler.memory)["vms"]
        return [v for v in vms if partition is None or v["partition"] == partition]

    @r.get("/1.0/vms/{name}", dependencies=[VIEWER], response_model=m.VmInfo)
    def get_vm(name: NamePath) -> dict[str, Any]:
        return _vm_json(d.ctx(), valid_name("VM", name))

    @r.post("/1.0/vms", dependencies=[OPERATOR], status_code=202, responses=m.ACCEPTED,
            summary="Define a VM, and start it with start=true (operation)")
    def create_vm(request: Request, body: m.VmCreate) -> JSONResponse:
        from fusuma.network import addr
        from fusuma.spec import VmSpec

        c = d.ctx()
        fields = body.model_dump(exclude={"start"}, exclude_unset=True)
        spec = VmSpec.model_validate(fields)
        for f in map(addr.parse_forward, spec.ports):
            if f.addr != addr.LOOPBACK or f.host_port < PRIVILEGED_PORTS:
                # A host port on an outside address, or one below 1024 (which only
                # root's services may bind), is the host's, not a guest's to take.
                require(request, Role.ADMIN, f"forwarding host port {f.addr}:"
                        f"{f.host_port} (an address other than 127.0.0.1, or a port "
                        f"below {PRIVILEGED_PORTS})")
        c.vms.create(spec)       # synchronous: a bad definition is refused right here

        def work(op: Operation) -> Any:
            c = d.ctx()
            if body.start:
                try:
                    c.vms.start(spec.name)
                except FusumaError:
                    c.vms.delete(spec.name, force=True)
                    raise
            return _vm_json(c, spec.name)
        return d.submit("vm-create", f"create VM {spec.name}"
                        + (" and start it" if body.start else ""),
                        {"vms": [f"/1.0/vms/{spec.name}"]}, work)

    @r.patch("/1.0/vms/{name}", dependencies=[OPERATOR], response_model=m.VmInfo,
             summary="Change a stopped VM: its QoS class, its disks")
    def change_vm(name: NamePath, body: m.VmPatch) -> dict[str, Any]:
        c = d.ctx()
        rec = c.db.vm(valid_name("VM", name))
        if body.qos is not None and body.qos != rec.qos:
            c.vms.set_qos(name, body.qos)
        if body.disks is not None:
            for disk in [x for x in rec.disks if x not in body.disks]:
                c.vms.detach_disk(name, disk)
            for disk in [x for x in body.disks if x not in rec.disks]:
                c.vms.attach_disk(name, disk)
        return _vm_json(c, name)

    @r.delete("/1.0/vms/{name}", dependencies=[OPERATOR], status_code=202, responses=m.ACCEPTED,
              summary="Delete a VM (operation); force=true kills it first")
    def delete_vm(name: NamePath, force: bool = False) -> JSONResponse:
        from fusuma.vm.view import VmView

        c = d.ctx()
        rec = c.db.vm(valid_name("VM", name))
        not_busy(c, vm_obj(name))
        state = VmView(rec).state
        if state not in ("stopped", "crashed") and not force:
            raise StateError(f"VM {name!r} is {state}; stop it first or use force=true.")

        def work(op: Operation) -> Any:
            d.ctx().vms.delete(name, force=force)
            return {"deleted": f"/1.0/vms/{name}"}
        return d.submit("vm-delete", f"delete VM {name}", {"vms": [f"/1.0/vms/{name}"]},
                        work)

    @r.get("/1.0/vms/{name}/state", dependencies=[VIEWER], response_model=m.VmStateInfo)
    def get_vm_state(name: NamePath) -> dict[str, Any]:
        v = _vm_json(d.ctx(), valid_name("VM", name))
        return {"state": v["state"], "pid": v["pid"], "partition": v["partition"],
                "job": v["job"], "error": v["error"]}

    @r.put("/1.0/vms/{name}/state", dependencies=[OPERATOR], status_code=202, responses=m.ACCEPTED,
           summary="start, stop (guest sync, then quit) or kill a VM (operation)")
    def change_vm_state(name: NamePath, body: m.VmStateChange) -> JSONResponse:
        from fusuma.vm.view import VmView

        c = d.ctx()
        rec = c.db.vm(valid_name("VM", name))
        not_busy(c, vm_obj(name))
        state = VmView(rec).state
        if body.action == "start":
            if state == "running" and rec.pid:     # the supervisor's (the CLI's) sentence
                raise StateError(f"VM {name!r} is already running (pid {rec.pid}).")
            if state not in ("stopped", "crashed"):
                raise StateError(f"VM {name!r} is {state}; it can only be started when "
                                 "stopped or crashed.")
            from fusuma import capacity
            from fusuma.images import find_image

            if rec.boot == "kernel":
                find_image(c.paths.cache, kind=rec.image)
            capacity.check_start(c.paths, rec, c.db)
        elif body.action == "kill" and state in ("stopped",):
            raise StateError(f"VM {name!r} is {state}; there is no QEMU to kill.")

        def work(op: Operation) -> Any:
            c = d.ctx()
            if body.action == "start":
                c.vms.start(name, wait_agent=body.wait_agent)
            elif body.action == "stop":
                c.vms.stop(name, timeout=body.timeout)
            else:
                c.vms.kill(name)
            return _vm_json(c, name)
        return d.submit(f"vm-{body.action}", f"{body.action} VM {name}",
                        {"vms": [f"/1.0/vms/{name}"]}, work)

    @r.post("/1.0/vms/{name}/move", dependencies=[OPERATOR], status_code=202, responses=m.ACCEPTED,
            summary="Move a running VM to another partition (operation); cancellable "
                    "until its stream starts")
    def move_vm(name: NamePath, body: m.VmMove) -> JSONResponse:
        from fusuma.migration import check, migrate

        c = d.ctx()
        rec = c.db.vm(valid_name("VM", name))
        not_busy(c, vm_obj(name))
        check(c.parts, name, body.partition, body.mode)
        source = rec.partition

        def work(op: Operation) -> Any:
            c = d.ctx()
            res = migrate(c.parts, name, body.partition, body.mode,
                          progress=lambda s: d.ops.set_progress(op, s),
                          checkpoint=op.check_cancel)
            return res.as_json()
        return d.submit("vm-move", f"move VM {name} {source} -> {body.partition} "
                        f"({body.mode})",
                        {"vms": [f"/1.0/vms/{name}"],
                         "partitions": [f"/1.0/partitions/{source}",
                                        f"/1.0/partitions/{body.partition}"]},
                        work, cancellable=True)

    def _running(name: str) -> None:
        """409 now unless VM ``name`` runs (404 when there is none)."""
        from fusuma.vm.view import VmView

        state = VmView(d.ctx().db.vm(valid_name("VM", name))).state
        if state != "running":
            raise StateError(f"VM {name!r} is {state}; start it first.")

    @r.post("/1.0/vms/{name}/exec", dependencies=[OPERATOR], status_code=202, responses=m.ACCEPTED,
            summary="Run a command in the guest through its agent (operation)")
    def exec_vm(name: NamePath, body: m.VmExec) -> JSONResponse:
        _running(name)

        def work(op: Operation) -> Any:
            res = d.ctx().vms.exec(name, list(body.command),
                                   stdin=body.stdin.encode() if body.stdin is not None
                                   else None, timeout=body.timeout)
            return {"exit_code": res.exit_code, "signal": res.signal,
                    "stdout": res.stdout.decode(errors="replace"),
                    "stderr": res.stderr.decode(errors="replace")}
        # Neither the command nor its output goes to the event log or the daemon's log.
        return d.submit("vm-exec", f"exec in VM {name}", {"vms": [f"/1.0/vms/{name}"]},
                        work, private=True)

    @r.post("/1.0/vms/{name}/resize", dependencies=[OPERATOR],
            summary="Grow a VM's disk (online while it runs, QMP block_resize)")
    def resize_vm(name: NamePath, body: m.VmResize) -> dict[str, Any]:
        return dataclasses.asdict(d.ctx().vms.resize_disk(name, body.size, body.disk))

    @r.post("/1.0/vms/{name}/trim", dependencies=[OPERATOR], status_code=202, responses=m.ACCEPTED,
            summary="Drop the guest's caches and hand its free memory back (operation)")
    def trim_vm(name: NamePath) -> JSONResponse:
        _running(name)

        def work(op: Operation) -> Any:
            return d.ctx().vms.trim(name)
        return d.submit("vm-trim", f"trim VM {name}", {"vms": [f"/1.0/vms/{name}"]}, work)

    return r
