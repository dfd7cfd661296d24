"""A supervisor's VM operations: start, stop, kill, exec, trim, wait for the agent, and
the recovery of a local job (start, stop, kill, template save, backup) whose supervisor
died.

Each handler takes the partition (``PartitionHost``) and its typed request
(``fusuma.supervisor.rpc``) and returns its typed reply."""

from __future__ import annotations

import asyncio
import base64
import contextlib
import time
from dataclasses import replace
from pathlib import Path

from fusuma.errors import FusumaError, GuestAgentError, QemuError, SpecError, StateError
from fusuma.host import storage
from fusuma.host.accel import probe_accel
from fusuma.images.store import disk_path
from fusuma.memshare import clones, reporting
from fusuma.qemu import privilege
from fusuma.qemu.cmdline import BOOT_DRIVE
from fusuma.qemu.instance import QemuInstance, remove_run_files
from fusuma.state import ALIVE, DiskRecord, Job, JobKind, VmRecord, VmState
from fusuma.supervisor import rpc
from fusuma.supervisor.host import PartitionHost
from fusuma.undo import Reverter


async def start(h: PartitionHost, req: rpc.Start) -> rpc.VmPid:
    vm = req.vm
    requested = time.time()
    async with h.lock(vm), h.job(vm, JobKind.START):
        inst = await start_held(h, h.vm(vm), requested)
    if req.wait_agent > 0:
        await wait_agent(h, rpc.WaitAgent(vm, timeout=req.wait_agent))
    return rpc.VmPid(vm, inst.pid)


async def start_held(h: PartitionHost, vm: VmRecord, requested: float) -> QemuInstance:
    """Start ``vm``'s QEMU under a job its caller holds."""
    running = h.instances.get(vm.name)
    if running is not None:
        raise StateError(f"VM {vm.name!r} is already running (pid {running.pid}).")
    if vm.state not in (VmState.STOPPED, VmState.CRASHED):
        raise StateError(f"VM {vm.name!r} is {vm.state.value}; it can only be started "
                         "when stopped or crashed.")
    accel = probe_accel(vm.accel)
    if accel.notice:
        h.log.info("%s", accel.notice)
    run = h.paths.vm_run_dir(vm.name)
    ram = h.paths.ram_file(vm.name) if vm.shared_ram else None
    resume = clones.resumes(h.paths, vm)     # a clone: from its template's guest
    try:
        with Reverter() as rev:
            h.db.transition(vm.name, VmState.STARTING,
                            expect={VmState.STOPPED, VmState.CRASHED}, error=None)
            rev.add(lambda: h.settle_state(vm.name, VmState.STOPPED, pid=None))
            started = time.time()
            h.phase(vm.name, "launch")
            inst = await h.launch(vm, accel.name, run, ram, None, rev)
            restore_ms = None
            if resume:
                from fusuma.supervisor import templates as template_ops

                h.phase(vm.name, "restore", pid=inst.pid)
                restore_ms = await template_ops.restore(h, vm, inst)
            h.phase(vm.name, "pin", pid=inst.pid)
            await h.repin_all()
            h.db.transition(
                vm.name, VmState.RUNNING, expect={VmState.STARTING}, pid=inst.pid,
                accel_used=accel.name, qemu_binary=str(h.qemu().binary), started_at=started,
                qemu_version=inst.version, error=None, ram_path=str(ram) if ram else None)
            rev.commit()
    except FusumaError as exc:
        with contextlib.suppress(Exception):
            h.db.set_vm(vm.name, error=str(exc))
        raise
    h.log.info("started %s: pid %d, %s", vm.name, inst.pid, accel.name)
    if restore_ms is not None:
        from fusuma.supervisor import templates as template_ops

        template_ops.begin_identity(h, vm.name, inst, requested, restore_ms)
    return inst


async def wait_agent(h: PartitionHost, req: rpc.WaitAgent) -> rpc.Seconds:
    """Wait until the guest agent answers; the seconds since QEMU started."""
    rec, inst = h.running(req.vm)
    async with h.agent_lock(req.vm), h.agent(inst) as ga:
        await ga.connect(timeout=req.timeout)
        await ga.ping()
    return rpc.Seconds(time.time() - (rec.started_at or time.time()))


async def stop(h: PartitionHost, req: rpc.Stop) -> rpc.Ended:
    """Flush the guest's filesystems through its agent, then quit QEMU (killed after
    ``timeout``). Always finishes: an agent that answers garbage, or nothing, costs at
    most :data:`SYNC_S` and the VM is stopped without the flush, its record saying so."""
    vm, timeout = req.vm, req.timeout
    async with h.lock(vm):
        rec = h.vm(vm)
        inst = h.instances.get(vm)
        if inst is None:
            if rec.state in (VmState.STOPPED, VmState.CRASHED):
                return rpc.Ended(vm, was=rec.state.value)
            h.no_job(vm)
            h.end_unmanaged(rec)
            return rpc.Ended(vm, was="killed", pid=rec.pid)
        async with h.job(vm, JobKind.STOP):
            await shut_down(h, inst, timeout)
    return rpc.Ended(vm, was="running", pid=inst.pid)


async def shut_down(h: PartitionHost, inst: QemuInstance, timeout: float) -> None:
    """Stop VM ``inst.vm``'s QEMU under a job its caller holds: flush the guest's
    filesystems, then quit QEMU (killed after ``timeout``)."""
    vm = inst.vm
    h.db.transition(vm, VmState.STOPPING, expect={VmState.RUNNING, VmState.PAUSED})
    inst.stopping = True
    try:
        h.phase(vm, "sync")
        why = await _flush_guest(h, inst, min(timeout, SYNC_S))
        if why is not None:
            inst.stop_note = f"stopped without flushing the guest's filesystems: {why}"
            h.log.warning("%s: %s", vm, inst.stop_note)
    finally:
        # Whatever the guest did, QEMU is ended (quit, then SIGKILL).
        h.phase(vm, "quit")
        await inst.stop(timeout)


# At most this long for the guest to flush its filesystems when it stops.
SYNC_S = 7.0


async def _flush_guest(h: PartitionHost, inst: QemuInstance, budget: float) -> str | None:
    """``sync`` in the guest through its agent, within ``budget`` seconds (waiting for
    a command already running on the channel included); None if done, else why not,
    in fusuma's words (never the guest's)."""
    try:
        async with asyncio.timeout(budget):
            async with h.agent_lock(inst.vm), h.agent(inst) as ga:
                await ga.connect(timeout=min(2.0, budget))
                res = await ga.run(["/bin/sync"], timeout=budget)
    except TimeoutError:
        return f"its guest agent did not finish within {budget:.0f} s"
    except GuestAgentError as exc:
        return exc.summary
    except (FusumaError, OSError) as exc:
        return f"its guest agent could not be used ({type(exc).__name__})"
    if res.exit_code != 0:
        return f"sync in the guest exited with status {res.exit_code}"
    return None


async def kill(h: PartitionHost, req: rpc.Kill) -> rpc.Ended:
    vm = req.vm
    rec = h.vm(vm)
    inst = h.instances.get(vm)
    if inst is None:
        if rec.state in (VmState.STOPPED, VmState.CRASHED):
            raise StateError(f"VM {vm!r} is {rec.state.value}; there is no QEMU to kill.")
        h.no_job(vm)
        h.end_unmanaged(rec)
        return rpc.Ended(vm, was="killed", pid=rec.pid)
    async with h.job(vm, JobKind.KILL):
        h.db.transition(vm, VmState.STOPPING, expect={VmState.RUNNING, VmState.PAUSED})
        await inst.kill()
    return rpc.Ended(vm, was="killed", pid=inst.pid)


async def exec_(h: PartitionHost, req: rpc.Exec) -> rpc.ExecResult:
    h.running(req.vm)
    h.no_job(req.vm)
    data = base64.b64decode(req.stdin) if req.stdin is not None else None
    async with h.agent_lock(req.vm):
        _, inst = h.running(req.vm)   # it may have stopped while we waited for the channel
        async with h.agent(inst) as ga:
            await ga.connect(timeout=req.timeout)
            res = await ga.run(req.argv, stdin=data, timeout=req.timeout)
    return rpc.ExecResult(exit_code=res.exit_code, signal=res.signal,
                          stdout=base64.b64encode(res.stdout).decode(),
                          stderr=base64.b64encode(res.stderr).decode())


async def trim(h: PartitionHost, req: rpc.Trim) -> rpc.Trimmed:
    """Ask the guest to drop its caches and compact, then wait until the pages it
    freed have been reported and the RAM's resident size holds still."""
    vm, timeout = req.vm, req.timeout
    rec, inst = h.running(vm)
    h.no_job(vm)
    reporting.refuse_without_device(rec)
    try:
        status = await inst.qmp.execute("x-query-virtio-status",
                                        {"path": reporting.balloon_path()})
    except QemuError as exc:
        raise StateError(f"VM {vm!r}: QEMU cannot say whether its guest took page "
                         f"reporting ({exc})") from exc
    if not reporting.negotiated(status):
        raise reporting.refuse_without_driver(vm)
    t0 = time.monotonic()
    before = reporting.resident_bytes(rec, inst.pid)
    async with h.agent_lock(vm):
        h.running(vm)
        async with h.agent(inst) as ga:
            await ga.connect(timeout=timeout)
            res = await ga.run(reporting.TRIM_ARGV, timeout=timeout)
    if res.exit_code != 0:
        # Its stderr is the guest's to say: only its size goes into the error.
        raise GuestAgentError(f"VM {vm!r}: dropping the guest's caches failed (exit "
                              f"{res.exit_code}, {len(res.stderr)} bytes on stderr); "
                              "`fusuma vm exec` the same to see why.")
    after = await reporting.settled_bytes(rec, inst.pid)

    def mib(b: int | None) -> float | None:
        return None if b is None else round(b / 2**20, 1)
    returned = None if before is None or after is None else max(0, before - after)
    h.log.info("trim %s: %s -> %s MiB", vm, mib(before), mib(after))
    return rpc.Trimmed(vm=vm, resident_before_mib=mib(before),
                       resident_after_mib=mib(after), returned_mib=mib(returned),
                       seconds=round(time.monotonic() - t0, 2))


async def resize_disk(h: PartitionHost, req: rpc.ResizeDisk) -> rpc.Resized:
    """Grow a VM's disk: its thin disk (``req.disk`` "") or a registered disk attached
    to it. Running, by QMP ``block_resize`` (the guest sees the new capacity at once,
    virtio-blk's configuration change); stopped, by ``qemu-img resize`` as the VM's
    uid (a qcow2) or by growing the file (a raw disk: fusuma.host.storage.grow). Never
    shrinks: a smaller or equal size is refused."""
    rec = h.vm(req.vm)
    if req.disk:
        if req.disk not in rec.disks:
            raise StateError(f"disk {req.disk!r} is not attached to VM {req.vm!r}; "
                             f"its disks: {', '.join(rec.disks) or 'none'}.")
        drive, what = f"disk-{req.disk}", f"disk {req.disk!r}"
    else:
        if rec.boot == "kernel":
            raise StateError(f"VM {req.vm!r} runs an image fusuma builds and has no thin "
                             "disk; name one of its disks (--disk).")
        drive, what = BOOT_DRIVE, f"VM {req.vm!r}'s disk"
    h.no_job(req.vm)       # a move, a backup...: refused now, not waited for
    async with h.lock(req.vm):
        h.no_job(req.vm)
        rec = h.vm(req.vm)
        inst = h.instances.get(req.vm)
        if inst is not None:
            old = await _resize_online(inst, req, drive, what)
        elif rec.state in (VmState.STOPPED, VmState.CRASHED):
            # The records are read here: the state file's connection is this thread's.
            d = h.db.disk(req.disk) if req.disk else None
            old = await asyncio.to_thread(_resize_offline, h, rec, d, req, what)
        else:
            raise StateError(f"VM {req.vm!r} is {rec.state.value}; resize its disk when "
                             "it runs or is stopped.")
    h.log.info("resized %s of %s (%s): %d -> %d bytes", drive, req.vm,
               "online" if inst is not None else "stopped", old, req.size)
    return rpc.Resized(vm=req.vm, drive=drive, old_size=old, size=req.size)


async def _resize_online(inst: QemuInstance, req: rpc.ResizeDisk, drive: str,
                         what: str) -> int:
    """The size now is QEMU's own (``query-block``)."""
    from fusuma.qemu import block

    found = (await block.drives(inst.qmp)).get(drive)
    if found is None:
        raise StateError(f"VM {req.vm!r}'s QEMU has no drive {drive}; stop and start it.")
    old = found.virtual_size
    if req.size <= old:
        raise SpecError(f"{what} is {old} bytes; a disk only grows (give more than that).")
    await inst.qmp.execute("block_resize", {"device": drive, "size": req.size})
    return old


def _resize_offline(h: PartitionHost, rec: VmRecord, d: DiskRecord | None,
                    req: rpc.ResizeDisk, what: str) -> int:
    """A stopped VM's disk (``d``: a registered one, else its thin disk), with no QEMU:
    the supervisor holds the VM's lock, so no start comes in between."""
    if d is not None:
        return storage.grow(d.name, Path(d.path), d.dev, d.ino, req.size)
    from fusuma.images import snapshots as offline

    path, uid = disk_path(h.paths, rec.name), privilege.uid_for(h.paths, rec)
    old = offline.size_of(path, uid)
    if req.size <= old:
        raise SpecError(f"{what} is {old} bytes; a disk only grows (give more than that).")
    offline.grow(path, uid, req.size)
    return old


async def recover_local(h: PartitionHost, job: Job) -> None:
    """Finish a start, stop, kill or template save whose supervisor died, asking QEMU
    (one entry point for every local job kind; a kind whose module keeps its own
    recovery, a backup or a snapshot, is registered in ``h.local_recoverers``)."""
    if h.db.take_over(job.obj, job.owner, h.owner) is None:
        return
    other = h.local_recoverers.get(job.kind)
    if other is not None:       # a kind whose module registered its own recovery
        try:
            await other(replace(job, owner=h.owner))
        finally:
            h.db.end_job(job.obj, h.owner)
        return
    name = job.name
    inst = h.instances.get(name)
    if job.kind == JobKind.IDENTITY and inst is not None:
        from fusuma.supervisor import templates as template_ops

        # A clone that runs and was never given its own identity: give it now (the
        # step ends the job).
        template_ops.begin_identity(h, name, inst, time.time(), 0.0,
                                    job=replace(job, owner=h.owner))
        h.log.info("giving %s its identity as a clone (owner pid %d died first)", name,
                   job.owner.pid)
        return
    try:
        rec = h.db.find_vm(name)
        inst = h.instances.get(name)
        if rec is None:
            pass
        elif job.kind in ("stop", "kill"):
            if inst is not None:
                with contextlib.suppress(QemuError):
                    await inst.kill()
            elif rec.state in ALIVE:
                h.end_unmanaged(rec)
            with contextlib.suppress(FusumaError):
                h.settle_state(name, VmState.STOPPED, pid=None)
        elif job.kind == JobKind.TEMPLATE:
            from fusuma.supervisor import templates as template_ops

            await template_ops.recover(h, job)
        elif job.kind == JobKind.START:
            status = None if inst is None else await inst.qmp.query_status()
            if inst is not None and status in ("inmigrate", "prelaunch"):
                # A clone that never loaded its template's state: it cannot run.
                with contextlib.suppress(QemuError):
                    await inst.kill()
                inst = None
            if inst is None:
                remove_run_files(h.paths.vm_run_dir(name))
                with contextlib.suppress(FusumaError):
                    h.settle_state(name, VmState.STOPPED, pid=None,
                                   error="the supervisor died while starting it")
            else:
                h.settle_state(name, VmState.RUNNING if status == "running"
                               else VmState.PAUSED, pid=inst.pid)
        h.log.info("recovered the %s job of %s (owner pid %d died)", job.kind, name,
                   job.owner.pid)
    finally:
        h.db.end_job(job.obj, h.owner)


def crashed_while_away(h: PartitionHost, vm: VmRecord) -> None:
    """A VM whose QEMU exited while no supervisor watched it."""
    h.log.warning("%s (pid %s) exited while no supervisor watched it", vm.name, vm.pid)
    remove_run_files(h.paths.vm_run_dir(vm.name))
    if vm.ram_path:
        h.remove_ram(Path(vm.ram_path))
    with contextlib.suppress(FusumaError):
        h.settle_state(vm.name, VmState.CRASHED, pid=None,
                       error="QEMU exited while the partition's supervisor was down")
