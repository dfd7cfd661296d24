"""FusumaNetwork on this host: the cluster's one definition of a network (subnet, VXLAN
id) made here as a managed network (``fusuma network create``) whose bridge is a part
of the segment the other hosts' bridges make (fusuma.network.span: a VXLAN port
flooding to the other registered hosts' addresses). Each agent keeps its own entry of
``status.hosts``; the peers follow the FusumaHosts (a host that registers is added at
the next pass, one that is gone removed). Its MTU is ``spec.mtu``, or the most this
uplink of the registered hosts carries after the VXLAN's headers (fusuma.network.span.
span_mtu: 1450 on 1500-byte uplinks), the same on every host; a host whose uplink cannot
carry it reports why.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

from fusuma.cluster.context import AgentContext
from fusuma.cluster.kube import NETWORK, Obj
from fusuma.cluster.reconcile import PerHostReconciler

if TYPE_CHECKING:
    from fusuma.ops.context import Ctx

LOG = logging.getLogger(__name__)


def network_mtu(a: AgentContext, spec: dict[str, Any]) -> int:
    """The network's MTU on this host: ``spec.mtu`` if it fits this host's uplink, else
    one sentence; unset, the most the smallest uplink of the registered hosts carries
    (each agent reports its own as ``status.uplinkMtu``): the segment's frames cross
    every host's uplink, so every host must give its bridge the same MTU."""
    from fusuma.network import span

    want = spec.get("mtu")
    dev, mtu = span.uplink(a.address)
    if want is not None:
        return span.span_mtu(dev, mtu, int(want))
    return span.span_mtu(*smallest_uplink(a, dev, mtu))


def smallest_uplink(a: AgentContext, dev: str, mtu: int) -> tuple[str, int]:
    """The smallest uplink among this host's (``dev``, MTU ``mtu``) and the other
    registered hosts' reported ones, named for a sentence."""
    least = (dev, mtu)
    for h in a.hosts_informer.items():
        theirs = (h.get("status") or {}).get("uplinkMtu")
        name = (h.get("metadata") or {}).get("name")
        if isinstance(theirs, int) and not isinstance(theirs, bool) and 0 < theirs < least[1] \
                and name != a.host:
            least = (f"the uplink of host {name}", theirs)
    return least


def peers(a: AgentContext) -> list[str]:
    """The registered hosts' addresses (this one's included)."""
    out = {str((h.get("status") or {}).get("address") or "")
           for h in a.hosts_informer.items()}
    return sorted(x for x in out if x)


class NetworkReconciler(PerHostReconciler):
    kind = NETWORK
    section = "networks"
    what = "network"
    ready = ("Spanned", "up on every host")
    not_ready = ("NotSpanned", "not up on every host yet")

    def exists(self, c: Ctx, name: str) -> bool:
        return c.db.find_network(name) is not None

    def make(self, c: Ctx, obj: Obj) -> None:
        from fusuma.network.manager import NetworkManager

        spec = obj.get("spec") or {}
        name = obj["metadata"]["name"]
        NetworkManager(c.paths, c.db).create(name, "managed", subnet=str(spec.get("subnet")),
                                             nat=bool(spec.get("nat", True)),
                                             mtu=network_mtu(self.a, spec))
        self.a.events.emit(obj, "Created", f"network {name} made on host {self.a.host}")

    def keep(self, c: Ctx, obj: Obj) -> dict[str, Any]:
        from fusuma.network import ifnames, span
        from fusuma.network.manager import NetworkManager

        name = obj["metadata"]["name"]
        spec = obj.get("spec") or {}
        mgr = NetworkManager(c.paths, c.db)
        mtu = network_mtu(self.a, spec)
        changed = mgr.set_mtu(name, mtu)
        if mgr.status(name).state != "up":
            mgr.ensure(name)
        done = span.attach(name, c.db.network(name).bridge,
                           ifnames.span_table_name(c.paths.cgroup_prefix, name),
                           int(spec.get("vni") or 0), self.a.address, peers(self.a), mtu)
        if changed:
            done.insert(0, f"MTU {mtu}")
        if done:
            LOG.info("network %s on host %s: %s", name, self.a.host, ", ".join(done))
        return {"ready": True}

    def remove(self, c: Ctx, name: str) -> None:
        from fusuma.network.manager import NetworkManager

        NetworkManager(c.paths, c.db).delete(name)
