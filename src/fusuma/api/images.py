"""The API's imported images: ``/1.0/images/{name}``, ``/1.0/images/import``. An
import names a host file that root then reads, so it is admin's, and only files inside
storage directories root declared may be named (as for disks); deleting one is admin's
too. Reading is a viewer's. (Listing and building fusuma's own images: fusuma.api.app.)"""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter
from fastapi.responses import JSONResponse

from fusuma.api import models as m
from fusuma.api.daemon import Daemon
from fusuma.api.http import NamePath, valid_name
from fusuma.api.operations import Operation
from fusuma.api.roles import ADMIN, VIEWER, RoleRoute


def router(d: Daemon) -> APIRouter:
    r = APIRouter(route_class=RoleRoute)

    @r.get("/1.0/images/{name}", dependencies=[VIEWER],
           summary="An imported image: format, sizes, SHA-256, its VMs (or a built one)")
    def get_image(name: NamePath) -> dict[str, Any]:
        from fusuma.images import KINDS, find_image
        from fusuma.views.images import image_json, imported_data

        c = d.ctx()
        if valid_name("image", name) in KINDS:
            return image_json(find_image(c.paths.cache, kind=name))
        return imported_data(c, name)

    @r.post("/1.0/images/import", dependencies=[ADMIN], status_code=202,
            responses=m.ACCEPTED,
            summary="Import a disk image from a storage directory (operation)")
    def import_image(body: m.ImageImport) -> JSONResponse:
        from fusuma.host import storage
        from fusuma.images import store

        c = d.ctx()
        store.check_new_name(c.db, body.name)
        storage.locate(c.paths, c.db, body.path)      # refused now, not in the operation

        def work(op: Operation) -> Any:
            from fusuma.views.images import imported_data

            c = d.ctx()
            store.import_image(c.paths, c.db, body.name, body.path, anywhere=False,
                               fmt=body.format)
            return imported_data(c, body.name)
        return d.submit("image-import", f"import image {body.name}",
                        {"images": [f"/1.0/images/{body.name}"]}, work)

    @r.delete("/1.0/images/{name}", dependencies=[ADMIN], response_model=m.Deleted,
              summary="Delete an imported image no VM's disk is on")
    def delete_image(name: NamePath) -> dict[str, Any]:
        from fusuma.images import store

        store.delete_image(d.ctx().db, valid_name("image", name))
        return {"deleted": f"/1.0/images/{name}"}

    return r
