"""The supervisor's half of a migration between two partitions on one host.

Destination: ``incoming_prepare`` starts a QEMU with ``-incoming defer`` in this
partition (sockets under ``<run>/in``), ``incoming_finish`` waits for the guest to run
and takes ownership of the VM's record, ``settle`` moves the sockets to their usual
place once the source QEMU is gone, ``incoming_abort`` undoes a failed attempt.
Source: ``migrate_out`` streams the VM and reports, ``release`` ends the paused source
QEMU, ``resume_source`` lets it run again if the destination failed after completion.

Zero-copy: both QEMUs map the same named RAM file and the capability
``x-ignore-shared`` keeps RAM out of the stream; only device state moves. The RAM file
then belongs to both until the source exits, so neither side deletes it on exit.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from qemu.qmp import EventListener

from fusuma.errors import MigrationError, NotFoundError, QemuError, StateError
from fusuma.host.accel import probe_accel
from fusuma.partition.supervisor_consts import INCOMING_PREFIX
from fusuma.qemu.cmdline import NET_ID, hostfwd
from fusuma.qemu.qmp import EVENT_RESUME, EVENT_STOP, event_time
from fusuma.state import VmState

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
    listener: EventListener
    mode: str
    source: str


def capabilities(mode: str) -> dict[str, bool]:
    return {"x-ignore-shared": mode == "zero-copy", "events": True}


async def incoming_prepare(sup: Supervisor, vm: str, mode: str) -> dict[str, Any]:
    if mode not in MODES:
        raise StateError(f"unknown migration mode {mode!r}; use zero-copy or copy.")
    rec = sup.db.vm(vm)
    if rec.partition == sup.partition:
        raise StateError(f"VM {vm!r} is already in partition {sup.partition!r}.")
    if vm in sup.vms or vm in sup.incoming:
        raise StateError(f"partition {sup.partition!r} already runs a QEMU for {vm!r}.")
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
        rt = await sup._launch(rec, accel, run, ram, "defer", undo,
                               disk_owner=rec.partition)
        rt.detached = True
        rt.owns_ram = mode == "copy"
        await rt.qmp.migrate_set_capabilities(capabilities(mode))
        listener = rt.qmp.listener(EVENT_RESUME)
        uri = f"unix:{run}/migrate.sock"
        await rt.qmp.migrate_incoming(uri)
    except BaseException:
        sup._undo(undo)
        raise
    sup.incoming[vm] = Incoming(rt, listener, mode, rec.partition)
    sup._watch(rt)
    prepare_ms = (time.monotonic() - t0) * 1000
    sup.log.info("waiting for %s (%s) from %s on %s", vm, mode, rec.partition, uri)
    return {"uri": uri, "pid": rt.pid, "prepare_ms": round(prepare_ms, 2)}


async def migrate_out(sup: Supervisor, vm: str, uri: str, mode: str,
                      timeout: float = 600.0) -> dict[str, Any]:
    rt = sup.vms.get(vm)
    rec = sup.db.vm(vm)
    if rt is None:
        raise StateError(f"VM {vm!r} is {rec.state.value}, not running in partition "
                         f"{sup.partition!r}.")
    sup.db.update_vm(rec.with_(state=VmState.MIGRATING))
    listener = rt.qmp.listener(EVENT_STOP)
    paused = False
    try:
        await rt.qmp.migrate_set_capabilities(capabilities(mode))
        if mode == "copy" and await _tcg_dirty_bug(rt, rec.accel_used):
            paused = True
        t0 = time.time()
        if paused:
            await rt.qmp.stop()
        await rt.qmp.migrate(uri)
        info = await _wait_migration(rt, timeout)
        if info.status != "completed":
            raise MigrationError(f"migration of {vm!r} failed ({info.error or info.status}); "
                                 f"it keeps running in partition {sup.partition!r}.")
        stop_ts = None
        with contextlib.suppress(QemuError):
            stop_ts = event_time(await rt.qmp.wait_event(listener, 5.0))
    except BaseException:
        with contextlib.suppress(Exception):
            if rt.exited.is_set():
                raise
            if (await rt.qmp.query_status()) != "running":
                await rt.qmp.cont()
            sup.db.update_vm(sup.db.vm(vm).with_(state=VmState.RUNNING))
        raise
    finally:
        rt.qmp.drop_listener(listener)
    # The VM now lives on at the destination; this QEMU is paused ("postmigrate").
    rt.detached = True
    rt.owns_ram = mode == "copy"
    del sup.vms[vm]
    sup.leaving[vm] = rt
    return {"t0": t0, "stop_ts": stop_ts, "qemu_total_ms": info.total_ms,
            "qemu_downtime_ms": info.downtime_ms, "bytes_sent": info.transferred,
            "source_pid": rt.pid, "paused": paused}


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


async def incoming_finish(sup: Supervisor, vm: str, timeout: float = 30.0,
                          resume: bool = False) -> dict[str, Any]:
    """``resume``: the source was paused for the transfer, so the destination starts
    paused too and is continued here."""
    inc = sup.incoming.get(vm)
    if inc is None:
        raise NotFoundError(f"no incoming migration of {vm!r} in partition {sup.partition!r}.")
    rt = inc.rt
    if resume:
        await _wait_incoming_done(rt, timeout)
        await rt.qmp.cont()
    try:
        ev = await rt.qmp.wait_event(inc.listener, timeout)
    except QemuError as exc:
        raise MigrationError(f"{vm!r} did not start running at the destination: {exc}") \
            from exc
    finally:
        rt.qmp.drop_listener(inc.listener)
    status = await rt.qmp.query_status()
    if status != "running":
        raise MigrationError(f"{vm!r} is {status} at the destination, not running.")
    del sup.incoming[vm]
    rt.detached = False
    sup.vms[vm] = rt
    rec = sup.db.vm(vm)
    for dname in rec.disks:
        sup.db.move_disk(dname, sup.partition)
    sup.db.update_vm(rec.with_(
        partition=sup.partition, state=VmState.RUNNING, pid=rt.pid,
        ram_path=str(rt.ram_file) if rt.ram_file else None,
        qemu_binary=sup._qemu_binary(), error=None))
    await sup._repin_all()
    return {"resume_ts": event_time(ev), "pid": rt.pid}


async def _wait_incoming_done(rt: VmRuntime, timeout: float) -> None:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while (status := await rt.qmp.query_status()) in ("inmigrate", "postmigrate"):
        if loop.time() > deadline:
            raise MigrationError(f"{rt.name!r} is still {status} at the destination after "
                                 f"{timeout:.0f} s.")
        await asyncio.sleep(0.002)


async def release(sup: Supervisor, vm: str, timeout: float = 10.0) -> dict[str, Any]:
    rt = sup.leaving.pop(vm, None)
    if rt is None:
        return {"vm": vm, "was": "gone"}
    rt.stopping = True
    if not rt.exited.is_set():
        await rt.qmp.quit()
        try:
            await asyncio.wait_for(rt.exited.wait(), timeout)
        except TimeoutError:
            os.kill(rt.pid, 9)
            await asyncio.wait_for(rt.exited.wait(), 10)
    return {"vm": vm, "was": "released"}


async def resume_source(sup: Supervisor, vm: str) -> dict[str, Any]:
    """The destination failed after completion: run the paused source again."""
    rt = sup.leaving.pop(vm, None)
    if rt is None or rt.exited.is_set():
        raise MigrationError(f"the source QEMU of {vm!r} is gone; the VM is lost.")
    await rt.qmp.cont()
    rt.detached = False
    rt.owns_ram = True
    sup.vms[vm] = rt
    sup.db.update_vm(sup.db.vm(vm).with_(partition=sup.partition, state=VmState.RUNNING,
                                         pid=rt.pid))
    return {"vm": vm, "pid": rt.pid}


async def settle(sup: Supervisor, vm: str) -> dict[str, Any]:
    """Move the sockets of a migrated-in QEMU from ``<run>/in`` to ``<run>``.

    Only after the source QEMU exited: QEMU unlinks its listening sockets' paths on
    exit, which would remove ours if they already had the same names."""
    rt = sup.vms.get(vm)
    if rt is None or not rt.run_dir.name.startswith(INCOMING_PREFIX):
        return {"vm": vm, "moved": False}
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
    target = rt.run_dir.parent
    for name in SOCKET_FILES:
        with contextlib.suppress(FileNotFoundError):
            (rt.run_dir / name).rename(target / name)
    with contextlib.suppress(FileNotFoundError):
        (rt.run_dir / "migrate.sock").unlink()
    with contextlib.suppress(OSError):
        rt.run_dir.rmdir()
    rt.run_dir = target
    rt.qmp.socket = target / "qmp.sock"
    return {"vm": vm, "moved": True, "unbound_ports": unbound}


async def incoming_abort(sup: Supervisor, vm: str) -> dict[str, Any]:
    inc = sup.incoming.pop(vm, None)
    if inc is None:
        return {"vm": vm, "was": "gone"}
    rt = inc.rt
    rt.qmp.drop_listener(inc.listener)
    if not rt.exited.is_set():
        rt.stopping = True
        with contextlib.suppress(ProcessLookupError):
            os.kill(rt.pid, 9)
        await asyncio.wait_for(rt.exited.wait(), 10)
    return {"vm": vm, "was": "aborted"}
