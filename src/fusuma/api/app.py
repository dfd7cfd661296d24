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
a body that does not arrive; 503 and 429 for a connection over a listener's or an
address's limit (``guard``).

The routes by topic: ``partitions`` (and disks), ``vms``, ``memshare`` (segments,
templates, the share report), ``ui`` (the dashboard); here the host, ``ps``, the
governor, images, operations, events and metrics. ``daemon`` holds what they share,
``http`` the error bodies and the request limits, ``guard`` each listener's connection
limits and deadlines.
"""

from __future__ import annotations

import logging
import os
import platform
import socket
import time
from typing import Any

from fastapi import FastAPI, Query, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp

from fusuma import __version__
from fusuma.api import backups, images, memshare, networks, partitions, snapshots, ui, vms
from fusuma.api import models as m
from fusuma.api.daemon import Daemon
from fusuma.api.events import TYPES
from fusuma.api.http import (
    BODY_TIMEOUT_S,
    BodyError,
    Limits,
    NameQuery,
    error_response,
    unless_gone,
    valid_name,
    validation_sentence,
)
from fusuma.api.operations import Operation, http_code
from fusuma.api.roles import ADMIN, METRICS, OPERATOR, VIEWER, RoleRoute, check_roles, identity_of
from fusuma.errors import FusumaError, SpecError
from fusuma.paths import Paths
from fusuma.views.governor import status_data
from fusuma.views.host import ps_data
from fusuma.views.images import image_json, images_data

LOG = logging.getLogger(__name__)

# The longest a GET /1.0/operations/ID/wait waits (its timeout=-1 too).
WAIT_MAX_S = 600.0

API_EXTENSIONS = ["operations", "events_sse", "metrics_prometheus", "vm_move",
                  "partition_maintain", "vm_exec", "segments", "governor_status",
                  "tokens"]


def create_app(paths: Paths, daemon: Daemon | None = None) -> FastAPI:
    d = daemon or Daemon(paths)
    # The OpenAPI document is served by a route of our own, which declares its role.
    app = FastAPI(title="fusuma", version=__version__, docs_url=None, redoc_url=None,
                  openapi_url=None, responses=m.ERRORS,
                  description="The host API of fusuma: partitions, VMs, zero-copy moves, "
                              "shared segments, the CPU governor. Long work returns 202 "
                              "with an operation; `GET /1.0/events` streams what happens "
                              "(server-sent events); `GET /metrics` is for Prometheus.")
    app.router.route_class = RoleRoute
    app.state.daemon = d
    app.include_router(ui.router(d))

    # -- errors -----------------------------------------------------------------------
    @app.exception_handler(FusumaError)
    async def _fusuma_error(request: Request, exc: FusumaError) -> JSONResponse:
        return error_response(http_code(exc), str(exc))

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, exc: RequestValidationError) -> JSONResponse:
        return error_response(400, validation_sentence(exc))

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        # FastAPI turns an error raised while it reads the body into "400 There was an
        # error parsing the body"; the Limits middleware's 408/413 is the cause.
        if isinstance(exc.__cause__, BodyError):
            return error_response(exc.__cause__.code, exc.__cause__.sentence)
        if exc.status_code == 404:
            return error_response(404, f"no such API path: {request.url.path} (see /docs).")
        if exc.status_code == 405:
            resp = error_response(405, f"{request.method} is not allowed on "
                                       f"{request.url.path} (see /docs).")
            # RFC 9110: every method of the resource, not only those of the one route
            # Starlette matched (GET and POST of a path are two routes).
            resp.headers["Allow"] = ", ".join(allowed_methods(app, request.scope["path"]))
            return resp
        return error_response(exc.status_code, str(exc.detail))

    @app.exception_handler(Exception)
    async def _bug(request: Request, exc: Exception) -> JSONResponse:
        LOG.exception("internal error on %s %s", request.method, request.url.path)
        return error_response(500, f"internal error: {exc!r}; see the daemon's log.")

    # -- host -------------------------------------------------------------------------
    @app.get("/1.0", dependencies=[VIEWER], response_model=m.HostInfo,
             summary="The host and the API")
    def host_info(request: Request) -> dict[str, Any]:
        c = d.ctx()
        who = identity_of(request)
        h = c.parts.host
        from fusuma.host.accel import probe_accel

        accel = probe_accel("auto")
        return {"api_version": "1.0", "api_extensions": API_EXTENSIONS,
                "api_status": "stable", "auth": "trusted",
                "auth_user_name": who.name if who else None,
                "auth_role": who.role.value if who else None,
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
                           "event_subscribers": d.hub.subscribers},
                "connections": {k: g.as_json() for k, g in d.gates.items()}}

    @app.get("/1.0/ps", dependencies=[VIEWER],
             response_model=m.PsInfo, summary="What `fusuma ps --json` shows")
    def ps() -> dict[str, Any]:
        return ps_data(d.ctx(), memory=d.sampler.memory)

    app.include_router(partitions.router(d))
    app.include_router(vms.router(d))
    app.include_router(snapshots.router(d))
    app.include_router(memshare.router(d))
    app.include_router(networks.router(d))
    app.include_router(images.router(d))
    app.include_router(backups.router(d))

    @app.get("/1.0/governor", dependencies=[VIEWER],
             summary="What `fusuma governor status --json` shows")
    def governor(partition: NameQuery = None,
                 limit: int = Query(20, ge=0, le=256)) -> dict[str, Any]:
        name = None if partition is None else valid_name("partition", partition)
        return status_data(d.ctx(), name, limit)

    @app.get("/1.0/images", dependencies=[VIEWER], summary="Guest images in the cache")
    def list_images() -> list[dict[str, Any]]:
        return images_data(d.ctx())

    @app.post("/1.0/images", dependencies=[ADMIN],
              status_code=202, responses=m.ACCEPTED, summary="Build a guest image (operation)")
    def build_image(body: m.ImageBuild) -> JSONResponse:
        def work(op: Operation) -> Any:
            from fusuma.images import build_image

            t0 = time.monotonic()
            img = build_image(d.paths.cache, kind=body.kind, force=body.force,
                              progress=lambda s: d.ops.set_progress(op, s))
            return {**image_json(img), "seconds": round(time.monotonic() - t0, 2)}
        return d.submit("image-build", f"build image {body.kind}",
                        {"images": [f"/1.0/images/{body.kind}"]}, work)

    # -- operations -------------------------------------------------------------------
    @app.get("/1.0/operations", dependencies=[VIEWER], response_model=list[m.OperationInfo])
    def list_operations(status: str | None = None) -> list[dict[str, Any]]:
        return [o.as_json() for o in d.ops.all() if status is None or o.status == status]

    @app.get("/1.0/operations/{op_id}", dependencies=[VIEWER], response_model=m.OperationInfo)
    def get_operation(op_id: str) -> dict[str, Any]:
        return d.ops.get(op_id).as_json()

    @app.get("/1.0/operations/{op_id}/wait", dependencies=[VIEWER],
             response_model=m.OperationWait,
             summary="Wait for an operation to end (at most ?timeout= seconds)",
             description=f"The operation once it has ended, or when `timeout` seconds "
                         f"have passed. The server waits at most {WAIT_MAX_S:g} s: "
                         f"`timeout=-1` (the default, Incus' \"forever\") and any "
                         f"longer timeout wait that long. The reply is the operation "
                         f"either way, with `timed_out: true` when it had not ended yet "
                         f"(ask again). A waiter holds no thread of the daemon, only "
                         f"its connection; it ends when its client goes away.")
    async def wait_operation(request: Request, op_id: str,
                             timeout: float = Query(-1, ge=-1, le=86400)) -> dict[str, Any]:
        op = d.ops.get(op_id)
        limit = WAIT_MAX_S if timeout < 0 else min(timeout, WAIT_MAX_S)
        ended = await unless_gone(request, d.ops.wait(op, limit))
        return {**op.as_json(), "timed_out": not ended}

    @app.delete("/1.0/operations/{op_id}", dependencies=[OPERATOR], response_model=m.OperationInfo,
                summary="Cancel an operation where it can stop safely")
    def cancel_operation(op_id: str) -> dict[str, Any]:
        return d.ops.cancel(op_id).as_json()

    @app.get("/openapi.json", dependencies=[VIEWER], include_in_schema=False)
    def openapi() -> JSONResponse:
        return JSONResponse(app.openapi())

    @app.get("/docs", dependencies=[VIEWER], include_in_schema=False)
    def docs() -> Response:
        """Swagger UI from the package (vendored swagger-ui-dist): no CDN."""
        from fastapi.openapi.docs import get_swagger_ui_html

        return get_swagger_ui_html(openapi_url="/openapi.json", title="fusuma API",
                                   swagger_js_url="/static/swagger-ui-bundle.js",
                                   swagger_css_url="/static/swagger-ui.css",
                                   swagger_favicon_url="/static/favicon.svg")

    # -- events and metrics -----------------------------------------------------------
    @app.get("/1.0/events", dependencies=[VIEWER],
             summary="Server-sent events: lifecycle, operation, governor",
             response_class=EventStream, responses=m.ERRORS_AS_JSON)
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

    @app.get("/metrics", dependencies=[METRICS],
             summary="Prometheus metrics", response_class=PrometheusText,
             responses=m.ERRORS_AS_JSON)
    def metrics() -> Response:
        from fusuma.api.metrics import render

        body, ctype = render(d.registry)
        return Response(body, media_type=ctype)

    check_roles(app)
    return app


class EventStream(StreamingResponse):
    """What ``GET /1.0/events`` answers, as the OpenAPI document names it."""

    media_type = "text/event-stream"


class PrometheusText(Response):
    """What ``GET /metrics`` answers: Prometheus' text format."""

    media_type = "text/plain"


def allowed_methods(app: FastAPI, path: str) -> list[str]:
    """The methods of every route of ``app`` whose path matches ``path``."""
    from fastapi.routing import iter_route_contexts
    from starlette.routing import compile_path

    out: set[str] = set()
    for ctx in iter_route_contexts(app.routes):
        if ctx.path and ctx.methods and compile_path(ctx.path)[0].match(path):
            out |= ctx.methods
    return sorted(out)


def wrap(app: FastAPI, body_timeout: float = BODY_TIMEOUT_S) -> ASGIApp:
    """The app with the request limits in front (what the servers run)."""
    return Limits(app, timeout=body_timeout)

