"""The API's shared memory: segments, templates, and the share report and analysis."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse

from fusuma.api import models as m
from fusuma.api.daemon import Daemon
from fusuma.api.http import NamePath, NameQuery, valid_name
from fusuma.api.operations import Operation
from fusuma.api.roles import ADMIN, OPERATOR, VIEWER, RoleRoute, require
from fusuma.errors import SpecError
from fusuma.ops import segments
from fusuma.ops.segments import segment_manager
from fusuma.ops.templates import template_manager
from fusuma.state.roles import Role
from fusuma.views.segments import segments_data
from fusuma.views.share import analyze_data, report_data


def router(d: Daemon) -> APIRouter:
    r = APIRouter(route_class=RoleRoute)

    # -- segments ---------------------------------------------------------------------
    @r.get("/1.0/segments", dependencies=[VIEWER], response_model=list[m.SegmentInfo])
    def list_segments() -> list[dict[str, Any]]:
        return segments_data(d.ctx())

    @r.get("/1.0/segments/{name}", dependencies=[VIEWER], response_model=m.SegmentInfo)
    def get_segment(name: NamePath) -> dict[str, Any]:
        c = d.ctx()
        c.db.segment(valid_name("segment", name))
        return next(s for s in segments_data(c) if s["name"] == name)

    @r.post("/1.0/segments", dependencies=[ADMIN], status_code=202, responses=m.ACCEPTED,
            summary="Build a segment from a directory or an image's root (operation)")
    def create_segment(body: m.SegmentCreate) -> JSONResponse:
        c = d.ctx()
        from_dir = Path(body.from_dir) if body.from_dir is not None else None
        segments.check_source(c, from_dir)        # a host directory: root's CLI only
        if (body.from_dir is None) == (body.from_image is None):
            raise SpecError("give either from_dir or from_image (one of them).")
        if c.db.find_segment(body.name) is not None:
            from fusuma.errors import ConflictError

            raise ConflictError(f"a segment named {body.name!r} already exists.")
        if body.from_image is not None:       # refused now, not in a failed operation
            from fusuma.images import find_image

            find_image(c.paths.cache, kind=body.from_image)

        def work(op: Operation) -> Any:
            c = d.ctx()
            segments.create(c, body.name, from_dir=from_dir, from_image=body.from_image,
                            progress=lambda s: d.ops.set_progress(op, s))
            return next(s for s in segments_data(c) if s["name"] == body.name)
        return d.submit("segment-create", f"create segment {body.name}",
                        {"segments": [f"/1.0/segments/{body.name}"]}, work)

    @r.delete("/1.0/segments/{name}", dependencies=[ADMIN], response_model=m.Deleted)
    def delete_segment(name: NamePath) -> dict[str, Any]:
        segment_manager(d.ctx()).delete(valid_name("segment", name))
        return {"deleted": f"/1.0/segments/{name}"}

    # -- templates ---------------------------------------------------------------------
    @r.get("/1.0/templates", dependencies=[VIEWER],
           summary="What `fusuma template list --json` shows")
    def list_templates() -> list[dict[str, Any]]:
        mgr = template_manager(d.ctx())
        return [mgr.as_json(t) for t in mgr.all()]

    @r.get("/1.0/templates/{name}", dependencies=[VIEWER],
           summary="What `fusuma template show --json` shows")
    def get_template(name: NamePath) -> dict[str, Any]:
        mgr = template_manager(d.ctx())
        return dict(mgr.as_json(d.ctx().db.template(valid_name("template", name))))

    @r.post("/1.0/templates", dependencies=[OPERATOR], status_code=202, responses=m.ACCEPTED,
            summary="Stop a running VM into a template (operation)")
    def create_template(body: m.TemplateCreate) -> JSONResponse:
        # Refused now (404, 409), not in a failed operation later.
        template_manager(d.ctx()).check(body.name, body.from_vm)

        def work(op: Operation) -> Any:
            mgr = template_manager(d.ctx())
            return mgr.as_json(mgr.create(body.name, body.from_vm))
        return d.submit("template-create", f"template {body.name} from VM {body.from_vm}",
                        {"templates": [f"/1.0/templates/{body.name}"],
                         "vms": [f"/1.0/vms/{body.from_vm}"]}, work)

    @r.delete("/1.0/templates/{name}", dependencies=[OPERATOR], response_model=m.Deleted)
    def delete_template(name: NamePath) -> dict[str, Any]:
        template_manager(d.ctx()).delete(valid_name("template", name))
        return {"deleted": f"/1.0/templates/{name}"}

    @r.get("/1.0/share/report", dependencies=[VIEWER],
           summary="What `fusuma share report --json` shows")
    def share_report() -> dict[str, Any]:
        return report_data(d.ctx())

    @r.get("/1.0/share/analyze", dependencies=[VIEWER],
           summary="What `fusuma share analyze --json` shows, for ?vm= or ?pid=")
    def share_analyze(request: Request, vm: NameQuery = None,
                      pid: int | None = None) -> dict[str, Any]:
        if pid is not None:      # any process of the host, not one of fusuma's VMs
            require(request, Role.ADMIN, "analyzing a host process by pid (not ?vm=)")
        return analyze_data(d.ctx(), pid, valid_name("VM", vm) if vm is not None else None)

    return r
