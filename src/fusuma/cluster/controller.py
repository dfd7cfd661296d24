"""The placement controller: every agent runs it, one at a time acts (the holder of the
``fusuma-placement`` Lease).

Each pass: (1) a host whose heartbeat Lease expired is lost: its FusumaHost's Ready
turns False, its VMs are marked Lost, and the restartable ones without a pinned
``spec.host`` get a new placement (their new host starts them from their image: guest
RAM and disks local to the lost host are gone, and the status says so); (2) VMs without
a host or partition are placed by ``fusuma.cluster.placement`` and the choice written
to ``status.placement``; (3) a deleted VM whose host is lost loses its finalizer (no
agent is left to clean up after it).
"""

from __future__ import annotations

import logging
import time

from fusuma.cluster import FINALIZER, room
from fusuma.cluster.context import AgentContext
from fusuma.cluster.events import WARNING
from fusuma.cluster.kube import HOST, VM, Obj
from fusuma.cluster.lease import Observer, host_lease_name
from fusuma.cluster.placement import Choice, HostView, choose, load
from fusuma.cluster.resources import (
    LOST,
    PLACED,
    VmView,
    condition,
    deleting,
    now_iso,
    set_condition,
)

LOG = logging.getLogger(__name__)


class Placement:
    def __init__(self, agent: AgentContext) -> None:
        self.a = agent
        self.observer = Observer()
        self.first_seen: dict[str, float] = {}
        self.room = room.Ledger(agent.kube, agent.host)
        self.room_read = False

    def lost_hosts(self) -> set[str]:
        leases = {lease["metadata"]["name"]: lease
                  for lease in self.a.leases_informer.items()}
        lost: set[str] = set()
        now = time.monotonic()
        for h in self.a.hosts_informer.items():
            name = h["metadata"]["name"]
            lease = leases.get(host_lease_name(name))
            if lease is None:
                # A host without a Lease: lost once it stayed so for a lease duration.
                since = self.first_seen.setdefault(name, now)
                if now - since > self.a.cfg.lease_seconds:
                    lost.add(name)
                continue
            self.first_seen.pop(name, None)
            if self.observer.expired(lease):
                lost.add(name)
        return lost

    def _views(self, lost: set[str]) -> dict[str, HostView]:
        """Each host and the room taken on it: by the VMs placed there (as this
        process's informer has them, its own writes included) and by the holds of the
        room ledger as last read."""
        hosts = {h["metadata"]["name"]: HostView.from_obj(
            h, h["metadata"]["name"] not in lost and _ready(h))
            for h in self.a.hosts_informer.items()}
        vms = [VmView(o) for o in self.a.vms_informer.items() if not deleting(o)]
        load(hosts, vms)
        room.count(hosts, vms, self.room.holds)
        return hosts

    def run_once(self) -> None:
        lost = self.lost_hosts()
        for h in self.a.hosts_informer.items():
            if h["metadata"]["name"] in lost:
                self._host_lost(h)
        # Read when the pass first places a VM (most passes place none).
        self.room = room.Ledger(self.a.kube, self.a.host)
        self.room_read = False
        hosts = self._views(lost)
        vms = [VmView(o) for o in self.a.vms_informer.items()]
        for v in vms:
            if deleting(v.obj):
                if FINALIZER in (v.obj["metadata"].get("finalizers") or []) and (
                        v.host in lost or (v.host and v.host not in hosts)):
                    self.a.remove_finalizer(VM, v.obj)
                continue
            where = v.host or v.want_host
            if where in lost:
                self._vm_lost(v, where or "", hosts, vms, lost)
        vms = [VmView(o) for o in self.a.vms_informer.items()]
        for v in sorted(vms, key=lambda x: str(x.obj["metadata"].get("creationTimestamp"))):
            if deleting(v.obj) or (v.want_host and v.want_partition):
                continue
            if v.state == LOST:
                continue
            self._place(v, hosts, vms, lost)

    def _taken(self, vms: list[VmView], v: VmView) -> dict[str, set[str]]:
        out: dict[str, set[str]] = {}
        for o in vms:
            if o.name == v.name and o.namespace != v.namespace and o.want_host:
                out.setdefault(o.want_host, set()).add(o.name)
        return out

    def _place(self, v: VmView, hosts: dict[str, HostView], vms: list[VmView],
               lost: set[str], reason: str = "Placed") -> Choice | None:
        pinned = v.spec.get("host")
        if pinned and pinned not in hosts:
            msg = f"host {pinned!r} is not registered (kubectl get fusumahosts)."
            self._unschedulable(v, "UnknownHost", msg)
            return None
        for _ in range(room.TRIES):
            if not self.room_read:
                # Count the room others hold, then choose.
                self.room.read()
                self.room_read = True
                fresh = self._views(lost)
                hosts.clear()
                hosts.update(fresh)
            candidates = {k: h for k, h in hosts.items() if not pinned or k == pinned}
            got = choose(v, candidates, exclude=lost, taken_names=self._taken(vms, v))
            if isinstance(got, str):
                self._unschedulable(v, "Unschedulable", got)
                return None
            hold = room.Hold.of(v, hosts[got.host], got.partition, self.room.clock())
            if self.room.take([hold]):
                break
            # Another writer (a draining host) reserved room since the ledger was
            # read: count it, and choose again.
            self.room_read = False
        else:
            LOG.info("placement of %s/%s: the room ledger kept changing; next pass",
                     v.namespace, v.name)
            return None
        placement = {"host": got.host, "partition": got.partition, "at": now_iso(),
                     "reason": reason}
        conds = set_condition(list(v.status.get("conditions") or []), "Placed", True,
                              reason, f"on {got.host}/{got.partition}", v.generation)
        status: Obj = {"placement": placement, "conditions": conds, "state": PLACED,
                       "message": None}
        if reason == "Restarted":
            status.update({"host": None, "partition": None, "pid": None})
        new = self.a.kube.patch_status(VM, v.name, status, v.namespace)
        self.a.vms_informer.put(new)
        # Count it at once, so the next VM of this pass sees the room it takes.
        from fusuma.cluster.placement import record

        hosts[got.host].vms.append(record(VmView(new), got.partition,
                                          hosts[got.host].accelerator))
        self.a.events.emit(v.obj, reason, f"placed on host {got.host}, partition "
                           f"{got.partition}")
        return got

    def _unschedulable(self, v: VmView, reason: str, msg: str) -> None:
        old = condition(v.obj, "Placed")
        if old and old.get("status") == "False" and old.get("message") == msg:
            return
        conds = set_condition(list(v.status.get("conditions") or []), "Placed", False,
                              reason, msg, v.generation)
        conds = set_condition(conds, "Ready", False, reason, msg, v.generation)
        new = self.a.kube.patch_status(VM, v.name, {"conditions": conds, "state": "Pending",
                                                    "message": msg}, v.namespace)
        self.a.vms_informer.put(new)
        self.a.events.emit(v.obj, reason, msg, WARNING)

    def _host_lost(self, h: Obj) -> None:
        c = condition(h, "Ready")
        if c and c.get("status") == "False" and c.get("reason") == "LeaseExpired":
            return
        name = h["metadata"]["name"]
        msg = (f"host {name}'s heartbeat Lease expired (not renewed for "
               f"{self.a.cfg.lease_seconds} s): its VMs are marked Lost")
        conds = set_condition(list((h.get("status") or {}).get("conditions") or []),
                              "Ready", False, "LeaseExpired", msg)
        new = self.a.kube.patch_status(HOST, name, {"conditions": conds})
        self.a.hosts_informer.put(new)
        self.a.events.emit(h, "HostLost", msg, WARNING)

    def _vm_lost(self, v: VmView, host: str, hosts: dict[str, HostView],
                 vms: list[VmView], lost: set[str]) -> None:
        if v.state != LOST:
            local = "; disks local to it are gone" if v.spec.get("disks") else ""
            if v.restartable and not v.spec.get("host"):
                what = "it will be started on another host from its image (its RAM " \
                       f"is gone{local})"
            elif v.restartable:
                what = "it is pinned there by spec.host: clear spec.host or name another " \
                       "host to start it elsewhere from its image"
            else:
                what = "it is not restartable: set spec.restartable to start it " \
                       "elsewhere from its image, or bring the host back"
            msg = f"host {host}'s Lease expired: the VM is lost; {what}."
            conds = set_condition(list(v.status.get("conditions") or []), "Ready", False,
                                  "HostLost", msg, v.generation)
            new = self.a.kube.patch_status(VM, v.name, {
                "state": LOST, "lostAt": now_iso(), "lostFrom": host, "pid": None,
                "message": msg, "conditions": conds}, v.namespace)
            self.a.vms_informer.put(new)
            self.a.events.emit(v.obj, "HostLost", msg, WARNING)
            v = VmView(new)
        if v.restartable and not v.spec.get("host"):
            self._place(v, hosts, vms, lost, reason="Restarted")


def _ready(h: Obj) -> bool:
    c = condition(h, "Ready")
    return c is not None and c.get("status") == "True"
