"""The supervisor's half of a move between two partitions on one host.

Destination: ``incoming_prepare`` starts a QEMU with ``-S -incoming defer`` in this
partition (sockets under ``<run>/in-…``) and a task that, when the stream completes,
records the move's outcome as "forward" and only then lets the guest run there
(``incoming_commit``: cont, and the VM's record now names this partition and pid).
``incoming_finish`` waits for that; ``settle`` moves the sockets to their usual place
once the source QEMU is gone; ``incoming_abort`` ends a destination that must not run.
Source: ``migrate_out`` streams the VM and reports; ``release`` ends the source once the
outcome is "forward"; ``resume_source`` lets it run again once the outcome is "back".
``instances`` tells recovery what this supervisor holds of a VM, asking QEMU.

The outcome is written once (``Database.decide``): whoever records it first, the
destination's task or a recovery, wins, and the other follows. So a source never
resumes after its destination has run, and two QEMUs never run one guest.

Zero-copy: both QEMUs map the same named RAM file and the capability
``x-ignore-shared`` keeps RAM out of the stream; only device state moves. The RAM file
then belongs to both until the source exits, so neither side deletes it on exit.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from qemu.qmp import EventListener

from fusuma.errors import FusumaError, MigrationError, NotFoundError, QemuError, StateError
from fusuma.host.accel import probe_accel
from fusuma.partition import rpc
from fusuma.partition.supervisor_consts import INCOMING_PREFIX
from fusuma.qemu import privilege, process
from fusuma.qemu.cmdline import NET_ID, hostfwd
from fusuma.qemu.qmp import EVENT_MIGRATION, EVENT_RESUME, EVENT_STOP, event_time
from fusuma.state import VmState, vm_obj

if TYPE_CHECKING:
    from fusuma.partition.supervisor import Supervisor, VmRuntime

MODES = ("zero-copy", "copy")
# QEMU before 9.0 loses TCG guest writes from the dirty bitmap during pre-copy
# (fixed upstream by 03bfc2188f06 "physmem: Fix migration dirty bitmap coherency with
# TCG memory access"): a live copy migration can hand the destination stale pages.
# Under TCG with such a QEMU, copy mode pauses the guest for the transfer instead.
TCG_DIRTY_FIX = (9, 0)
SOCKET_FILES = ("qmp.sock", "qga.sock", "console.sock", "qemu.pid")


@dataclass
class Incoming:
    rt: VmRuntime
    listener: EventListener | None
    mode: str
    source: str
    # Resolves to the commit's result once the guest runs here (or the error).
    done: asyncio.Future[rpc.Resumed] | None = None
    task: asyncio.Task[None] | None = None
    extra: dict[str, Any] = field(default_factory=dict)


def capabilities(mode: str) -> dict[str, bool]:
    return {"x-ignore-shared": mode == "zero-copy", "events": True}


async def incoming_prepare(sup: Supervisor, vm: str, mode: str,
                           fault_decide_delay: float = 0.0) -> rpc.Prepared:
    if mode not in MODES:
        raise StateError(f"unknown migration mode {mode!r}; use zero-copy or copy.")
    rec = sup.db.vm(vm)
    if rec.partition == sup.partition:
        raise StateError(f"VM {vm!r} is already in partition {sup.partition!r}.")
    if vm in sup.vms or vm in sup.incoming:
        raise StateError(f"partition {sup.partition!r} already runs a QEMU for {vm!r}.")
    job = sup.db.find_job(vm_obj(vm))
    if job is None or job.kind != "migrate" or job.peer != sup.partition:
        raise StateError(f"no move of {vm!r} to partition {sup.partition!r} is under way.")
    if mode == "zero-copy" and not (rec.shared_ram and rec.ram_path):
        raise StateError(f"VM {vm!r} has private RAM; zero-copy migration needs RAM in a "
                         "shared file: use --mode copy.")
    if mode == "zero-copy":
        ram: Path | None = Path(str(rec.ram_path))
    elif rec.shared_ram:
        ram = sup.paths.shm / f"{vm}.{uuid.uuid4().hex[:8]}.ram"
    else:
        ram = None
    run = sup.paths.vm_run_dir(vm) / f"{INCOMING_PREFIX}{uuid.uuid4().hex[:8]}"
    accel = probe_accel(rec.accel_used or rec.accel).name
    t0 = time.monotonic()
    undo: list[Any] = []
    try:
        if mode == "copy" and ram is not None:
            undo.append(lambda: sup._remove_ram(ram))
            # The destination's own RAM file, made like a new VM's (0600, the VM's uid).
            privilege.create_ram_file(ram, privilege.uid_for(sup.paths, rec))
            sup.charge_ram(ram, rec.memory_mib)
        rt = await sup._launch(rec, accel, run, ram, "defer", undo,
                               disk_owner=rec.partition)
        rt.detached = True
        rt.owns_ram = mode == "copy"
        await rt.qmp.migrate_set_capabilities(capabilities(mode))
        listener = rt.qmp.listener(EVENT_MIGRATION)
        uri = f"unix:{run}/migrate.sock"
        await rt.qmp.migrate_incoming(uri)
    except BaseException:
        sup._undo(undo)
        raise
    inc = Incoming(rt, listener, mode, rec.partition,
                   done=asyncio.get_running_loop().create_future(),
                   extra={"fault_decide_delay": fault_decide_delay})
    sup.incoming[vm] = inc
    sup._watch(rt)
    inc.task = asyncio.ensure_future(_resume_when_complete(sup, vm, inc))
    prepare_ms = (time.monotonic() - t0) * 1000
    sup.log.info("waiting for %s (%s) from %s on %s", vm, mode, rec.partition, uri)
    return rpc.Prepared(uri=uri, pid=rt.pid, prepare_ms=round(prepare_ms, 2),
                        run_dir=str(run),
                        dest_ram=str(ram) if ram and mode == "copy" else None)


async def _resume_when_complete(sup: Supervisor, vm: str, inc: Incoming) -> None:
    """When the stream has arrived, record "forward" and let the guest run here."""
    rt = inc.rt
    assert inc.done is not None and inc.listener is not None
    try:
        while True:
            ev: Any = await inc.listener.get()
            status = ev.get("data", {}).get("status")
            if status == "completed":
                break
            if status in ("failed", "cancelled"):
                raise MigrationError(f"the stream of {vm!r} into partition "
                                     f"{sup.partition!r} {status}.")
        delay = float(inc.extra.get("fault_decide_delay") or 0)
        if delay > 0:     # fault injection (tests): hold between stream and outcome
            await asyncio.sleep(delay)
        result = await incoming_commit(sup, vm, paused=True)
        if not inc.done.done():
            inc.done.set_result(result)
    except asyncio.CancelledError:
        _fail(inc.done, MigrationError(f"the incoming QEMU of {vm!r} in partition "
                                       f"{sup.partition!r} ended before the guest ran."))
    except Exception as exc:
        _fail(inc.done, exc)
    finally:
        rt.qmp.drop_listener(inc.listener)


def _fail(done: asyncio.Future[rpc.Resumed], exc: BaseException) -> None:
    if not done.done():
        done.set_exception(exc)
        done.exception()     # retrieved: no "never retrieved" noise when nobody waits


async def incoming_commit(sup: Supervisor, vm: str, paused: bool = False) -> rpc.Resumed:
    """Make this partition's incoming QEMU the VM's: record "forward", run the guest,
    take the record. Idempotent; refused if the outcome recorded is "back".

    ``paused``: the caller knows the guest is paused here (the stream has just
    completed into a ``-S`` QEMU), which saves a round trip in the move's downtime."""
    inc = sup.incoming.get(vm)
    if inc is None:
        rt = sup.vms.get(vm)
        if rt is not None:
            return rpc.Resumed(pid=rt.pid, resume_ts=time.time(), already=True)
        raise NotFoundError(f"no incoming QEMU of {vm!r} in partition {sup.partition!r}.")
    rt = inc.rt
    decision = sup.db.decide(vm_obj(vm), "forward")
    if decision != "forward":
        raise MigrationError(f"the move of {vm!r} was decided {decision!r}: the guest "
                             f"stays at its source.")
    status = "paused" if paused else await rt.qmp.query_status()
    resume_ts = time.time()
    if status != "running":
        listener = rt.qmp.listener(EVENT_RESUME)
        try:
            await rt.qmp.cont()
            with contextlib.suppress(QemuError):
                resume_ts = event_time(await rt.qmp.wait_event(listener, 5.0))
        finally:
            rt.qmp.drop_listener(listener)
    sup.incoming.pop(vm, None)
    rt.detached = False
    # The guest's RAM is this QEMU's now (removal still waits until no QEMU maps it).
    rt.owns_ram = True
    old = sup.vms.get(vm)
    if old is not None and old is not rt:
        # An in-place move (fusuma.migration.cpr): the old QEMU of this partition is
        # the leaving side now, ended by ``release``.
        old.detached = True
        old.owns_ram = False
        sup.leaving[vm] = old
    sup.vms[vm] = rt
    rec = sup.db.vm(vm)
    for dname in rec.disks:
        sup.db.move_disk(dname, sup.partition)
    fields: dict[str, Any] = dict(
        partition=sup.partition, pid=rt.pid, error=None,
        ram_path=str(rt.ram_file) if rt.ram_file else None,
        qemu_binary=sup._qemu_binary(),
        qemu_version=rt.qemu_version or sup._qemu().version)
    if rec.state == VmState.MIGRATING:
        sup.db.transition(vm, VmState.RUNNING, expect={VmState.MIGRATING}, **fields)
    else:
        sup.db.set_vm(vm, **fields)
    if rt.runstate_task is None:
        rt.runstate_task = asyncio.ensure_future(sup._follow_runstate(rt))
    await sup._repin_all()
    return rpc.Resumed(pid=rt.pid, resume_ts=resume_ts)


async def migrate_out(sup: Supervisor, vm: str, uri: str, mode: str,
                      timeout: float = 600.0, max_bandwidth: int = 0) -> rpc.Streamed:
    rt = sup.vms.get(vm)
    rec = sup.db.vm(vm)
    if rt is None:
        raise StateError(f"VM {vm!r} is {rec.state.value}, not running in partition "
                         f"{sup.partition!r}.")
    if rec.state != VmState.MIGRATING:
        raise StateError(f"VM {vm!r} is {rec.state.value}; no move of it is under way.")
    listener = rt.qmp.listener(EVENT_STOP)
    paused = False
    try:
        await rt.qmp.migrate_set_capabilities(capabilities(mode))
        if max_bandwidth > 0:     # fault injection (tests): a stream slow enough to hit
            await rt.qmp.execute("migrate-set-parameters",
                                 {"max-bandwidth": max_bandwidth})
        if mode == "copy" and await _tcg_dirty_bug(rt, rec.accel_used):
            paused = True
        t0 = time.time()
        if paused:
            await rt.qmp.stop()
        await rt.qmp.migrate(uri)
        info = await _wait_migration(rt, timeout)
        if info.status != "completed":
            raise MigrationError(f"migration of {vm!r} failed ({info.error or info.status}).")
        stop_ts = None
        with contextlib.suppress(QemuError):
            stop_ts = event_time(await rt.qmp.wait_event(listener, 5.0))
    finally:
        rt.qmp.drop_listener(listener)
    # The stream is complete; this QEMU is paused ("postmigrate"). It is the leaving
    # side now: the destination (or recovery) decides whether the guest moves on.
    rt.detached = True
    rt.owns_ram = mode == "copy"
    if sup.vms.get(vm) is rt:
        del sup.vms[vm]
    sup.leaving[vm] = rt
    return rpc.Streamed(t0=t0, stop_ts=stop_ts, qemu_total_ms=info.total_ms,
                        qemu_downtime_ms=info.downtime_ms, bytes_sent=info.transferred,
                        source_pid=rt.pid, paused=paused)


async def _tcg_dirty_bug(rt: VmRuntime, accel: str | None) -> bool:
    """True if this QEMU runs the guest under TCG and predates the dirty-bitmap fix."""
    if accel != "tcg":
        return False
    try:
        ver = (await rt.qmp.execute("query-version"))["qemu"]
        return (int(ver["major"]), int(ver["minor"])) < TCG_DIRTY_FIX
    except (QemuError, KeyError, TypeError, ValueError):
        return True


async def _wait_migration(rt: VmRuntime, timeout: float) -> Any:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    delay = 0.001
    while True:
        if rt.exited.is_set():
            raise MigrationError(f"the source QEMU of {rt.name!r} exited during migration.")
        info = await rt.qmp.query_migrate()
        if info.status in ("completed", "failed", "cancelled"):
            return info
        if loop.time() > deadline:
            with contextlib.suppress(QemuError):
                await rt.qmp.migrate_cancel()
            raise MigrationError(f"migration of {rt.name!r} did not finish in "
                                 f"{timeout:.0f} s and was cancelled.")
        await asyncio.sleep(delay)
        delay = min(delay * 2, 0.05)


async def incoming_finish(sup: Supervisor, vm: str, timeout: float = 30.0) -> rpc.Resumed:
    """Wait until the guest runs here (the destination's own task resumes it)."""
    inc = sup.incoming.get(vm)
    if inc is None:
        rt = sup.vms.get(vm)
        if rt is not None:
            return rpc.Resumed(pid=rt.pid, resume_ts=time.time(), already=True)
        raise NotFoundError(f"no incoming migration of {vm!r} in partition {sup.partition!r}.")
    if inc.done is None:
        return await incoming_commit(sup, vm)
    try:
        return await asyncio.wait_for(asyncio.shield(inc.done), timeout)
    except TimeoutError as exc:
        raise MigrationError(f"{vm!r} did not start running in partition "
                             f"{sup.partition!r} within {timeout:.0f} s.") from exc


async def release(sup: Supervisor, vm: str, timeout: float = 10.0) -> rpc.Ended:
    """End the source QEMU of a move whose outcome is "forward"."""
    rt = sup.leaving.get(vm)
    if rt is None:
        cand = sup.vms.get(vm)
        rec = sup.db.find_vm(vm)
        if cand is None or rec is None or (rec.partition == sup.partition
                                           and rec.pid == cand.pid):
            return rpc.Ended(vm, was="gone")
        rt = cand     # a source the record no longer names (adopted after a crash)
    job = sup.db.find_job(vm_obj(vm))
    decision = job.detail.get("decision") if job else None
    if job is not None and decision != "forward":
        raise MigrationError(f"the source QEMU of {vm!r} is kept: the move's outcome is "
                             f"{decision or 'not decided'}.")
    sup.leaving.pop(vm, None)
    if sup.vms.get(vm) is rt:
        del sup.vms[vm]
    rt.detached = True
    rt.stopping = True
    if not rt.exited.is_set():
        await rt.qmp.quit()
        try:
            await asyncio.wait_for(rt.exited.wait(), timeout)
        except TimeoutError:
            process.kill(rt.pid)
            await asyncio.wait_for(rt.exited.wait(), 10)
    return rpc.Ended(vm, was="released", pid=rt.pid)


async def resume_source(sup: Supervisor, vm: str) -> rpc.Resumed:
    """Run the source again: only once the move's outcome is recorded as "back"."""
    rt = sup.leaving.get(vm) or sup.vms.get(vm)
    if rt is None or rt.exited.is_set():
        raise MigrationError(f"the source QEMU of {vm!r} is gone.")
    decision = sup.db.decide(vm_obj(vm), "back")
    if decision not in ("back", None):
        raise MigrationError(f"the source of {vm!r} must not run again: its destination "
                             "may already have run the guest.")
    if await rt.qmp.query_status() != "running":
        await rt.qmp.cont()
    job = sup.db.find_job(vm_obj(vm))
    if job is not None and job.detail.get("mode") == "cpr-transfer":
        from fusuma.migration import cpr

        await cpr.normal_mode(rt)    # its next move may be an ordinary one
    sup.leaving.pop(vm, None)
    rt.detached = False
    rt.owns_ram = True
    sup.vms[vm] = rt
    if rt.runstate_task is None:
        rt.runstate_task = asyncio.ensure_future(sup._follow_runstate(rt))
    return rpc.Resumed(pid=rt.pid, resume_ts=time.time())


async def settle(sup: Supervisor, vm: str) -> rpc.Settled:
    """Move the sockets of a migrated-in QEMU from ``<run>/in-…`` to ``<run>``.

    Only after the source QEMU exited: QEMU unlinks its listening sockets' paths on
    exit, which would remove ours if they already had the same names."""
    rt = sup.vms.get(vm)
    if rt is None or not rt.run_dir.name.startswith(INCOMING_PREFIX):
        return rpc.Settled(vm, moved=False)
    # The source held the forwarded host ports until it exited: take them over now.
    unbound = []
    for item in sup.db.vm(vm).ports:
        host, guest = (int(x) for x in item.split(":"))
        out = await rt.qmp.execute("human-monitor-command", {
            "command-line": f"hostfwd_add {NET_ID} {hostfwd(host, guest)}"})
        if isinstance(out, str) and out.strip():
            unbound.append(item)
            sup.log.warning("%s: cannot forward host port %d after migration: %s",
                            vm, host, out.strip())
    rec = sup.db.vm(vm)
    if rec.ram_path and rec.shared_ram:
        # The source QEMU's memory has left the RAM group: its peak starts again here.
        sup.cg.reset_ram_peak(Path(rec.ram_path).name.removesuffix(".ram"))
    target = rt.run_dir.parent
    for name in SOCKET_FILES:
        with contextlib.suppress(FileNotFoundError):
            (rt.run_dir / name).rename(target / name)
    for name in ("migrate.sock", "cpr.sock"):
        with contextlib.suppress(FileNotFoundError):
            (rt.run_dir / name).unlink()
    with contextlib.suppress(OSError):
        rt.run_dir.rmdir()
    rt.run_dir = target
    rt.qmp.socket = target / "qmp.sock"
    return rpc.Settled(vm, moved=True, unbound_ports=unbound)


async def incoming_abort(sup: Supervisor, vm: str) -> rpc.Ended:
    """End the incoming QEMU (never one the outcome "forward" lets run)."""
    inc = sup.incoming.get(vm)
    if inc is None:
        return rpc.Ended(vm, was="gone")
    job = sup.db.find_job(vm_obj(vm))
    if job is not None and job.detail.get("decision") == "forward":
        raise MigrationError(f"the incoming QEMU of {vm!r} is kept: the guest has moved "
                             "to it.")
    sup.incoming.pop(vm, None)
    rt = inc.rt
    if inc.task is not None:
        inc.task.cancel()
    if not rt.exited.is_set():
        rt.stopping = True
        process.kill(rt.pid)
        await asyncio.wait_for(rt.exited.wait(), 10)
    return rpc.Ended(vm, was="aborted", pid=rt.pid)


async def instances(sup: Supervisor, vm: str) -> list[rpc.Instance]:
    """What this supervisor holds of ``vm``, as QEMU itself reports it."""
    held: list[tuple[str, VmRuntime]] = []
    if vm in sup.vms:
        held.append(("vm", sup.vms[vm]))
    if vm in sup.leaving:
        held.append(("leaving", sup.leaving[vm]))
    if vm in sup.incoming:
        held.append(("incoming", sup.incoming[vm].rt))
    out = []
    for role, rt in held:
        if rt.exited.is_set() or not process.pid_alive(rt.pid):
            continue
        try:
            status = await rt.qmp.query_status()
            migration = (await rt.qmp.query_migrate()).status
        except FusumaError as exc:
            status, migration = f"unknown ({exc})", "unknown"
        out.append(rpc.Instance(role=role, pid=rt.pid, status=status, migration=migration,
                                run_dir=str(rt.run_dir)))
    return out
