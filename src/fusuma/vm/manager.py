"""The CLI's operations on VMs. Definitions live in the state DB; running a VM is
asked of its partition's supervisor."""

from __future__ import annotations

import base64
import contextlib
import dataclasses
import logging
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol, TypeVar

from fusuma.errors import ConflictError, FusumaError, NotFoundError, SpecError, StateError
from fusuma.frozen import frozen
from fusuma.names import check_name
from fusuma.paths import Paths
from fusuma.qemu import process
from fusuma.state import ALIVE, Database, JobKind, VmRecord, VmState, busy_sentence, vm_obj
from fusuma.state.jobs import JobOwner
from fusuma.state.lock import locked
from fusuma.supervisor import rpc
from fusuma.vm.view import VmView

R = TypeVar("R")

LOG = logging.getLogger(__name__)

if TYPE_CHECKING:   # not imported at run time: `fusuma ps` needs only VmView (issue 17)
    from fusuma.host.cgroups import CgroupDriver
    from fusuma.host.topology import HostInfo
    from fusuma.network.manager import NetworkManager
    from fusuma.spec import DiskSpec, VmSpec
    from fusuma.state.joblock import JobLock
    from fusuma.state.records import DiskRecord
    from fusuma.supervisor.client import SupervisorClient


class Partitions(Protocol):
    """What VM operations need of the partitions (``PartitionManager`` is it): the
    partitions' layer sits above the VMs', so this one names no class of it."""

    host: HostInfo

    @property
    def cg(self) -> CgroupDriver: ...

    def client(self, name: str) -> SupervisorClient: ...

    def ensure_recovered(self, obj: str) -> None: ...

    def job(self, obj: str, kind: str, *, source: str | None = None,
            peer: str | None = None) -> JobLock: ...

    def add_disk(self, spec: DiskSpec) -> DiskRecord: ...

    def drop_disk(self, name: str) -> None: ...



@frozen
class ExecOutput:
    exit_code: int
    stdout: bytes
    stderr: bytes
    signal: int | None


class VmManager:
    def __init__(self, paths: Paths, db: Database, parts: Partitions) -> None:
        self.paths = paths
        self.db = db
        self.parts = parts

    @locked
    def create(self, spec: VmSpec, adopt: Path | None = None) -> VmRecord:
        """Define VM ``spec``. ``adopt``: its files are there already, in a shared
        storage directory (a move in from another host, fusuma.cluster.hostmove)."""
        from fusuma import capacity

        check_name("VM", spec.name)
        if self.db.find_vm(spec.name) is not None:
            raise ConflictError(f"a VM named {spec.name!r} already exists.")
        self._name_free(spec.name)
        part = self.db.partition(spec.partition)
        if spec.template is not None:
            spec = self._clone_spec(spec, part.qemu)
        for dname in spec.disks:
            disk = self.db.disk(dname)
            if disk.partition != spec.partition:
                raise ConflictError(f"disk {dname!r} belongs to partition {disk.partition!r}; "
                                    f"move it with `fusuma disk move {dname} --to "
                                    f"{spec.partition}` first.")
            users = [v.name for v in self.db.vms() if dname in v.disks]
            if users:
                raise ConflictError(f"disk {dname!r} is already used by VM {users[0]!r}.")
        for item in spec.segments:
            self.db.segment(item.partition(":")[0])
        from fusuma.network.manager import NicRequest

        nets = self._networks()
        nics = nets.plan_nics(spec.name, [NicRequest(n.network, n.mac, n.ip)
                                          for n in spec.nics], spec.ports)
        from fusuma.vm import boot as fwboot

        boot, base = fwboot.resolve(self.db, spec.image, spec.boot)
        fwboot.check_spec_fields(boot, disk_size=spec.disk_size, ssh_keys=spec.ssh_keys,
                                 user_data=spec.user_data, segments=spec.segments,
                                 storage=spec.storage)
        if spec.storage is not None and adopt is None:
            from fusuma.host import storage

            storage.shared_dir(self.paths, self.db, spec.storage)   # refused now
        if base is None:
            from fusuma.images import find_image

            find_image(self.paths.cache, kind=spec.image)
        else:
            disk_size, keys = fwboot.check_inputs(base, spec.disk_size, spec.ssh_keys)
        machine = self._machine(part.name, part.qemu, spec.machine)
        from fusuma.memshare import reporting

        rec = VmRecord(name=spec.name, partition=spec.partition, vcpus=spec.vcpus,
                       memory_mib=spec.memory_mib, image=spec.image, disks=list(spec.disks),
                       accel=spec.accel, autostart=spec.autostart,
                       shared_ram=spec.shared_ram, qos=spec.qos,
                       segments=list(spec.segments), mergeable=spec.mergeable,
                       ports=list(spec.ports),
                       overhead_mib=capacity.definition_overhead(spec.accel,
                                                                firmware=boot != "kernel"),
                       machine=machine, emulator=spec.emulator,
                       page_reporting=reporting.resolve(
                           spec.page_reporting, spec.shared_ram, spec.template,
                           self.parts.cg),
                       template=spec.template, boot=boot,
                       memory_class=spec.memory_class, memory_min=spec.memory_min)
        from fusuma.governor.qos import check_admission, check_emulators

        check_admission(part.name, len(part.cpus), self.db.vms(part.name), rec)
        check_emulators(part.name, part.cpus, [*self.db.vms(part.name), rec])
        capacity.check_partition_room(self.db, part.name, [rec], "create",
                                      limit=part.memory_mib)
        capacity.check_memory_class(rec.name, rec.memory_mib, rec.memory_class,
                                    rec.memory_min)
        capacity.check_host_ram(self.db, self.parts.host, [rec], f"VM {rec.name!r}",
                                "give it less memory, delete a VM or shrink a partition"
                                + ("; or make it burstable with a floor (--memory-class "
                                   "burstable --memory-min MiB) on a partition with a "
                                   "memory overcommit" if rec.memory_class == "guaranteed"
                                   and rec.shared_ram else ""))
        with self.db.transaction():
            stored = self.db.add_vm(rec, self.paths.vm_uids)
            self.db.add_nics(nics)
        try:
            if base is not None and spec.template is not None:
                from fusuma.memshare.templates import template_dir

                fwboot.prepare_clone(self.paths, stored,
                                     template_dir(self.paths, spec.template),
                                     [n.mac for n in nics])
            elif base is not None and adopt is not None:
                from fusuma.vm import shared

                shared.point(self.paths, rec.name, adopt)
            elif base is not None:
                fwboot.prepare(self.paths, stored, base, disk_size, keys, spec.user_data,
                               [n.mac for n in nics], nets.nic_mtus(nics), db=self.db,
                               storage_dir=spec.storage)
            for net in sorted({n.network for n in nics}):
                nets.refresh(net)
        except BaseException:
            if adopt is not None:     # the files are the source's: only forget them
                from fusuma.vm import shared

                shared.detach(self.paths, rec.name)
            fwboot.remove(self.paths, rec.name)
            self.db.remove_vm(rec.name)
            for net in sorted({n.network for n in nics}):
                with contextlib.suppress(FusumaError):
                    nets.refresh(net)
            raise
        return self.db.vm(rec.name)

    def _name_free(self, name: str) -> None:
        """Refuse a name another operation holds (a restore making a VM of that name,
        which would otherwise take this one for its own); a dead holder's job is
        recovered first. The holder's own create passes: a restore, a move in from
        another host, whatever job this process holds on the name."""
        held = self.db.find_job(vm_obj(name))
        if held is None or held.owner == JobOwner.me():
            return
        if held.owner.alive():
            raise StateError(busy_sentence(held))
        self.parts.ensure_recovered(vm_obj(name))
        if self.db.find_vm(name) is not None:
            raise ConflictError(f"a VM named {name!r} already exists.")

    def _networks(self) -> NetworkManager:
        from fusuma.network.manager import NetworkManager

        return NetworkManager(self.paths, self.db)

    def _clone_spec(self, spec: VmSpec, qemu: str | None) -> VmSpec:
        """A clone's definition: what its template's saved guest has (a value given
        that differs is refused), on a partition whose QEMU can map the template."""
        from fusuma.memshare import templates
        from fusuma.qemu import versions
        from fusuma.spec import NicSpec
        from fusuma.vm import boot as fwboot

        t = self.db.template(str(spec.template))
        templates.check_clone_nics(t, len(spec.nics))
        given = spec.model_fields_set
        fwboot.check_clone_fields(t.name, [f"--{k.replace('_', '-')}" for k in given
                                           if k in ("boot", "disk_size", "ssh_keys",
                                                    "user_data")])
        fill: dict[str, object] = {k: getattr(t, k) for k in ("vcpus", "memory_mib",
                                                             "image", "segments")
                                   if k not in given}
        if not spec.nics and t.networks:
            # Its template's NICs: the same networks, a MAC and an address of its own.
            fill["nics"] = [NicSpec(network=n) for n in t.networks]
        fill["machine"] = spec.machine or t.machine
        fill["shared_ram"] = False
        # The firmware its guest booted by (its device set says; a kernel boot's none).
        fill["boot"] = templates.devices_of(t).firmware or "kernel"
        merged = spec.model_copy(update=fill)
        templates.check_clone(t, vcpus=merged.vcpus, memory_mib=merged.memory_mib,
                              disks=list(spec.disks), ports=list(spec.ports),
                              segments=list(merged.segments), image=merged.image,
                              accel=spec.accel,
                              shared_ram="shared_ram" in given and spec.shared_ram)
        if merged.machine != t.machine:
            raise SpecError(f"template {t.name!r}'s guest has machine type {t.machine}; a "
                            "clone has it too (leave out --machine).")
        q = versions.resolve(self.paths, qemu)
        if not templates.version_ok(q.version):
            raise templates.too_old(f"partition {spec.partition!r}", q.version)
        templates.check_files(t)
        return merged.model_copy(update={"accel": t.accel})

    def _machine(self, partition: str, qemu: str | None, wanted: str | None) -> str:
        """The machine type a new VM pins: ``wanted`` if its partition's QEMU has it,
        else the oldest installed QEMU's q35 (fusuma.qemu.versions.default_machine)."""
        from fusuma.qemu import versions

        q = versions.resolve(self.paths, qemu)
        machine = wanted or versions.default_machine(self.paths, q)
        why = versions.cannot_run(q, machine)
        if why is not None:
            raise StateError(f"partition {partition!r} runs QEMU {q.version}, which cannot "
                             f"run machine type {machine}: {why}; pick one from `fusuma "
                             "qemu list` or a partition on a newer QEMU.")
        return machine

    def start(self, name: str, wait_agent: float = 0.0) -> VmRecord:
        vm = self.db.vm(name)
        if vm.boot == "kernel":
            from fusuma.images import find_image

            find_image(self.paths.cache, kind=vm.image)
        if VmView(vm).state in ("stopped", "crashed"):
            from fusuma import capacity

            capacity.check_start(self.paths, vm, self.db)
        self._send(name, rpc.Start(name, wait_agent=wait_agent), 120 + wait_agent)
        return self.db.vm(name)

    def _send(self, name: str, req: rpc.Request[R], timeout: float = 60.0) -> R:
        """Ask the supervisor that runs VM ``name`` (recovering a dead job first; if
        the VM moved meanwhile, ask its new partition)."""
        self.parts.ensure_recovered(vm_obj(name))
        for attempt in range(2):
            vm = self.db.vm(name)
            try:
                return self.parts.client(vm.partition).send(req, timeout)
            except NotFoundError:
                if attempt or self.db.vm(name).partition == vm.partition:
                    raise
        raise AssertionError("unreachable")

    def send(self, name: str, req: rpc.Request[R], timeout: float = 60.0) -> R:
        """Ask the supervisor that runs VM ``name`` (fusuma.vm.snapshots, ...)."""
        return self._send(name, req, timeout)

    def stop(self, name: str, timeout: float = 10.0) -> VmRecord:
        self._send(name, rpc.Stop(name, timeout=timeout), timeout + 30)
        return self.db.vm(name)

    def kill(self, name: str) -> VmRecord:
        self._send(name, rpc.Kill(name))
        return self.db.vm(name)

    def exec(self, name: str, argv: list[str], stdin: bytes | None = None,
             timeout: float = 60.0) -> ExecOutput:
        res = self._send(name, rpc.Exec(
            name, argv, stdin=base64.b64encode(stdin).decode() if stdin is not None
            else None, timeout=timeout), timeout + 30)
        return ExecOutput(res.exit_code, base64.b64decode(res.stdout),
                          base64.b64decode(res.stderr), res.signal)

    def trim(self, name: str, timeout: float = 60.0) -> dict[str, Any]:
        """Drop the guest's caches and wait for its free pages to be handed back."""
        return dataclasses.asdict(self._send(name, rpc.Trim(name, timeout=timeout),
                                             timeout + 60))

    def resize_disk(self, name: str, size: str, disk: str | None = None) -> rpc.Resized:
        """Grow VM ``name``'s thin disk (``disk`` None) or its registered disk ``disk``:
        online while it runs, else with no QEMU (its supervisor does either)."""
        from fusuma.images.store import parse_size

        return self._send(name, rpc.ResizeDisk(name, disk or "", parse_size(size)))

    @locked
    def resize_registered(self, disk: str, size: str) -> rpc.Resized:
        """Grow registered disk ``disk`` (`fusuma disk resize`): through its VM when one
        has it attached (:meth:`resize_disk`), else its file here."""
        from fusuma.host import storage
        from fusuma.images.store import parse_size

        want = parse_size(size)
        rec = self.db.disk(disk)
        users = [v.name for v in self.db.vms() if disk in v.disks]
        if users:
            return self.resize_disk(users[0], size, disk)
        rec = storage.take_over(self.paths, self.db, rec)
        old = storage.grow(disk, Path(rec.path), rec.dev, rec.ino, want)
        return rpc.Resized(vm="", drive=f"disk-{disk}", old_size=old, size=want)

    def wait_agent(self, name: str, timeout: float = 60.0) -> float:
        return self._send(name, rpc.WaitAgent(name, timeout=timeout), timeout + 10).seconds

    @locked
    def delete(self, name: str, force: bool = False) -> None:
        held = self.db.find_job(vm_obj(name))
        self.parts.ensure_recovered(vm_obj(name))
        if held is not None and held.kind == JobKind.RESTORE \
                and self.db.find_vm(name) is None:
            return      # a restore killed while making it was undone: gone, as asked
        vm = self.db.vm(name)
        view = VmView(vm)
        if view.state not in ("stopped", "crashed") and not force:
            raise StateError(f"VM {name!r} is {view.state}; stop it first or use --force.")
        with self.parts.job(vm_obj(name), JobKind.DELETE, source=vm.partition) as jh:
            jh.phase("kill")
            self.finish_delete(name)

    def finish_delete(self, name: str) -> None:
        """End the VM's QEMU (by its checked pid), then remove its record and files.
        Run under the VM's delete job, or by recovery of one."""
        vm = self.db.vm(name)
        run = self.paths.vm_run_dir(name)
        for pid in sorted({*([vm.pid] if vm.pid else []), *process.vm_pids(name, run)}):
            process.end_unmanaged(pid, name, run)     # checked against its command line
        # The supervisor records the exit; without one (or if it is slow) say it here.
        deadline = time.monotonic() + 3
        while self.db.vm(name).state in ALIVE and time.monotonic() < deadline:
            time.sleep(0.05)
        if self.db.vm(name).state in ALIVE:
            with contextlib.suppress(StateError):
                self.db.transition(name, VmState.CRASHED, pid=None,
                                   error="killed to delete it")
        networks = sorted({n.network for n in self.db.nics(vm=name)})
        self.db.remove_vm(name)      # its NICs with it
        for net in networks:
            # Its address leaves dnsmasq's hosts, its tap the filter.
            try:
                self._networks().refresh(net)
            except FusumaError as exc:
                LOG.warning("network %s: not refreshed after VM %s went: %s", net, name, exc)
        from fusuma.vm import shared

        shared.remove(self.paths, name)      # its files on shared storage, if any
        import shutil

        for d in (self.paths.vm_dir(name), self.paths.vm_run_dir(name)):
            shutil.rmtree(d, ignore_errors=True)
        rams = {self.paths.ram_file(name), *([Path(vm.ram_path)] if vm.ram_path else [])}
        if self.paths.shm.exists():
            rams |= set(self.paths.shm.glob(f"{name}.*.ram"))
        for ram in rams:
            process.remove_unmapped(ram, self.paths)
        with contextlib.suppress(Exception):
            self.parts.cg.sweep_ram_groups(self.paths.shm)
        for p in self.db.partitions():
            with contextlib.suppress(Exception):
                self.parts.cg.delete_leaf(p.name, f"vm.{name}")

    @locked
    def attach_disk(self, name: str, disk: str) -> VmRecord:
        vm = self._stopped(name, "attach a disk")
        d = self.db.disk(disk)
        if d.partition != vm.partition:
            raise ConflictError(f"disk {disk!r} belongs to partition {d.partition!r}, not "
                                f"{vm.partition!r}.")
        users = [v.name for v in self.db.vms() if disk in v.disks]
        if users:
            raise ConflictError(f"disk {disk!r} is already used by VM {users[0]!r}.")
        self.db.set_vm(name, expect=vm.state, disks=[*vm.disks, disk])
        return self.db.vm(name)

    @locked
    def detach_disk(self, name: str, disk: str) -> VmRecord:
        vm = self._stopped(name, "detach a disk")
        if disk not in vm.disks:
            raise StateError(f"disk {disk!r} is not attached to VM {name!r}.")
        self.db.set_vm(name, expect=vm.state, disks=[d for d in vm.disks if d != disk])
        return self.db.vm(name)

    @locked
    def set_qos(self, name: str, qos: str) -> VmRecord:
        """Change stopped VM ``name``'s QoS class (admitted like a new VM: a guaranteed
        VM's vCPUs must fit the partition's cores beside the other guaranteed ones)."""
        from fusuma.governor.qos import QOS_NAMES, check_admission

        if qos not in QOS_NAMES:
            raise StateError(f"unknown QoS class {qos!r}; use one of "
                             f"{', '.join(QOS_NAMES)}.")
        vm = self._stopped(name, "change its QoS class")
        part = self.db.partition(vm.partition)
        check_admission(part.name, len(part.cpus), self.db.vms(part.name), vm.with_(qos=qos))
        from fusuma.governor.qos import check_emulators

        check_emulators(part.name, part.cpus,
                        [v for v in self.db.vms(part.name) if v.name != name] + [
                            vm.with_(qos=qos)])
        self.db.set_vm(name, expect=vm.state, qos=qos)
        return self.db.vm(name)

    def _stopped(self, name: str, what: str) -> VmRecord:
        self.parts.ensure_recovered(vm_obj(name))
        vm = self.db.vm(name)
        job = self.db.find_job(vm_obj(name))
        if job is not None:
            raise StateError(busy_sentence(job))
        if VmView(vm).state not in ("stopped", "crashed"):
            raise StateError(f"VM {name!r} is {VmView(vm).state}; stop it to {what}.")
        return vm
