"""The CLI's operations on partitions: create, resize, restart, delete, disks.

Each operation validates everything first (so a refused request changes nothing), then
applies its steps with a Reverter so a failure half-way leaves nothing half-created.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import subprocess
import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING

from fusuma import spawn
from fusuma.errors import (
    ConflictError,
    FusumaError,
    HostError,
    ResourceError,
    SpecError,
    StateError,
    SupervisorError,
)
from fusuma.frozen import frozen
from fusuma.host.topology import HostInfo, format_cpulist, host_info, siblings_text
from fusuma.names import check_name
from fusuma.partition import files as partition_files
from fusuma.partition import liveness
from fusuma.partition.liveness import SUPERVISOR_MODULE
from fusuma.paths import PRIVATE_DIR, Paths, ensure_dir, exclusive
from fusuma.qemu import process
from fusuma.state import Database, DiskRecord, Job, JobKind, PartitionRecord
from fusuma.state.joblock import JobLock, Recover, ensure_recovered
from fusuma.state.jobs import partition_obj
from fusuma.state.lock import locked
from fusuma.supervisor import rpc
from fusuma.supervisor.client import SupervisorClient
from fusuma.undo import Reverter

if TYPE_CHECKING:   # fusuma.spec needs pydantic: not imported by `fusuma ps`
    from fusuma.host import cgroups
    from fusuma.host.systemd import Units
    from fusuma.spec import DiskSpec, PartitionSpec

LOG = logging.getLogger(__name__)

__all__ = ["PartitionManager", "PartitionStatus"]


@frozen
class PartitionStatus:
    record: PartitionRecord
    supervisor_alive: bool

    @property
    def state(self) -> str:
        return "running" if self.supervisor_alive else "supervisor-down"


class PartitionManager:
    def __init__(self, paths: Paths, db: Database, host: HostInfo | None = None) -> None:
        self.paths = paths
        self.db = db
        self.host = host or host_info()
        self._cg: cgroups.CgroupDriver | None = None
        # Where notices for the user go (the CLI prints them on stderr).
        self.notice: Callable[[str], None] = lambda text: LOG.warning("%s", text)
        # How a job whose owner died is recovered before an operation takes its object.
        self.recover: Recover = self._recover_by_process
        # Whether the caller may name a host binary as a partition's QEMU: root's CLI
        # (and spec) only; the API's and the cluster's callers name versions.
        self.host_paths = False

    @property
    def cg(self) -> cgroups.CgroupDriver:
        from fusuma.host import cgroups

        if self._cg is None:
            self._cg = cgroups.for_paths(self.paths)
            self._cg.notice = lambda text: self.notice(text)
        return self._cg

    def client(self, name: str) -> SupervisorClient:
        return SupervisorClient(self.paths, name)

    # -- jobs -------------------------------------------------------------------------
    def job(self, obj: str, kind: str, *, source: str | None = None,
            peer: str | None = None) -> JobLock:
        """Hold ``obj`` for one operation (``fusuma.state.joblock``), recovering a job
        whose owner died first."""
        return JobLock(self.db, obj, kind, source=source, peer=peer).take(self.recover)

    def ensure_recovered(self, obj: str) -> None:
        """Before an operation touches ``obj``: recover a job whose owner died."""
        ensure_recovered(self.db, obj, self.recover)

    def _recover_by_process(self, held: Job) -> None:
        """Recover ``held`` in a process of its own (``python -m fusuma.recovery``), the
        way a supervisor's sweep does: the recovery used where no in-process one was
        given (``fusuma.ops.context`` gives ``fusuma.recovery.recover``)."""
        with contextlib.suppress(subprocess.TimeoutExpired):
            subprocess.run(spawn.module_argv("fusuma.recovery", held.obj),
                           env=spawn.child_env({**os.environ, **self.paths.as_env()}),
                           cwd=spawn.CWD, stdin=subprocess.DEVNULL, capture_output=True,
                           timeout=120)

    @property
    def units(self) -> Units | None:
        """fusuma's systemd units when supervisors run as units (PID 1 is systemd on a
        cgroup v2 host; fusuma.host.systemd), else None."""
        from fusuma.host.cgroups import CgroupSystemdDriver

        cg = self.cg
        return cg.units if isinstance(cg, CgroupSystemdDriver) else None

    def install_units(self) -> list[str]:
        """Install fusuma's systemd unit files where supervisors run as units; returns
        the files written (none when they are current or PID 1 is not systemd)."""
        units = self.units
        return [] if units is None else [str(p) for p in units.install()]

    def _repin_disturbed(self, but: str | None = None) -> None:
        """Pin again the threads of partitions whose cpuset the kernel reset while
        another partition changed (a cpuset partition made or undone)."""
        for other in sorted(self.cg.disturbed - {but}):
            if self.db.find_partition(other) is None:
                continue
            try:
                self.client(other).send(rpc.Repin())
            except FusumaError as exc:
                LOG.warning("partition %s: its vCPUs were not re-pinned: %s", other, exc)
        self.cg.disturbed.clear()

    # -- checks -----------------------------------------------------------------------
    def check_cpus(self, name: str, cpus: list[int]) -> None:
        missing = [c for c in cpus if c not in self.host.cpus]
        if missing:
            raise ResourceError(f"core(s) {format_cpulist(missing)} do not exist; this host "
                                f"has cores {format_cpulist(self.host.cpus)}.")
        for other in self.db.partitions():
            if other.name == name:
                continue
            shared = sorted(set(cpus) & set(other.cpus))
            if shared:
                raise ConflictError(
                    f"core(s) {format_cpulist(shared)} belong to partition {other.name!r}; "
                    "partitions cannot share a core (shrink it first with `fusuma partition "
                    f"resize {other.name} --cpus ...`).")

    def smt_cpus(self, name: str, cpus: list[int], smt: str) -> list[int]:
        """The CPUs a partition gets on an SMT host: whole physical cores (every sibling
        of the CPUs asked for, with a notice) unless it asks for single threads; then a
        warning names the siblings it shares with another partition."""
        if smt == "cores":
            whole = self.host.whole_cores(cpus)
            if whole != sorted(cpus):
                cores = "; ".join(siblings_text(g) for g in self.host.split_cores(cpus))
                self.notice(f"fusuma: notice: partition {name!r} gets whole physical cores: "
                            f"CPUs {format_cpulist(whole)} ({cores}); use --smt threads "
                            "for single threads.")
            return whole
        owner = {c: p.name for p in self.db.partitions() if p.name != name for c in p.cpus}
        for group in self.host.split_cores(cpus):
            others = sorted({owner[c] for c in group if c in owner})
            if others:
                self.notice(f"fusuma: warning: partition {name!r} splits {siblings_text(group)} "
                            f"with partition(s) {', '.join(map(repr, others))}: their vCPUs "
                            "compete for that core's execution units and caches.")
        return sorted(cpus)

    def check_memory(self, name: str, memory_mib: int,
                     overcommit: float | None = None) -> None:
        """Refuse a size (and a memory overcommit being set) the host or the
        partition's VMs cannot take."""
        from fusuma import capacity

        capacity.check_host_room(self.db, self.host, name, memory_mib, overcommit)
        if self.db.find_partition(name) is not None:
            capacity.check_resize(self.db, name, memory_mib)

    def check_qemu(self, qemu: str | None) -> None:
        """A partition's QEMU: a version `fusuma qemu list` shows, or, where the caller
        may name host paths (``host_paths``: root's CLI), a binary's path
        (fusuma.qemu.versions raises the sentence that says how to get it)."""
        if qemu is None:
            return
        from fusuma.qemu import versions

        if self.host_paths:
            versions.resolve(self.paths, qemu)
        else:
            versions.check_version_name(self.paths, qemu)

    # -- create / delete --------------------------------------------------------------
    @locked
    def create(self, spec: PartitionSpec) -> PartitionRecord:
        from fusuma import capacity

        check_name("partition", spec.name)
        if self.db.find_partition(spec.name) is not None:
            raise ConflictError(f"a partition named {spec.name!r} already exists.")
        cpus = self.smt_cpus(spec.name, spec.cpus, spec.smt)
        self.check_cpus(spec.name, cpus)
        self.check_memory(spec.name, spec.memory_mib, spec.memory_overcommit)
        self.check_qemu(spec.qemu)
        if spec.memory_mib < capacity.MIN_PARTITION_MIB:
            raise ResourceError(f"partition {spec.name!r} needs at least "
                                f"{capacity.MIN_PARTITION_MIB} MiB of memory.")
        rec = PartitionRecord(name=spec.name, cpus=cpus, memory_mib=spec.memory_mib,
                              io_weight=spec.io_weight, qemu=spec.qemu, smt=spec.smt,
                              memory_overcommit=spec.memory_overcommit)
        with Reverter() as rev:
            self.cg.ensure_parent()
            for path in self.cg.installed:
                self.notice(f"fusuma: installed {path}")
            rev.add(self.cg.remove_parent_if_empty, "parent cgroup")
            if self.cg.exists(spec.name):
                raise ConflictError(f"cgroup of partition {spec.name!r} already exists "
                                    "(left by an earlier run?); remove it or pick another name.")
            self.cg.create(spec.name, self.limits(rec))
            rev.add(lambda: self.cg.delete(spec.name), "cgroup")
            self.db.add_partition(rec)
            rev.add(lambda: self.db.remove_partition(spec.name), "db row")
            pid = self.start_supervisor(spec.name)
            rev.commit()
        self._repin_disturbed(spec.name)
        return PartitionRecord(**{**rec.__dict__, "supervisor_pid": pid})

    @locked
    def delete(self, name: str, force: bool = False) -> None:
        rec = self.db.partition(name)
        vms = self.db.vms(name)
        if vms and not force:
            raise StateError(f"partition {name!r} still has VM(s) "
                             f"{', '.join(v.name for v in vms)}; delete them first or use "
                             "--force to stop and delete them.")
        if vms:
            from fusuma.vm import VmManager

            vmm = VmManager(self.paths, self.db, self)
            for v in vms:
                vmm.delete(v.name, force=True)
        self.stop_supervisor(name)
        # A supervisor that was killed leaves its socket and pidfile behind.
        for f in (self.paths.supervisor_socket(name), self.paths.supervisor_pidfile(name)):
            with contextlib.suppress(FileNotFoundError):
                f.unlink()
        # QEMUs that outlived a dead supervisor are still ours to end.
        for pid in self.cg.pids(name) if self.cg.exists(name) else []:
            LOG.warning("killing leftover pid %d in partition %s", pid, name)
            process.kill(pid)
        for d in self.db.disks(name):
            self.drop_disk(d.name)
        self._wait_empty(name)
        self.cg.delete(name)
        self.db.remove_partition(name)
        self.cg.sweep_ram_groups(self.paths.shm)
        self.cg.remove_parent_if_empty()
        self._repin_disturbed(name)
        partition_files.remove(self.paths.partition_dir(name))
        LOG.info("deleted partition %s (cores %s)", name, format_cpulist(rec.cpus))

    def _wait_empty(self, name: str, timeout: float = 10.0) -> None:
        deadline = time.monotonic() + timeout
        while self.cg.exists(name) and self.cg.pids(name) and time.monotonic() < deadline:
            time.sleep(0.05)

    # -- resize -----------------------------------------------------------------------
    @locked
    def resize(self, name: str, cpus: list[int] | None = None,
               memory_mib: int | None = None,
               memory_overcommit: float | None = None) -> PartitionRecord:
        """Change a partition's cores, memory budget and memory overcommit (each only
        when given)."""
        rec = self.db.partition(name)
        new_cpus = self.smt_cpus(name, cpus, rec.smt) if cpus is not None else rec.cpus
        new_mem = memory_mib if memory_mib is not None else rec.memory_mib
        if not new_cpus:
            raise SpecError("a partition needs at least one core.")
        self.check_cpus(name, new_cpus)
        self.check_memory(name, new_mem, memory_overcommit)
        from fusuma.governor.qos import check_cores, check_emulators

        check_cores(name, len(new_cpus), self.db.vms(name))

        check_emulators(name, sorted(new_cpus), self.db.vms(name))
        new = PartitionRecord(**{**rec.__dict__, "cpus": sorted(new_cpus),
                                 "memory_mib": new_mem,
                                 "memory_overcommit": rec.memory_overcommit
                                 if memory_overcommit is None else memory_overcommit})
        # A resize killed half-way is finished from the record by recovery (the record
        # is written last, so the kernel gets the limits the record names).
        with self.job(partition_obj(name), JobKind.RESIZE) as jh, Reverter() as rev:
            jh.phase("cgroup", cpus=new.cpus, memory_mib=new.memory_mib)
            rev.add(lambda: self.cg.update(name, self.limits(rec)), "cgroup limits")
            self.cg.update(name, self.limits(new))
            jh.phase("record")
            self.db.update_partition(new)
            rev.add(lambda: self.db.update_partition(rec), "db row")
            rev.commit()
        self.db.emit("lifecycle", "partition-resized", f"/1.0/partitions/{name}",
                     cpus=new.cpus, memory_mib=new.memory_mib,
                     memory_overcommit=new.memory_overcommit,
                     old_cpus=rec.cpus, old_memory_mib=rec.memory_mib)
        # The kernel resets the affinity of every task in a changed cpuset: pin again.
        try:
            self.client(name).send(rpc.Repin())
        except FusumaError as exc:
            LOG.warning("partition %s resized, but its vCPUs were not re-pinned: %s", name, exc)
        self._repin_disturbed(name)
        return new

    @locked
    def set_memory_overcommit(self, name: str, value: float | None) -> PartitionRecord:
        """Set a partition's memory overcommit (None: the host's again), refused while
        the VMs already admitted would not fit at it."""
        from fusuma import capacity

        rec = self.db.partition(name)
        effective = capacity.effective_overcommit(value, capacity.host_overcommit(self.db))
        capacity.check_host_room(self.db, self.host, name, rec.memory_mib, effective)
        new = PartitionRecord(**{**rec.__dict__, "memory_overcommit": value})
        self.db.update_partition(new)
        self.db.emit("lifecycle", "partition-resized", f"/1.0/partitions/{name}",
                     memory_overcommit=value, old_memory_overcommit=rec.memory_overcommit)
        return new

    @locked
    def set_host_overcommit(self, value: float) -> float:
        """Set the host's memory overcommit, refused while the VMs already admitted would
        not fit at it; returns the old one."""
        from fusuma import capacity

        old = capacity.host_overcommit(self.db)
        if value != old:
            capacity.check_host_overcommit(self.db, self.host, value)
            self.db.set_setting(capacity.OVERCOMMIT_KEY, repr(float(value)))
            self.db.emit("lifecycle", "host-updated", "/1.0", memory_overcommit=value,
                         old_memory_overcommit=old)
        return old

    def limits(self, rec: PartitionRecord) -> cgroups.Limits:
        from fusuma.host import cgroups

        return cgroups.Limits(cpus=rec.cpus, mems=self.host.mems,
                              memory_bytes=rec.memory_mib * 1024 * 1024,
                              io_weight=rec.io_weight)

    # -- supervisor -------------------------------------------------------------------
    def supervisor_pid(self, name: str) -> int | None:
        """The live supervisor's pid, checked against its command line."""
        return liveness.supervisor_pid(self.paths, name,
                                       self.db.partition(name).supervisor_pid)

    def status(self, name: str) -> PartitionStatus:
        return PartitionStatus(self.db.partition(name), self.supervisor_pid(name) is not None)

    # Generous: a supervisor imports asyncio, QMP and the governor, which takes ~8 s on
    # a slow machine (a TCG guest); success returns as soon as its socket answers.
    def start_supervisor(self, name: str, timeout: float = 60.0) -> int:
        if self.supervisor_pid(name) is not None:
            raise StateError(f"partition {name!r} already has a running supervisor.")
        pdir = ensure_dir(self.paths.partition_dir(name), PRIVATE_DIR)
        # One start at a time per partition, until its socket answers (its pidfile is
        # written by then).
        with exclusive(pdir / partition_files.START_LOCK):
            # Another process may have started one while this one waited here (an
            # agent's pass over its partitions and a move's next step, both finding the
            # supervisor killed): that one adopts the QEMUs, and a second must not.
            pid = self.supervisor_pid(name)
            if pid is not None:
                return pid
            return self._start(name, pdir, timeout)

    def _start(self, name: str, pdir: Path, timeout: float) -> int:
        self.paths.ensure_runtime()   # the socket's dir: runtime/partitions, 0711
        logf = pdir / partition_files.SUPERVISOR_LOG
        units = self.units
        if units is not None:
            return self._start_unit(units, name, logf, timeout)
        env = spawn.child_env({**os.environ, **self.paths.as_env()})
        with open(logf, "ab") as log:
            child = subprocess.Popen(spawn.module_argv(SUPERVISOR_MODULE, name),
                                     stdin=subprocess.DEVNULL, stdout=log, stderr=log,
                                     start_new_session=True, close_fds=True, env=env,
                                     cwd=spawn.CWD)
        deadline = time.monotonic() + timeout
        client = self.client(name)
        while time.monotonic() < deadline:
            if child.poll() is not None:
                raise SupervisorError(f"the supervisor of partition {name!r} exited at start: "
                                      f"{process.tail(logf, 1)}")
            if client.alive():
                return child.pid
            time.sleep(0.05)
        child.kill()
        child.wait()
        raise SupervisorError(f"the supervisor of partition {name!r} did not come up in "
                              f"{timeout:.0f} s; see {logf}.")

    def _start_unit(self, units: Units, name: str, logf: Path, timeout: float) -> int:
        """Start the supervisor as ``fusuma-supervisor@INSTANCE`` and wait for its socket;
        a unit that fails is stopped again and says why."""
        from fusuma.host import systemd

        unit = units.supervisor(name)
        # The unit gets this namespace's settings (and a checkout's PYTHONPATH), not
        # the CLI's whole environment.
        env = spawn.child_env({k: v for k, v in os.environ.items()
                               if k.startswith("FUSUMA_") or k == "PYTHONPATH"})
        env.update(self.paths.as_env())
        try:
            units.install()
            units.write_supervisor(name, env, logf,
                                   systemd.named_netns("a partition's supervisor"))
            units.start(unit)
        except HostError as exc:
            units.run(["systemctl", "stop", unit])
            units.run(["systemctl", "reset-failed", unit])
            raise SupervisorError(f"the supervisor of partition {name!r} did not start: "
                                  f"{exc}") from exc
        deadline = time.monotonic() + timeout
        client = self.client(name)
        active = units.active_check(unit)
        while time.monotonic() < deadline:
            if client.alive():
                pid = units.main_pid(unit)
                if pid is not None:
                    return pid
            if not active():
                why = process.tail(logf, 1) or units.why_failed(unit)
                units.run(["systemctl", "reset-failed", unit])
                raise SupervisorError(f"the supervisor of partition {name!r} ({unit}) "
                                      f"exited at start: {why}")
            time.sleep(0.05)
        units.run(["systemctl", "stop", unit])
        raise SupervisorError(f"the supervisor of partition {name!r} ({unit}) did not come "
                              f"up in {timeout:.0f} s; see {logf} and `systemctl status "
                              f"{unit}`.")

    def stop_supervisor(self, name: str, timeout: float = 10.0) -> bool:
        """End the supervisor (SIGTERM, then SIGKILL); its VMs keep running."""
        units = self.units
        if units is not None:
            # KillMode=process: systemd signals the supervisor only, never its VMs.
            unit = units.supervisor(name)
            was = units.active(unit)
            if was:
                units.stop(unit)
            else:
                units.run(["systemctl", "reset-failed", unit])
            return was
        pid = self.supervisor_pid(name)
        if pid is None:
            return False
        process.kill(pid, signal.SIGTERM)
        deadline = time.monotonic() + timeout
        while process.pid_alive(pid) and time.monotonic() < deadline:
            time.sleep(0.05)
        if process.pid_alive(pid):
            process.kill(pid)
        with contextlib.suppress(ChildProcessError):
            os.waitpid(pid, os.WNOHANG)
        return True

    @locked
    def restart(self, name: str) -> int:
        """A new supervisor for ``name`` that re-adopts its running VMs."""
        self.db.partition(name)
        old = self.stop_supervisor(name)
        pid = self.start_supervisor(name)
        self.db.emit("lifecycle", "partition-restarted", f"/1.0/partitions/{name}",
                     supervisor_pid=pid, was_running=old)
        return pid

    # -- storage directories ----------------------------------------------------------
    @locked
    def add_storage(self, path: str, shared: bool = False) -> Path:
        """Declare a directory for disk files (root's CLI and spec only)."""
        from fusuma.host import storage

        return storage.add(self.paths, self.db, path, shared)

    @locked
    def remove_storage(self, path: str) -> Path:
        """Undeclare a storage directory; refused while a disk or a VM's files
        (``vm create --storage``) lie in it."""
        from fusuma.host import storage
        from fusuma.images.store import placed_in

        real = Path(os.path.realpath(path)) if os.path.isabs(path) else None
        held = [v.name for v in self.db.vms()
                if real is not None and (p := placed_in(self.paths, v.name)) is not None
                and p.parent == real]
        if held:
            raise StateError(f"storage directory {real} holds the files of VM(s) "
                             f"{', '.join(held)}; delete them first (`fusuma vm delete`).")
        return storage.remove(self.paths, self.db, path)

    def storage_dirs(self) -> list[Path]:
        from fusuma.host import storage

        return storage.declared(self.paths, self.db)

    # -- disks ------------------------------------------------------------------------
    @locked
    def add_disk(self, spec: DiskSpec) -> DiskRecord:
        """Register (or, with ``size_mib`` and no file there, create) a disk file inside
        a storage directory (``fusuma.host.storage``), with its device and inode."""
        from fusuma.host import storage

        check_name("disk", spec.name)
        self.db.partition(spec.partition)
        if self.db.find_disk(spec.name) is not None:
            raise ConflictError(f"a disk named {spec.name!r} already exists.")
        place = storage.locate(self.paths, self.db, spec.path)
        ident, created = storage.claim(place, spec.size_mib)
        path = place.path
        rec = DiskRecord(spec.name, str(path), spec.partition, created, ident.dev, ident.ino)
        try:
            same = self.db.disk_with_identity(ident.dev, ident.ino)
            if same is not None:
                raise ConflictError(f"{path} is the file of disk {same.name!r} already "
                                    f"({same.path}).")
            self.db.add_disk(rec)
        except ConflictError:
            if created:
                path.unlink()
            raise
        return rec

    @locked
    def move_disk(self, name: str, to: str) -> DiskRecord:
        disk = self.db.disk(name)
        self.db.partition(to)
        users = [v for v in self.db.vms() if name in v.disks]
        if users:
            v = users[0]
            raise StateError(f"disk {name!r} is attached to VM {v.name!r} ({v.state.value}); "
                             f"detach it first with `fusuma vm detach {v.name} {name}`.")
        self.db.move_disk(name, to)
        return replace(disk, partition=to)

    @locked
    def remove_disk(self, name: str, delete_file: bool = False) -> None:
        """Unregister disk ``name``; ``delete_file``: also delete its file, which is
        refused (nothing changes) unless fusuma created it and it is still that file."""
        from fusuma.host import storage

        disk = self.db.disk(name)
        users = [v.name for v in self.db.vms() if name in v.disks]
        if users:
            raise StateError(f"disk {name!r} is attached to VM {users[0]!r}; detach it first.")
        if delete_file:
            why = storage.deletable(disk)
            if why is not None:
                raise StateError(f"disk {name!r}: {why}; remove the disk without deleting "
                                 "its file, and delete the file yourself if you mean to.")
        self.db.remove_disk(name)
        if delete_file:
            why = storage.delete_file(disk)
            if why is not None:
                self.notice(f"fusuma: notice: disk {name!r} removed, its file kept: {why}.")

    @locked
    def drop_disk(self, name: str) -> None:
        """Unregister disk ``name`` as part of removing more (a partition, the host):
        its file goes if fusuma created it and it is still that file, else it stays
        with a notice when fusuma created it."""
        from fusuma.host import storage

        disk = self.db.disk(name)
        self.db.remove_disk(name)
        if disk.created_file:
            why = storage.delete_file(disk)
            if why is not None:
                self.notice(f"fusuma: notice: disk {name!r} removed, its file kept: {why}.")

