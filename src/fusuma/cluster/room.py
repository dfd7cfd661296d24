"""The room ledger: every writer of a VM's ``status.placement`` reserves the room first,
by a conditional update of one shared object, so two writers never give the same room
to two VMs.

Two writers choose room for VMs: the placement controller (new and lost VMs) and a
draining host's agent (the VMs it gives away, ``fusuma.cluster.drain``). Each counts
the VMs placed on each host (``placement.load``), but from its own informer's copy: a
placement the other wrote a moment ago may not be there yet, and both may then fill the
same last room. So before writing a placement, a writer adds a *hold* (the VM, its
destination, its footprint) to the Lease ``fusuma-system/fusuma-room`` with that Lease's
resourceVersion as a precondition (as leader election does); a writer whose read is
stale gets 409 Conflict, reads again (now counting the other's hold) and chooses again.
A hold counts until its VM's own placement shows it (then ``load`` counts the VM) or
``HOLD_S`` passed (a writer that died between its hold and its placement).

The Lease is used only as a versioned record (its ``holderIdentity`` is the last
writer, as the admission policy wants of every Lease a host writes); the holds are
JSON in its annotation ``fusuma.io/holds``. A host identity made before the ledger
existed may not write it (403): the writer then places as before, unreserved, and says
once that `fusuma cluster join HOST` gives it the right.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable, Iterable

from fusuma.cluster import SYSTEM_NAMESPACE, ApiError, ConflictApiError, NotFoundApiError
from fusuma.cluster.kube import LEASE, Kube, Obj
from fusuma.cluster.lease import ROOM_LEASE
from fusuma.cluster.placement import HostView, record
from fusuma.cluster.resources import VmView, deleting
from fusuma.frozen import frozen
from fusuma.state import VmRecord

LOG = logging.getLogger(__name__)
ANNOTATION = "fusuma.io/holds"
# Longer than any informer lags behind a write it could miss.
HOLD_S = 60.0
# Conditional writes tried before a writer gives up for this pass.
TRIES = 4


@frozen
class Hold:
    """Room on ``host``/``partition`` held for VM ``vm`` (namespace/name) since ``at``."""

    vm: str
    host: str
    partition: str
    at: float
    vcpus: int
    memory_mib: int
    overhead_mib: int
    shared_ram: bool

    @classmethod
    def of(cls, v: VmView, host: HostView, partition: str, at: float) -> Hold:
        rec = record(v, partition, host.accelerator)
        return cls(f"{v.namespace}/{v.name}", host.name, partition, at, rec.vcpus,
                   rec.memory_mib, int(rec.overhead_mib or 0), rec.shared_ram)

    def as_record(self) -> VmRecord:
        return VmRecord(name=self.vm.rsplit("/", 1)[-1], partition=self.partition,
                        vcpus=self.vcpus, memory_mib=self.memory_mib,
                        overhead_mib=self.overhead_mib, shared_ram=self.shared_ram)

    def to_json(self) -> Obj:
        return {"vm": self.vm, "host": self.host, "partition": self.partition,
                "at": self.at, "vcpus": self.vcpus, "memoryMiB": self.memory_mib,
                "overheadMiB": self.overhead_mib, "sharedRam": self.shared_ram}

    @classmethod
    def from_json(cls, d: Obj) -> Hold:
        return cls(str(d["vm"]), str(d["host"]), str(d["partition"]), float(d["at"]),
                   int(d["vcpus"]), int(d["memoryMiB"]), int(d["overheadMiB"]),
                   bool(d["sharedRam"]))


def count(hosts: dict[str, HostView], vms: Iterable[VmView], holds: Iterable[Hold]) -> None:
    """Add to ``hosts`` the room held for VMs whose placement does not show it yet
    (those that do were counted by ``placement.load``; a deleted VM holds nothing)."""
    by_key = {f"{v.namespace}/{v.name}": v for v in vms}
    for h in holds:
        view = hosts.get(h.host)
        v = by_key.get(h.vm)
        if view is None or (v is not None and (deleting(v.obj) or (
                v.want_host == h.host and v.want_partition == h.partition))):
            continue
        view.vms.append(h.as_record())


class Ledger:
    """The holds as last read, and the conditional write that adds some."""

    def __init__(self, kube: Kube, me: str, clock: Callable[[], float] = time.time) -> None:
        self.kube, self.me, self.clock = kube, me, clock
        self.obj: Obj | None = None
        self.holds: list[Hold] = []
        self.unguarded = False       # the identity may not write the ledger (403)

    def read(self) -> list[Hold]:
        """The holds still in force, read from the API server (not an informer)."""
        try:
            obj = self.kube.find(LEASE, ROOM_LEASE, SYSTEM_NAMESPACE)
            if obj is None:
                try:
                    obj = self.kube.create(LEASE, {"metadata": {
                        "name": ROOM_LEASE, "namespace": SYSTEM_NAMESPACE},
                        "spec": {"holderIdentity": self.me}}, SYSTEM_NAMESPACE)
                except ConflictApiError:
                    obj = self.kube.get(LEASE, ROOM_LEASE, SYSTEM_NAMESPACE)
        except ApiError as exc:
            self._forbidden(exc)
            self.obj, self.holds = None, []
            return []
        self.obj = obj
        raw = ((obj.get("metadata") or {}).get("annotations") or {}).get(ANNOTATION)
        now = self.clock()
        try:
            held = [Hold.from_json(d) for d in json.loads(raw or "[]")]
        except (ValueError, KeyError, TypeError):
            LOG.warning("the room ledger's holds are not readable; starting it afresh")
            held = []
        self.holds = [h for h in held if now - h.at < HOLD_S]
        return list(self.holds)

    def take(self, new: list[Hold]) -> bool:
        """Add ``new`` (replacing older holds of the same VMs) if nobody wrote the
        ledger since ``read``; False when somebody did (read again, choose again)."""
        if not new:
            return True
        if self.obj is None:
            return self.unguarded
        vms = {h.vm for h in new}
        holds = [h for h in self.holds if h.vm not in vms] + new
        obj = dict(self.obj)
        md = dict(obj.get("metadata") or {})
        md["annotations"] = {**(md.get("annotations") or {}),
                             ANNOTATION: json.dumps([h.to_json() for h in holds])}
        obj["metadata"] = md
        obj["spec"] = {**(obj.get("spec") or {}), "holderIdentity": self.me}
        try:
            self.obj = self.kube.replace(LEASE, obj)
        except ConflictApiError:
            return False
        except NotFoundApiError:
            return False
        except ApiError as exc:
            self._forbidden(exc)
            return self.unguarded
        self.holds = holds
        return True

    def _forbidden(self, exc: ApiError) -> None:
        if exc.code != 403:
            raise exc
        if not self.unguarded:
            LOG.warning("host %s may not write the room ledger (Lease %s/%s): its "
                        "identity predates it; placements go unreserved (two writers may "
                        "fill the same room) until `fusuma cluster join %s` is run again",
                        self.me, SYSTEM_NAMESPACE, ROOM_LEASE, self.me)
        self.unguarded = True

