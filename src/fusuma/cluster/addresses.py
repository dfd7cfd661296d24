"""Addresses on the cluster's networks, allocated cluster-wide.

On one host, ``vm create --nic NET`` takes the first address no NIC of the host has
(fusuma.network.addr.allocate_ip). Across hosts that is not enough: two agents defining
VMs on one FusumaNetwork at the same moment would each pick the same first free address.

**The lock is the object's name.** Each address a NIC holds is a FusumaAddress named
``NETWORK.A.B.C.D`` (cluster-scoped), as Kubernetes holds its Service IPs as IPAddress
objects named by the address. Creating it is taking the address: the API server lets a
name exist once, so of two agents creating the same name one gets 409 (AlreadyExists),
reads the holders again and tries the next free address. Why this and not the others:

- no single writer has to be up (a placement controller under its Lease would make
  every VM's creation wait for the leader, and a VM pinned by ``spec.host`` is never
  placed at all), and each decision is still made by exactly one writer: the agent of
  the host that defines the VM;
- no shared object is rewritten by every allocation (a compare-and-swap on the
  FusumaNetwork's status would retry under contention and grow with the subnet), and
  an allocation is never lost to a stale read: a create cannot overwrite;
- the admission policy can judge each object alone: it names its holder host, so a host
  may create addresses only in its own name and change or delete only those it holds
  (``policy.address_policy``) — it cannot take another host's VM's address (the name
  exists) nor free it (not its to delete).

The FusumaVM's ``status.nics`` shows what its NICs hold. The holder host follows the VM:
the agent that holds an address whose VM now runs on another host hands it on (after a
live move, a stopped VM's handover, a restart after its host was lost). It frees the
address (deletes the object) once the FusumaVM is gone: at the VM's deletion, or at
its next sweep (:func:`sweep`) for one deleted while it was away. A host that never comes
back keeps its addresses until an administrator deletes them
(``kubectl delete fusumaaddresses -l fusuma.io/host=NAME``).
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping
from typing import Any, Protocol

from fusuma.cluster import ConflictApiError, NotFoundApiError
from fusuma.cluster.kube import ADDRESS, NETWORK, VM, Kind, Obj
from fusuma.cluster.resources import VmView
from fusuma.errors import ConflictError, SpecError
from fusuma.frozen import frozen
from fusuma.network import addr

LOG = logging.getLogger(__name__)
NETWORK_LABEL = "fusuma.io/network"
HOST_LABEL = "fusuma.io/host"
VM_UID_LABEL = "fusuma.io/vm-uid"
# Each conflict teaches the allocator one more taken address; past this many in one
# allocation the pool is being raced for faster than it can learn.
MAX_TRIES = 32


class AddressApi(Protocol):
    """What the allocator needs of the API server (fusuma.cluster.kube.Kube)."""

    def list(self, kind: Kind, namespace: str | None = None,
             label_selector: str | None = None) -> tuple[list[Obj], str]: ...

    def find(self, kind: Kind, name: str, namespace: str | None = None) -> Obj | None: ...

    def create(self, kind: Kind, obj: Obj, namespace: str | None = None) -> Obj: ...

    def replace(self, kind: Kind, obj: Obj, sub: str | None = None) -> Obj: ...

    def delete(self, kind: Kind, name: str, namespace: str | None = None) -> None: ...


def object_name(network: str, ip: str) -> str:
    """The FusumaAddress that holds ``ip`` on ``network``: network names have no dots,
    so the name is unique per (network, address)."""
    return f"{network}.{ip}"


@frozen
class Held:
    """A FusumaAddress as the allocator reads it."""

    network: str
    ip: str
    namespace: str
    vm: str
    uid: str
    nic: int
    host: str
    static: bool

    @classmethod
    def of(cls, obj: Obj) -> Held:
        s = obj.get("spec") or {}
        vm = s.get("vm") or {}
        return cls(str(s.get("network") or ""), str(s.get("address") or ""),
                   str(vm.get("namespace") or ""), str(vm.get("name") or ""),
                   str(vm.get("uid") or ""), int(s.get("nic") or 0),
                   str(s.get("host") or ""), bool(s.get("static")))

    @property
    def name(self) -> str:
        return object_name(self.network, self.ip)

    @property
    def holder(self) -> str:
        return f"FusumaVM {self.namespace}/{self.vm}"


def address_object(network: str, ip: str, v: VmView, index: int, host: str,
                   static: bool) -> Obj:
    return {"metadata": {"name": object_name(network, ip),
                         "labels": {NETWORK_LABEL: network, HOST_LABEL: host,
                                    VM_UID_LABEL: v.uid}},
            "spec": {"network": network, "address": ip,
                     "vm": {"namespace": v.namespace, "name": v.name, "uid": v.uid},
                     "nic": index, "static": static, "host": host}}


def _held(kube: AddressApi, network: str) -> list[Held]:
    items, _ = kube.list(ADDRESS, label_selector=f"{NETWORK_LABEL}={network}")
    return [Held.of(o) for o in items]


def _subnet(kube: AddressApi, network: str) -> addr.Subnet | None:
    """The FusumaNetwork's subnet; None when ``network`` is no FusumaNetwork (the
    host's own network, which allocates by itself)."""
    obj = kube.find(NETWORK, network)
    if obj is None:
        return None
    return addr.parse_subnet(str((obj.get("spec") or {}).get("subnet") or ""))


def _check_static(sub: addr.Subnet, network: str, index: int, ip: str) -> str:
    try:
        return addr.check_ip(sub, ip, {})
    except SpecError as exc:
        raise SpecError(f"spec.nics[{index}].ip: {exc}".replace(
            "leave ip= out", "leave it out to have one allocated").replace(
            "the network's subnet", f"network {network}'s subnet")) from exc


def _take(kube: AddressApi, v: VmView, network: str, index: int, ip: str, host: str,
          static: bool) -> Held | None:
    """Create the address's object: None when taken now, else its holder."""
    for _ in range(3):
        try:
            kube.create(ADDRESS, address_object(network, ip, v, index, host, static))
            return None
        except ConflictApiError:
            obj = kube.find(ADDRESS, object_name(network, ip))
            if obj is not None:
                return Held.of(obj)
            # Freed between the create and the read: try again.
    raise ConflictError(f"address {ip} of network {network} was taken and freed three "
                        "times while this host tried to take it; it is tried again at "
                        "the next pass.")


def _mine(h: Held, v: VmView, index: int) -> bool:
    return h.uid == v.uid and h.nic == index


def allocate(kube: AddressApi, host: str, v: VmView,
             local_taken: Mapping[str, Iterable[str]] | None = None) -> dict[int, str]:
    """The address of each of ``v``'s NICs on a FusumaNetwork (NIC index -> address),
    held for it cluster-wide before host ``host`` defines it. Idempotent: a NIC that
    holds an address already (an earlier pass, another host before a move or a host
    loss) keeps it. ``local_taken``: addresses this host's own records use per network
    (VMs the CLI made), never handed out. One sentence (SpecError, ConflictError) for a
    static address outside the subnet or held by another VM, or a full subnet."""
    out: dict[int, str] = {}
    for index, nic in enumerate(v.spec.get("nics") or []):
        network = str(nic.get("network") or "")
        sub = _subnet(kube, network)
        if sub is None:
            continue
        static = str(nic.get("ip") or "")
        if static:
            ip = _check_static(sub, network, index, static)
            other = _take(kube, v, network, index, ip, host, True)
            if other is not None and not _mine(other, v, index):
                raise ConflictError(
                    f"spec.nics[{index}].ip: address {ip} of network {network} is held "
                    f"by {other.holder} (its NIC {other.nic}); pick another or leave it "
                    "out to have one allocated.")
            out[index] = ip
            continue
        held = _held(kube, network)
        mine = [h for h in held if _mine(h, v, index)]
        if mine:
            out[index] = mine[0].ip
            continue
        out[index] = _allocate_one(kube, sub, v, network, index, host, held,
                                   set((local_taken or {}).get(network, ())))
    return out


def _allocate_one(kube: AddressApi, sub: addr.Subnet, v: VmView, network: str,
                  index: int, host: str, held: list[Held], local: set[str]) -> str:
    taken = {h.ip for h in held} | local
    for _ in range(MAX_TRIES):
        ip = addr.allocate_ip(sub, taken)
        other = _take(kube, v, network, index, ip, host, False)
        if other is None or _mine(other, v, index):
            return ip
        # Another agent took it first (409): learn who holds what now, try the next.
        LOG.info("address %s of network %s was taken meanwhile by %s; trying another",
                 ip, network, other.holder)
        taken |= {h.ip for h in _held(kube, network)} | {ip}
    raise ConflictError(f"no address of network {network} could be taken for "
                        f"{v.namespace}/{v.name} in {MAX_TRIES} tries (other hosts are "
                        "taking them as fast); it is tried again at the next pass.")


def status_nics(allocated: Mapping[int, str], v: VmView) -> list[dict[str, Any]]:
    """``status.nics`` before the VM is defined (no MAC yet)."""
    nets = [str(n.get("network") or "") for n in v.spec.get("nics") or []]
    return [{"index": i, "network": nets[i], "ip": ip} for i, ip in sorted(allocated.items())]


def free(kube: AddressApi, host: str, uid: str) -> list[str]:
    """Delete the addresses host ``host`` holds for the VM ``uid`` (it was deleted);
    the names freed. Those another host holds are that host's to free (:func:`sweep`)."""
    items, _ = kube.list(ADDRESS, label_selector=f"{VM_UID_LABEL}={uid},{HOST_LABEL}={host}")
    out = []
    for o in items:
        h = Held.of(o)
        if h.uid == uid and h.host == host:
            kube.delete(ADDRESS, h.name)
            out.append(h.name)
    return out


def sweep(kube: AddressApi, host: str, vm_of: Any, namespace: str | None = None) -> list[str]:
    """The level-based half of holding: for each address host ``host`` holds, free it
    if its FusumaVM is gone (``vm_of(namespace, name)``: the informer's object, or None;
    checked again against the API server before freeing), hand it on to the host its VM
    is defined on now if that is another and no move is under way. ``namespace``: the
    only namespace this agent may judge (None: all). What was done, one line each."""
    items, _ = kube.list(ADDRESS, label_selector=f"{HOST_LABEL}={host}")
    done = []
    for o in items:
        h = Held.of(o)
        if h.host != host or (namespace is not None and h.namespace != namespace):
            continue
        vm = vm_of(h.namespace, h.vm)
        if vm is None or VmView(vm).uid != h.uid:
            vm = kube.find(VM, h.vm, h.namespace)
        if vm is None or VmView(vm).uid != h.uid:
            kube.delete(ADDRESS, h.name)
            done.append(f"freed {h.name} ({h.holder} is gone)")
            continue
        view = VmView(vm)
        if view.host and view.host != host and view.move is None \
                and _hand(kube, o, view.host):
            done.append(f"handed {h.name} to host {view.host}")
    return done


def _hand(kube: AddressApi, o: Obj, to: str) -> bool:
    new = dict(o)
    new["metadata"] = {**o["metadata"], "labels": {**(o["metadata"].get("labels") or {}),
                                                   HOST_LABEL: to}}
    new["spec"] = {**o["spec"], "host": to}
    try:
        kube.replace(ADDRESS, new)     # resourceVersion precondition: 409 if changed
    except (ConflictApiError, NotFoundApiError):
        return False
    return True


def hand_on(kube: AddressApi, host: str, uid: str, to: str) -> list[str]:
    """Hand the addresses host ``host`` holds for VM ``uid`` to host ``to``, where the
    VM went (a move's source, once the guest runs there); the names handed on. What
    fails here is done by the next :func:`sweep`."""
    items, _ = kube.list(ADDRESS, label_selector=f"{VM_UID_LABEL}={uid},{HOST_LABEL}={host}")
    return [Held.of(o).name for o in items
            if Held.of(o).host == host and Held.of(o).uid == uid and _hand(kube, o, to)]

