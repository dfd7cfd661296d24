"""Placement across hosts: which host and partition take a VM, by the same capacity
rules one host uses (``fusuma.capacity``: a partition's budget holds its supervisor and
each VM's share; the host holds the partitions' budgets and the guest RAM).

Pure functions over what the cluster says: each FusumaHost's status (its partitions and
what fusuma may give there) and every FusumaVM assigned to a host (running or not yet
made), so two VMs placed a second apart never both count on the same room.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

from fusuma import capacity
from fusuma.cluster.resources import Obj, VmView
from fusuma.frozen import frozen
from fusuma.qemu.cmdline import overhead_mib
from fusuma.state import VmRecord


@frozen
class PartView:
    name: str
    cpus: int
    memory_mib: int


@dataclass
class HostView:
    name: str
    available_mib: int
    accelerator: str
    partitions: list[PartView]
    schedulable: bool = True
    vms: list[VmRecord] = field(default_factory=list)
    # Its partitions being drained (spec.drainPartitions): left out of ``partitions``.
    draining: tuple[str, ...] = ()

    @classmethod
    def from_obj(cls, obj: Obj, ready: bool) -> HostView:
        st = obj.get("status") or {}
        parts = [PartView(str(p.get("name")), len(p.get("cpus") or []),
                          int(p.get("memoryMiB") or 0))
                 for p in st.get("partitions") or []]
        accel = str(st.get("accelerator") or "tcg").split()[0]
        spec = obj.get("spec") or {}
        # A host being drained (fusuma.cluster.drain) takes no new VM either, nor do
        # the partitions of it being emptied.
        draining = tuple(sorted(str(p) for p in spec.get("drainPartitions") or []))
        return cls(str(obj["metadata"]["name"]), int(st.get("availableMiB") or 0),
                   accel if accel in ("kvm", "tcg") else "tcg",
                   [p for p in parts if p.name not in draining],
                   ready and not spec.get("unschedulable") and not spec.get("drain"),
                   draining=draining)


def record(vm: VmView, partition: str, accelerator: str) -> VmRecord:
    """The record ``vm`` would get on a host with ``accelerator``: its footprint there."""
    from fusuma.images import KINDS

    accel = vm.accel if vm.accel in ("kvm", "tcg") else accelerator
    # Booted by firmware unless its image is a kind fusuma builds (fusuma.vm.boot).
    firmware = str(vm.spec.get("image") or "minimal") not in KINDS
    return VmRecord(name=vm.name, partition=partition, vcpus=vm.vcpus,
                    memory_mib=vm.memory_mib, accel=vm.accel,
                    overhead_mib=overhead_mib(accel, firmware), shared_ram=vm.shared_ram)


def load(hosts: dict[str, HostView], vms: Iterable[VmView]) -> None:
    """Count each VM on the host it is (or is to be) on."""
    for v in vms:
        h = hosts.get(v.want_host or "")
        part = v.want_partition
        if h is None or part is None:
            continue
        h.vms.append(record(v, part, h.accelerator))


@frozen
class Choice:
    host: str
    partition: str
    free_mib: int


def fits(h: HostView, p: PartView, rec: VmRecord) -> str | None:
    """Why ``rec`` does not fit partition ``p`` of ``h`` (None: it fits)."""
    if rec.vcpus > p.cpus:
        return f"{h.name}/{p.name}: {p.cpus} core(s) < {rec.vcpus} vCPUs"
    in_part = [v for v in h.vms if v.partition == p.name and v.name != rec.name]
    need = capacity.vms_need([*in_part, rec])
    if need.total > p.memory_mib:
        return f"{h.name}/{p.name}: {need.against(p.memory_mib)}"
    others = [v for v in h.vms if v.name != rec.name]
    hneed = capacity.host_need(((q.name, q.memory_mib) for q in h.partitions),
                               [*others, rec])
    if hneed.total > h.available_mib:
        return f"{h.name}: {hneed.total} > {h.available_mib} MiB for partitions and guest RAM"
    return None


def choose(vm: VmView, hosts: dict[str, HostView], exclude: Iterable[str] = (),
           taken_names: dict[str, set[str]] | None = None,
           avoid: Mapping[str, str] | None = None) -> Choice | str:
    """The host and partition for ``vm`` (the most free memory left after it, so VMs
    spread), or one sentence saying why none fits. ``exclude``: lost hosts; ``avoid``:
    hosts not to use for now, each with the reason."""
    excluded = set(exclude)
    reasons: list[str] = []
    best: Choice | None = None
    for h in sorted(hosts.values(), key=lambda x: x.name):
        if h.name in excluded:
            reasons.append(f"{h.name}: lost")
            continue
        if avoid and h.name in avoid:
            reasons.append(f"{h.name}: {avoid[h.name]}")
            continue
        if not h.schedulable:
            reasons.append(f"{h.name}: not ready, or unschedulable (cordoned or draining)")
            continue
        if taken_names and vm.name in taken_names.get(h.name, set()):
            reasons.append(f"{h.name}: a VM named {vm.name!r} is already there")
            continue
        parts = [p for p in h.partitions
                 if vm.spec.get("partition") in (None, "", p.name)]
        if not parts:
            want = vm.spec.get("partition")
            reasons.append(f"{h.name}: partition {want!r} is being drained" if want
                           and want in h.draining else f"{h.name}: no partition {want!r}"
                           if want else f"{h.name}: no partitions")
            continue
        for p in parts:
            rec = record(vm, p.name, h.accelerator)
            why = fits(h, p, rec)
            if why:
                reasons.append(why)
                continue
            others = [v for v in h.vms if v.name != rec.name]
            used = capacity.host_need(((q.name, q.memory_mib) for q in h.partitions),
                                      [*others, rec]).total
            in_part = capacity.vms_need([*(v for v in others if v.partition == p.name),
                                         rec]).total
            free = min(h.available_mib - used, p.memory_mib - in_part)
            if best is None or free > best.free_mib:
                best = Choice(h.name, p.name, free)
    if best is not None:
        return best
    if not hosts:
        return "no FusumaHost is registered; start `fusuma agent` on a host."
    return (f"no host has room for {vm.name!r} ({vm.vcpus} vCPU, {vm.memory_mib} MiB): "
            + "; ".join(reasons[:6]) + ("; ..." if len(reasons) > 6 else "")
            + "; add a host or partition, or ask for less.")
