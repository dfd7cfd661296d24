"""What a supervisor's handlers get: one partition's QEMUs, state and cgroups.

:class:`PartitionHost` is the narrow interface every handler receives (VM lifecycle in
``fusuma.supervisor.vms``, the sides of a move in ``fusuma.supervisor.moves.source`` /
``dest`` / ``cpr`` / ``remote``, templates in ``fusuma.supervisor.templates``); none
of them sees the daemon that serves the socket. It holds:

- ``instances``: the partition's QEMUs (``fusuma.qemu.instance``), each with its role;
- the state (``db``), jobs on VMs (:meth:`job`, :meth:`phase`) and the state settling
  of :meth:`settle_state`;
- the cgroups (``cg``), RAM files and their memory groups;
- :meth:`launch`: a QEMU for a VM in this partition, from its record to a connected
  instance, as one transaction;
- :meth:`watch`: what happens to the records when a QEMU ends.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

from fusuma import capacity
from fusuma.errors import FusumaError, NotFoundError, StateError
from fusuma.governor.qos import emulator_cores, vcpu_order
from fusuma.host import cgroups, oom
from fusuma.memshare import clones
from fusuma.memshare.ksm import enable_merge_any
from fusuma.names import vm_leaf
from fusuma.network import queues
from fusuma.paths import PRIVATE_DIR, Paths, ensure_dir
from fusuma.qemu import privilege, process, versions
from fusuma.qemu.cmdline import DeviceSetMismatch, build_argv
from fusuma.qemu.consolelog import LOG_NAME, ConsoleLog
from fusuma.qemu.instance import (
    Instances,
    LaunchPlan,
    QemuInstance,
    Role,
    remove_run_files,
)
from fusuma.qemu.process import end_unmanaged
from fusuma.qemu.qga import GuestAgent
from fusuma.state import (
    LOCAL_JOBS,
    Database,
    Decision,
    Job,
    JobKind,
    JobOwner,
    VmRecord,
    VmState,
    busy_sentence,
    vm_obj,
)
from fusuma.state.joblock import JobLock
from fusuma.state.machine import valid_transition
from fusuma.supervisor import config, rpc
from fusuma.undo import Reverter


class PartitionHost:
    """One partition's QEMUs, state and cgroups (see the module docstring)."""

    def __init__(self, paths: Paths, partition: str, db: Database,
                 cg: cgroups.CgroupDriver, log: logging.Logger) -> None:
        self.paths = paths
        self.partition = partition
        self.db = db
        self.cg = cg
        self.log = log
        self.instances = Instances()
        self.owner = JobOwner.me()
        self._locks: dict[str, asyncio.Lock] = {}
        # One caller at a time on each guest agent channel (so `stop` always flushes).
        self._agent_locks: dict[str, asyncio.Lock] = {}
        # Set by the daemon: finish a local job whose owner died (fusuma.supervisor.
        # recover), and the governor's class of a QEMU, and its pinning.
        self.recover_local: Callable[[Job], Awaitable[None]] | None = None
        # The recovery of a local job kind kept in its own module (snapshots), by kind.
        self.local_recoverers: dict[str, Callable[[Job], Awaitable[None]]] = {}
        self.apply_class: Callable[[VmRecord, int], None] = lambda rec, pid: None
        self.pin_guaranteed: Callable[[], object] = lambda: None
        # Each VM's last move into this partition as its commit answered it (when the
        # guest resumed here, the steps): a caller that asks only after the commit
        # ended gets those, not the moment it asked (fusuma.supervisor.moves.dest).
        self.arrived: dict[str, rpc.Resumed] = {}

    # -- records ----------------------------------------------------------------------
    def vm(self, name: str) -> VmRecord:
        """VM ``name``'s record, which must be of this partition."""
        vm = self.db.vm(name)
        if vm.partition != self.partition:
            raise NotFoundError(f"VM {name!r} is in partition {vm.partition!r}, "
                                f"not {self.partition!r}.")
        return vm

    def running(self, vm: str) -> tuple[VmRecord, QemuInstance]:
        rec = self.vm(vm)
        inst = self.instances.get(vm)
        if inst is None:
            raise StateError(f"VM {vm!r} is {rec.state.value}; start it with "
                             f"`fusuma vm start {vm}`.")
        return rec, inst

    def settle_state(self, name: str, to: VmState, **fields: Any) -> None:
        """Bring a VM to ``to`` (with ``fields``) from whatever non-final state it was
        left in, in one transaction: no reader sees a step on the way, such as a
        crashed VM without the reason that ``fields`` bring."""
        with self.db.atomic():
            rec = self.db.vm(name)
            if rec.state == to:
                if fields:
                    self.db.set_vm(name, **fields)
                return
            via = {VmState.CRASHED: (), VmState.STOPPED: (VmState.STOPPING,),
                   VmState.RUNNING: (), VmState.PAUSED: ()}.get(to, ())
            if not valid_transition(rec.state, to):
                for step in via:
                    if valid_transition(rec.state, step):
                        self.db.transition(name, step)
                        break
                else:
                    if rec.state == VmState.STOPPING and to in (VmState.RUNNING,
                                                                VmState.PAUSED):
                        # A stop that never happened: the QEMU is still there.
                        self.db.transition(name, VmState.CRASHED)
                        self.db.transition(name, VmState.STARTING)
            self.db.transition(name, to, **fields)

    # -- locks and jobs ---------------------------------------------------------------
    def lock(self, vm: str) -> asyncio.Lock:
        return self._locks.setdefault(vm, asyncio.Lock())

    def agent_lock(self, vm: str) -> asyncio.Lock:
        return self._agent_locks.setdefault(vm, asyncio.Lock())

    def agent(self, inst: QemuInstance) -> GuestAgent:
        """A guest agent session on ``inst`` (hold :meth:`agent_lock` around it)."""
        return GuestAgent(inst.vm, inst.run_dir / "qga.sock", self.vm_logger(inst.vm))

    @contextlib.asynccontextmanager
    async def job(self, vm: str, kind: str) -> AsyncIterator[JobLock]:
        """Hold VM ``vm`` for a local job (start, stop, kill, template save): the one
        job lock (``fusuma.state.joblock``); a local job of this partition whose owner
        died is recovered here first, any other is left to its recovery."""
        async def recover(held: Job) -> None:
            if held.kind in LOCAL_JOBS and held.source == self.partition \
                    and self.recover_local is not None:
                await self.recover_local(held)
                return
            raise StateError(f"VM {vm!r} is being recovered: the owner (pid "
                             f"{held.owner.pid}) of its {held.kind} job died; try again "
                             "in a few seconds.")
        async with await JobLock(self.db, vm_obj(vm), kind, source=self.partition,
                                 owner=self.owner, tries=2).take_async(recover) as lock:
            yield lock

    def phase(self, vm: str, phase: str, **detail: object) -> None:
        with contextlib.suppress(StateError):
            self.db.set_phase(vm_obj(vm), self.owner, phase, **detail)

    def no_job(self, vm: str) -> None:
        """Refuse to use a VM another operation holds (a move, a stop...)."""
        job = self.db.find_job(vm_obj(vm))
        if job is None:
            return
        if job.owner.alive():
            raise StateError(busy_sentence(job))
        raise StateError(f"VM {vm!r} is being recovered: the owner (pid {job.owner.pid}) of "
                         f"its {job.kind} job died; try again in a few seconds.")

    # -- QEMU -------------------------------------------------------------------------
    def vm_logger(self, vm: str) -> logging.Logger:
        log = logging.getLogger(f"fusuma.vm.{vm}")
        for old in list(log.handlers):
            # A VM of that name deleted since (its directory with it) and made again,
            # as a move between hosts that went back and came again does: a handler
            # would write on into the deleted file.
            if isinstance(old, logging.FileHandler) and not os.path.exists(old.baseFilename):
                log.removeHandler(old)
                old.close()
        if not log.handlers:
            vdir = ensure_dir(self.paths.vm_dir(vm), PRIVATE_DIR)
            h = logging.FileHandler(vdir / "qmp.log")
            h.setFormatter(logging.Formatter("%(asctime)s %(message)s"))
            log.addHandler(h)
            log.setLevel(logging.DEBUG)
            log.propagate = False
        return log

    def console_log(self, vm: str) -> ConsoleLog:
        """Where VM ``vm``'s console goes, capped (fusuma.qemu.consolelog)."""
        return ConsoleLog(self.paths.vm_dir(vm) / LOG_NAME, self.paths.console_log_max)

    def qemu(self) -> versions.Qemu:
        """This partition's QEMU (fusuma.qemu.versions: cached, no subprocess)."""
        return versions.resolve(self.paths, self.db.partition(self.partition).qemu)

    async def launch(self, vm: VmRecord, accel: str, run: Path, ram: Path | None,
                     incoming: str | None, rev: Reverter, *,
                     role: Role = Role.RUNNING, owns_ram: bool = True,
                     disk_owner: str | None = None,
                     cpr_socket: Path | None = None,
                     own_taps: bool = False, join_taps: bool = False,
                     control: bool = False) -> QemuInstance:
        """Start one QEMU for ``vm`` in this partition's cgroup, as the VM's own uid,
        and connect QMP (``cpr_socket``: an in-place move's new QEMU, which opens QMP
        only once the old one has sent the guest's descriptors: wait until it listens
        there instead; ``join_taps``: a move's destination on this host, whose NICs
        join the taps the VM's running QEMU holds; ``control``: its leaf gets the
        control weight, not its class's, from before the QEMU exists, see
        :meth:`control_cpu`). Every step registers its undo with ``rev`` (the caller's
        transaction). The instance is registered and watched."""
        t0 = time.monotonic()
        q = self.qemu()
        uid = privilege.uid_for(self.paths, vm)
        groups = privilege.groups_for(accel)
        if accel == "kvm":
            privilege.check_kvm_access(groups)
        cfg = config.vm_config(self, vm, accel, run, ram, incoming, disk_owner)
        devices = config.devices(self, vm, cfg, q, incoming)
        cfg = replace(cfg, devices=devices, data_dirs=q.data_dirs,
                      cpu_off=versions.cpu_off(q, devices.cpu_features),
                      aux_ram_share=q.features.get("aux-ram-share", False),
                      cpr_socket=cpr_socket)
        if incoming is None and clones.resumes(self.paths, vm):
            cfg, groups = clones.clone_config(self.paths, self.db, vm, cfg, groups)
        remove_run_files(run)
        self.paths.ensure_runtime()
        # ``run`` is the VM's run dir or, for a move's destination, a dir in it.
        for d in (self.paths.vm_run_dir(vm.name), run):
            ensure_dir(d, PRIVATE_DIR, owner=uid)
        ensure_dir(self.paths.vm_dir(vm.name), PRIVATE_DIR)
        self.paths.ensure_shm()
        rev.add(lambda: remove_run_files(run))
        if ram is not None and incoming is None:
            self.remove_ram(ram)
            rev.add(lambda: self.remove_ram(ram))
        leaf = vm_leaf(vm.name)
        self.cg.create_leaf(self.partition, leaf)
        rev.add(lambda: self.delete_leaf(vm.name))
        if control:
            # Before the exec: a QEMU starting at its class's weight beside a VM busy
            # at the top weight gets ~1% of the core, and its start (~0.3 s of CPU)
            # then takes tens of seconds, against the QMP connect's deadline.
            self.control_cpu(vm.name)
            sharing = self.instances.get(vm.name)
            if sharing is not None:
                # An in-place move's: the running QEMU shares the leaf; a failed start
                # gives it back its class's weight.
                rev.add(lambda: self.class_cpu(vm.name, sharing.pid))
        cg, part, mergeable = self.cg, self.partition, vm.mergeable
        # Where the memory hierarchy is separate (cgroup v1), QEMU's memory membership is
        # its RAM file's group: guest RAM is faulted lazily and charged there, wherever
        # the VM runs, with QEMU's own memory (all QEMUs of the file: a move's two).
        ram_stem = ram.name.removesuffix(".ram") if ram is not None and \
            self.cg.separate_memory else None

        def into_cgroup() -> None:
            # Before exec: QEMU's memory is charged to its own leaf (or RAM group) from
            # the first page. Joining the cgroup and KSM merge-any need root: privileges
            # go last.
            cg.attach(part, leaf, os.getpid(), ram_stem=ram_stem)
            if mergeable:
                enable_merge_any()
            privilege.drop_to(uid, groups)

        # A new VM gets a new RAM file; a move's destination opens the one its caller
        # chose (the source's for zero-copy, a new one made for a copy).
        # ``own_taps``: a move from another host, whose VM is defined here with taps of
        # its own (its slot on this host): made like a boot's. ``join_taps``: a move on
        # this host, whose destination joins the taps the running QEMU holds.
        if cfg.nics and incoming is not None and not (own_taps or join_taps):
            raise StateError(f"VM {vm.name!r} has NICs on taps, which this kind of move "
                             "cannot hand over; stop it and start it again instead.")
        cfg, files = privilege.open_for_qemu(cfg, uid, new_ram=incoming is None)
        headers: dict[str, int] = {}
        with files:
            if join_taps and incoming is not None:
                # A move on this host: queues of the taps the running QEMU holds.
                cfg, headers = config.join_taps(cfg, files.add)
            else:
                cfg = config.open_taps(cfg, uid, files.add)
            if cfg.template_ram is not None:
                cfg = clones.open_files(self.db, vm, cfg, files)
            if ram is not None and incoming is None:
                self.charge_ram(ram, vm.memory_mib)
            if ram_stem is not None:
                self.cg.create_ram_group(ram_stem, capacity.lazy_ram_limit(
                    vm.memory_mib * 2**20, capacity.vm_overhead(vm) * 2**20))
            try:
                argv = build_argv(cfg, str(q.binary))
            except DeviceSetMismatch as exc:
                raise StateError(f"{exc}; stop and start it to record its devices anew."
                                 ) from exc
            plan = LaunchPlan(argv, {**os.environ, **q.env}, cfg.passed_fds(), into_cgroup,
                              self.paths.vm_dir(vm.name) / "qemu.log", cfg.qmp_socket,
                              cpr_socket=cpr_socket, uid=uid,
                              cgroup=f"{self.partition}/{leaf}",
                              console=self.console_log(vm.name))
            def spawned(pid: int) -> None:
                if incoming is None:
                    # Known at once, so a supervisor killed during the start leaves a
                    # QEMU that the next one can find (or end) by its checked pid. The
                    # guest boots with these devices: every move's destination gets
                    # the same.
                    self.db.set_vm(vm.name, pid=pid, machine=devices.machine,
                                   devices=devices.dumps())
                elif not vm.devices:
                    # A guest booted by a fusuma that recorded nothing: what it got,
                    # from now on.
                    self.db.set_vm(vm.name, machine=devices.machine,
                                   devices=devices.dumps())
                if not control:
                    self.apply_class(vm, pid)
                oom.set_score(pid, oom.qemu_score(vm.memory_class),
                              f"the QEMU of {vm.name}")

            held = self.instances.get(vm.name, role)
            if held is not None:
                raise StateError(f"VM {vm.name!r} already has a {role.value} QEMU (pid "
                                 f"{held.pid}) in partition {self.partition!r}.")
            # Its start sets each tap's header size to its own default under the QEMU
            # that runs the guest (``queues.HeaderHold``): held at that one's meanwhile.
            hold = queues.HeaderHold(vm.pid, headers) if headers and vm.pid else None
            if hold is not None:
                hold.start()
            t1 = time.monotonic()
            try:
                inst = await QemuInstance.launch(vm.name, plan, run_dir=run, ram_file=ram,
                                                 logger=self.vm_logger(vm.name), role=role,
                                                 version=q.version, on_spawn=spawned,
                                                 console_fd=files.take_console())
            finally:
                if hold is not None:
                    hold.stop()
        t2 = time.monotonic()
        self.log.info("%s: QEMU pid %d (%s) up in %.0f ms: its plan %.0f ms, its start to "
                      "%s %.0f ms", vm.name, inst.pid, role.value, (t2 - t0) * 1000,
                      (t1 - t0) * 1000, "its cpr channel" if cpr_socket else "QMP",
                      (t2 - t1) * 1000)
        rev.add(lambda: asyncio.ensure_future(inst.qmp.disconnect()))
        rev.add(inst.reap)
        inst.owns_ram = owns_ram
        self.instances.add(inst)
        rev.add(lambda: self.instances.remove(inst))
        self.watch(inst)
        if headers:
            # Its start set each tap's header size to its own default, under the QEMU
            # that runs the guest: put that one's back (fusuma.network.queues).
            queues.restore_header(inst.pid, headers)
        return inst

    # -- watching ---------------------------------------------------------------------
    def watch(self, inst: QemuInstance) -> None:
        inst.watch(self._record_exit, self._forget)
        if inst.role == Role.RUNNING:
            self.follow_runstate(inst)

    def follow_runstate(self, inst: QemuInstance) -> None:
        """running <-> paused in the record as QEMU reports STOP and RESUME (only while
        no job holds the VM: a move's pause is the move's business)."""
        inst.follow_runstate(self._runstate_changed)

    def _runstate_changed(self, inst: QemuInstance, paused: bool) -> None:
        if self.instances.get(inst.vm) is not inst or inst.stopping:
            return
        if self.db.find_job(vm_obj(inst.vm)) is not None:
            return
        want, was = ((VmState.PAUSED, VmState.RUNNING) if paused
                     else (VmState.RUNNING, VmState.PAUSED))
        with contextlib.suppress(FusumaError):
            self.db.transition(inst.vm, want, expect={was})

    def _forget(self, inst: QemuInstance) -> None:
        """A QEMU ended: out of the registry before anything waits, so that nothing
        takes it for a live one meanwhile."""
        self.instances.remove(inst)
        if inst.move is not None and inst.move.task is not None:
            inst.move.task.cancel()      # whoever waits for it learns at once

    async def _record_exit(self, inst: QemuInstance) -> None:
        """A QEMU ended (forgotten, its own cleanup done): its RAM, its cgroup and, if
        it was the VM's own, the VM's record."""
        was = inst.role
        self._forget(inst)
        if inst.ram_file is not None and inst.owns_ram:
            self.remove_ram(inst.ram_file)
        self.delete_leaf(inst.vm)
        running = self.instances.get(inst.vm)
        if was == Role.LEAVING and running is not None and running is not inst:
            # The old QEMU of an in-place move ended (released, or not): the leaf the
            # new one runs in goes back from the move's control weight to its class's.
            self.class_cpu(inst.vm, running.pid)
        rec = self.db.find_vm(inst.vm)
        job = self.db.find_job(vm_obj(inst.vm))
        if was != Role.RUNNING or rec is None or rec.partition != self.partition \
                or rec.pid != inst.pid:
            self.log.info("%s (pid %d) exited; its record belongs elsewhere", inst.vm,
                          inst.pid)
            if inst.ram_file is not None and (rec is None or (
                    rec.state in (VmState.CRASHED, VmState.STOPPED)
                    and rec.ram_path == str(inst.ram_file))):
                # The last QEMU of a guest that is gone: its RAM goes too.
                self.remove_ram(inst.ram_file)
            return
        if job is not None and job.kind == JobKind.MIGRATE and not (
                job.detail.get("decision") == Decision.FORWARD and job.peer == self.partition):
            # A move is under way: its owner (or recovery) decides what this means.
            self.log.warning("%s (pid %d) exited during a move", inst.vm, inst.pid)
            return
        if inst.stopping:
            with contextlib.suppress(FusumaError):
                self.settle_state(inst.vm, VmState.STOPPED, pid=None, error=inst.stop_note)
            self.log.info("%s stopped", inst.vm)
            return
        msg = f"QEMU {inst.how_ended} unexpectedly{self._log_news(inst)}"
        with contextlib.suppress(FusumaError):
            self.settle_state(inst.vm, VmState.CRASHED, pid=None, error=msg)
        self.log.warning("%s crashed: %s", inst.vm, msg)

    def _log_news(self, inst: QemuInstance) -> str:
        """``": <QEMU's last log line>"`` if QEMU wrote it after its start, else empty."""
        tail = process.tail(self.paths.vm_dir(inst.vm) / "qemu.log", 1)
        return f": {tail}" if tail and tail != inst.started_log else ""

    async def end_note(self, inst: QemuInstance, wait: float = 2.0) -> str:
        """For the message of a QMP command that ``inst`` broke off: how the QEMU ended,
        once its end is seen within ``wait`` seconds; empty while it runs on."""
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(inst.exited.wait(), wait)
        if not inst.exited.is_set():
            return ""
        return f" (its QEMU, pid {inst.pid}, {inst.how_ended}{self._log_news(inst)})"

    def end_unmanaged(self, rec: VmRecord) -> None:
        """A QEMU no instance holds (it never answered QMP): end it by its checked pid,
        and the VM is stopped."""
        if rec.pid:
            end_unmanaged(rec.pid, rec.name, self.paths.vm_run_dir(rec.name))
        remove_run_files(self.paths.vm_run_dir(rec.name))
        if rec.ram_path:
            self.remove_ram(Path(rec.ram_path))
        self.delete_leaf(rec.name)
        self.settle_state(rec.name, VmState.STOPPED, pid=None)

    # -- pinning ----------------------------------------------------------------------
    async def repin_all(self) -> dict[str, list[int]]:
        """Spread the vCPUs of all running VMs round-robin over the partition's cores,
        the guaranteed VMs' first; each VM's other threads go where its ``emulator``
        setting says (fusuma.governor.qos.emulator_cores)."""
        out: dict[str, list[int]] = {}
        offset = 0
        cores = self.db.partition(self.partition).cpus
        running = self.instances.running()
        recs = [v for v in self.db.vms(self.partition) if v.name in running]
        for rec in vcpu_order(recs):
            try:
                others = emulator_cores(rec, cores, recs)
            except FusumaError as exc:
                self.log.warning("%s; its emulator threads share the partition's cores", exc)
                others = cores
            out[rec.name] = await self._repin(running[rec.name], offset, others)
            offset += len(out[rec.name])
        for name in sorted(set(running) - {r.name for r in recs}):
            out[name] = await self._repin(running[name], offset)
            offset += len(out[name])
        self.pin_guaranteed()   # cores a guaranteed VM has to itself stay its own
        return out

    async def _repin(self, inst: QemuInstance, offset: int = 0,
                     others: list[int] | None = None) -> list[int]:
        cpus = self.db.partition(self.partition).cpus
        tids = inst.vcpu_tids
        if tids is None:
            # Asked once per QEMU: each move's commit re-pins every VM of the
            # partition, and a QMP round trip to each of them (every QEMU scheduled on
            # the partition's busy cores) made a move's finish grow by about 8 ms per
            # VM already there.
            try:
                vcpus = await inst.qmp.query_cpus_fast()
            except FusumaError as exc:
                self.log.warning("cannot query vCPUs of %s: %s", inst.vm, exc)
                return []
            tids = [v.thread_id for v in sorted(vcpus, key=lambda v: v.index)]
            foreign = process.foreign_tids(inst.pid, tids)
            if foreign:
                self.log.warning("%s: QEMU pid %d reports vCPU thread id(s) %s that are "
                                 "not threads of its own; nothing is pinned there",
                                 inst.vm, inst.pid, ", ".join(map(str, foreign)))
            else:
                inst.vcpu_tids = tids
        given = process.pin(inst.pid, tids, cpus, offset, others)
        return [given[t][0] for t in tids if t in given]

    # -- RAM files and cgroups ----------------------------------------------------------
    def remove_ram(self, ram: Path) -> None:
        """Unlink a guest RAM file, never while any QEMU still maps it (a move's other
        side may), and the memory cgroup its pages were charged to."""
        if not process.remove_unmapped(ram, self.paths):
            self.log.info("kept RAM file %s: still mapped, or already gone", ram)
        self.cg.sweep_ram_groups(self.paths.shm)

    def charge_ram(self, ram: Path, memory_mib: int) -> None:
        """Give a new RAM file a memory cgroup of its own (see fusuma.host.cgroups:
        guest RAM) before any QEMU maps it. Where a QEMU's memory can sit in that group
        (cgroup v1), its faults charge it lazily; elsewhere its pages are allocated now,
        from a process in the group."""
        stem = ram.name.removesuffix(".ram")
        size = memory_mib * 1024 * 1024
        t0 = time.monotonic()
        self.cg.create_ram_group(stem, capacity.ram_group_limit(size))
        if self.cg.separate_memory:
            return
        try:
            self.cg.charge_ram(stem, ram, size)
        except BaseException:
            with contextlib.suppress(FusumaError):
                self.cg.delete_ram_group(stem)
            raise
        self.log.info("allocated %s (%d MiB) in its RAM cgroup in %.0f ms", ram.name,
                      memory_mib, (time.monotonic() - t0) * 1000)

    # -- the control weight of a moving VM's QEMU -------------------------------------
    def control_cpu(self, vm: str) -> None:
        """The control weight for VM ``vm``'s leaf while a move holds its guest paused
        (or about to be): the QEMU then does the move's work (a destination's start,
        saving or loading the device state), which a guaranteed VM busy beside it must
        not hold up. Best effort: a move goes on at the class's weight."""
        try:
            self.cg.set_control_cpu(self.partition, vm_leaf(vm))
        except FusumaError as exc:
            self.log.warning("%s: cannot give its QEMU the control weight: %s", vm, exc)

    def class_cpu(self, vm: str, pid: int) -> None:
        """VM ``vm``'s leaf back at its class's policy, its guest running here again."""
        try:
            self.apply_class(self.db.vm(vm), pid)
        except FusumaError as exc:
            self.log.warning("%s: cannot give its QEMU its class's weight again: %s",
                             vm, exc)

    def delete_leaf(self, vm: str) -> None:
        if vm in self.instances:
            return    # an in-place move's other QEMU of this VM still lives in it
        try:
            self.cg.delete_leaf(self.partition, vm_leaf(vm))
        except FusumaError as exc:
            self.log.warning("cannot remove cgroup of %s: %s", vm, exc)
