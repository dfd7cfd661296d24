"""The NICs of VMs and the networks they sit on, as `ps`, `vm show`, the API and the
dashboard show them: the records (network, MAC, address) beside the kernel's view of
each tap, read in one ``ip`` call, so a tap that is gone (a stopped or killed VM) or
left over shows as it is."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from fusuma.ops.context import Ctx
from fusuma.state import Database, NicRecord, VmRecord


def nic_json(n: NicRecord, slot: int, taps: set[str]) -> dict[str, Any]:
    """One NIC: its index, network, MAC, address (a managed network's), the tap's name
    (derived from the VM's slot) and whether the kernel has that tap now."""
    from fusuma.network.ifnames import tap_name

    tap = tap_name(slot, n.index) if slot else None
    return {"index": n.index, "network": n.network, "mac": n.mac, "ip": n.ip,
            "tap": tap, "tap_present": tap is not None and tap in taps}


def present_taps() -> set[str]:
    """The taps of fusuma's name (``fzt-*``) this network namespace has."""
    from fusuma.network import ifnames, link

    return set(link.links(ifnames.TAP_PREFIX))


def nics_by_vm(db: Database, records: Sequence[VmRecord], taps: set[str] | None = None
               ) -> dict[str, list[dict[str, Any]]]:
    """Every VM's NICs (an empty list for one without), reading the kernel (unless
    ``taps`` gives its taps) only when a NIC exists."""
    nics = db.nics()
    out: dict[str, list[dict[str, Any]]] = {r.name: [] for r in records}
    if not nics:
        return out
    taps = present_taps() if taps is None else taps
    slots = {r.name: r.slot for r in records}
    for n in nics:
        if n.vm in out:
            out[n.vm].append(nic_json(n, slots[n.vm], taps))
    return out


def networks_data(c: Ctx, taps: set[str] | None = None) -> list[dict[str, Any]]:
    """Every network as `network list --json` shows it (bridge, subnet, state, its
    VMs), each with its NICs; [] without reading the kernel when there is none."""
    if not c.db.networks():
        return []
    taps = present_taps() if taps is None else taps
    slots = {r.name: r.slot for r in c.db.vms()}
    return [_with_nics(c, st.as_json(), slots, taps) for st in c.nets.statuses()]


def _with_nics(c: Ctx, d: dict[str, Any], slots: dict[str, int], taps: set[str]
               ) -> dict[str, Any]:
    d["nics"] = [{"vm": n.vm, **nic_json(n, slots.get(n.vm, 0), taps)}
                 for n in c.db.nics(network=str(d["name"]))]
    return d


def vm_nics(db: Database, vm: VmRecord) -> list[dict[str, Any]]:
    """One VM's NICs (`vm show`, ``GET /1.0/vms/NAME``)."""
    return nics_by_vm(db, [vm])[vm.name]


def network_data(c: Ctx, name: str) -> dict[str, Any]:
    """One network as ``networks_data`` shows it (`network show`, the API)."""
    d = c.nets.status(name).as_json()
    return _with_nics(c, d, {r.name: r.slot for r in c.db.vms()}, present_taps())
