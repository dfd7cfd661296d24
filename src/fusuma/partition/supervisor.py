"""A partition's supervisor: its own hypervisor instance (Mint's OS node).

Run as ``python -m fusuma.partition.supervisor PARTITION``. It moves itself into the
partition's cgroup, re-adopts QEMU processes left running by an earlier supervisor
(pidfile + QMP socket), then serves requests on its UNIX socket. QEMU processes are
started in their own session, so killing the supervisor (even with SIGKILL) never
touches them; SIGTERM ends the supervisor and leaves the VMs running too.

Everything runs in one thread (asyncio): ``preexec_fn`` is used to place QEMU in its
cgroup before exec, which is only safe without other threads.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import logging
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from fusuma import capacity
from fusuma.errors import (
    FusumaError,
    GuestAgentError,
    HostError,
    NotFoundError,
    QemuError,
    SegmentError,
    StateError,
    SupervisorError,
)
from fusuma.governor.loop import Governor
from fusuma.governor.qos import emulator_cores, vcpu_order
from fusuma.host import cgroups
from fusuma.host.accel import probe_accel
from fusuma.images import find_image
from fusuma.memshare import reporting, template_ops
from fusuma.memshare.ksm import enable_merge_any
from fusuma.migration import cpr, remote
from fusuma.migration import supervisor_ops as migration_ops
from fusuma.partition import rpc
from fusuma.partition.supervisor_consts import INCOMING_PREFIX
from fusuma.paths import MAX_SOCKET_PATH, PRIVATE_DIR, Paths, ensure_dir
from fusuma.qemu import privilege, process, versions
from fusuma.qemu.cmdline import (
    DeviceSet,
    DeviceSetMismatch,
    DiskConfig,
    SegmentConfig,
    VmConfig,
    build_argv,
    device_set,
    new_vmgenid,
)
from fusuma.qemu.qga import GuestAgent
from fusuma.qemu.qmp import EVENT_RESUME, EVENT_STOP, Qmp
from fusuma.state import (
    Database,
    Job,
    JobOwner,
    VmRecord,
    VmState,
    busy_sentence,
    vm_obj,
)
from fusuma.state.machine import ALIVE, valid_transition

LOG = logging.getLogger("fusuma.supervisor")

DEFAULT_QEMU = "qemu-system-x86_64"
# A RAM cgroup's limit beyond its file's size: the page cache's index of the file's
# pages (xarray nodes, about 0.2% of its size; v1 charges them with the pages) and the
# allocating process itself.
def ram_group_limit(size_bytes: int) -> int:
    return size_bytes + size_bytes // 256 + 8 * 1024 * 1024


def lazy_ram_limit(size_bytes: int, overhead_bytes: int) -> int:
    """A RAM group that also holds the QEMUs mapping the file (cgroup v1): two of them
    while a move runs, each within its overhead."""
    return ram_group_limit(size_bytes) + 2 * overhead_bytes
# Jobs a supervisor owns and recovers itself (the CLI owns moves, deletes, resizes).
LOCAL_JOBS = ("start", "stop", "kill", "template")



def vm_leaf(vm: str) -> str:
    return f"vm.{vm}"


@dataclass
class VmRuntime:
    """What the supervisor holds for one running QEMU."""

    name: str
    pid: int
    qmp: Qmp
    run_dir: Path
    ram_file: Path | None
    child: subprocess.Popen[bytes] | None = None
    pidfd: int | None = None
    stopping: bool = False
    # False while another QEMU maps the same RAM file (zero-copy migration): then the
    # file must outlive this process.
    owns_ram: bool = True
    # An incoming migration target, or a source whose VM has moved on: its exit never
    # touches the VM's record, which belongs to the other side.
    detached: bool = False
    exited: asyncio.Event = field(default_factory=asyncio.Event)
    # The last QEMU log line when it started: an exit message must be newer.
    started_log: str | None = None
    # Follows QMP STOP/RESUME so that `ps` says paused when the guest is.
    runstate_task: asyncio.Task[None] | None = None
    qemu_version: str | None = None   # of the QEMU this supervisor started


class Supervisor:
    def __init__(self, paths: Paths, partition: str) -> None:
        self.paths = paths
        self.partition = partition
        self.db = Database(paths.db)
        self.cg = cgroups.for_paths(paths)
        self.vms: dict[str, VmRuntime] = {}
        # Migrations under way: destination QEMUs not yet running the VM, and source
        # QEMUs whose VM has moved on but which have not exited yet.
        self.incoming: dict[str, migration_ops.Incoming] = {}
        self.leaving: dict[str, VmRuntime] = {}
        self.log = LOG.getChild(partition)
        self._server: asyncio.AbstractServer | None = None
        self._done = asyncio.Event()
        self._locks: dict[str, asyncio.Lock] = {}
        # One caller at a time on each guest agent channel (so `stop` always flushes).
        self._agent_locks: dict[str, asyncio.Lock] = {}
        # Recovery processes this supervisor started, by job (obj, owner pid).
        self._recoverers: dict[tuple[str, int], subprocess.Popen[bytes]] = {}
        self.owner = JobOwner.me()
        self._handlers = self.handlers()
        self.governor = Governor(partition, self.cg, self.db,
                                 pids=lambda: {n: rt.pid for n, rt in self.vms.items()},
                                 repin=self._repin_all, leaf=vm_leaf, log=self.log)

    # -- lifecycle of the supervisor itself ------------------------------------------
    async def run(self) -> None:
        rec = self.db.partition(self.partition)
        self.cg.create_leaf(self.partition, "supervisor")
        self.cg.attach(self.partition, "supervisor", os.getpid())
        sock = self.paths.supervisor_socket(self.partition)
        sock.parent.mkdir(parents=True, exist_ok=True)
        with contextlib.suppress(FileNotFoundError):
            sock.unlink()
        await self.adopt()
        await self._repin_all()
        self._server = await asyncio.start_unix_server(self._handle, path=str(sock))
        os.chmod(sock, 0o600)
        self.paths.supervisor_pidfile(self.partition).write_text(f"{os.getpid()}\n")
        self.db.set_supervisor_pid(self.partition, os.getpid())
        self.db.emit("lifecycle", "partition-supervisor-started",
                     f"/1.0/partitions/{self.partition}", supervisor_pid=os.getpid(),
                     vms=sorted(self.vms))
        self.log.info("supervisor %d serving %s on cores %s", os.getpid(), sock, rec.cpus)
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, self._done.set)
        governing = asyncio.create_task(self.governor.run())
        sweeping = asyncio.create_task(self._sweep_jobs())
        await self._done.wait()
        governing.cancel()
        sweeping.cancel()
        await self.shutdown()

    async def shutdown(self) -> None:
        """Stop serving; VMs keep running and the next supervisor re-adopts them."""
        if self._server is not None:
            self._server.close()
        for rt in self.vms.values():
            await rt.qmp.disconnect()
            if rt.pidfd is not None:
                asyncio.get_running_loop().remove_reader(rt.pidfd)
                os.close(rt.pidfd)
        with contextlib.suppress(FileNotFoundError):
            self.paths.supervisor_socket(self.partition).unlink()
        with contextlib.suppress(FileNotFoundError):
            self.paths.supervisor_pidfile(self.partition).unlink()
        with self.db.transaction():
            cur = self.db.find_partition(self.partition)
            if cur is not None and cur.supervisor_pid == os.getpid():
                self.db.set_supervisor_pid(self.partition, None)
        self.log.info("supervisor %d stopped; %d VM(s) left running", os.getpid(),
                      len(self.vms))

    async def adopt(self) -> None:
        """Account for every QEMU of this partition that outlived a supervisor.

        Each QEMU found in this partition's VM cgroups (or named by a record) is taken
        back as what the state and the jobs say it is: a VM's own QEMU, a move's
        incoming destination or its leaving source. A QEMU nothing explains is ended
        if it is not running a guest. A record whose QEMU is gone becomes crashed. Jobs
        whose owner (an earlier supervisor) died are then finished here."""
        found: dict[str, list[int]] = {}
        for vm in self.db.vms(self.partition):
            if vm.pid:
                found.setdefault(vm.name, []).append(vm.pid)
        for name, pids in self._qemus_in_cgroup().items():
            found.setdefault(name, []).extend(pids)
        for name, pids in sorted(found.items()):
            for pid in sorted(set(pids)):
                if process.pid_alive(pid) and process.is_vm_process(
                        pid, name, self.paths.vm_run_dir(name)):
                    await self._adopt_one(name, pid)
        for vm in self.db.vms(self.partition):
            job = self.db.find_job(vm_obj(vm.name))
            if vm.state in ALIVE and vm.name not in self.vms and (
                    job is None or job.kind != "migrate"):
                if vm.pid and process.pid_alive(vm.pid) and process.is_vm_process(
                        vm.pid, vm.name, self.paths.vm_run_dir(vm.name)):
                    self.log.error("%s (pid %d) runs but could not be adopted; left "
                                   "alone (see the warning above)", vm.name, vm.pid)
                    continue
                self.log.warning("%s (pid %s) exited while no supervisor watched it",
                                 vm.name, vm.pid)
                self._cleanup_run(self.paths.vm_run_dir(vm.name))
                if vm.ram_path:
                    self._remove_ram(Path(vm.ram_path))
                with contextlib.suppress(FusumaError):
                    self._settle_state(vm.name, VmState.CRASHED, pid=None,
                                       error="QEMU exited while the partition's "
                                             "supervisor was down")
        for job in self.db.jobs():
            if job.kind in LOCAL_JOBS and job.source == self.partition \
                    and not job.owner.alive():
                await self._recover_local(job)

    def _qemus_in_cgroup(self) -> dict[str, list[int]]:
        """QEMU pids in this partition's per-VM cgroups, by VM name."""
        out: dict[str, list[int]] = {}
        if not self.cg.exists(self.partition):
            return out
        for pid in self.cg.pids(self.partition):
            argv = process.cmdline(pid)
            for arg in argv:
                if arg.startswith("guest=") and arg.endswith(",debug-threads=on"):
                    out.setdefault(arg[len("guest="):-len(",debug-threads=on")],
                                   []).append(pid)
        return out

    async def _adopt_one(self, name: str, pid: int) -> None:
        rec = self.db.find_vm(name)
        job = self.db.find_job(vm_obj(name))
        run = self._run_dir_of(name, pid)
        qmp = Qmp(name, run / "qmp.sock", self._vm_logger(name))
        mine = rec is not None and rec.partition == self.partition and rec.pid == pid
        side = cpr.in_place_side(job, self.partition, rec, pid)
        try:
            if side == "incoming" and not (run / "qmp.sock").exists():
                raise QemuError(f"VM {name}: no QMP socket yet")
            await qmp.connect(timeout=5.0)
            status = await qmp.query_status()
        except QemuError as exc:
            await qmp.disconnect()
            if side == "incoming":
                # An in-place move's new QEMU still waiting for the guest's descriptors
                # (it opens QMP only once it has them): it has not run the guest, and
                # nothing can decide "forward" for it without QMP. Ending it is safe.
                self.log.warning("ending the new QEMU pid %d of %s: it never received "
                                 "the guest (%s)", pid, name, exc)
                process.kill(pid)
                self._cleanup_run(run)
                return
            self.log.warning("cannot adopt %s (pid %d): %s", name, pid, exc)
            return
        mode = str(job.detail.get("mode", "zero-copy")) if job else "zero-copy"
        ram = Path(rec.ram_path) if rec and rec.ram_path else None
        rt = VmRuntime(name, pid, qmp, run_dir=run, ram_file=ram)
        if job is not None and job.kind == "migrate" and job.peer == self.partition \
                and not mine and side != "leaving":
            # A move's destination, not yet the VM's QEMU: recovery decides its fate.
            rt.detached = True
            rt.owns_ram = mode == "copy"
            if mode == "copy":
                rt.ram_file = Path(str(job.detail.get("dest_ram"))) \
                    if job.detail.get("dest_ram") else None
            self.incoming[name] = migration_ops.Incoming(rt, None, mode,
                                                          job.source or "")
            self._watch(rt)
            self.log.info("adopted %s (pid %d) as the incoming side of a move", name, pid)
            return
        if job is not None and job.kind == "migrate" and job.source == self.partition \
                and not mine:
            # The source of a move whose record has gone on to the destination.
            rt.detached = True
            rt.owns_ram = mode == "copy"
            self.leaving[name] = rt
            self._watch(rt)
            self.log.info("adopted %s (pid %d) as the leaving side of a move", name, pid)
            return
        if mine and rec is not None:
            self.vms[name] = rt
            self._watch(rt)
            if job is None:
                with contextlib.suppress(FusumaError):
                    self._settle_state(name, VmState.RUNNING if status == "running"
                                       else VmState.PAUSED)
                if run.name.startswith(INCOMING_PREFIX):
                    # Migrated in, its sockets never moved to their usual place; the
                    # source is gone (no job), so that is safe now.
                    with contextlib.suppress(FusumaError):
                        await migration_ops.settle(self, name)
            self.log.info("adopted %s (pid %d, %s)", name, pid, status)
            with contextlib.suppress(FusumaError):
                self.governor.apply_class(rec, pid)
            return
        # Nothing explains this QEMU: never let it run a guest beside the VM's own.
        self.log.warning("ending QEMU pid %d of %s: no record or job explains it (%s)",
                         pid, name, status)
        await qmp.disconnect()
        process.kill(pid)

    def _run_dir_of(self, name: str, pid: int) -> Path:
        """Where this QEMU's sockets are now: where its argv put them, unless a move's
        ``settle`` has since renamed them into the VM's usual run dir. (An in-place
        move's new QEMU that still waits on its cpr channel has no QMP socket yet: its
        dir is where its cpr socket is, never the old QEMU's.)"""
        base = self.paths.vm_run_dir(name)
        for arg in process.cmdline(pid):
            if "path=" in arg and "qmp.sock" in arg:
                sock = Path(arg.split("path=", 1)[1].split(",", 1)[0])
                if sock.exists() or (sock.parent / cpr.CPR_SOCKET).exists():
                    return sock.parent
        return base

    def _settle_state(self, name: str, to: VmState, **fields: Any) -> None:
        """Bring a VM to ``to`` from whatever non-final state it was left in."""
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

    # -- jobs this supervisor runs (start, stop, kill) --------------------------------
    @contextlib.asynccontextmanager
    async def _job(self, vm: str, kind: str) -> Any:
        job = Job(vm_obj(vm), kind, "begin", self.owner, source=self.partition)
        for _ in range(2):
            held = self.db.begin_job(job)
            if held is None:
                break
            if held.owner.alive():
                raise StateError(busy_sentence(held))
            if held.kind in LOCAL_JOBS and held.source == self.partition:
                await self._recover_local(held)
                continue
            raise StateError(f"VM {vm!r} is being recovered: the owner (pid "
                             f"{held.owner.pid}) of its {held.kind} job died; try again "
                             "in a few seconds.")
        else:
            raise StateError(f"VM {vm!r} is busy; try again.")
        try:
            yield
        finally:
            self.db.end_job(job.obj, self.owner)

    def _phase(self, vm: str, phase: str, **detail: object) -> None:
        with contextlib.suppress(StateError):
            self.db.set_phase(vm_obj(vm), self.owner, phase, **detail)

    async def _recover_local(self, job: Job) -> None:
        """Finish a start, stop or kill whose supervisor died, asking QEMU."""
        if self.db.take_over(job.obj, job.owner, self.owner) is None:
            return
        name = job.name
        try:
            rec = self.db.find_vm(name)
            rt = self.vms.get(name)
            if rec is None:
                pass
            elif job.kind in ("stop", "kill"):
                if rt is not None:
                    rt.stopping = True
                    process.kill(rt.pid)
                    with contextlib.suppress(QemuError):
                        await self._wait_exit(rt)
                elif rec.state in ALIVE:
                    self._kill_unmanaged(rec)
                with contextlib.suppress(FusumaError):
                    self._settle_state(name, VmState.STOPPED, pid=None)
            elif job.kind == "template":
                await template_ops.recover(self, job)
            elif job.kind == "start":
                status = None if rt is None else await rt.qmp.query_status()
                if rt is not None and status in ("inmigrate", "prelaunch"):
                    # A clone that never loaded its template's state: it cannot run.
                    rt.stopping = True
                    process.kill(rt.pid)
                    with contextlib.suppress(QemuError):
                        await self._wait_exit(rt)
                    rt = None
                if rt is None:
                    self._cleanup_run(self.paths.vm_run_dir(name))
                    with contextlib.suppress(FusumaError):
                        self._settle_state(name, VmState.STOPPED, pid=None,
                                           error="the supervisor died while starting it")
                else:
                    self._settle_state(name, VmState.RUNNING if status == "running"
                                       else VmState.PAUSED, pid=rt.pid)
            self.log.info("recovered the %s job of %s (owner pid %d died)", job.kind, name,
                          job.owner.pid)
        finally:
            self.db.end_job(job.obj, self.owner)

    async def _sweep_jobs(self, every: float = 1.0) -> None:
        """Within a second or two of a job owner's death, have its job recovered: a
        paused guest never waits for an operator."""
        while True:
            await asyncio.sleep(every)
            try:
                await self._sweep_once()
            except Exception:
                self.log.exception("job sweep failed")

    async def _sweep_once(self) -> None:
        for key, child in list(self._recoverers.items()):
            if child.poll() is not None:
                del self._recoverers[key]
        for job in self.db.jobs():
            if job.owner.alive() or job.owner == self.owner:
                continue
            if job.kind in LOCAL_JOBS:
                if job.source == self.partition:
                    await self._recover_local(job)
                continue
            involved = self.partition in (job.source, job.peer)
            if not involved and job.obj.startswith("vm:"):
                rec = self.db.find_vm(job.name)
                involved = rec is not None and rec.partition == self.partition
            if not involved and job.obj == f"partition:{self.partition}":
                involved = True
            key = (job.obj, job.owner.pid)
            if involved and key not in self._recoverers:
                self.log.warning("owner pid %d of the %s job on %s died; recovering",
                                 job.owner.pid, job.kind, job.obj)
                env = {**os.environ, **self.paths.as_env()}
                with open(self.paths.partition_dir(self.partition) / "recovery.log",
                          "ab") as log:
                    self._recoverers[key] = subprocess.Popen(
                        [sys.executable, "-m", "fusuma.recovery", job.obj],
                        stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=log,
                        start_new_session=True, close_fds=True, env=env)

    # -- request handling -----------------------------------------------------------
    def handlers(self) -> dict[type[rpc.Request[Any]], Any]:
        """The one table from request class to handler (every class of
        ``rpc.REQUESTS`` has one; a unit test holds them together)."""
        return {
            rpc.Ping: self.op_ping, rpc.Status: self.op_status, rpc.Start: self.op_start,
            rpc.WaitAgent: self.op_wait_agent, rpc.Stop: self.op_stop,
            rpc.Kill: self.op_kill, rpc.Exec: self.op_exec, rpc.Trim: self.op_trim,
            rpc.TemplateSave: self.op_template_save,
            rpc.GovernorStatus: self.op_governor_status, rpc.Repin: self.op_repin,
            rpc.IncomingPrepare: self.op_incoming_prepare,
            rpc.MigrateOut: self.op_migrate_out, rpc.CprPrepare: self.op_cpr_prepare,
            rpc.CprTransfer: self.op_cpr_transfer,
            rpc.IncomingFinish: self.op_incoming_finish,
            rpc.IncomingCommit: self.op_incoming_commit,
            rpc.IncomingAbort: self.op_incoming_abort, rpc.Release: self.op_release,
            rpc.ResumeSource: self.op_resume_source, rpc.Settle: self.op_settle,
            rpc.ListInstances: self.op_instances,
            rpc.RemoteIncoming: self.op_remote_incoming,
            rpc.RemoteIncomingWait: self.op_remote_incoming_wait,
        }

    async def _handle(self, reader: asyncio.StreamReader,
                      writer: asyncio.StreamWriter) -> None:
        try:
            req = rpc.decode_request(await reader.readline())
            result = await self._handlers[type(req)](req)
            out = rpc.encode_reply(result)
        except FusumaError as exc:
            out = rpc.encode_error(exc)
        except Exception as exc:  # report, keep serving
            self.log.exception("request failed")
            out = rpc.encode_error(SupervisorError(f"internal supervisor error: {exc!r}"))
        try:
            writer.write(out)
            await writer.drain()
            writer.close()
        except OSError:
            pass

    def _lock(self, vm: str) -> asyncio.Lock:
        return self._locks.setdefault(vm, asyncio.Lock())

    def _vm(self, name: str) -> VmRecord:
        vm = self.db.vm(name)
        if vm.partition != self.partition:
            raise NotFoundError(f"VM {name!r} is in partition {vm.partition!r}, "
                                f"not {self.partition!r}.")
        return vm

    async def op_ping(self, req: rpc.Ping) -> rpc.Pong:
        return rpc.Pong(pid=os.getpid(), partition=self.partition, vms=sorted(self.vms))

    async def op_status(self, req: rpc.Status) -> rpc.Running:
        return rpc.Running([rpc.VmPid(rt.name, rt.pid) for rt in self.vms.values()])

    async def op_start(self, req: rpc.Start) -> rpc.VmPid:
        vm = req.vm
        requested = time.time()
        async with self._lock(vm), self._job(vm, "start"):
            await self._start(self._vm(vm), requested)
        if req.wait_agent > 0:
            await self.op_wait_agent(rpc.WaitAgent(vm, timeout=req.wait_agent))
        return rpc.VmPid(vm, self.vms[vm].pid)

    def _agent_lock(self, vm: str) -> asyncio.Lock:
        return self._agent_locks.setdefault(vm, asyncio.Lock())

    def _no_job(self, vm: str) -> None:
        """Refuse to use a VM another operation holds (a move, a stop...)."""
        job = self.db.find_job(vm_obj(vm))
        if job is None:
            return
        if job.owner.alive():
            raise StateError(busy_sentence(job))
        raise StateError(f"VM {vm!r} is being recovered: the owner (pid {job.owner.pid}) of "
                         f"its {job.kind} job died; try again in a few seconds.")

    async def op_wait_agent(self, req: rpc.WaitAgent) -> rpc.Seconds:
        """Wait until the guest agent answers; returns seconds since QEMU started."""
        vm, timeout = req.vm, req.timeout
        rec = self._running(vm)
        async with self._agent_lock(vm), GuestAgent(
                vm, self.vms[vm].run_dir / "qga.sock", self._vm_logger(vm)) as ga:
            await ga.connect(timeout=timeout)
            await ga.ping()
        return rpc.Seconds(time.time() - (rec.started_at or time.time()))

    async def op_stop(self, req: rpc.Stop) -> rpc.Ended:
        vm, timeout = req.vm, req.timeout
        async with self._lock(vm):
            rec = self._vm(vm)
            rt = self.vms.get(vm)
            if rt is None:
                if rec.state in (VmState.STOPPED, VmState.CRASHED):
                    return rpc.Ended(vm, was=rec.state.value)
                self._no_job(vm)
                return self._kill_unmanaged(rec)
            async with self._job(vm, "stop"):
                rec = self.db.transition(vm, VmState.STOPPING,
                                         expect={VmState.RUNNING, VmState.PAUSED})
                rt.stopping = True
                # Flush guest filesystems first, so stopping a VM with disks loses no
                # data; the agent lock waits for a command already running there.
                self._phase(vm, "sync")
                with contextlib.suppress(FusumaError, OSError, TimeoutError):
                    await asyncio.wait_for(self._agent_lock(vm).acquire(), timeout)
                    try:
                        async with GuestAgent(vm, rt.run_dir / "qga.sock",
                                              self._vm_logger(vm)) as ga:
                            await ga.connect(timeout=min(2.0, timeout))
                            await ga.run(["/bin/sync"], timeout=min(5.0, timeout))
                    finally:
                        self._agent_lock(vm).release()
                self._phase(vm, "quit")
                await rt.qmp.quit()
                try:
                    await asyncio.wait_for(rt.exited.wait(), timeout)
                except TimeoutError:
                    self.log.warning("%s did not quit in %.0f s; killing pid %d", vm,
                                     timeout, rt.pid)
                    process.kill(rt.pid)
                    await self._wait_exit(rt)
        return rpc.Ended(vm, was="running", pid=rt.pid)

    async def op_kill(self, req: rpc.Kill) -> rpc.Ended:
        vm = req.vm
        rec = self._vm(vm)
        rt = self.vms.get(vm)
        if rt is None:
            if rec.state in (VmState.STOPPED, VmState.CRASHED):
                raise StateError(f"VM {vm!r} is {rec.state.value}; there is no QEMU to kill.")
            self._no_job(vm)
            return self._kill_unmanaged(rec)
        async with self._job(vm, "kill"):
            self.db.transition(vm, VmState.STOPPING, expect={VmState.RUNNING,
                                                             VmState.PAUSED})
            rt.stopping = True
            process.kill(rt.pid)
            await self._wait_exit(rt)
        return rpc.Ended(vm, was="killed", pid=rt.pid)

    async def _wait_exit(self, rt: VmRuntime, timeout: float = 10.0) -> None:
        try:
            await asyncio.wait_for(rt.exited.wait(), timeout)
        except TimeoutError as exc:
            raise QemuError(f"VM {rt.name}: QEMU (pid {rt.pid}) did not exit within "
                            f"{timeout:.0f} s of SIGKILL.") from exc

    def _kill_unmanaged(self, rec: VmRecord) -> rpc.Ended:
        """A QEMU this supervisor could not adopt (no QMP): end it by its checked pid."""
        if rec.pid and process.is_vm_process(rec.pid, rec.name,
                                             self.paths.vm_run_dir(rec.name)):
            process.kill(rec.pid)
            deadline = time.monotonic() + 10
            while process.pid_alive(rec.pid) and time.monotonic() < deadline:
                time.sleep(0.02)
        self._cleanup_run(self.paths.vm_run_dir(rec.name))
        if rec.ram_path:
            self._remove_ram(Path(rec.ram_path))
        self._delete_leaf(rec.name)
        self._settle_state(rec.name, VmState.STOPPED, pid=None)
        return rpc.Ended(rec.name, was="killed", pid=rec.pid)

    async def op_exec(self, req: rpc.Exec) -> rpc.ExecResult:
        vm, argv, stdin, timeout = req.vm, req.argv, req.stdin, req.timeout
        self._running(vm)
        self._no_job(vm)
        data = base64.b64decode(stdin) if stdin is not None else None
        async with self._agent_lock(vm):
            self._running(vm)     # it may have stopped while we waited for the channel
            async with GuestAgent(vm, self.vms[vm].run_dir / "qga.sock",
                                  self._vm_logger(vm)) as ga:
                await ga.connect(timeout=timeout)
                res = await ga.run(argv, stdin=data, timeout=timeout)
        return rpc.ExecResult(exit_code=res.exit_code, signal=res.signal,
                              stdout=base64.b64encode(res.stdout).decode(),
                              stderr=base64.b64encode(res.stderr).decode())

    async def op_trim(self, req: rpc.Trim) -> rpc.Trimmed:
        """Ask the guest to drop its caches and compact, then wait until the pages it
        freed have been reported and the RAM's resident size holds still."""
        vm, timeout = req.vm, req.timeout
        rec = self._running(vm)
        self._no_job(vm)
        reporting.refuse_without_device(rec)
        rt = self.vms[vm]
        try:
            status = await rt.qmp.execute("x-query-virtio-status",
                                          {"path": reporting.balloon_path()})
        except QemuError as exc:
            raise StateError(f"VM {vm!r}: QEMU cannot say whether its guest took page "
                             f"reporting ({exc})") from exc
        if not reporting.negotiated(status):
            raise reporting.refuse_without_driver(vm)
        t0 = time.monotonic()
        before = reporting.resident_bytes(rec, rt.pid)
        async with self._agent_lock(vm):
            self._running(vm)
            async with GuestAgent(vm, rt.run_dir / "qga.sock", self._vm_logger(vm)) as ga:
                await ga.connect(timeout=timeout)
                res = await ga.run(reporting.TRIM_ARGV, timeout=timeout)
        if res.exit_code != 0:
            raise GuestAgentError(f"VM {vm!r}: dropping the guest's caches failed (exit "
                                  f"{res.exit_code}): {res.stderr.decode(errors='replace')}")
        # Reports come 2 s after the guest's free memory crosses its threshold, then in
        # batches: wait for the resident size to stop falling.
        last, still_since = reporting.resident_bytes(rec, rt.pid), time.monotonic()
        deadline = time.monotonic() + reporting.TRIM_TIMEOUT_S
        await asyncio.sleep(2.0)
        while time.monotonic() < deadline:
            await asyncio.sleep(0.25)
            now = reporting.resident_bytes(rec, rt.pid)
            if now != last:
                last, still_since = now, time.monotonic()
            elif time.monotonic() - still_since >= reporting.SETTLE_S:
                break
        after = last

        def mib(b: int | None) -> float | None:
            return None if b is None else round(b / 2**20, 1)
        returned = None if before is None or after is None else max(0, before - after)
        self.log.info("trim %s: %s -> %s MiB", vm, mib(before), mib(after))
        return rpc.Trimmed(vm=vm, resident_before_mib=mib(before),
                           resident_after_mib=mib(after), returned_mib=mib(returned),
                           seconds=round(time.monotonic() - t0, 2))

    async def op_template_save(self, req: rpc.TemplateSave) -> rpc.TemplateSaved:
        return await template_ops.save(self, req.vm, req.template, req.fault)

    async def op_governor_status(self, req: rpc.GovernorStatus) -> rpc.GovernorReport:
        return rpc.GovernorReport(self.governor.status(req.limit))

    async def op_repin(self, req: rpc.Repin) -> rpc.Pins:
        return rpc.Pins(await self._repin_all())

    async def _repin_all(self) -> dict[str, list[int]]:
        """Spread the vCPUs of all running VMs round-robin over the partition's cores,
        the guaranteed VMs' first; each VM's other threads go where its ``emulator``
        setting says (fusuma.governor.qos.emulator_cores)."""
        out: dict[str, list[int]] = {}
        offset = 0
        cores = self.db.partition(self.partition).cpus
        recs = [v for v in self.db.vms(self.partition) if v.name in self.vms]
        for rec in vcpu_order(recs):
            rt = self.vms[rec.name]
            try:
                others = emulator_cores(rec, cores, recs)
            except FusumaError as exc:
                self.log.warning("%s; its emulator threads share the partition's cores", exc)
                others = cores
            out[rec.name] = await self._repin(rt, offset, others)
            offset += len(out[rec.name])
        for name in sorted(set(self.vms) - {r.name for r in recs}):
            out[name] = await self._repin(self.vms[name], offset)
            offset += len(out[name])
        self.governor.pin()   # cores a guaranteed VM has to itself stay its own
        return out

    # -- migration (fusuma.migration.supervisor_ops) -----------------------------------
    async def op_incoming_prepare(self, req: rpc.IncomingPrepare) -> rpc.Prepared:
        return await migration_ops.incoming_prepare(self, req.vm, req.mode,
                                                    req.fault_decide_delay)

    async def op_migrate_out(self, req: rpc.MigrateOut) -> rpc.Streamed:
        async with self._lock(req.vm):
            return await migration_ops.migrate_out(self, req.vm, req.uri, req.mode,
                                                   max_bandwidth=req.max_bandwidth)

    async def op_cpr_prepare(self, req: rpc.CprPrepare) -> rpc.Prepared:
        return await cpr.cpr_prepare(self, req.vm, req.fault_decide_delay)

    async def op_cpr_transfer(self, req: rpc.CprTransfer) -> rpc.Streamed:
        async with self._lock(req.vm):
            return await cpr.cpr_transfer(self, req.vm,
                                          fault_incoming_delay=req.fault_incoming_delay)

    async def op_incoming_finish(self, req: rpc.IncomingFinish) -> rpc.Resumed:
        return await migration_ops.incoming_finish(self, req.vm, timeout=req.timeout)

    async def op_incoming_commit(self, req: rpc.IncomingCommit) -> rpc.Resumed:
        return await migration_ops.incoming_commit(self, req.vm)

    async def op_incoming_abort(self, req: rpc.IncomingAbort) -> rpc.Ended:
        return await migration_ops.incoming_abort(self, req.vm)

    async def op_release(self, req: rpc.Release) -> rpc.Ended:
        return await migration_ops.release(self, req.vm)

    async def op_resume_source(self, req: rpc.ResumeSource) -> rpc.Resumed:
        return await migration_ops.resume_source(self, req.vm)

    async def op_settle(self, req: rpc.Settle) -> rpc.Settled:
        return await migration_ops.settle(self, req.vm)

    async def op_instances(self, req: rpc.ListInstances) -> rpc.Instances:
        return rpc.Instances(await migration_ops.instances(self, req.vm))

    # -- moves between hosts (fusuma.migration.remote; the cluster agent orchestrates) --
    async def op_remote_incoming(self, req: rpc.RemoteIncoming) -> rpc.Prepared:
        return await remote.remote_incoming(self, req.vm, req.listen)

    async def op_remote_incoming_wait(self, req: rpc.RemoteIncomingWait
                                      ) -> rpc.StreamState:
        return await remote.remote_incoming_wait(self, req.vm, req.timeout)

    def _running(self, vm: str) -> VmRecord:
        rec = self._vm(vm)
        if vm not in self.vms:
            raise StateError(f"VM {vm!r} is {rec.state.value}; start it with "
                             f"`fusuma vm start {vm}`.")
        return rec

    # -- starting and watching QEMU ---------------------------------------------------
    def _vm_logger(self, vm: str) -> logging.Logger:
        log = logging.getLogger(f"fusuma.vm.{vm}")
        if not log.handlers:
            vdir = ensure_dir(self.paths.vm_dir(vm), PRIVATE_DIR)
            h = logging.FileHandler(vdir / "qmp.log")
            h.setFormatter(logging.Formatter("%(asctime)s %(message)s"))
            log.addHandler(h)
            log.setLevel(logging.DEBUG)
            log.propagate = False
        return log

    def _qemu(self) -> versions.Qemu:
        """This partition's QEMU (fusuma.qemu.versions: cached, no subprocess)."""
        return versions.resolve(self.paths, self.db.partition(self.partition).qemu)

    def _qemu_binary(self) -> str:
        return str(self._qemu().binary)

    def _devices(self, vm: VmRecord, cfg: VmConfig, q: versions.Qemu,
                 incoming: str | None) -> DeviceSet:
        """What the guest sees: for a boot, today's devices on the VM's pinned machine
        type; for a move's destination, the set recorded when the guest booted."""
        if vm.template is not None and incoming is None:
            # A clone: the template's devices (fusuma.memshare.templates).
            ds = template_ops.clone_devices(self, vm, q)
        elif incoming is not None and vm.devices:
            try:
                ds = DeviceSet.loads(vm.devices)
            except (ValueError, KeyError, TypeError) as exc:
                raise StateError(f"VM {vm.name!r}: its recorded device set is unreadable "
                                 f"({exc}); stop and start it to record it anew.") from exc
        else:
            # A boot, or a guest booted by a fusuma that recorded no device set: what
            # that fusuma gave it (the same devices, in the same order).
            machine = vm.machine or (versions.machine_of(self.paths, vm) if incoming
                                     else versions.default_machine(self.paths, q))
            # A boot gets a vmgenid of its own: the recorded set keeps it for moves.
            ds = device_set(replace(cfg, machine=machine,
                                    vmgenid=new_vmgenid() if incoming is None else None))
            if incoming is None and ds.cpu == "max":
                # TCG's CPU, trimmed to what every installed QEMU emulates (the guest
                # must never be told of an instruction a QEMU it moves to lacks), with
                # one identity on every QEMU version (each names its max differently).
                ds = replace(ds, cpu=f"max,{versions.TCG_CPU_IDENTITY}",
                             cpu_features=versions.tcg_cpu_features(self.paths, q))
        why = versions.cannot_run(q, ds.machine)
        missing = versions.cpu_missing(q, ds.cpu_features)
        if why is None and missing:
            why = f"its TCG lacks the guest's CPU features {', '.join(missing)}"
        if why is not None:
            raise StateError(f"VM {vm.name!r} has machine type {ds.machine}, and partition "
                             f"{self.partition!r} runs QEMU {q.version}: {why}; run it in "
                             "a partition whose QEMU has it (`fusuma qemu list`).")
        return ds

    def _config(self, vm: VmRecord, accel: str, run: Path, ram_file: Path | None,
                incoming: str | None = None, disk_owner: str | None = None) -> VmConfig:
        image = find_image(self.paths.cache, kind=vm.image)
        vdir = self.paths.vm_dir(vm.name)
        disks = []
        for dname in vm.disks:
            d = self.db.disk(dname)
            if d.partition != (disk_owner or self.partition):
                raise StateError(f"disk {dname!r} belongs to partition {d.partition!r}, not "
                                 f"{self.partition!r}; a VM can only use its partition's disks.")
            if not Path(d.path).exists():
                raise HostError(f"disk {dname!r}: {d.path} does not exist.")
            disks.append(DiskConfig(dname, Path(d.path)))
        segments = []
        for item in vm.segments:
            sname, _, mount = item.partition(":")
            seg = self.db.find_segment(sname)
            if seg is None:
                raise SegmentError(f"VM {vm.name!r} needs segment {sname!r}, which does not "
                                   "exist; create it with `fusuma segment create`.")
            try:
                size = Path(seg.path).stat().st_size
            except OSError as exc:
                raise SegmentError(f"segment {sname!r}: its file {seg.path} is unreadable "
                                   f"({exc.strerror}); delete and re-create the segment."
                                   ) from exc
            segments.append(SegmentConfig(sname, Path(seg.path), size, mount or
                                          f"/mnt/{sname}"))
        root_disk = None
        if image.root is not None and not any(s.mount == "/" for s in segments):
            root_disk = image.root
        ports = [(int(h), int(g)) for h, g in (p.split(":") for p in vm.ports)]
        qmp = run / "qmp.sock"
        if len(str(qmp)) > MAX_SOCKET_PATH - 4:
            raise HostError(f"socket path {qmp} is too long for a UNIX socket; set "
                            "FUSUMA_RUNTIME_DIR to a shorter directory.")
        return VmConfig(
            name=vm.name, vcpus=vm.vcpus, memory_mib=vm.memory_mib,
            accel="kvm" if accel == "kvm" else "tcg",
            kernel=image.kernel, initrd=image.initrd, append=image.append,
            qmp_socket=qmp, qga_socket=run / "qga.sock", console_socket=run / "console.sock",
            console_log=vdir / "console.log", pidfile=run / "qemu.pid",
            ram_file=ram_file, disks=disks, incoming=incoming, segments=segments,
            mergeable=vm.mergeable, ports=ports, bind_ports=incoming is None,
            page_reporting=reporting.wanted(vm, self.cg),
            root_disk=root_disk)

    async def _start(self, vm: VmRecord, requested: float | None = None) -> None:
        if vm.name in self.vms:
            raise StateError(f"VM {vm.name!r} is already running (pid {self.vms[vm.name].pid}).")
        if vm.state not in (VmState.STOPPED, VmState.CRASHED):
            raise StateError(f"VM {vm.name!r} is {vm.state.value}; it can only be started "
                             "when stopped or crashed.")
        accel = probe_accel(vm.accel)
        if accel.notice:
            self.log.info("%s", accel.notice)
        run = self.paths.vm_run_dir(vm.name)
        ram = self.paths.ram_file(vm.name) if vm.shared_ram else None
        undo: list[Any] = []
        try:
            self.db.transition(vm.name, VmState.STARTING,
                               expect={VmState.STOPPED, VmState.CRASHED}, error=None)
            undo.append(lambda: self._settle_state(vm.name, VmState.STOPPED, pid=None))
            started = time.time()
            self._phase(vm.name, "launch")
            rt = await self._launch(vm, accel.name, run, ram, None, undo)
            self.vms[vm.name] = rt
            undo.append(lambda: self.vms.pop(vm.name, None))
            self._watch(rt)
            restore_ms = None
            if vm.template is not None:
                self._phase(vm.name, "restore", pid=rt.pid)
                restore_ms = await template_ops.restore(self, vm, rt)
            self._phase(vm.name, "pin", pid=rt.pid)
            await self._repin_all()
            self.db.transition(
                vm.name, VmState.RUNNING, expect={VmState.STARTING}, pid=rt.pid,
                accel_used=accel.name, qemu_binary=self._qemu_binary(), started_at=started,
                qemu_version=rt.qemu_version,
                error=None, ram_path=str(ram) if ram else None)
            self.log.info("started %s: pid %d, %s", vm.name, rt.pid, accel.name)
            if restore_ms is not None:
                template_ops.begin_identity(self, vm.name, rt, requested or started,
                                            restore_ms)
        except BaseException as exc:
            self._undo(undo)
            if isinstance(exc, FusumaError):
                with contextlib.suppress(Exception):
                    self.db.set_vm(vm.name, error=str(exc))
            raise

    def _undo(self, undo: list[Any]) -> None:
        for fn in reversed(undo):
            try:
                fn()
            except Exception:
                self.log.exception("undo step failed")

    async def _launch(self, vm: VmRecord, accel: str, run: Path, ram: Path | None,
                      incoming: str | None, undo: list[Any],
                      disk_owner: str | None = None,
                      cpr_socket: Path | None = None) -> VmRuntime:
        """Start one QEMU for ``vm`` in this partition's cgroup and connect QMP.

        ``cpr_socket``: an in-place move's new QEMU (``fusuma.migration.cpr``), which
        opens QMP only once the old QEMU has sent the guest's descriptors there: wait
        until it listens instead.

        Every step appends its undo to ``undo``; the caller runs them on failure."""
        q = self._qemu()
        binary = str(q.binary)
        # QEMU runs as the VM's own uid (fusuma.qemu.privilege): what it needs is
        # opened here and passed as fds, or lives in its run dir, which that uid owns.
        uid = privilege.uid_for(self.paths, vm)
        groups = privilege.groups_for(accel)
        if accel == "kvm":
            privilege.check_kvm_access(groups)
        cfg = self._config(vm, accel, run, ram, incoming, disk_owner)
        devices = self._devices(vm, cfg, q, incoming)
        cfg = replace(cfg, devices=devices, data_dirs=q.data_dirs,
                      cpu_off=versions.cpu_off(q, devices.cpu_features))
        cfg = replace(cfg, aux_ram_share=q.features.get("aux-ram-share", False),
                      cpr_socket=cpr_socket)
        if vm.template is not None and incoming is None:
            cfg, groups = template_ops.clone_config(self, vm, cfg, groups)
        self._cleanup_run(run)
        self.paths.ensure_runtime()
        # ``run`` is the VM's run dir or, for a migration's destination, a dir in it.
        for d in (self.paths.vm_run_dir(vm.name), run):
            ensure_dir(d, PRIVATE_DIR, owner=uid)
        for d in (self.paths.vm_dir(vm.name), self.paths.shm):
            ensure_dir(d, PRIVATE_DIR)
        undo.append(lambda: self._cleanup_run(run))
        if ram is not None and incoming is None:
            self._remove_ram(ram)
            undo.append(lambda: self._remove_ram(ram))
        self.cg.create_leaf(self.partition, vm_leaf(vm.name))
        undo.append(lambda: self._delete_leaf(vm.name))
        cg, part, leaf = self.cg, self.partition, vm_leaf(vm.name)
        mergeable = vm.mergeable
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

        # A new VM gets a new RAM file; a migration's destination opens the one its
        # caller chose (the source's for zero-copy, a new one made for a copy).
        cfg, files = privilege.open_for_qemu(cfg, uid, new_ram=incoming is None)
        try:
            if cfg.template_ram is not None:
                cfg = template_ops.open_files(self, vm, cfg, files)
            if ram is not None and incoming is None:
                self.charge_ram(ram, vm.memory_mib)
            if ram_stem is not None:
                self.cg.create_ram_group(ram_stem, lazy_ram_limit(
                    vm.memory_mib * 2**20, capacity.vm_overhead(vm) * 2**20))
        except BaseException:
            files.close()
            raise
        with files, open(self.paths.vm_dir(vm.name) / "qemu.log", "ab") as log:
            try:
                argv = build_argv(cfg, binary)
            except DeviceSetMismatch as exc:
                raise StateError(f"{exc}; stop and start it to record its devices anew."
                                 ) from exc
            log.write(f"--- {time.ctime()} {argv}\n".encode())
            log.flush()
            try:
                child = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=log,
                                         env={**os.environ, **q.env},
                                         stderr=log, start_new_session=True, close_fds=True,
                                         pass_fds=cfg.passed_fds(), preexec_fn=into_cgroup)
            except OSError as exc:
                raise QemuError(f"VM {vm.name}: cannot run {binary} as uid {uid}: "
                                f"{exc.strerror}; QEMU, its firmware and libraries must be "
                                "readable and executable by other users.",
                                argv=argv) from exc
            except subprocess.SubprocessError as exc:
                # preexec_fn (cgroup, KSM, dropping privileges) failed.
                raise QemuError(f"VM {vm.name}: cannot place QEMU in cgroup "
                                f"{self.partition}/{vm_leaf(vm.name)} as uid {uid}: {exc}.",
                                argv=argv) from exc
        undo.append(lambda: self._reap(child))
        if incoming is None:
            # Known at once, so a supervisor killed during the start leaves a QEMU
            # that the next one can find (or end) by its checked pid. The guest boots
            # with these devices: every move's destination gets the same.
            self.db.set_vm(vm.name, pid=child.pid, machine=devices.machine,
                           devices=devices.dumps())
        elif not vm.devices:
            # A guest booted by a fusuma that recorded nothing: what it got, from now on.
            self.db.set_vm(vm.name, machine=devices.machine, devices=devices.dumps())
        self.governor.apply_class(vm, child.pid)
        qmp = Qmp(vm.name, cfg.qmp_socket, self._vm_logger(vm.name))
        if cpr_socket is not None:
            await cpr.wait_listening(child, cpr_socket,
                                     self.paths.vm_dir(vm.name) / "qemu.log", vm.name)
        else:
            await self._connect_or_fail(vm.name, child, qmp)
        undo.append(lambda: asyncio.ensure_future(qmp.disconnect()))
        return VmRuntime(vm.name, child.pid, qmp, run_dir=run, ram_file=ram, child=child,
                         started_log=process.tail(self.paths.vm_dir(vm.name) / "qemu.log", 1),
                         qemu_version=q.version)

    async def _connect_or_fail(self, vm: str, child: subprocess.Popen[bytes],
                               qmp: Qmp) -> None:
        log = self.paths.vm_dir(vm) / "qemu.log"
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            if child.poll() is not None:
                said = process.tail(log, 1)
                raise QemuError(f"VM {vm}: QEMU exited at start with status "
                                f"{child.returncode}: {said or 'no message'}",
                                exit_status=child.returncode, log_tail=process.tail(log))
            try:
                await qmp.connect(timeout=0.5)
                return
            except QemuError:
                continue
        raise QemuError(f"VM {vm}: QEMU did not open its QMP socket within 30 s; "
                        f"see {log}.", log_tail=process.tail(log))

    def _reap(self, child: subprocess.Popen[bytes]) -> None:
        if child.poll() is None:
            child.kill()
        child.wait(timeout=10)

    async def _repin(self, rt: VmRuntime, offset: int = 0,
                     others: list[int] | None = None) -> list[int]:
        cpus = self.db.partition(self.partition).cpus
        try:
            vcpus = await rt.qmp.query_cpus_fast()
        except QemuError as exc:
            self.log.warning("cannot query vCPUs of %s: %s", rt.name, exc)
            return []
        tids = [v.thread_id for v in sorted(vcpus, key=lambda v: v.index)]
        given = process.pin(rt.pid, tids, cpus, offset, others)
        return [given[t][0] for t in tids if t in given]

    def _watch(self, rt: VmRuntime) -> None:
        """Learn of the QEMU's exit through a pidfd (works for adopted, non-child pids)."""
        loop = asyncio.get_running_loop()
        if not rt.detached and rt.runstate_task is None:
            rt.runstate_task = asyncio.ensure_future(self._follow_runstate(rt))
        try:
            fd = os.pidfd_open(rt.pid)
        except ProcessLookupError:
            loop.call_soon(lambda: asyncio.ensure_future(self._on_exit(rt)))
            return
        rt.pidfd = fd
        loop.add_reader(fd, lambda: asyncio.ensure_future(self._on_exit(rt)))

    async def _follow_runstate(self, rt: VmRuntime) -> None:
        """running <-> paused in the record as QEMU reports STOP and RESUME (only while
        no job holds the VM: a move's pause is the move's business)."""
        listener = rt.qmp.listener(EVENT_STOP, EVENT_RESUME)
        try:
            while not rt.exited.is_set():
                ev = await listener.get()
                if self.vms.get(rt.name) is not rt or rt.detached or rt.stopping:
                    continue
                if self.db.find_job(vm_obj(rt.name)) is not None:
                    continue
                want, was = ((VmState.PAUSED, VmState.RUNNING) if ev["event"] == EVENT_STOP
                             else (VmState.RUNNING, VmState.PAUSED))
                with contextlib.suppress(FusumaError):
                    self.db.transition(rt.name, want, expect={was})
        except asyncio.CancelledError:
            pass
        finally:
            rt.qmp.drop_listener(listener)

    async def _on_exit(self, rt: VmRuntime) -> None:
        if rt.exited.is_set():
            return
        try:
            await self._record_exit(rt)
        except Exception:
            self.log.exception("handling the exit of %s failed", rt.name)
        finally:
            rt.exited.set()

    async def _record_exit(self, rt: VmRuntime) -> None:
        loop = asyncio.get_running_loop()
        if rt.pidfd is not None:
            loop.remove_reader(rt.pidfd)
            os.close(rt.pidfd)
            rt.pidfd = None
        if rt.runstate_task is not None:
            rt.runstate_task.cancel()
        status: int | None = None
        if rt.child is not None:
            status = rt.child.wait()
        if self.vms.get(rt.name) is rt:
            del self.vms[rt.name]
        if self.leaving.get(rt.name) is rt:
            del self.leaving[rt.name]
        inc = self.incoming.get(rt.name)
        if inc is not None and inc.rt is rt:
            del self.incoming[rt.name]
            if inc.task is not None:
                inc.task.cancel()     # whoever waits for it learns at once
        await rt.qmp.disconnect()
        self._cleanup_run(rt.run_dir)
        if rt.ram_file is not None and rt.owns_ram:
            self._remove_ram(rt.ram_file)
        self._delete_leaf(rt.name)
        rec = self.db.find_vm(rt.name)
        job = self.db.find_job(vm_obj(rt.name))
        if rt.detached or rec is None or rec.partition != self.partition or rec.pid != rt.pid:
            self.log.info("%s (pid %d) exited; its record belongs elsewhere", rt.name, rt.pid)
            if rt.ram_file is not None and (rec is None or (
                    rec.state in (VmState.CRASHED, VmState.STOPPED)
                    and rec.ram_path == str(rt.ram_file))):
                # The last QEMU of a guest that is gone: its RAM goes too.
                self._remove_ram(rt.ram_file)
            return
        if job is not None and job.kind == "migrate" and not (
                job.detail.get("decision") == "forward" and job.peer == self.partition):
            # A move is under way: its owner (or recovery) decides what this means.
            self.log.warning("%s (pid %d) exited during a move", rt.name, rt.pid)
            return
        if rt.stopping:
            with contextlib.suppress(FusumaError):
                self._settle_state(rt.name, VmState.STOPPED, pid=None, error=None)
            self.log.info("%s stopped", rt.name)
            return
        how = (f"killed by signal {-status}" if status is not None and status < 0
               else f"exited with status {status}" if status is not None
               else "exited (status unknown: adopted process)")
        msg = f"QEMU {how} unexpectedly"
        tail = process.tail(self.paths.vm_dir(rt.name) / "qemu.log", 1)
        if tail and (rt.started_log is None or tail != rt.started_log):
            msg += f": {tail}"
        with contextlib.suppress(FusumaError):
            self._settle_state(rt.name, VmState.CRASHED, pid=None, error=msg)
        self.log.warning("%s crashed: %s", rt.name, msg)

    def _cleanup_run(self, run: Path) -> None:
        """Remove a QEMU instance's sockets and pidfile (never a RAM file).

        The run dir belongs to the VM's uid, so its entries are removed through the
        directory's fd, opened without following a symlink: nothing that uid put there
        makes root remove a file elsewhere."""
        names = ["qmp.sock", "qga.sock", "console.sock", "qemu.pid"]
        incoming = run.name.startswith(INCOMING_PREFIX)
        if incoming:
            names += ["migrate.sock", cpr.CPR_SOCKET]
        try:
            fd = os.open(run, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
        except OSError:
            return   # gone, or not a directory of ours
        try:
            for name in names:
                with contextlib.suppress(OSError):
                    os.unlink(name, dir_fd=fd)
        finally:
            os.close(fd)
        if incoming:
            with contextlib.suppress(OSError):
                run.rmdir()

    def _remove_ram(self, ram: Path) -> None:
        """Unlink a guest RAM file, never while any QEMU still maps it (a move's other
        side may), and the memory cgroup its pages were charged to."""
        if not process.remove_unmapped(ram):
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
        self.cg.create_ram_group(stem, ram_group_limit(size))
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

    def _delete_leaf(self, vm: str) -> None:
        if any(vm in held for held in (self.vms, self.leaving, self.incoming)):
            return    # an in-place move's other QEMU of this VM still lives in it
        try:
            self.cg.delete_leaf(self.partition, vm_leaf(vm))
        except FusumaError as exc:
            self.log.warning("cannot remove cgroup of %s: %s", vm, exc)


def main() -> None:
    if len(sys.argv) != 2:
        print("usage: python -m fusuma.partition.supervisor PARTITION", file=sys.stderr)
        sys.exit(2)
    partition = sys.argv[1]
    # Nothing the supervisor (or a QEMU it starts) creates is for other users.
    os.umask(0o077)
    logging.basicConfig(level=logging.INFO, stream=sys.stderr,
                        format="%(asctime)s %(name)s %(levelname)s %(message)s")
    # fusuma logs every QMP exchange per VM; the library's own connection retries
    # would only add noise.
    logging.getLogger("qemu.qmp").setLevel(logging.CRITICAL)
    paths = Paths.from_env()
    paths.ensure_parents()
    try:
        asyncio.run(Supervisor(paths, partition).run())
    except FusumaError as exc:
        LOG.error("%s", exc)
        sys.exit(1)


if __name__ == "__main__":
    main()
