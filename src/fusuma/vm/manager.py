"""The CLI's operations on VMs. Definitions live in the state DB; running a VM is
asked of its partition's supervisor."""

from __future__ import annotations

import base64
import contextlib
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from fusuma.errors import ConflictError, FusumaError, ResourceError, StateError
from fusuma.governor.qos import check_admission
from fusuma.images import find_image
from fusuma.memshare.report import vm_memory
from fusuma.partition.manager import SUPERVISOR_MIB, PartitionManager, vm_need_mib
from fusuma.paths import Paths
from fusuma.qemu import process
from fusuma.spec import VmSpec, check_name
from fusuma.state import Database, VmRecord, VmState
from fusuma.state.lock import locked

# States in which a QEMU process should exist.
ALIVE = (VmState.STARTING, VmState.RUNNING, VmState.STOPPING, VmState.MIGRATING)


@dataclass(frozen=True)
class ExecOutput:
    exit_code: int
    stdout: bytes
    stderr: bytes
    signal: int | None


@dataclass(frozen=True)
class VmView:
    """A VM as `ps` shows it: the DB record checked against the live process."""

    record: VmRecord
    # Where segment files live (Paths.segments_dir), to find their mappings.
    segments_dir: Path = Path("/var/lib/fusuma/segments")

    @property
    def state(self) -> str:
        r = self.record
        if r.state == VmState.STARTING and r.pid is None:
            return r.state.value
        if r.state in ALIVE and not (r.pid and process.pid_alive(r.pid) and
                                     f"guest={r.name},debug-threads=on"
                                     in process.cmdline(r.pid)):
            # The supervisor is down or has not noticed yet: say what is true.
            return VmState.CRASHED.value
        return r.state.value

    def as_json(self) -> dict[str, Any]:
        r = self.record
        state = self.state
        alive = state in ("running", "migrating", "stopping") and r.pid is not None
        mem = None
        if alive and r.pid:
            files = {seg: self.segments_dir / f"{seg}.erofs"
                     for seg in (item.partition(":")[0] for item in r.segments)}
            with contextlib.suppress(FusumaError):
                mem = vm_memory(r.pid, files)
        return {"name": r.name, "partition": r.partition, "state": state,
                "pid": r.pid if state != "crashed" else None,
                "accel": r.accel_used or r.accel, "vcpus": r.vcpus,
                "memory_mib": r.memory_mib, "shared_ram": r.shared_ram, "qos": r.qos,
                "mergeable": r.mergeable, "segments": r.segments, "ports": r.ports,
                "host_memory": mem.as_json() if mem else None,
                "disks": r.disks, "error": r.error}


class VmManager:
    def __init__(self, paths: Paths, db: Database, parts: PartitionManager) -> None:
        self.paths = paths
        self.db = db
        self.parts = parts

    @locked
    def create(self, spec: VmSpec) -> VmRecord:
        check_name("VM", spec.name)
        if self.db.find_vm(spec.name) is not None:
            raise ConflictError(f"a VM named {spec.name!r} already exists.")
        part = self.db.partition(spec.partition)
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
        taken = {p.split(":")[0]: v.name for v in self.db.vms() for p in v.ports}
        for item in spec.ports:
            host = item.split(":")[0]
            if host in taken:
                raise ConflictError(f"host port {host} is already forwarded to VM "
                                    f"{taken[host]!r}; pick another port.")
        find_image(self.paths.cache, kind=spec.image)
        rec = VmRecord(name=spec.name, partition=spec.partition, vcpus=spec.vcpus,
                       memory_mib=spec.memory_mib, image=spec.image, disks=list(spec.disks),
                       accel=spec.accel, autostart=spec.autostart,
                       shared_ram=spec.shared_ram, qos=spec.qos,
                       segments=list(spec.segments), mergeable=spec.mergeable,
                       ports=list(spec.ports))
        check_admission(part.name, len(part.cpus), self.db.vms(part.name), rec)
        need = SUPERVISOR_MIB + sum(vm_need_mib(v) for v in self.db.vms(part.name))
        need += vm_need_mib(rec)
        if need > part.memory_mib:
            raise ResourceError(
                f"partition {part.name!r} has {part.memory_mib} MiB but its VMs would need "
                f"{need} MiB with {spec.name!r} ({spec.memory_mib} MiB guest RAM + QEMU "
                f"overhead); grow it with `fusuma partition resize {part.name} --memory "
                f"{need}` or give the VM less memory.")
        self.db.add_vm(rec)
        return rec

    def start(self, name: str, wait_agent: float = 0.0) -> VmRecord:
        vm = self.db.vm(name)
        find_image(self.paths.cache, kind=vm.image)
        self.parts.client(vm.partition).call("start", rpc_timeout=120 + wait_agent, vm=name,
                                             wait_agent=wait_agent)
        return self.db.vm(name)

    def stop(self, name: str, timeout: float = 10.0) -> VmRecord:
        vm = self.db.vm(name)
        self.parts.client(vm.partition).call("stop", rpc_timeout=timeout + 30, vm=name,
                                             timeout=timeout)
        return self.db.vm(name)

    def kill(self, name: str) -> VmRecord:
        vm = self.db.vm(name)
        self.parts.client(vm.partition).call("kill", vm=name)
        return self.db.vm(name)

    def exec(self, name: str, argv: list[str], stdin: bytes | None = None,
             timeout: float = 60.0) -> ExecOutput:
        vm = self.db.vm(name)
        res = self.parts.client(vm.partition).call(
            "exec", rpc_timeout=timeout + 30, vm=name, argv=argv,
            stdin=base64.b64encode(stdin).decode() if stdin is not None else None,
            timeout=timeout)
        return ExecOutput(int(res["exit_code"]), base64.b64decode(res["stdout"]),
                          base64.b64decode(res["stderr"]), res.get("signal"))

    def wait_agent(self, name: str, timeout: float = 60.0) -> float:
        vm = self.db.vm(name)
        return float(self.parts.client(vm.partition).call("wait-agent", rpc_timeout=timeout + 10,
                                                          vm=name, timeout=timeout))

    @locked
    def delete(self, name: str, force: bool = False) -> None:
        vm = self.db.vm(name)
        view = VmView(vm)
        if view.state in ("running", "starting", "stopping", "migrating"):
            if not force:
                raise StateError(f"VM {name!r} is {view.state}; stop it first or use --force.")
            try:
                self.parts.client(vm.partition).call("kill", vm=name)
            except FusumaError:
                # No supervisor to ask: end the QEMU ourselves, by its checked pid.
                if vm.pid and process.is_vm_process(vm.pid, name, self.paths.vm_run_dir(name)):
                    process.kill(vm.pid)
                    deadline = time.monotonic() + 10
                    while process.pid_alive(vm.pid) and time.monotonic() < deadline:
                        time.sleep(0.02)
        self.db.remove_vm(name)
        for d in (self.paths.vm_dir(name), self.paths.vm_run_dir(name)):
            shutil.rmtree(d, ignore_errors=True)
        for ram in {self.paths.ram_file(name), *([Path(vm.ram_path)] if vm.ram_path else [])}:
            with contextlib.suppress(FileNotFoundError):
                ram.unlink()
        with contextlib.suppress(Exception):
            self.parts.cg.delete_leaf(vm.partition, f"vm.{name}")

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
        new = vm.with_(disks=[*vm.disks, disk])
        self.db.update_vm(new)
        return new

    @locked
    def detach_disk(self, name: str, disk: str) -> VmRecord:
        vm = self._stopped(name, "detach a disk")
        if disk not in vm.disks:
            raise StateError(f"disk {disk!r} is not attached to VM {name!r}.")
        new = vm.with_(disks=[d for d in vm.disks if d != disk])
        self.db.update_vm(new)
        return new

    def _stopped(self, name: str, what: str) -> VmRecord:
        vm = self.db.vm(name)
        if VmView(vm).state not in ("stopped", "crashed"):
            raise StateError(f"VM {name!r} is {VmView(vm).state}; stop it to {what}.")
        return vm
