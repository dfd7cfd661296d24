"""`fusuma up` and `fusuma down`: make the host match a spec, or undo it.

``up`` plans first (every check runs before anything changes), then applies the plan
with a Reverter, so a spec that fails half-way leaves the host as it was. Applying the
same spec twice finds nothing to do.
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from fusuma.errors import ConflictError, FusumaError, SpecError
from fusuma.host import storage
from fusuma.partition.manager import PartitionManager
from fusuma.state import Database
from fusuma.state.lock import host_lock
from fusuma.undo import Reverter
from fusuma.vm import VmManager, VmView

if TYPE_CHECKING:   # fusuma.spec needs pydantic: not imported by `fusuma down`
    from fusuma.spec import DiskSpec, HostSpec, NetworkSpec, PartitionSpec, VmSpec

LOG = logging.getLogger(__name__)


@dataclass
class Plan:
    # Storage directories to declare (their real paths), before any disk is added.
    add_storage: list[str] = field(default_factory=list)
    # ... of which these are declared shared (``shared = true``).
    shared_storage: set[str] = field(default_factory=set)
    create_partitions: list[PartitionSpec] = field(default_factory=list)
    resize_partitions: list[tuple[PartitionSpec, bool]] = field(default_factory=list)
    add_disks: list[DiskSpec] = field(default_factory=list)
    move_disks: list[DiskSpec] = field(default_factory=list)
    create_vms: list[VmSpec] = field(default_factory=list)
    start_vms: list[str] = field(default_factory=list)
    # Partitions whose supervisor is down (killed, or the host crashed): started again
    # first; each re-adopts its VMs that still run and marks the others crashed.
    start_supervisors: list[str] = field(default_factory=list)
    # systemd unit files written on a host whose PID 1 is systemd (fusuma.host.systemd)
    installed: list[str] = field(default_factory=list)
    create_networks: list[NetworkSpec] = field(default_factory=list)
    # Networks whose bridge, tables or dnsmasq are gone (a reboot, a killed keeper):
    # made again from their records.
    ensure_networks: list[str] = field(default_factory=list)
    # The host's memory overcommit when the spec's differs from the host's now.
    host_overcommit: float | None = None
    # Partitions whose memory overcommit changes (None: the host's again).
    overcommit_partitions: list[tuple[str, float | None]] = field(default_factory=list)

    def empty(self) -> bool:
        return not (self.add_storage or self.create_partitions or self.resize_partitions
                    or self.add_disks or self.move_disks or self.create_vms or self.start_vms
                    or self.start_supervisors or self.installed or self.create_networks
                    or self.ensure_networks or self.host_overcommit is not None
                    or self.overcommit_partitions)

    def describe(self) -> list[str]:
        out = [f"install systemd unit {path}" for path in self.installed]
        out += [f"start the supervisor of partition {n}" for n in self.start_supervisors]
        out += [f"declare {'shared ' if d in self.shared_storage else ''}storage "
                f"directory {d}" for d in self.add_storage]
        out += [f"create network {n.name} ({n.type})" for n in self.create_networks]
        out += [f"bring back network {n}" for n in self.ensure_networks]
        if self.host_overcommit is not None:
            out.append(f"set the host's memory overcommit to {self.host_overcommit:g}")
        out += [f"create partition {p.name} (cores {p.cpus}, {p.memory_mib} MiB)"
                for p in self.create_partitions]
        out += [f"set partition {n}'s memory overcommit to "
                f"{'the host' + chr(39) + 's' if v is None else format(v, 'g')}"
                for n, v in self.overcommit_partitions]
        out += [f"resize partition {p.name} (cores {p.cpus}, {p.memory_mib} MiB)"
                for p, _ in self.resize_partitions]
        out += [f"add disk {d.name} ({d.path}) to {d.partition}" for d in self.add_disks]
        out += [f"move disk {d.name} to {d.partition}" for d in self.move_disks]
        out += [f"create vm {v.name} in {v.partition}" for v in self.create_vms]
        out += [f"start vm {n}" for n in self.start_vms]
        return out


def _vm_diff(db: Database, v: VmSpec) -> list[str]:
    cur = db.vm(v.name)
    diffs = []
    for key in ("partition", "vcpus", "memory_mib", "image", "disks", "accel", "shared_ram",
                "qos", "memory_class", "memory_min"):
        a, b = getattr(cur, key), getattr(v, key)
        if a != b:
            diffs.append(f"{key} {a} -> {b}")
    if v.boot is not None and cur.boot != v.boot:
        diffs.append(f"boot {cur.boot} -> {v.boot}")
    if v.machine is not None and cur.machine is not None and cur.machine != v.machine:
        diffs.append(f"machine {cur.machine} -> {v.machine}")
    return diffs


def _same_qemu(parts: PartitionManager, a: str | None, b: str | None) -> bool:
    """Two names of one QEMU (unset and "7.2" both name a system QEMU 7.2)."""
    if a == b:
        return True
    from fusuma.qemu import versions

    try:
        return versions.resolve(parts.paths, a).binary == \
            versions.resolve(parts.paths, b).binary
    except FusumaError:
        return False


def plan(db: Database, parts: PartitionManager, spec: HostSpec, source: str) -> Plan:
    from fusuma.spec import check_host_fit

    check_host_fit(spec, parts.host, source)
    p = Plan()
    have = {str(d) for d in storage.declared(parts.paths, db)}
    shared = set(db.shared_storage_dirs())
    for i, st in enumerate(spec.storage):
        real = os.path.realpath(st.path)
        if real in have and st.shared != (real in shared) and real not in p.add_storage:
            raise SpecError(f"{source}: storage[{i}].shared: {real} is declared "
                            f"{'shared' if real in shared else 'not shared'} on this host "
                            "already; remove it (`fusuma storage remove`) and declare it "
                            "again to change that.")
        if real in have or real == os.path.realpath(storage.default_dir(parts.paths)):
            continue
        try:
            storage.check_dir(parts.paths, st.path)
        except FusumaError as exc:
            raise SpecError(f"{source}: storage[{i}].path: {exc}") from exc
        p.add_storage.append(real)
        if st.shared:
            p.shared_storage.add(real)
        have.add(real)
    _plan_networks(db, parts, spec, source, p)
    for ps in spec.partition:
        cur = db.find_partition(ps.name)
        if cur is None:
            p.create_partitions.append(ps)
            continue
        if parts.supervisor_pid(ps.name) is None:
            p.start_supervisors.append(ps.name)
        if cur.cpus != ps.cpus or cur.memory_mib != ps.memory_mib:
            shrinking = set(ps.cpus) <= set(cur.cpus)
            p.resize_partitions.append((ps, shrinking))
        elif not _same_qemu(parts, cur.qemu, ps.qemu) or cur.io_weight != ps.io_weight:
            raise SpecError(f"{source}: partition {ps.name!r} exists with another qemu or "
                            "io_weight; those cannot change on a live partition.")
    for i, ds in enumerate(spec.disk):
        cur_d = db.find_disk(ds.name)
        if cur_d is None:
            try:
                storage.locate(parts.paths, db, ds.path, extra=p.add_storage)
            except SpecError as exc:
                raise SpecError(f"{source}: disk[{i}].path: {exc}") from exc
            p.add_disks.append(ds)
        elif cur_d.path != ds.path:
            raise SpecError(f"{source}: disk {ds.name!r} exists with path {cur_d.path}, "
                            f"not {ds.path}.")
        elif cur_d.partition != ds.partition:
            p.move_disks.append(ds)
    from fusuma import capacity

    if spec.host.memory_overcommit != capacity.host_overcommit(db):
        p.host_overcommit = spec.host.memory_overcommit
    for ps in spec.partition:
        cur = db.find_partition(ps.name)
        if cur is not None and cur.memory_overcommit != ps.memory_overcommit:
            p.overcommit_partitions.append((ps.name, ps.memory_overcommit))
    for vs in spec.vm:
        cur_v = db.find_vm(vs.name)
        if cur_v is None:
            p.create_vms.append(vs)
        else:
            diffs = _vm_diff(db, vs)
            if diffs:
                raise SpecError(f"{source}: VM {vs.name!r} exists with other settings "
                                f"({'; '.join(diffs)}); delete it first (`fusuma vm delete "
                                f"{vs.name} --force`).")
        if vs.autostart and (cur_v is None or VmView(cur_v).state != "running"):
            p.start_vms.append(vs.name)
    return p


def _plan_networks(db: Database, parts: PartitionManager, spec: HostSpec, source: str,
                   p: Plan) -> None:
    from fusuma.network.manager import NetworkManager

    nets = NetworkManager(parts.paths, db)
    named = {n.name for n in spec.network}
    for i, ns in enumerate(spec.network):
        cur = db.find_network(ns.name)
        if cur is None:
            try:
                nets.check_create(ns.name, ns.type, ns.subnet, ns.parent, ns.nat,
                                  ns.isolated, ns.filtering, ns.mtu)
            except FusumaError as exc:
                raise SpecError(f"{source}: network[{i}]: {exc}") from exc
            p.create_networks.append(ns)
            continue
        want_subnet = ns.subnet or cur.subnet
        if (cur.type, cur.subnet, cur.isolated) != (ns.type, want_subnet, ns.isolated) or \
                (ns.parent is not None and ns.parent != cur.bridge) or \
                (ns.mtu is not None and ns.mtu != cur.mtu):
            raise SpecError(f"{source}: network {ns.name!r} exists with other settings "
                            f"(type {cur.type}, subnet {cur.subnet}, bridge {cur.bridge}, "
                            f"MTU {cur.mtu}); "
                            "delete it first (`fusuma network delete`).")
    for n in db.networks():
        if (n.managed or n.name in named) and nets.status(n.name).state != "up":
            p.ensure_networks.append(n.name)
    for i, vs in enumerate(spec.vm):
        for nic in vs.nics:
            if nic.network not in named and db.find_network(nic.network) is None:
                raise SpecError(f"{source}: vm[{i}].nics: no network named "
                                f"{nic.network!r} in this spec or on this host.")


def up(paths_db: Database, parts: PartitionManager, vms: VmManager, spec: HostSpec,
       source: str, progress: Callable[[str], None] = lambda s: None,
       wait_agent: float = 0.0) -> Plan:
    """Apply ``spec``; on any failure undo every step already taken and re-raise."""
    with host_lock(parts.paths.home):
        return _up(paths_db, parts, vms, spec, source, progress, wait_agent)


def _up(db: Database, parts: PartitionManager, vms: VmManager, spec: HostSpec,
        source: str, progress: Callable[[str], None], wait_agent: float) -> Plan:
    the_plan = plan(db, parts, spec, source)
    if spec.partition:
        the_plan.installed = parts.install_units()
    for name in the_plan.start_supervisors:
        progress(f"starting the supervisor of partition {name}")
        parts.start_supervisor(name)
    from fusuma.network.manager import NetworkManager

    nets = NetworkManager(parts.paths, db, parts.notice)
    for name in the_plan.ensure_networks:
        progress(f"bringing back network {name}")
        nets.ensure(name)
    with Reverter() as rev:
        for ns in the_plan.create_networks:
            progress(f"creating network {ns.name}")
            nets.create(ns.name, ns.type, subnet=ns.subnet, parent=ns.parent, nat=ns.nat,
                        isolated=ns.isolated, filtering=ns.filtering, mtu=ns.mtu)
            rev.add(lambda n=ns.name: nets.delete(n))  # type: ignore[misc]
        for d in the_plan.add_storage:
            progress(f"declaring storage directory {d}")
            parts.add_storage(d, d in the_plan.shared_storage)
            rev.add(lambda d=d: parts.remove_storage(d))  # type: ignore[misc]
        # Overcommits first: a raised one makes room for what the spec adds.
        if the_plan.host_overcommit is not None:
            progress(f"setting the host's memory overcommit to {the_plan.host_overcommit:g}")
            was = parts.set_host_overcommit(the_plan.host_overcommit)
            rev.add(lambda w=was: parts.set_host_overcommit(w))  # type: ignore[misc]
        for pname, value in the_plan.overcommit_partitions:
            was_p = db.partition(pname).memory_overcommit
            parts.set_memory_overcommit(pname, value)
            rev.add(lambda n=pname, w=was_p: parts.set_memory_overcommit(n, w))  # type: ignore[misc]
        # Two phases, so cores and memory can move between partitions in one spec:
        # first every partition gives up what it loses, then each takes what it gains.
        for phase in ("shrink", "grow"):
            for ps, _ in the_plan.resize_partitions:
                old = db.partition(ps.name)
                if phase == "shrink":
                    cpus = [c for c in old.cpus if c in ps.cpus] or old.cpus
                    mem = min(old.memory_mib, ps.memory_mib)
                else:
                    cpus, mem = ps.cpus, ps.memory_mib
                if (cpus, mem) == (old.cpus, old.memory_mib):
                    continue
                progress(f"resizing partition {ps.name} ({phase})")
                rev.add(lambda o=old: parts.resize(o.name, o.cpus, o.memory_mib))  # type: ignore[misc]
                parts.resize(ps.name, cpus, mem)
        for ps in the_plan.create_partitions:
            progress(f"creating partition {ps.name} on cores {ps.cpus}")
            parts.create(ps)
            rev.add(lambda n=ps.name: parts.delete(n, force=True))  # type: ignore[misc]
        for ds in the_plan.add_disks:
            progress(f"adding disk {ds.name}")
            made = parts.add_disk(ds)
            # Undo removes only what this command created: a disk file that existed
            # before `up` is the user's and stays, whatever happens.
            rev.add(lambda d=made: parts.drop_disk(d.name))  # type: ignore[misc]
        for ds in the_plan.move_disks:
            old_p = db.disk(ds.name).partition
            parts.move_disk(ds.name, ds.partition)
            rev.add(lambda d=ds, o=old_p: parts.move_disk(d.name, o))  # type: ignore[misc]
        for vs in the_plan.create_vms:
            progress(f"creating vm {vs.name}")
            vms.create(vs)
            rev.add(lambda n=vs.name: vms.delete(n, force=True))  # type: ignore[misc]
        for name in the_plan.start_vms:
            progress(f"starting vm {name}")
            vms.start(name)
            rev.add(lambda n=name: vms.kill(n))  # type: ignore[misc]
        if wait_agent > 0:
            for name in the_plan.start_vms:
                progress(f"waiting for the guest agent of {name}")
                vms.wait_agent(name, timeout=wait_agent)
        rev.commit()
    return the_plan


def down(db: Database, parts: PartitionManager, vms: VmManager,
         progress: Callable[[str], None] = lambda s: None) -> list[str]:
    """Remove every VM, disk registration and partition of this FUSUMA_HOME.

    Disk files that fusuma created (a spec's ``size_mib``) are deleted; disk files the
    user brought are left in place.
    """
    with host_lock(parts.paths.home):
        return _down(db, parts, vms, progress)


def _down(db: Database, parts: PartitionManager, vms: VmManager,
          progress: Callable[[str], None]) -> list[str]:
    done: list[str] = []
    for v in db.vms():
        progress(f"deleting vm {v.name}")
        vms.delete(v.name, force=True)
        done.append(f"deleted vm {v.name}")
    if db.templates():
        from fusuma.ops.template_manager import TemplateManager

        for t in db.templates():
            progress(f"deleting template {t.name}")
            TemplateManager(parts.paths, db, parts).delete(t.name)
            done.append(f"deleted template {t.name}")
    for d in db.disks():
        parts.drop_disk(d.name)
        done.append(f"removed disk {d.name}")
    if db.networks():
        from fusuma.network.manager import NetworkManager

        nets = NetworkManager(parts.paths, db, parts.notice)
        for n in db.networks():
            progress(f"deleting network {n.name}")
            nets.delete(n.name)
            done.append(f"deleted network {n.name}")
    for p in db.partitions():
        progress(f"deleting partition {p.name}")
        parts.delete(p.name, force=True)
        done.append(f"deleted partition {p.name}")
    with contextlib.suppress(ConflictError):
        parts.cg.remove_parent_if_empty()
    # Empty directories fusuma made for runtime files go too (never non-empty ones).
    paths = parts.paths
    for empty in (paths.runtime / "vms", paths.runtime / "partitions",
                  paths.runtime / "networks", paths.runtime,
                  paths.shm):
        with contextlib.suppress(OSError):
            empty.rmdir()
    return done


