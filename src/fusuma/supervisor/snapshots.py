"""Snapshots of a VM: internal qcow2 snapshots of its disks, and with ``--memory`` of
its RAM and device state, taken, restored and deleted by its partition's supervisor
under the VM's job (``JobKind.SNAPSHOT``, phases below), recovered by
:func:`recover` when the supervisor dies in the middle.

Which disks: every writable disk the guest has must hold the snapshot, or a restore
would mix two times. A VM of an imported image has one, its thin disk (a qcow2
overlay, ``disk-fusuma-boot``); a VM of fusuma's own images boots its kernel from a
read-only root and has only raw disks, and a raw disk cannot hold a snapshot: both are
refused. The cloud-init seed is read-only. A UEFI VM's NVRAM (its variables, a raw
file) cannot hold a snapshot: each snapshot keeps a copy of it beside the disk
(fusuma.images.snapshots), taken with the disks (inside the freeze window; with
``--memory``, just before the save), and a restore writes it back before QEMU reads
it. With ``--memory``, QEMU's saved state holds the flash device's contents too and
its QEMU writes them back into the file when the guest runs on after the load, so the
file is the snapshot's whether the VM was running or stopped.

- **Create, running**: the guest agent, when the guest has one, freezes the guest's
  filesystems (``guest-fsfreeze-freeze``), QEMU snapshots every disk in one
  ``transaction``, and the filesystems are thawed in ``finally`` (and by the recovery
  when the supervisor died meanwhile). With ``--memory``: the ``snapshot-save`` job,
  with the stream's settings off (fusuma.qemu.blocksnap: ``x-ignore-shared`` would
  leave the RAM file out, as would a cpr mode) and put back after; no freeze (the
  state holds the guest's caches, and a restore must not bring back a frozen guest).
- **Create, stopped**: ``qemu-img snapshot -c`` on each disk, as the VM's uid.
- **Restore**: with memory, ``snapshot-load`` into the VM's QEMU (started first if the
  VM was stopped, from the snapshot's NVRAM): the guest runs on from the moment it was
  taken. Disks only, as Proxmox's rollback: a running VM is stopped (its filesystems
  flushed), each disk reverted by ``qemu-img snapshot -a`` and the NVRAM written back,
  and the VM started again (a fresh boot from the snapshot's disks); a stopped VM stays
  stopped.
- **Delete**: ``blockdev-snapshot-delete-internal-sync`` on each disk while it runs,
  ``qemu-img snapshot -d`` when stopped.

The record (fusuma.state.snapdb) is written ``creating`` before the first disk is
touched and ``ready`` after the last; a delete marks it ``deleting`` first. A create
or delete that did not finish is undone (the snapshot removed from every disk that has
it, the record dropped); a restore is finished (a revert again, a start).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections.abc import Callable
from pathlib import Path

from fusuma.errors import (
    ConflictError,
    FusumaError,
    QemuError,
    SpecError,
    StateError,
)
from fusuma.frozen import frozen
from fusuma.images import snapshots as offline
from fusuma.images.store import disk_path, nvram_path, snapshot_nvram_path
from fusuma.names import check_name
from fusuma.qemu import block, blocksnap
from fusuma.qemu.cmdline import BOOT_DRIVE
from fusuma.qemu.instance import QemuInstance
from fusuma.qemu.versions import parse_version
from fusuma.state import Job, JobKind, VmRecord, VmState
from fusuma.state.snapdb import SnapshotRecord, SnapState
from fusuma.supervisor import freeze, rpc, vms
from fusuma.supervisor.host import PartitionHost

# A job's phases, each recorded before its step.
RECORD, FREEZE, SAVE, THAW, DONE = "record", "freeze", "save", "thaw", "done"
STOP, REVERT, START, LOAD, DELETE = "stop", "revert", "start", "load", "delete"

#: Records a job's next phase (``JobLock.phase``, or ``PartitionHost.phase`` in a
#: recovery).
Phase = Callable[..., object]
#: The phases of a restore's start (``vms.start_held`` records its own steps).
START_PHASES = frozenset({START, "launch", "pin", "restore"})

JOB_S = 900.0            # a snapshot-save/-load of the RAM under TCG
STOP_S = 30.0
EXIT_S = 10.0            # a QEMU that stopped answering, to be seen gone


@frozen
class SnapDisk:
    """A disk a snapshot covers: QEMU's drive id and the qcow2 file."""

    drive: str
    path: Path


def disks_of(h: PartitionHost, rec: VmRecord) -> list[SnapDisk]:
    """The disks a snapshot of ``rec`` covers; one sentence if one cannot hold it."""
    if rec.boot == "kernel":
        raise StateError(f"VM {rec.name!r} boots fusuma's own image {rec.image!r}, whose "
                         "disks are raw and cannot hold snapshots; snapshots are for VMs "
                         "of imported images (`fusuma image import`), whose thin disk is "
                         "qcow2.")
    if rec.disks:
        raise StateError(f"VM {rec.name!r} has raw disk(s) {', '.join(rec.disks)} "
                         "attached, which cannot hold snapshots, so a snapshot would not "
                         f"cover them; detach them first (`fusuma vm detach {rec.name} "
                         "DISK`).")
    return [SnapDisk(BOOT_DRIVE, disk_path(h.paths, rec.name))]


def _info(snap: SnapshotRecord, seconds: float) -> rpc.Snapshot:
    return rpc.Snapshot(vm=snap.vm, name=snap.name, memory=snap.memory, disks=snap.disks,
                        created_at=snap.created_at, running=snap.running,
                        frozen=snap.frozen, vmstate_bytes=snap.vmstate_bytes,
                        seconds=round(seconds, 3))


def _live(h: PartitionHost, rec: VmRecord) -> QemuInstance | None:
    """The VM's QEMU when it runs, None when stopped; refused in between."""
    inst = h.instances.get(rec.name)
    if rec.state in (VmState.RUNNING, VmState.PAUSED) and inst is not None:
        return inst
    if rec.state in (VmState.STOPPED, VmState.CRASHED) and inst is None:
        return None
    raise StateError(f"VM {rec.name!r} is {rec.state.value}; try again when it is "
                     "running or stopped.")


async def _begin(h: PartitionHost, vm: str) -> tuple[VmRecord, list[SnapDisk],
                                                    QemuInstance | None]:
    """Under the VM's job: its record, the disks a snapshot covers, its QEMU (None:
    stopped); records a job left unfinished are cleared first."""
    rec = h.vm(vm)
    disks = disks_of(h, rec)
    inst = _live(h, rec)
    await _purge_stale(h, rec, inst, disks)
    return rec, disks, inst


# -- create -------------------------------------------------------------------------
async def create(h: PartitionHost, req: rpc.SnapshotCreate) -> rpc.Snapshot:
    check_name("snapshot", req.name)
    t0 = time.monotonic()
    async with h.lock(req.vm), h.job(req.vm, JobKind.SNAPSHOT) as job:
        rec, disks, inst = await _begin(h, req.vm)
        if req.memory:
            _check_memory(h, rec, inst)
        if h.db.find_snapshot(rec.name, req.name) is not None:
            raise ConflictError(f"VM {rec.name!r} already has a snapshot named "
                                f"{req.name!r}; delete it first or give another name.")
        held = [d.drive for d in disks if req.name in await _names_on(h, rec, inst, d)]
        if held:
            raise ConflictError(f"the disk of VM {rec.name!r} already holds a snapshot "
                                f"named {req.name!r} that fusuma did not record (made by "
                                "hand?); give another name.")
        running = inst is not None and await inst.qmp.query_status() == "running"
        snap = SnapshotRecord(vm=rec.name, name=req.name, memory=req.memory,
                              disks=[d.drive for d in disks], running=running,
                              devices=rec.devices if req.memory else None)
        job.phase(RECORD, op="create", snapshot=req.name, memory=req.memory)
        h.db.add_snapshot(snap)
        try:
            frozen, size = await _take(h, job.phase, rec, inst, disks, snap)
        except BaseException:
            await asyncio.shield(_undo(h, rec, disks, req.name))
            raise
        job.phase(DONE)
        h.db.set_snapshot(rec.name, req.name, state=SnapState.READY, frozen=frozen,
                          vmstate_bytes=size)
    h.log.info("snapshot %s of %s taken (memory: %s, frozen: %s) in %.2f s", req.name,
               req.vm, req.memory, frozen, time.monotonic() - t0)
    return _info(h.db.snapshot(req.vm, req.name), time.monotonic() - t0)


def _check_memory(h: PartitionHost, rec: VmRecord, inst: QemuInstance | None) -> None:
    """Refuse ``--memory`` where it cannot work."""
    if inst is None:
        raise SpecError(f"VM {rec.name!r} is {rec.state.value}: it has no memory to "
                        "snapshot; start it, or leave out --memory for a snapshot of its "
                        "disks.")
    version = inst.version or rec.qemu_version
    # (An unparsable version, (0,), is not refused: QEMU's own answer then decides.)
    if version is not None and (0,) < parse_version(version) < blocksnap.SNAPSHOT_QEMU:
        raise SpecError(f"VM {rec.name!r} runs on QEMU {version}, which cannot snapshot "
                        "memory (QEMU 6.0 or later can); leave out --memory, or move it "
                        "to a partition with a newer QEMU (`fusuma maintain --via`).")


async def _names_on(h: PartitionHost, rec: VmRecord, inst: QemuInstance | None,
                    d: SnapDisk) -> set[str]:
    """The internal snapshots the disk holds now, by QEMU or qemu-img."""
    if inst is not None:
        drive = (await block.drives(inst.qmp)).get(d.drive)
        if drive is None:
            raise StateError(f"VM {rec.name!r}'s QEMU has no drive {d.drive}; stop and "
                             "start it.")
        if drive.format != "qcow2":
            raise StateError(f"VM {rec.name!r}'s disk {d.drive} is {drive.format}, which "
                             "cannot hold snapshots.")
        return {s.name for s in drive.snapshots}
    return {s.name for s in await asyncio.to_thread(offline.list_, d.path, rec.uid)}


async def _take(h: PartitionHost, phase: Phase, rec: VmRecord, inst: QemuInstance | None,
                disks: list[SnapDisk], snap: SnapshotRecord) -> tuple[bool, int | None]:
    """Write the snapshot into every disk; (whether the guest was frozen, the size of
    its memory state)."""
    if inst is None:
        phase(SAVE)
        for d in disks:
            await asyncio.to_thread(offline.create, d.path, rec.uid, snap.name)
        await _save_nvram(h, rec, snap.name)
        return False, None
    if snap.memory:
        settings = await blocksnap.stream_settings(inst.qmp)
        phase(SAVE, settings=settings)
        try:
            await _save_nvram(h, rec, snap.name)
            await blocksnap.for_snapshot(inst.qmp, settings)
            nodes = await _nodes(inst, disks)
            await blocksnap.save(inst.qmp, snap.name, nodes[0], nodes, JOB_S)
        finally:
            await asyncio.shield(blocksnap.put_back(inst.qmp, settings))
        top = (await block.drives(inst.qmp))[disks[0].drive]
        size = next((s.vm_state_size for s in top.snapshots if s.name == snap.name), 0)
        if size <= 0:
            raise QemuError(f"VM {rec.name!r}: QEMU saved no memory state into snapshot "
                            f"{snap.name!r}.")
        return False, size
    async with h.agent_lock(rec.name):
        phase(FREEZE)
        frozen = False
        try:
            frozen = await freeze.freeze(h, inst, "snapshot")
            phase(SAVE, frozen=frozen)
            await blocksnap.snapshot_disks(inst.qmp, [d.drive for d in disks], snap.name)
            await _save_nvram(h, rec, snap.name)
        finally:
            if frozen:
                phase(THAW)
                await asyncio.shield(freeze.thaw(h, inst))
    return frozen, None


async def _save_nvram(h: PartitionHost, rec: VmRecord, name: str) -> None:
    """Keep a UEFI VM's NVRAM as snapshot ``name`` finds it."""
    if rec.boot == "uefi":
        await asyncio.to_thread(offline.save_nvram, nvram_path(h.paths, rec.name),
                                snapshot_nvram_path(h.paths, rec.name, name))


async def _put_nvram(h: PartitionHost, rec: VmRecord, name: str) -> None:
    """Write snapshot ``name``'s NVRAM back (the VM's QEMU is not running)."""
    if rec.boot != "uefi":
        return
    if not await asyncio.to_thread(offline.put_nvram,
                                   snapshot_nvram_path(h.paths, rec.name, name),
                                   nvram_path(h.paths, rec.name), rec.uid):
        h.log.warning("snapshot %s of %s has no copy of the NVRAM; the VM keeps its "
                      "variables as they are", name, rec.name)


async def _nodes(inst: QemuInstance, disks: list[SnapDisk]) -> list[str]:
    """The top node names of ``disks`` (``snapshot-save`` names nodes, not drives)."""
    found = await block.drives(inst.qmp)
    missing = [d.drive for d in disks if d.drive not in found or not found[d.drive].node]
    if missing:
        raise StateError(f"VM {inst.vm!r}'s QEMU has no node for {', '.join(missing)}; "
                         "stop and start it.")
    return [found[d.drive].node for d in disks]


# -- undo, and stale records ----------------------------------------------------------
async def _undo(h: PartitionHost, rec: VmRecord, disks: list[SnapDisk], name: str) -> None:
    """Remove snapshot ``name`` from every disk that has it, then its record; a failure
    is logged and leaves the record (not ready: never listed) for the next job."""
    try:
        inst = h.instances.get(rec.name)
        if inst is not None:
            try:
                await block.wait(inst.qmp, [blocksnap.JOB_ID], JOB_S, "a snapshot job",
                                 missing_ok=True)
            except block.JobFailed:
                pass                   # it ended: what it left is removed below
            except QemuError:
                # Its QEMU died (killed while it wrote?): the disk is qemu-img's once
                # the process is gone.
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(inst.exited.wait(), EXIT_S)
                if not inst.exited.is_set():
                    raise
                inst = None
        for d in disks:
            if inst is None:
                # A QEMU or qemu-img killed while it wrote leaves the disk's refcounts
                # out of step (never its data): repaired first (fusuma.images.snapshots).
                how = await asyncio.to_thread(offline.repair, d.path, rec.uid)
                if how is not None:
                    h.log.warning("%s's disk %s after an unfinished snapshot: %s",
                                  rec.name, d.path, how)
            if name not in await _names_on(h, rec, inst, d):
                continue
            if inst is not None:
                await blocksnap.delete_internal(inst.qmp, d.drive, name)
            else:
                await asyncio.to_thread(offline.delete, d.path, rec.uid, name)
        await asyncio.to_thread(offline.drop_nvram,
                                snapshot_nvram_path(h.paths, rec.name, name))
        h.db.remove_snapshot(rec.name, name)
    except FusumaError as exc:
        h.log.error("could not remove the unfinished snapshot %s of %s: %s", name,
                    rec.name, exc)


async def _purge_stale(h: PartitionHost, rec: VmRecord, inst: QemuInstance | None,
                       disks: list[SnapDisk]) -> None:
    """Under the VM's job, every record that is not ready is an unfinished create or
    delete whose undo failed: remove it now."""
    for s in h.db.snapshots(rec.name, every=True):
        if s.state != SnapState.READY:
            await _undo(h, rec, disks, s.name)


# -- restore ------------------------------------------------------------------------
async def restore(h: PartitionHost, req: rpc.SnapshotRestore) -> rpc.SnapshotDone:
    t0 = time.monotonic()
    async with h.lock(req.vm), h.job(req.vm, JobKind.SNAPSHOT) as job:
        rec, disks, inst = await _begin(h, req.vm)
        snap = h.db.snapshot(rec.name, req.name)
        if sorted(snap.disks) != sorted(d.drive for d in disks):
            raise StateError(f"snapshot {req.name!r} covers {', '.join(snap.disks)} and VM "
                             f"{rec.name!r} now has {', '.join(d.drive for d in disks)}; "
                             "it cannot be restored.")
        for d in disks:
            if req.name not in await _names_on(h, rec, inst, d):
                raise StateError(f"the disk {d.path} no longer holds snapshot "
                                 f"{req.name!r}; delete the record "
                                 f"(`fusuma vm snapshot delete {rec.name} {req.name}`).")
        if snap.memory:
            _same_devices(rec, snap)
            job.phase(START if inst is None else LOAD, op="restore", snapshot=req.name,
                      memory=True)
            if inst is None:
                await _put_nvram(h, rec, req.name)
                inst = await vms.start_held(h, rec, time.time())
                _same_devices(h.vm(rec.name), snap, started=inst)
            await _load(h, job.phase, inst, disks, snap.name, snap.running)
        else:
            job.phase(STOP, op="restore", snapshot=req.name, memory=False,
                      was_running=inst is not None)
            await _revert(h, job.phase, rec, inst, disks, req.name)
    state = h.vm(req.vm).state.value
    h.log.info("%s restored to snapshot %s in %.2f s", req.vm, req.name,
               time.monotonic() - t0)
    return rpc.SnapshotDone(req.vm, req.name, state, round(time.monotonic() - t0, 3))


def _loadable(devices: str) -> object:
    """A recorded device set as a state's load compares it: without the vmgenid
    device's guid, which every boot draws anew (a guest restored from a snapshot is
    told a new generation, as the device is meant for: its kernel reseeds its RNG)."""
    d = json.loads(devices)
    for dev in d.get("devices") or []:
        if isinstance(dev, dict) and dev.get("driver") == "vmgenid":
            dev["props"] = [p for p in dev.get("props") or [] if p[:1] != ["guid"]]
    return d


def _same_devices(rec: VmRecord, snap: SnapshotRecord,
                  started: QemuInstance | None = None) -> None:
    """A memory state loads only into the devices it was saved from."""
    same = rec.devices is None or snap.devices is None or \
        _loadable(rec.devices) == _loadable(snap.devices)
    if not same:
        extra = " (it was started and is left running)" if started is not None else ""
        raise StateError(f"VM {rec.name!r}'s devices changed since snapshot "
                         f"{snap.name!r} was taken, so its memory state cannot be "
                         f"loaded{extra}.")


async def _load(h: PartitionHost, phase: Phase, inst: QemuInstance, disks: list[SnapDisk],
                name: str, running: bool) -> None:
    """Load snapshot ``name`` (disks, RAM, devices) into ``inst``; the guest runs on
    from there (``running``: it ran when it was taken)."""
    settings = await blocksnap.stream_settings(inst.qmp)
    phase(LOAD, settings=settings)
    try:
        await blocksnap.for_snapshot(inst.qmp, settings)
        nodes = await _nodes(inst, disks)
        await blocksnap.load(inst.qmp, name, nodes[0], nodes, JOB_S)
    finally:
        await asyncio.shield(blocksnap.put_back(inst.qmp, settings))
    status = await inst.qmp.query_status()
    if status == "paused" and running:
        await inst.qmp.cont()
    h.settle_state(inst.vm, VmState.PAUSED if status == "paused" and not running
                   else VmState.RUNNING, pid=inst.pid)


async def _revert(h: PartitionHost, phase: Phase, rec: VmRecord, inst: QemuInstance | None,
                  disks: list[SnapDisk], name: str) -> None:
    """Stop (if running), revert every disk, start again (if it ran)."""
    was_running = inst is not None
    if inst is not None:
        await vms.shut_down(h, inst, STOP_S)
        phase(REVERT)
        await _wait_stopped(h, rec.name)
    phase(REVERT)
    for d in disks:
        await asyncio.to_thread(offline.apply, d.path, rec.uid, name)
    await _put_nvram(h, rec, name)
    if was_running:
        phase(START)
        await vms.start_held(h, h.vm(rec.name), time.time())


async def _wait_stopped(h: PartitionHost, vm: str, timeout: float = STOP_S) -> None:
    """Until the record says stopped (its QEMU's exit handled: its instance gone)."""
    deadline = time.monotonic() + timeout
    while h.instances.get(vm) is not None or h.vm(vm).state not in (VmState.STOPPED,
                                                                   VmState.CRASHED):
        if time.monotonic() > deadline:
            raise StateError(f"VM {vm!r} did not stop within {timeout:.0f} s.")
        await asyncio.sleep(0.05)


# -- delete -------------------------------------------------------------------------
async def delete(h: PartitionHost, req: rpc.SnapshotDelete) -> rpc.SnapshotDone:
    t0 = time.monotonic()
    async with h.lock(req.vm), h.job(req.vm, JobKind.SNAPSHOT) as job:
        h.db.snapshot(req.vm, req.name)          # one sentence when there is none
        rec, disks, _ = await _begin(h, req.vm)
        job.phase(DELETE, op="delete", snapshot=req.name)
        h.db.set_snapshot(rec.name, req.name, state=SnapState.DELETING)
        await _undo(h, rec, disks, req.name)
        if h.db.find_snapshot(rec.name, req.name) is not None:
            raise StateError(f"snapshot {req.name!r} of VM {rec.name!r} could not be "
                             "removed from its disk (see the supervisor's log); it is no "
                             "longer listed, and the next snapshot command retries.")
    return rpc.SnapshotDone(req.vm, req.name, h.vm(req.vm).state.value,
                            round(time.monotonic() - t0, 3))


# -- recovery -----------------------------------------------------------------------
async def recover(h: PartitionHost, job: Job) -> None:
    """Finish or undo the snapshot job of a supervisor that died (this supervisor has
    taken the job over; its caller ends it): asking QEMU and the disks, not the record.
    A create or delete is undone; a restore is finished."""
    name = str(job.detail.get("snapshot", ""))
    rec = h.db.find_vm(job.name)
    if rec is None or not name:
        return
    inst = h.instances.get(rec.name)
    if inst is not None:
        with contextlib.suppress(FusumaError):
            # A save or load QEMU still runs.
            await block.wait(inst.qmp, [blocksnap.JOB_ID], JOB_S, "a snapshot job",
                             missing_ok=True)
        settings = job.detail.get("settings")
        if isinstance(settings, dict):
            with contextlib.suppress(FusumaError):
                await blocksnap.put_back(inst.qmp, settings)
        if job.phase in (FREEZE, SAVE, THAW) and not job.detail.get("memory"):
            async with h.agent_lock(rec.name):
                await freeze.thaw(h, inst)
    disks = [SnapDisk(BOOT_DRIVE, disk_path(h.paths, rec.name))]
    op = job.detail.get("op")
    if op in ("create", "delete"):
        await _undo(h, rec, disks, name)
    elif op == "restore":
        await _recover_restore(h, job, rec, inst, disks, name)
    h.log.info("recovered the snapshot %s of %s (%s, phase %s)", name, rec.name, op,
               job.phase)


async def _recover_restore(h: PartitionHost, job: Job, rec: VmRecord,
                           inst: QemuInstance | None, disks: list[SnapDisk],
                           name: str) -> None:
    snap = h.db.find_snapshot(rec.name, name)
    if job.detail.get("memory"):
        if inst is None or snap is None:
            return           # it never started, or its QEMU ended: its exit says so
        # Loaded or not, half or whole: loading it again gives the same guest.
        try:
            await _load(h, lambda p, **d: h.phase(rec.name, p, **d), inst, disks, name,
                        snap.running)
        except FusumaError as exc:
            h.log.error("the restore of %s to snapshot %s failed again: %s", rec.name,
                        name, exc)
            with contextlib.suppress(QemuError):
                await inst.kill()
            with contextlib.suppress(FusumaError):
                h.settle_state(rec.name, VmState.STOPPED, pid=None,
                               error=f"the restore of snapshot {name!r} was interrupted; "
                                     "restore it again")
        return
    if job.phase in START_PHASES and inst is not None:
        h.settle_state(rec.name, VmState.RUNNING, pid=inst.pid)
        return
    if inst is not None:          # killed between the stop's start and its end
        with contextlib.suppress(QemuError):
            await inst.kill()
        await _wait_stopped(h, rec.name)
    with contextlib.suppress(FusumaError):
        h.settle_state(rec.name, VmState.STOPPED, pid=None)
    for d in disks:
        await asyncio.to_thread(offline.apply, d.path, rec.uid, name)
    await _put_nvram(h, rec, name)
    if job.detail.get("was_running"):
        await vms.start_held(h, h.vm(rec.name), time.time())
