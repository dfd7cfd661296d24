"""A partition's supervisor: its own hypervisor instance (Mint's OS node).

Run as ``python -m fusuma.supervisor PARTITION``. It moves itself into the partition's
cgroup, re-adopts QEMU processes left running by an earlier supervisor
(``fusuma.supervisor.adopt``), then serves typed requests (``fusuma.supervisor.rpc``)
on its UNIX socket, one handler per request in :meth:`Supervisor.handlers`, or in a
group of :data:`LAZY` whose modules (moves, backups, snapshots, template saves: the
image, block-job and TLS code behind them) are imported with the group's first request,
as most supervisors never get one (tests/unit/test_supervisor_imports.py). Handlers
get the partition (``PartitionHost``: its QEMUs, state and cgroups), never this
daemon. QEMU processes are started in their own session, so killing the supervisor
(even with SIGKILL) never touches them; SIGTERM ends the supervisor and leaves the VMs
running too.

Everything runs in one thread (asyncio): ``preexec_fn`` is used to place QEMU in its
cgroup before exec, which is only safe without other threads.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import os
import signal
import subprocess
import sys
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any, TypeVar

from fusuma import spawn
from fusuma.errors import FusumaError, SupervisorError
from fusuma.governor import balloons
from fusuma.governor.loop import Governor
from fusuma.governor.memloop import Actions, MemoryGovernor
from fusuma.host import cgroups, oom
from fusuma.memshare import holes
from fusuma.names import SUPERVISOR_LEAF, vm_leaf
from fusuma.paths import Paths
from fusuma.state import LOCAL_JOBS, Database, Job, JobKind, VmRecord
from fusuma.supervisor import adopt, rpc, vms
from fusuma.supervisor.host import PartitionHost

LOG = logging.getLogger("fusuma.supervisor")

Handler = Callable[[Any], Awaitable[Any]]
Routes = list[tuple[type[rpc.Request[Any]], Handler]]
R = TypeVar("R")


def route(req: type[rpc.Request[R]], handler: Callable[[Any], Awaitable[R]]
          ) -> tuple[type[rpc.Request[Any]], Handler]:
    """One row of the handler table: mypy checks that ``handler`` answers with the
    reply class ``req`` names."""
    return req, handler


def locked(h: PartitionHost, fn: Callable[[Any], Awaitable[R]]
           ) -> Callable[[Any], Awaitable[R]]:
    """``fn`` run holding the lock of the request's VM."""
    async def run(req: Any) -> R:
        async with h.lock(req.vm):
            return await fn(req)
    return run


# -- the handlers loaded on first use (each function imports its group's modules) ------
def backup_routes(h: PartitionHost) -> Routes:
    from fusuma.supervisor import backups

    return [route(rpc.Backup, lambda r: backups.backup(h, r))]


def snapshot_routes(h: PartitionHost) -> Routes:
    from fusuma.supervisor import snapshots

    return [
        route(rpc.SnapshotCreate, lambda r: snapshots.create(h, r)),
        route(rpc.SnapshotRestore, lambda r: snapshots.restore(h, r)),
        route(rpc.SnapshotDelete, lambda r: snapshots.delete(h, r)),
    ]


def template_routes(h: PartitionHost) -> Routes:
    from fusuma.supervisor import templates

    return [route(rpc.TemplateSave, lambda r: templates.save(h, r.vm, r.template, r.fault))]


def move_routes(h: PartitionHost) -> Routes:
    from fusuma.supervisor.moves import cpr, dest, remote, source

    async def instances(req: rpc.ListInstances) -> rpc.Instances:
        return rpc.Instances(await source.instances(h, req.vm))
    return [
        route(rpc.IncomingPrepare,
              lambda r: dest.prepare(h, r.vm, r.mode, r.fault_decide_delay)),
        route(rpc.MigrateOut, locked(h, lambda r: source.perform(
            h, r.vm, r.uri, r.mode, max_bandwidth=r.max_bandwidth, tls_peer=r.tls_peer,
            plain_tcp=r.plain_tcp, channels=r.channels, nbd=r.nbd,
            mirror_speed=r.mirror_speed))),
        route(rpc.CprPrepare, lambda r: cpr.prepare(h, r.vm, r.fault_decide_delay)),
        route(rpc.CprTransfer, locked(h, lambda r: cpr.transfer(
            h, r.vm, fault_incoming_delay=r.fault_incoming_delay))),
        route(rpc.IncomingFinish, lambda r: dest.finish(h, r.vm, timeout=r.timeout)),
        route(rpc.IncomingCommit, lambda r: dest.commit(h, r.vm)),
        route(rpc.IncomingAbort, lambda r: dest.abort(h, r.vm)),
        route(rpc.Release, lambda r: source.release(h, r.vm)),
        route(rpc.ResumeSource, lambda r: source.resume(h, r.vm)),
        route(rpc.Settle, lambda r: dest.settle(h, r.vm)),
        route(rpc.ListInstances, instances),
        route(rpc.RemoteIncoming,
              lambda r: remote.remote_incoming(h, r.vm, r.listen, r.peer, r.tls,
                                               r.channels, r.nbd, r.shared_disk)),
        route(rpc.RemoteIncomingWait,
              lambda r: remote.remote_incoming_wait(h, r.vm, r.timeout)),
    ]


# Request class -> the function that imports its group's modules and returns the
# group's routes (a unit test holds each group and this table together).
LAZY: dict[type[rpc.Request[Any]], Callable[[PartitionHost], Routes]] = {
    rpc.Backup: backup_routes,
    **dict.fromkeys((rpc.SnapshotCreate, rpc.SnapshotRestore, rpc.SnapshotDelete),
                    snapshot_routes),
    rpc.TemplateSave: template_routes,
    **dict.fromkeys((rpc.IncomingPrepare, rpc.MigrateOut, rpc.CprPrepare, rpc.CprTransfer,
                     rpc.IncomingFinish, rpc.IncomingCommit, rpc.IncomingAbort, rpc.Release,
                     rpc.ResumeSource, rpc.Settle, rpc.ListInstances, rpc.RemoteIncoming,
                     rpc.RemoteIncomingWait), move_routes),
}


async def recover_snapshot(h: PartitionHost, job: Job) -> None:
    from fusuma.supervisor import snapshots

    await snapshots.recover(h, job)


async def recover_backup(h: PartitionHost, job: Job) -> None:
    from fusuma.supervisor import backups

    await backups.recover(h, job)


def templates_of_running(h: PartitionHost) -> set[str]:
    """The templates whose clones run in this partition."""
    out = set()
    for vm in h.instances.running():
        rec = h.db.find_vm(vm)
        if rec is not None and rec.template is not None:
            out.add(rec.template)
    return out


def _reserved_mib() -> int:
    """What fusuma keeps for the host itself (the memory governor's target is half)."""
    from fusuma.host.topology import host_reserve_mib

    total = 0
    with contextlib.suppress(OSError, ValueError, IndexError):
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                total = int(line.split()[1]) // 1024
    return host_reserve_mib(total) if total else 512


def memory_actions(h: PartitionHost) -> Actions:
    """The memory governor's hands on this partition's QEMUs and guest agents."""
    async def balloon(vm: str, mib: int) -> None:
        _, inst = h.running(vm)
        await inst.qmp.balloon(mib * 2**20)

    async def balloon_now(vm: str) -> int | None:
        _, inst = h.running(vm)
        actual = await inst.qmp.query_balloon()
        return None if actual is None else actual // 2**20

    async def guest(vm: str, argv: list[str]) -> None:
        async with h.agent_lock(vm):
            _, inst = h.running(vm)
            async with h.agent(inst) as ga:
                await ga.connect(timeout=10.0)
                await ga.run(argv, timeout=20.0)
    from fusuma.memshare import reporting

    def has_balloon(rec: VmRecord) -> bool:
        # A clone carries its template's balloon with its driver unbound.
        return rec.template is None and reporting.recorded(rec)
    return Actions(balloon, balloon_now, guest, reporting.resident_bytes, has_balloon)


class Supervisor:
    """Serve one partition: adopt, answer requests, sweep dead jobs, govern CPUs."""

    def __init__(self, paths: Paths, partition: str) -> None:
        self.paths = paths
        self.partition = partition
        self.log = LOG.getChild(partition)
        self.host = h = PartitionHost(paths, partition, Database(paths.db),
                                      cgroups.for_paths(paths), self.log)
        h.recover_local = functools.partial(vms.recover_local, h)
        h.local_recoverers[JobKind.SNAPSHOT] = functools.partial(recover_snapshot, h)
        h.local_recoverers[JobKind.BACKUP] = functools.partial(recover_backup, h)
        self.governor = Governor(
            partition, h.cg, h.db,
            pids=lambda: {n: i.pid for n, i in h.instances.running().items()},
            repin=h.repin_all, leaf=vm_leaf, log=self.log)
        h.apply_class = self.governor.apply_class
        h.pin_guaranteed = self.governor.pin
        self.memory = MemoryGovernor(
            partition, h.cg, h.db,
            pids=lambda: {n: i.pid for n, i in h.instances.running().items()},
            actions=memory_actions(h), reserved_mib=_reserved_mib(), log=self.log,
            store=paths.partition_dir(partition) / balloons.FILE_NAME)
        self._handlers = self.handlers()
        self._server: asyncio.AbstractServer | None = None
        self._done = asyncio.Event()
        # Recovery processes this supervisor started, by job (obj, owner pid).
        self._recoverers: dict[tuple[str, int], subprocess.Popen[bytes]] = {}

    def handlers(self) -> dict[type[rpc.Request[Any]], Handler]:
        """The table from request class to handler, but for the groups of :data:`LAZY`
        (:meth:`handler` adds each with its first request); together they cover
        ``rpc.REQUESTS`` (a unit test holds them together)."""
        h = self.host
        routes = [
            route(rpc.Ping, self.ping),
            route(rpc.Status, self.status),
            route(rpc.Start, lambda r: vms.start(h, r)),
            route(rpc.WaitAgent, lambda r: vms.wait_agent(h, r)),
            route(rpc.Stop, lambda r: vms.stop(h, r)),
            route(rpc.Kill, lambda r: vms.kill(h, r)),
            route(rpc.Exec, lambda r: vms.exec_(h, r)),
            route(rpc.Trim, lambda r: vms.trim(h, r)),
            route(rpc.ResizeDisk, lambda r: vms.resize_disk(h, r)),
            route(rpc.GovernorStatus, self.governor_status),
            route(rpc.Repin, self.repin),
        ]
        return dict(routes)

    def handler(self, req: type[rpc.Request[Any]]) -> Handler:
        """The handler of ``req``, its group's modules imported on first use."""
        if req not in self._handlers:
            self._handlers.update(LAZY[req](self.host))
        return self._handlers[req]

    # -- the daemon's own requests ------------------------------------------------------
    async def ping(self, req: rpc.Ping) -> rpc.Pong:
        return rpc.Pong(pid=os.getpid(), partition=self.partition,
                        vms=sorted(self.host.instances.running()))

    async def status(self, req: rpc.Status) -> rpc.Running:
        return rpc.Running([rpc.VmPid(n, i.pid)
                            for n, i in self.host.instances.running().items()])

    async def governor_status(self, req: rpc.GovernorStatus) -> rpc.GovernorReport:
        return rpc.GovernorReport({**self.governor.status(req.limit),
                                   "memory": self.memory.status(req.limit)})

    async def repin(self, req: rpc.Repin) -> rpc.Pins:
        return rpc.Pins(await self.host.repin_all())

    # -- lifecycle of the supervisor itself ------------------------------------------
    async def run(self) -> None:
        h = self.host
        rec = h.db.partition(self.partition)
        h.cg.create_leaf(self.partition, SUPERVISOR_LEAF)
        h.cg.attach(self.partition, SUPERVISOR_LEAF, os.getpid())
        try:
            # Above any VM's weight: a guaranteed VM busy on the partition's only core
            # must not keep the control path waiting (docs/explanation/governor.md).
            h.cg.set_control_cpu(self.partition, SUPERVISOR_LEAF)
        except FusumaError as exc:
            self.log.warning("cannot give the supervisor its control weight: %s", exc)
        oom.set_score(os.getpid(), oom.SUPERVISOR, f"the supervisor of {self.partition}")
        sock = self.paths.supervisor_socket(self.partition)
        sock.parent.mkdir(parents=True, exist_ok=True)
        with contextlib.suppress(FileNotFoundError):
            sock.unlink()
        await adopt.adopt(h)
        await h.repin_all()
        self._server = await asyncio.start_unix_server(self._handle, path=str(sock))
        os.chmod(sock, 0o600)
        self.paths.supervisor_pidfile(self.partition).write_text(f"{os.getpid()}\n")
        h.db.set_supervisor_pid(self.partition, os.getpid())
        h.db.emit("lifecycle", "partition-supervisor-started",
                  f"/1.0/partitions/{self.partition}", supervisor_pid=os.getpid(),
                  vms=sorted(h.instances.running()))
        self.log.info("supervisor %d serving %s on cores %s", os.getpid(), sock, rec.cpus)
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, self._done.set)
        governing = asyncio.create_task(self.governor.run())
        memory = asyncio.create_task(self.memory.run())
        sweeping = asyncio.create_task(self._sweep_jobs())
        trimming = asyncio.create_task(self._trim_templates(holes.trim_every()))
        await self._done.wait()
        governing.cancel()
        memory.cancel()
        sweeping.cancel()
        trimming.cancel()
        await self.shutdown()

    async def shutdown(self) -> None:
        """Stop serving; VMs keep running and the next supervisor re-adopts them."""
        h = self.host
        if self._server is not None:
            self._server.close()
        for inst in h.instances:
            await inst.qmp.disconnect()
            inst.detach()
        with contextlib.suppress(FileNotFoundError):
            self.paths.supervisor_socket(self.partition).unlink()
        with contextlib.suppress(FileNotFoundError):
            self.paths.supervisor_pidfile(self.partition).unlink()
        with h.db.transaction():
            cur = h.db.find_partition(self.partition)
            if cur is not None and cur.supervisor_pid == os.getpid():
                h.db.set_supervisor_pid(self.partition, None)
        self.log.info("supervisor %d stopped; %d VM(s) left running", os.getpid(),
                      len(h.instances.running()))

    async def _handle(self, reader: asyncio.StreamReader,
                      writer: asyncio.StreamWriter) -> None:
        try:
            req = rpc.decode_request(await reader.readline())
            out = rpc.encode_reply(await self.handler(type(req))(req))
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

    # -- jobs whose owner died ----------------------------------------------------------
    async def _sweep_jobs(self, every: float = 1.0) -> None:
        """Within a second or two of a job owner's death, have its job recovered: a
        paused guest never waits for an operator."""
        while True:
            await asyncio.sleep(every)
            try:
                await self._sweep_once()
            except Exception:
                self.log.exception("job sweep failed")

    # -- templates' RAM files ------------------------------------------------------------
    async def _trim_templates(self, every: float) -> None:
        """While clones run here, punch what they filled in their templates' holes
        (fusuma.memshare.holes); once more after the last of a template's clones here
        stopped."""
        if every <= 0:
            return
        last: set[str] = set()
        while True:
            await asyncio.sleep(every)
            try:
                now = templates_of_running(self.host)
                if not now | last:
                    continue
                from fusuma.supervisor import templates

                targets = templates.trim_targets(self.host, now | last)
                freed = await asyncio.to_thread(templates.trim_files, self.host, targets)
                last = now
                for name, n in freed.items():
                    if n:
                        self.log.info("template %s: %d KiB its clones filled punched again",
                                      name, n // 1024)
            except Exception:
                self.log.exception("trimming templates failed")

    async def _sweep_once(self) -> None:
        h = self.host
        for key, child in list(self._recoverers.items()):
            if child.poll() is not None:
                del self._recoverers[key]
        for job in h.db.jobs():
            if job.owner.alive() or job.owner == h.owner:
                continue
            if job.kind in LOCAL_JOBS:
                if job.source == self.partition:
                    await vms.recover_local(h, job)
                continue
            involved = self.partition in (job.source, job.peer)
            if not involved and job.obj.startswith("vm:"):
                rec = h.db.find_vm(job.name)
                involved = rec is not None and rec.partition == self.partition
            if not involved and job.obj == f"partition:{self.partition}":
                involved = True
            key = (job.obj, job.owner.pid)
            if involved and key not in self._recoverers:
                self.log.warning("owner pid %d of the %s job on %s died; recovering",
                                 job.owner.pid, job.kind, job.obj)
                env = spawn.child_env({**os.environ, **self.paths.as_env()})
                with open(self.paths.partition_dir(self.partition) / "recovery.log",
                          "ab") as log:
                    self._recoverers[key] = subprocess.Popen(
                        spawn.module_argv("fusuma.recovery", job.obj),
                        stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=log,
                        start_new_session=True, close_fds=True, env=env, cwd=spawn.CWD)


def main() -> None:
    if len(sys.argv) != 2:
        print("usage: python -m fusuma.supervisor PARTITION", file=sys.stderr)
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
