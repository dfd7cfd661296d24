"""A running VM's backup, taken by its partition's supervisor with QEMU's block jobs.

One QMP ``transaction`` starts, at one instant for every disk: a ``blockdev-backup``
of each disk into a compressed qcow2 target (root made the file and passed it as a
descriptor), and a new persistent dirty bitmap on each disk that tracks the writes
after this point. A full backup copies every cluster (``sync=full``); an incremental
one copies what the previous point's bitmap marks (``sync=bitmap`` with
``bitmap-mode=never``) into a qcow2 whose backing file is the previous point's. The
previous bitmap is deleted only once the new point's manifest is written: QEMU's
``sync=incremental`` would clear it when its job ends, before fusuma has recorded
anything, and a supervisor killed between the two would lose those writes from every
later backup. With a guest agent, the guest's filesystems are frozen around the
transaction (milliseconds), and always thawed.

A raw disk (a registered disk, ``--disk``) cannot hold a persistent dirty bitmap, so
it is copied whole into every point (``sync=full``, no bitmap): an incremental point
holds what changed on the qcow2 thin disk and each raw disk entire, and says so
(``BackedUp.whole``). An in-memory bitmap would be lost with the QEMU at every move and
restart, and an incremental point missing writes would look whole: a full copy is
slower but never wrong.

A backup is a local job (``JobKind.BACKUP``): a supervisor killed during one leaves it
to the next, which (:func:`recover`) thaws the guest, cancels QEMU's jobs, removes the
target nodes and the point's new bitmap and deletes the point, which has no manifest.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import os
import time
import uuid
from pathlib import Path
from typing import Any

from fusuma.errors import FusumaError, QemuError, StateError
from fusuma.frozen import frozen
from fusuma.images import backup as bk
from fusuma.images.store import nvram_path
from fusuma.qemu import block
from fusuma.qemu.cmdline import BOOT_DRIVE
from fusuma.qemu.instance import QemuInstance
from fusuma.state import Job, JobKind, VmRecord
from fusuma.supervisor import freeze, rpc
from fusuma.supervisor.host import PartitionHost

FDSET_OPAQUE = "fusuma-backup"
COPY_S = 6 * 3600.0       # a backup's copy (its rate is the disk's or --max-bandwidth's)
CANCEL_S = 30.0


@frozen
class Target:
    drive: str           # the disk's drive id
    file: str            # its file in the point
    node: str            # the target's node name in QEMU
    job: str             # the block job's id


def drives(rec: VmRecord) -> list[tuple[str, str]]:
    """The disks of ``rec`` a backup copies, as (drive id, file name): its thin disk,
    then each raw disk attached (:func:`is_raw`); one sentence for a VM whose disks
    cannot be backed up."""
    if rec.boot == "kernel":
        raise StateError(f"VM {rec.name!r} runs image {rec.image!r}, which fusuma builds "
                         "and shares read-only between VMs: it has no disk of its own to "
                         "back up.")
    return [(BOOT_DRIVE, "boot.qcow2"),
            *((f"disk-{d}", bk.raw_disk_file(d)) for d in rec.disks)]


def is_raw(drive: str) -> bool:
    """A raw disk's drive (no dirty bitmap: copied whole into every point)."""
    return drive != BOOT_DRIVE


def plan(targets: list[Target], new_bitmap: str, previous_bitmap: str | None,
         max_bandwidth: int) -> list[dict[str, Any]]:
    """The one transaction: per disk, its new bitmap and its backup job."""
    actions: list[dict[str, Any]] = []
    for t in targets:
        if not is_raw(t.drive):
            actions.append({"type": "block-dirty-bitmap-add",
                            "data": {"node": t.drive, "name": new_bitmap,
                                     "persistent": True}})
        job: dict[str, Any] = {"job-id": t.job, "device": t.drive, "target": t.node,
                               "compress": True, "auto-dismiss": False}
        if previous_bitmap is None or is_raw(t.drive):
            job["sync"] = "full"
        else:
            job.update({"sync": "bitmap", "bitmap": previous_bitmap,
                        "bitmap-mode": "never"})
        if max_bandwidth:
            job["speed"] = max_bandwidth
        actions.append({"type": "blockdev-backup", "data": job})
    return actions


async def _attach(inst: QemuInstance, pt: bk.NewPoint, t: Target, size: int, uid: int,
                  backing: str | None) -> None:
    """Root creates the target file; QEMU gets it as a descriptor and opens it as a
    qcow2 node without its backing (the backing is root's file: never QEMU's)."""
    fd = bk.create_target(pt, t.file, size, uid, backing)
    try:
        fdset = await inst.qmp.add_fd(fd, FDSET_OPAQUE)
    finally:
        os.close(fd)
    await inst.qmp.execute("blockdev-add", {
        "driver": "qcow2", "node-name": t.node, "backing": None,
        "file": {"driver": "file", "filename": f"/dev/fdset/{fdset}"}})


async def _detach(inst: QemuInstance, nodes: list[str]) -> None:
    """Remove the target nodes and the fdsets backups passed (each best effort)."""
    for node in nodes:
        with contextlib.suppress(QemuError):
            await inst.qmp.execute("blockdev-del", {"node-name": node})
    with contextlib.suppress(QemuError):
        for s in await inst.qmp.execute("query-fdsets"):
            fds = s.get("fds") or []
            if fds and all(f.get("opaque") == FDSET_OPAQUE for f in fds):
                await inst.qmp.execute("remove-fd", {"fdset-id": s["fdset-id"]})


async def _cancel(inst: QemuInstance, jobs: list[str]) -> None:
    """End backup jobs that may still run, and dismiss them (a job QEMU never
    started, or ended and dismissed, is no matter)."""
    for job in jobs:
        with contextlib.suppress(QemuError):
            await inst.qmp.execute("job-cancel", {"id": job})
    with contextlib.suppress(QemuError):     # a cancelled job ends with an error
        await block.wait(inst.qmp, jobs, CANCEL_S, "the cancelled backup",
                         missing_ok=True)


async def _drop_bitmaps(inst: QemuInstance, drive_ids: list[str], keep: str | None,
                        only: str | None = None) -> None:
    """Remove fusuma's backup bitmaps from the drives: ``only`` that one, else every
    one but ``keep``."""
    found = await block.drives(inst.qmp)
    for d in drive_ids:
        for name in [m.name for m in found[d].bitmaps] if d in found else []:
            if not name.startswith(bk.BITMAP_PREFIX) or name == keep:
                continue
            if only is not None and name != only:
                continue
            with contextlib.suppress(QemuError):
                await inst.qmp.execute("block-dirty-bitmap-remove",
                                       {"node": d, "name": name})


async def _wait(h: PartitionHost, inst: QemuInstance, vm: str,
                targets: list[Target], chain_dir: Path) -> None:
    """Wait for every job to end, writing its progress into the job's phase; one
    sentence if one failed (the full filesystem named, with its free room)."""
    try:
        await block.wait(inst.qmp, [t.job for t in targets], COPY_S, "the backup",
                         progress=lambda done, total: h.phase(vm, "copy", done=done,
                                                              total=total))
    except block.JobFailed as exc:
        if "No space left" not in exc.error:
            raise
        raise StateError(full_sentence(vm, chain_dir)) from exc


def full_sentence(vm: str, chain_dir: Path) -> str:
    """What a user reads when the filesystem of a backup's destination filled."""
    try:
        st = os.statvfs(chain_dir.parent)
        free = f" ({st.f_bavail * st.f_frsize // 2**20} MiB free of " \
               f"{st.f_blocks * st.f_frsize // 2**20} MiB)"
    except OSError:
        free = ""
    return (f"VM {vm!r}: the backup into {chain_dir} filled its filesystem{free}; "
            "nothing of it was kept and the VM runs on: free room there, or back up "
            "to another directory.")


def filled(exc: BaseException, vm: str, chain_dir: Path) -> StateError | None:
    """The one sentence for a backup that failed because its destination's filesystem
    filled at one of fusuma's own writes (the NVRAM's copy, the manifest), as at QEMU's
    (which `_wait` names); None for any other failure."""
    if isinstance(exc, OSError) and exc.errno == errno.ENOSPC:
        return StateError(full_sentence(vm, chain_dir))
    return None


async def backup(h: PartitionHost, req: rpc.Backup) -> rpc.BackedUp:
    disks = drives(h.vm(req.vm))       # before "start it": a VM that never could
    h.running(req.vm)
    chain_dir = bk.locate(h.paths, h.db, req.dest, anywhere=req.anywhere)
    async with h.job(req.vm, JobKind.BACKUP):
        rec, inst = h.running(req.vm)
        return await _backup(h, rec, inst, disks, chain_dir, req)


async def _backup(h: PartitionHost, rec: VmRecord, inst: QemuInstance,
                  disks: list[tuple[str, str]], chain_dir: Path,
                  req: rpc.Backup) -> rpc.BackedUp:
    vm = rec.name
    t0 = time.monotonic()
    pt, last = bk.begin(chain_dir, incremental=req.incremental)
    chain = last.chain if last is not None else uuid.uuid4().hex
    new_bitmap = bk.bitmap_name(chain, pt.number)
    tag = uuid.uuid4().hex[:8]
    targets = [Target(d, f, f"fzbk-{tag}-{i}", f"fzbk-{tag}-{i}")
               for i, (d, f) in enumerate(disks)]
    h.phase(vm, "prepare", point=str(pt.path), bitmap=new_bitmap,
            nodes=[t.node for t in targets])
    started = False
    frozen = False
    try:
        found = await block.drives(inst.qmp)
        missing = [d for d, _ in disks if d not in found]
        if missing:
            raise StateError(f"VM {vm!r}'s QEMU has no drive {', '.join(missing)}; stop "
                             "and start it.")
        if last is not None:
            # A bitmap QEMU did not save whole (it was killed) loads "inconsistent".
            kept = {d: found[d].bitmap(last.bitmap) for d, _ in disks if not is_raw(d)}
            gone = [d for d, m in kept.items() if m is None or m.inconsistent]
            then = [e.drive for e in last.disks]
            if then != [d for d, _ in disks]:
                raise StateError(
                    f"VM {vm!r}'s disks changed since backup point {last.point} of "
                    f"{chain_dir} ({', '.join(then)}; now "
                    f"{', '.join(d for d, _ in disks)}); take a full backup into a new "
                    "directory.")
            if gone:
                raise StateError(
                    f"VM {vm!r} no longer tracks its writes since backup point "
                    f"{last.point} of {chain_dir} (its dirty bitmap is gone: a later full "
                    "backup started another chain, or QEMU ended without saving it); take "
                    "a full backup into a new directory.")
            if last.vm.name != vm:
                raise StateError(f"{chain_dir} is a backup of VM {last.vm.name!r}, not of "
                                 f"{vm!r}; give a new directory for a full backup.")
        sizes = {d: found[d].virtual_size for d, _ in disks}
        for t in targets:
            backing = None if last is None or is_raw(t.drive) else \
                f"../{bk.point_name(last.point)}/{t.file}"
            await _attach(inst, pt, t, sizes[t.drive], rec.uid, backing)
        async with h.agent_lock(vm):
            frozen = await freeze.freeze(h, inst, "backup")
            try:
                h.phase(vm, "start", frozen=frozen)
                await inst.qmp.execute("transaction", {"actions": plan(
                    targets, new_bitmap, None if last is None else last.bitmap,
                    req.max_bandwidth)})
                started = True
                nvram = None
                if rec.boot == "uefi":
                    nvram = await asyncio.to_thread(bk.copy_nvram, pt,
                                                    nvram_path(h.paths, vm))
            finally:
                if frozen:
                    await freeze.thaw(h, inst)
        await _wait(h, inst, vm, targets, chain_dir)
        await _detach(inst, [t.node for t in targets])
        h.phase(vm, "checksum")
        entries = []
        for (d, f), t in zip(disks, targets, strict=True):
            fd = os.open(t.file, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC,
                         dir_fd=pt.dir_fd)
            try:
                digest, size = await asyncio.to_thread(bk.digest_fd, fd)
            finally:
                os.close(fd)
            entries.append(bk.DiskEntry(
                drive=d, file=f, virtual_size=sizes[d], sha256=digest, size=size,
                backing=None if last is None or is_raw(d)
                else f"../{bk.point_name(last.point)}/{f}"))
        previous: list[str] = []
        if last is not None:
            previous = [*last.previous, bk.read_point(chain_dir, last.point)[1]]
        m = bk.Manifest(chain=chain, point=pt.number,
                        kind="full" if last is None else "incremental",
                        taken_at=time.time(), seconds=round(time.monotonic() - t0, 3),
                        vm=_config(h, rec), disks=entries, nvram=nvram, bitmap=new_bitmap,
                        previous=previous, frozen=frozen)
        h.phase(vm, "commit")
        await asyncio.to_thread(bk.commit, pt, m)
    except BaseException as exc:
        with contextlib.suppress(Exception):
            if started:
                await _cancel(inst, [t.job for t in targets])
            await _detach(inst, [t.node for t in targets])
            await _drop_bitmaps(inst, [d for d, _ in disks], None, only=new_bitmap)
        bk.abandon(pt)
        full = filled(exc, vm, chain_dir)
        if full is not None:
            raise full from exc
        raise
    pt.close()
    # The point exists: from now on only its bitmap tracks what the next one copies.
    await _drop_bitmaps(inst, [d for d, _ in disks], keep=new_bitmap)
    total = sum(e.size for e in entries) + (nvram.size if nvram else 0)
    h.log.info("backup of %s: point %d (%s) in %s, %d bytes, %.1f s", vm, pt.number,
               m.kind, chain_dir, total, time.monotonic() - t0)
    return rpc.BackedUp(vm=vm, dest=str(chain_dir), point=pt.number, kind=m.kind,
                        chain=chain, bytes=total,
                        disk_bytes=sum(e.virtual_size for e in entries),
                        seconds=round(time.monotonic() - t0, 3), frozen=frozen,
                        files=[str(pt.path / e.file) for e in entries]
                        + ([str(pt.path / bk.NVRAM)] if nvram else []),
                        whole=[] if last is None else
                        [d.removeprefix("disk-") for d, _ in disks if is_raw(d)])


def _config(h: PartitionHost, rec: VmRecord) -> bk.VmConfig:
    image = h.db.imported(rec.image)
    return bk.VmConfig(name=rec.name, partition=rec.partition, memory_mib=rec.memory_mib,
                       vcpus=rec.vcpus, boot=rec.boot, image=rec.image,
                       image_sha256=image.sha256, machine=rec.machine, qos=rec.qos,
                       networks=[n.network for n in sorted(h.db.nics(vm=rec.name),
                                                           key=lambda n: n.index)])


async def recover(h: PartitionHost, job: Job) -> None:
    """A backup whose supervisor died (this supervisor has taken the job over; its
    caller ends it): thaw the guest, end QEMU's jobs, remove the target nodes and the
    point's bitmap, and delete the point unless its manifest was written (then only
    the bitmaps older than it go)."""
    inst = h.instances.get(job.name)
    point = job.detail.get("point")
    bitmap = job.detail.get("bitmap")
    nodes = [str(n) for n in job.detail.get("nodes") or []]
    whole = bool(point) and (Path(str(point)) / bk.MANIFEST).is_file()
    if inst is not None:
        with contextlib.suppress(FusumaError):
            ids = [d for d, _ in drives(h.vm(job.name))]
            if job.phase in ("prepare", "start"):     # it may have died while frozen
                async with h.agent_lock(inst.vm):
                    await freeze.thaw(h, inst)
            await _cancel(inst, nodes)
            await _detach(inst, nodes)
            if isinstance(bitmap, str):
                if whole:
                    await _drop_bitmaps(inst, ids, keep=bitmap)
                else:
                    await _drop_bitmaps(inst, ids, None, only=bitmap)
    if point and not whole:
        p = Path(str(point))
        if bk.POINT_RE.fullmatch(p.name):
            bk.abandon(bk.NewPoint(p.parent, int(p.name), -1,
                                   created_chain=not bk.points(p.parent)))
    h.log.info("recovered the backup of %s (point %s %s)", job.name, point,
               "kept: its manifest was written" if whole else "removed")
