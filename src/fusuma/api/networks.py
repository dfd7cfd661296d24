"""The API's networks: ``/1.0/networks``. A network's bridge, host address, NAT and
nftables tables are the host's: creating, restarting and deleting one is admin's;
reading is a viewer's. Attaching a VM's NIC to an existing network is part of defining
the VM (``POST /1.0/vms`` with ``nics``), an operator's."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter

from fusuma.api import models as m
from fusuma.api.daemon import Daemon
from fusuma.api.http import NamePath, valid_name
from fusuma.api.roles import ADMIN, VIEWER, RoleRoute
from fusuma.views.networks import network_data, networks_data


def router(d: Daemon) -> APIRouter:
    r = APIRouter(route_class=RoleRoute)

    @r.get("/1.0/networks", dependencies=[VIEWER], response_model=list[m.NetworkInfo],
           summary="Networks: type, bridge, subnet, options, state and their VMs")
    def list_networks() -> list[dict[str, Any]]:
        return networks_data(d.ctx())

    @r.get("/1.0/networks/{name}", dependencies=[VIEWER], response_model=m.NetworkInfo)
    def get_network(name: NamePath) -> dict[str, Any]:
        return network_data(d.ctx(), valid_name("network", name))

    @r.post("/1.0/networks", dependencies=[ADMIN], status_code=201,
            response_model=m.NetworkInfo,
            summary="Create a network (a managed one's bridge, tables and dnsmasq)")
    def create_network(body: m.NetworkCreate) -> dict[str, Any]:
        c = d.ctx()
        c.nets.create(body.name, body.type, subnet=body.subnet, parent=body.parent,
                      nat=body.nat, isolated=body.isolated, filtering=body.filtering,
                      mtu=body.mtu)
        return c.nets.status(body.name).as_json()

    @r.post("/1.0/networks/{name}/restart", dependencies=[ADMIN],
            response_model=m.NetworkInfo,
            summary="Bring a managed network back: bridge, tables, a new dnsmasq")
    def restart_network(name: NamePath) -> dict[str, Any]:
        c = d.ctx()
        c.nets.restart(valid_name("network", name))
        return c.nets.status(name).as_json()

    @r.delete("/1.0/networks/{name}", dependencies=[ADMIN], response_model=m.Deleted,
              summary="Delete a network no VM uses")
    def delete_network(name: NamePath) -> dict[str, Any]:
        d.ctx().nets.delete(valid_name("network", name))
        return {"deleted": f"/1.0/networks/{name}"}

    return r
