"""The REST API: resources under ``/1.0``, operations, events, metrics.

Every handler calls what the CLI calls (the managers, ``migration.migrate``, the same
``--json`` data functions), in a thread with its own state-file connection, so the
daemon and the CLI share one set of locks, jobs and state. Work that takes more than a
moment (start, stop, move, maintain, resize, delete, exec, builds) answers ``202
Accepted`` with an operation (``Location: /1.0/operations/ID``); the operation's
``result`` is what the CLI prints with ``--json``.

Errors are ``{"type": "error", "error": SENTENCE, "error_code": N}``: the CLI's
sentence; 400 for bad input (the field named), 404 for unknown names or paths, 409 for
a conflict (a busy object, a wrong state, no room), 413 for a body over 1 MiB, 408 for
a body that does not arrive.
"""

from __future__ import annotations

import asyncio
import logging
import os
import platform
import socket
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from fastapi import FastAPI, Query, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from fusuma import __version__
from fusuma.api import models as m
from fusuma.api.events import TYPES, EventHub
from fusuma.api.operations import Operation, Operations, http_code
from fusuma.cli.common import Ctx
from fusuma.errors import FusumaError, SpecError, StateError
from fusuma.names import check_name
from fusuma.paths import Paths
from fusuma.state import Database, busy_sentence, partition_obj, vm_obj

LOG = logging.getLogger(__name__)

API_EXTENSIONS = ["operations", "events_sse", "metrics_prometheus", "vm_move",
                  "partition_maintain", "vm_exec", "segments", "governor_status",
                  "tokens"]
MAX_BODY = 1 << 20          # bytes
BODY_TIMEOUT_S = 10.0       # a request body must arrive within this


def _error(code: int, sentence: str) -> JSONResponse:
    return JSONResponse({"type": "error", "error": sentence, "error_code": code},
                        status_code=code)


def _accepted(op: Operation) -> JSONResponse:
    return JSONResponse(op.as_json(), status_code=202,
                        headers={"Location": f"/1.0/operations/{op.id}"})


def _name(kind: str, value: str) -> str:
    check_name(kind, value)
    return value


def _validation_sentence(exc: RequestValidationError) -> str:
    err = exc.errors()[0]
    loc = [str(x) for x in err.get("loc", ()) if x != "body"]
    where = ".".join(loc)
    kind = err.get("type", "")
    if kind == "json_invalid":
        ctx = err.get("ctx") or {}
        return f"the request body is not valid JSON ({ctx.get('error', 'parse error')})."
    if kind == "extra_forbidden":
        return f"unknown field {where!r}; see /docs for the fields this request takes."
    if kind == "missing":
        return f"field {where!r} is required." if where else "a request body is required."
    msg = str(err.get("msg", "invalid value")).removeprefix("Value error, ")
    if kind == "model_attributes_type" or not where:
        return f"the request body must be a JSON object: {msg}."
    return f"field {where!r}: {msg}."


class Limits:
    """Pure ASGI middleware: a body over MAX_BODY gets 413, a body that has not
    arrived BODY_TIMEOUT_S after the headers gets 408; either way the connection is
    answered and the daemon goes on."""

    def __init__(self, app: ASGIApp, max_body: int = MAX_BODY,
                 timeout: float = BODY_TIMEOUT_S) -> None:
        self.app = app
        self.max_body = max_body
        self.timeout = timeout

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        for k, v in scope.get("headers", []):
            if k == b"content-length":
                try:
                    if int(v) > self.max_body:
                        await _error(413, f"the request body is {int(v)} bytes; the API "
                                     f"takes at most {self.max_body}.")(scope, receive, send)
                        return
                except ValueError:
                    await _error(400, "bad Content-Length header.")(scope, receive, send)
                    return
        if scope.get("method") in ("POST", "PUT", "PATCH"):
            # Bodies are JSON whatever the client said (`curl -d` says form data).
            headers = [(k, v) for k, v in scope.get("headers", []) if k != b"content-type"]
            scope = {**scope, "headers": [*headers, (b"content-type", b"application/json")]}
        seen = 0
        started = False
        body_done = False

        async def limited_receive() -> Message:
            nonlocal seen, body_done
            if body_done:
                # After the whole body only http.disconnect can come, maybe hours later
                # (Starlette's StreamingResponse waits for it under the event stream):
                # no deadline, or every /1.0/events stream would be cut after timeout.
                return await receive()
            try:
                msg = await asyncio.wait_for(receive(), self.timeout)
            except TimeoutError:
                raise _BodyError(408, f"the request body did not arrive within "
                                 f"{self.timeout:g} s.") from None
            if msg["type"] == "http.request":
                seen += len(msg.get("body", b""))
                if seen > self.max_body:
                    raise _BodyError(413, f"the request body is over {self.max_body} "
                                     "bytes, the most the API takes.")
                body_done = not msg.get("more_body", False)
            return msg

        async def tracking_send(msg: Message) -> None:
            nonlocal started
            if msg["type"] == "http.response.start":
                started = True
            await send(msg)

        try:
            await self.app(scope, limited_receive, tracking_send)
        except _BodyError as exc:
            if not started:
                await _error(exc.code, exc.sentence)(scope, receive, send)


class _BodyError(Exception):
    def __init__(self, code: int, sentence: str) -> None:
        super().__init__(sentence)
        self.code = code
        self.sentence = sentence


class Daemon:
    """The daemon's shared parts: per-thread contexts, operations, events, metrics."""

    def __init__(self, paths: Paths) -> None:
        from fusuma.api import metrics

        self.paths = paths
        self._local = threading.local()
        self.started = time.time()
        self.ops = Operations(self._operation_event)
        self.registry, self.event_metrics = metrics.build_registry(
            paths, self.db, lambda: self.ctx().parts.cg)
        self.hub = EventHub(self.db, self.event_metrics.observe)
        from fusuma.api.ui import Sampler, Sessions

        self.sessions = Sessions()
        self.sampler = Sampler(self)

    def ctx(self) -> Ctx:
        """This thread's context (a state-file connection is per thread)."""
        c: Ctx | None = getattr(self._local, "ctx", None)
        if c is None:
            c = Ctx(self.paths)
            self._local.ctx = c
        return c

    def db(self) -> Database:
        return self.ctx().db

    def _operation_event(self, op: Operation, action: str) -> None:
        self.db().emit_context("operation", action, f"/1.0/operations/{op.id}",
                               op.as_json())

    def submit(self, kind: str, description: str, resources: dict[str, list[str]],
               work: Callable[[Operation], Any], cancellable: bool = False) -> JSONResponse:
        return _accepted(self.ops.submit(kind, description, resources, work,
                                         cancellable=cancellable))


def _not_busy(c: Ctx, obj: str) -> None:
    """409 now (not in a failed operation later) while a live owner holds ``obj``."""
    job = c.db.find_job(obj)
    if job is not None and job.owner.alive():
        raise StateError(busy_sentence(job))


def create_app(paths: Paths, daemon: Daemon | None = None) -> FastAPI:
    d = daemon or Daemon(paths)
    app = FastAPI(title="fusuma", version=__version__, docs_url=None, redoc_url=None,
                  description="The host API of fusuma: partitions, VMs, zero-copy moves, "
                              "shared segments, the CPU governor. Long work returns 202 "
                              "with an operation; `GET /1.0/events` streams what happens "
                              "(server-sent events); `GET /metrics` is for Prometheus.")
    app.state.daemon = d
    from fusuma.api.ui import router

    app.include_router(router(d))

    # -- errors -----------------------------------------------------------------------
    @app.exception_handler(FusumaError)
    async def _fusuma_error(request: Request, exc: FusumaError) -> JSONResponse:
        return _error(http_code(exc), str(exc))

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, exc: RequestValidationError) -> JSONResponse:
        return _error(400, _validation_sentence(exc))

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        # FastAPI turns an error raised while it reads the body into "400 There was an
        # error parsing the body"; the Limits middleware's 408/413 is the cause.
        if isinstance(exc.__cause__, _BodyError):
            return _error(exc.__cause__.code, exc.__cause__.sentence)
        if exc.status_code == 404:
            return _error(404, f"no such API path: {request.url.path} (see /docs).")
        if exc.status_code == 405:
            return _error(405, f"{request.method} is not allowed on {request.url.path} "
                               "(see /docs).")
        return _error(exc.status_code, str(exc.detail))

    @app.exception_handler(Exception)
    async def _bug(request: Request, exc: Exception) -> JSONResponse:
        LOG.exception("internal error on %s %s", request.method, request.url.path)
        return _error(500, f"internal error: {exc!r}; see the daemon's log.")

    # -- host -------------------------------------------------------------------------
    @app.get("/1.0", summary="The host and the API")
    def host_info() -> dict[str, Any]:
        c = d.ctx()
        h = c.parts.host
        from fusuma.host.accel import probe_accel

        accel = probe_accel("auto")
        return {"api_version": "1.0", "api_extensions": API_EXTENSIONS,
                "api_status": "stable", "auth": "trusted",
                "environment": {
                    "server": "fusuma", "server_version": __version__,
                    "server_pid": os.getpid(), "hostname": socket.gethostname(),
                    "kernel": platform.release(), "cores": h.cpus,
                    "memory_mib": h.memory_total_mib,
                    "memory_for_partitions_mib": h.memory_available_for_partitions_mib,
                    "cgroup": c.parts.cg.version,
                    "accelerator": accel.name, "accelerator_notice": accel.notice,
                    "started_at": d.started},
                "counts": {"partitions": len(c.db.partitions()), "vms": len(c.db.vms()),
                           "operations_running": sum(
                               1 for o in d.ops.all() if not o.done.is_set()),
                           "event_subscribers": d.hub.subscribers}}

    @app.get("/1.0/ps", response_model=m.PsInfo, summary="What `fusuma ps --json` shows")
    def ps() -> dict[str, Any]:
        from fusuma.cli.host import ps_data

        return ps_data(d.ctx(), memory=d.sampler.memory)

    # -- partitions -------------------------------------------------------------------
    def _partitions(c: Ctx) -> list[dict[str, Any]]:
        from fusuma.cli.host import partitions_data

        return partitions_data(c)

    @app.get("/1.0/partitions", response_model=list[m.PartitionInfo])
    def list_partitions() -> list[dict[str, Any]]:
        return _partitions(d.ctx())

    @app.get("/1.0/partitions/{name}", response_model=m.PartitionInfo)
    def get_partition(name: str) -> dict[str, Any]:
        c = d.ctx()
        c.db.partition(_name("partition", name))
        return next(p for p in _partitions(c) if p["name"] == name)

    @app.post("/1.0/partitions", status_code=202, summary="Create a partition (operation)")
    def create_partition(spec: m.PartitionCreate) -> JSONResponse:
        c = d.ctx()
        if c.db.find_partition(spec.name) is not None:
            from fusuma.errors import ConflictError

            raise ConflictError(f"a partition named {spec.name!r} already exists.")
        from fusuma.spec import PartitionSpec

        pspec = PartitionSpec.model_validate(spec.model_dump())

        def work(op: Operation) -> Any:
            c = d.ctx()
            c.parts.create(pspec)
            return _get_partition(c, pspec.name)
        return d.submit("partition-create", f"create partition {spec.name}",
                        {"partitions": [f"/1.0/partitions/{spec.name}"]}, work)

    def _get_partition(c: Ctx, name: str) -> dict[str, Any]:
        return next(p for p in _partitions(c) if p["name"] == name)

    @app.patch("/1.0/partitions/{name}", status_code=202,
               summary="Resize a partition: cores and/or memory (operation)")
    def resize_partition(name: str, body: m.PartitionPatch) -> JSONResponse:
        c = d.ctx()
        c.db.partition(_name("partition", name))
        if body.cpus is None and body.memory_mib is None:
            raise SpecError("give cpus and/or memory_mib.")
        from fusuma.host.topology import parse_cpulist

        cpus = parse_cpulist(body.cpus) if isinstance(body.cpus, str) else body.cpus
        _not_busy(c, partition_obj(name))

        def work(op: Operation) -> Any:
            c = d.ctx()
            c.parts.resize(name, cpus, body.memory_mib)
            return _get_partition(c, name)
        return d.submit("partition-resize", f"resize partition {name}",
                        {"partitions": [f"/1.0/partitions/{name}"]}, work)

    @app.post("/1.0/partitions/{name}/restart", status_code=202,
              summary="Start a new supervisor; it re-adopts the running VMs (operation)")
    def restart_partition(name: str) -> JSONResponse:
        c = d.ctx()
        c.db.partition(_name("partition", name))
        _not_busy(c, partition_obj(name))

        def work(op: Operation) -> Any:
            c = d.ctx()
            pid = c.parts.restart(name)
            return {"partition": name, "supervisor_pid": pid,
                    "running_vms": [v.name for v in c.db.vms(name)
                                    if v.state.value == "running"]}
        return d.submit("partition-restart", f"restart partition {name}",
                        {"partitions": [f"/1.0/partitions/{name}"]}, work)

    @app.delete("/1.0/partitions/{name}", status_code=202,
                summary="Delete a partition (operation); force=true also deletes its VMs")
    def delete_partition(name: str, force: bool = False) -> JSONResponse:
        c = d.ctx()
        c.db.partition(_name("partition", name))
        vms = c.db.vms(name)
        if vms and not force:
            raise StateError(f"partition {name!r} still has VM(s) "
                             f"{', '.join(v.name for v in vms)}; delete them first or use "
                             "force=true to stop and delete them.")
        _not_busy(c, partition_obj(name))

        def work(op: Operation) -> Any:
            d.ctx().parts.delete(name, force=force)
            return {"deleted": f"/1.0/partitions/{name}"}
        return d.submit("partition-delete", f"delete partition {name}",
                        {"partitions": [f"/1.0/partitions/{name}"]}, work)

    @app.post("/1.0/partitions/{name}/maintain", status_code=202,
              summary="Restart the partition's hypervisor under its running VMs "
                      "(operation)")
    def maintain(name: str, body: m.Maintain) -> JSONResponse:
        c = d.ctx()
        c.db.partition(_name("partition", name))
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
        _not_busy(c, partition_obj(name))
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
    def _disks(c: Ctx) -> list[dict[str, Any]]:
        from fusuma.cli.disk import disks_data

        return disks_data(c)

    @app.get("/1.0/disks", response_model=list[m.DiskInfo])
    def list_disks() -> list[dict[str, Any]]:
        return _disks(d.ctx())

    @app.get("/1.0/disks/{name}", response_model=m.DiskInfo)
    def get_disk(name: str) -> dict[str, Any]:
        c = d.ctx()
        c.db.disk(_name("disk", name))
        return next(x for x in _disks(c) if x["name"] == name)

    @app.post("/1.0/disks", status_code=201, response_model=m.DiskInfo)
    def add_disk(spec: m.DiskCreate, response: Response) -> dict[str, Any]:
        from fusuma.spec import DiskSpec

        c = d.ctx()
        c.parts.add_disk(DiskSpec.model_validate(spec.model_dump()))
        response.headers["Location"] = f"/1.0/disks/{spec.name}"
        return next(x for x in _disks(c) if x["name"] == spec.name)

    @app.patch("/1.0/disks/{name}", response_model=m.DiskInfo,
               summary="Move a disk to another partition")
    def move_disk(name: str, body: m.DiskPatch) -> dict[str, Any]:
        c = d.ctx()
        c.parts.move_disk(_name("disk", name), body.partition)
        return next(x for x in _disks(c) if x["name"] == name)

    @app.delete("/1.0/disks/{name}")
    def remove_disk(name: str, delete_file: bool = False) -> dict[str, Any]:
        d.ctx().parts.remove_disk(_name("disk", name), delete_file=delete_file)
        return {"deleted": f"/1.0/disks/{name}"}

    # -- VMs --------------------------------------------------------------------------
    def _vm_json(c: Ctx, name: str) -> dict[str, Any]:
        from fusuma.vm.view import VmView

        data = VmView(c.db.vm(name), c.paths.segments_dir, d.sampler.memory).as_json()
        job = c.db.find_job(vm_obj(name))
        from fusuma.cli.host import job_json

        data["job"] = job_json(job) if job else None
        return data

    @app.get("/1.0/vms", response_model=list[m.VmInfo],
             summary="VMs (of one partition with ?partition=); recursion=0 gives URLs")
    def list_vms(partition: str | None = None,
                 recursion: int = Query(1, ge=0, le=1)) -> Any:
        c = d.ctx()
        if partition is not None:
            c.db.partition(_name("partition", partition))
        if recursion == 0:
            return JSONResponse([f"/1.0/vms/{v.name}" for v in c.db.vms(partition)])
        from fusuma.cli.host import ps_data

        vms: list[dict[str, Any]] = ps_data(c, vms_only=True,
                                            memory=d.sampler.memory)["vms"]
        return [v for v in vms if partition is None or v["partition"] == partition]

    @app.get("/1.0/vms/{name}", response_model=m.VmInfo)
    def get_vm(name: str) -> dict[str, Any]:
        return _vm_json(d.ctx(), _name("VM", name))

    @app.post("/1.0/vms", status_code=202,
              summary="Define a VM, and start it with start=true (operation)")
    def create_vm(body: m.VmCreate) -> JSONResponse:
        from fusuma.spec import VmSpec

        c = d.ctx()
        fields = body.model_dump(exclude={"start"}, exclude_unset=True)
        spec = VmSpec.model_validate(fields)
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

    @app.patch("/1.0/vms/{name}", response_model=m.VmInfo,
               summary="Change a stopped VM: its QoS class, its disks")
    def change_vm(name: str, body: m.VmPatch) -> dict[str, Any]:
        c = d.ctx()
        rec = c.db.vm(_name("VM", name))
        if body.qos is not None and body.qos != rec.qos:
            c.vms.set_qos(name, body.qos)
        if body.disks is not None:
            for disk in [x for x in rec.disks if x not in body.disks]:
                c.vms.detach_disk(name, disk)
            for disk in [x for x in body.disks if x not in rec.disks]:
                c.vms.attach_disk(name, disk)
        return _vm_json(c, name)

    @app.delete("/1.0/vms/{name}", status_code=202,
                summary="Delete a VM (operation); force=true kills it first")
    def delete_vm(name: str, force: bool = False) -> JSONResponse:
        from fusuma.vm.view import VmView

        c = d.ctx()
        rec = c.db.vm(_name("VM", name))
        _not_busy(c, vm_obj(name))
        state = VmView(rec).state
        if state not in ("stopped", "crashed") and not force:
            raise StateError(f"VM {name!r} is {state}; stop it first or use force=true.")

        def work(op: Operation) -> Any:
            d.ctx().vms.delete(name, force=force)
            return {"deleted": f"/1.0/vms/{name}"}
        return d.submit("vm-delete", f"delete VM {name}", {"vms": [f"/1.0/vms/{name}"]},
                        work)

    @app.get("/1.0/vms/{name}/state")
    def get_vm_state(name: str) -> dict[str, Any]:
        v = _vm_json(d.ctx(), _name("VM", name))
        return {"state": v["state"], "pid": v["pid"], "partition": v["partition"],
                "job": v["job"], "error": v["error"]}

    @app.put("/1.0/vms/{name}/state", status_code=202,
             summary="start, stop (guest sync, then quit) or kill a VM (operation)")
    def change_vm_state(name: str, body: m.VmStateChange) -> JSONResponse:
        from fusuma.vm.view import VmView

        c = d.ctx()
        rec = c.db.vm(_name("VM", name))
        _not_busy(c, vm_obj(name))
        state = VmView(rec).state
        if body.action == "start":
            if state == "running" and rec.pid:     # the supervisor's (the CLI's) sentence
                raise StateError(f"VM {name!r} is already running (pid {rec.pid}).")
            if state not in ("stopped", "crashed"):
                raise StateError(f"VM {name!r} is {state}; it can only be started when "
                                 "stopped or crashed.")
            from fusuma import capacity
            from fusuma.images import find_image

            find_image(c.paths.cache, kind=rec.image)
            capacity.check_start(c.paths, rec)
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

    @app.post("/1.0/vms/{name}/move", status_code=202,
              summary="Move a running VM to another partition (operation); cancellable "
                      "until its stream starts")
    def move_vm(name: str, body: m.VmMove) -> JSONResponse:
        from fusuma.migration import check, migrate

        c = d.ctx()
        rec = c.db.vm(_name("VM", name))
        _not_busy(c, vm_obj(name))
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

        state = VmView(d.ctx().db.vm(_name("VM", name))).state
        if state != "running":
            raise StateError(f"VM {name!r} is {state}; start it first.")

    @app.post("/1.0/vms/{name}/exec", status_code=202,
              summary="Run a command in the guest through its agent (operation)")
    def exec_vm(name: str, body: m.VmExec) -> JSONResponse:
        _running(name)

        def work(op: Operation) -> Any:
            res = d.ctx().vms.exec(name, list(body.command),
                                   stdin=body.stdin.encode() if body.stdin is not None
                                   else None, timeout=body.timeout)
            return {"exit_code": res.exit_code, "signal": res.signal,
                    "stdout": res.stdout.decode(errors="replace"),
                    "stderr": res.stderr.decode(errors="replace")}
        return d.submit("vm-exec", f"exec in VM {name}: {' '.join(body.command)[:80]}",
                        {"vms": [f"/1.0/vms/{name}"]}, work)

    @app.post("/1.0/vms/{name}/trim", status_code=202,
              summary="Drop the guest's caches and hand its free memory back (operation)")
    def trim_vm(name: str) -> JSONResponse:
        _running(name)

        def work(op: Operation) -> Any:
            return d.ctx().vms.trim(name)
        return d.submit("vm-trim", f"trim VM {name}", {"vms": [f"/1.0/vms/{name}"]}, work)

    # -- segments, sharing, governor, images -------------------------------------------
    @app.get("/1.0/segments", response_model=list[m.SegmentInfo])
    def list_segments() -> list[dict[str, Any]]:
        from fusuma.cli.segment import segments_data

        return segments_data(d.ctx())

    @app.get("/1.0/segments/{name}", response_model=m.SegmentInfo)
    def get_segment(name: str) -> dict[str, Any]:
        from fusuma.cli.segment import segments_data

        c = d.ctx()
        c.db.segment(_name("segment", name))
        return next(s for s in segments_data(c) if s["name"] == name)

    @app.post("/1.0/segments", status_code=202,
              summary="Build a segment from a directory or an image's root (operation)")
    def create_segment(body: m.SegmentCreate) -> JSONResponse:
        if (body.from_dir is None) == (body.from_image is None):
            raise SpecError("give either from_dir or from_image (one of them).")
        c = d.ctx()
        if c.db.find_segment(body.name) is not None:
            from fusuma.errors import ConflictError

            raise ConflictError(f"a segment named {body.name!r} already exists.")

        def work(op: Operation) -> Any:
            from fusuma.cli.segment import segments_data
            from fusuma.memshare.segments import SegmentManager

            c = d.ctx()
            SegmentManager(c.paths, c.db).create(
                body.name, from_dir=Path(body.from_dir) if body.from_dir else None,
                from_image=body.from_image, progress=lambda s: d.ops.set_progress(op, s))
            return next(s for s in segments_data(c) if s["name"] == body.name)
        return d.submit("segment-create", f"create segment {body.name}",
                        {"segments": [f"/1.0/segments/{body.name}"]}, work)

    @app.delete("/1.0/segments/{name}")
    def delete_segment(name: str) -> dict[str, Any]:
        from fusuma.memshare.segments import SegmentManager

        c = d.ctx()
        SegmentManager(c.paths, c.db).delete(_name("segment", name))
        return {"deleted": f"/1.0/segments/{name}"}

    # -- templates ---------------------------------------------------------------------
    def _templates() -> Any:
        from fusuma.memshare.template_manager import TemplateManager

        c = d.ctx()
        return TemplateManager(c.paths, c.db, c.parts)

    @app.get("/1.0/templates", summary="What `fusuma template list --json` shows")
    def list_templates() -> list[dict[str, Any]]:
        mgr = _templates()
        return [mgr.as_json(t) for t in mgr.all()]

    @app.get("/1.0/templates/{name}", summary="What `fusuma template show --json` shows")
    def get_template(name: str) -> dict[str, Any]:
        mgr = _templates()
        return dict(mgr.as_json(d.ctx().db.template(_name("template", name))))

    @app.post("/1.0/templates", status_code=202,
              summary="Stop a running VM into a template (operation)")
    def create_template(body: m.TemplateCreate) -> JSONResponse:
        c = d.ctx()
        c.db.vm(body.from_vm)                   # 404 now, not a failed operation later
        if c.db.find_template(body.name) is not None:
            from fusuma.errors import ConflictError

            raise ConflictError(f"a template named {body.name!r} already exists.")

        def work(op: Operation) -> Any:
            mgr = _templates()
            return mgr.as_json(mgr.create(body.name, body.from_vm))
        return d.submit("template-create", f"template {body.name} from VM {body.from_vm}",
                        {"templates": [f"/1.0/templates/{body.name}"],
                         "vms": [f"/1.0/vms/{body.from_vm}"]}, work)

    @app.delete("/1.0/templates/{name}")
    def delete_template(name: str) -> dict[str, Any]:
        _templates().delete(_name("template", name))
        return {"deleted": f"/1.0/templates/{name}"}

    @app.get("/1.0/share/report", summary="What `fusuma share report --json` shows")
    def share_report() -> dict[str, Any]:
        from fusuma.cli.share import report_data

        return report_data(d.ctx())

    @app.get("/1.0/share/analyze",
             summary="What `fusuma share analyze --json` shows, for ?vm= or ?pid=")
    def share_analyze(vm: str | None = None, pid: int | None = None) -> dict[str, Any]:
        from fusuma.cli.share import analyze_data

        return analyze_data(d.ctx(), pid, _name("VM", vm) if vm else None)

    @app.get("/1.0/governor", summary="What `fusuma governor status --json` shows")
    def governor(partition: str | None = None,
                 limit: int = Query(20, ge=0, le=256)) -> dict[str, Any]:
        from fusuma.cli.governor import status_data

        return status_data(d.ctx(), _name("partition", partition) if partition else None,
                           limit)

    @app.get("/1.0/images", summary="Guest images in the cache")
    def list_images() -> list[dict[str, Any]]:
        from fusuma.cli.image import images_data

        return images_data(d.ctx())

    @app.post("/1.0/images", status_code=202, summary="Build a guest image (operation)")
    def build_image(body: m.ImageBuild) -> JSONResponse:
        def work(op: Operation) -> Any:
            from fusuma.cli.image import image_json
            from fusuma.images import build_image

            t0 = time.monotonic()
            img = build_image(d.paths.cache, kind=body.kind, force=body.force,
                              progress=lambda s: d.ops.set_progress(op, s))
            return {**image_json(img), "seconds": round(time.monotonic() - t0, 2)}
        return d.submit("image-build", f"build image {body.kind}",
                        {"images": [f"/1.0/images/{body.kind}"]}, work)

    # -- operations -------------------------------------------------------------------
    @app.get("/1.0/operations", response_model=list[m.OperationInfo])
    def list_operations(status: str | None = None) -> list[dict[str, Any]]:
        return [o.as_json() for o in d.ops.all() if status is None or o.status == status]

    @app.get("/1.0/operations/{op_id}", response_model=m.OperationInfo)
    def get_operation(op_id: str) -> dict[str, Any]:
        return d.ops.get(op_id).as_json()

    @app.get("/1.0/operations/{op_id}/wait", response_model=m.OperationInfo,
             summary="Wait for an operation to end (at most ?timeout= seconds)")
    async def wait_operation(op_id: str,
                             timeout: float = Query(-1, ge=-1, le=86400)) -> dict[str, Any]:
        op = d.ops.get(op_id)
        limit = None if timeout < 0 else timeout
        await asyncio.to_thread(op.done.wait, limit)
        return op.as_json()

    @app.delete("/1.0/operations/{op_id}", response_model=m.OperationInfo,
                summary="Cancel an operation where it can stop safely")
    def cancel_operation(op_id: str) -> dict[str, Any]:
        return d.ops.cancel(op_id).as_json()

    @app.get("/docs", include_in_schema=False)
    def docs() -> Response:
        """Swagger UI from the package (vendored swagger-ui-dist): no CDN."""
        from fastapi.openapi.docs import get_swagger_ui_html

        return get_swagger_ui_html(openapi_url="/openapi.json", title="fusuma API",
                                   swagger_js_url="/static/swagger-ui-bundle.js",
                                   swagger_css_url="/static/swagger-ui.css",
                                   swagger_favicon_url="/static/favicon.svg")

    # -- events and metrics -----------------------------------------------------------
    @app.get("/1.0/events", summary="Server-sent events: lifecycle, operation, governor",
             response_class=StreamingResponse)
    async def events(request: Request, type: str | None = None,
                     since: int | None = Query(None, ge=0)) -> StreamingResponse:
        wanted = frozenset(TYPES) if not type else frozenset(type.split(","))
        bad = wanted - set(TYPES)
        if bad:
            raise SpecError(f"unknown event type(s) {', '.join(sorted(bad))}; use "
                            f"{', '.join(TYPES)}.")
        last = request.headers.get("last-event-id")
        if since is None and last and last.isdigit():
            since = int(last)
        return StreamingResponse(d.hub.stream(wanted, since), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-store",
                                          "X-Accel-Buffering": "no"})

    @app.get("/metrics", summary="Prometheus metrics", response_class=Response)
    def metrics() -> Response:
        from fusuma.api.metrics import render

        body, ctype = render(d.registry)
        return Response(body, media_type=ctype)

    return app


def wrap(app: FastAPI) -> ASGIApp:
    """The app with the request limits in front (what the servers run)."""
    return Limits(app)

