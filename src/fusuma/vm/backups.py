"""Backups as the front doors run them: ``backup`` asks the VM's supervisor (which
holds its QEMU) and reports the copy's progress while it waits; ``restore`` makes a
new VM from a backup chain (fusuma.images.backup) in this process."""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import TYPE_CHECKING, Any

from fusuma.errors import ConflictError, FusumaError, NotFoundError, StateError
from fusuma.frozen import frozen
from fusuma.images import backup as bk
from fusuma.images.store import disk_path, nvram_path
from fusuma.names import check_name
from fusuma.qemu.cmdline import BOOT_DRIVE
from fusuma.state import JobKind, vm_obj
from fusuma.supervisor import rpc

if TYPE_CHECKING:
    from fusuma.vm.manager import VmManager

# A backup's copy may take long (its rate is the disk's, or --max-bandwidth's).
BACKUP_TIMEOUT = 6 * 3600.0
Progress = Callable[[str, dict[str, Any]], None]
# A restore's phases (its job, ``JobKind.RESTORE``, on the new VM), each recorded
# before its step.
DISKS, DEFINE, FLATTEN, NVRAM = "disks", "define", "flatten", "nvram"


def backup(vms: VmManager, name: str, dest: str, *, incremental: bool = False,
           anywhere: bool = False, max_bandwidth: int = 0,
           progress: Progress | None = None) -> rpc.BackedUp:
    """Back up running VM ``name`` into ``dest``; ``progress(phase, detail)`` is
    called about twice a second while the supervisor works."""
    vms.parts.ensure_recovered(vm_obj(name))
    rec = vms.db.vm(name)
    bk.locate(vms.paths, vms.db, dest, anywhere=anywhere)      # a bad DEST: refused here
    req = rpc.Backup(name, dest, incremental=incremental, anywhere=anywhere,
                     max_bandwidth=max_bandwidth)
    client = vms.parts.client(rec.partition)
    if progress is None:
        return client.send(req, BACKUP_TIMEOUT)
    with ThreadPoolExecutor(1) as pool:
        fut = pool.submit(client.send, req, BACKUP_TIMEOUT)
        seen: tuple[str, str] | None = None
        while True:
            with contextlib.suppress(TimeoutError):
                return fut.result(timeout=0.5)
            job = vms.db.find_job(vm_obj(name))
            if job is not None and job.kind == JobKind.BACKUP:
                key = (job.phase, str(job.detail.get("done")))
                if key != seen:
                    seen = key
                    progress(job.phase, job.detail)


@frozen
class Restored:
    vm: str
    partition: str
    source_vm: str
    dest: str
    point: int
    points: int
    seconds: float
    disk_bytes: int
    disks: list[str]          # the raw disks made for it, one per raw disk backed up


def restore(vms: VmManager, dest: str, new: str, partition: str | None, *,
            anywhere: bool = False, point: int | None = None, start: bool = False,
            say: Callable[[str], None] | None = None) -> Restored:
    """Make VM ``new`` from the backup at ``dest`` (its last point, or ``point``): the
    chain's checksums first, then the VM defined as the backup's was (a new MAC per
    NIC, a new cloud-init instance id), its disk flattened from the chain onto the
    same image, its NVRAM the backup's. Nothing is left of a restore that fails, nor,
    once it is recovered, of one whose process was killed."""
    from fusuma.spec import VmSpec, build

    t0 = time.monotonic()
    chain_dir = bk.locate(vms.paths, vms.db, dest, anywhere=anywhere)
    if say:
        say(f"checking {chain_dir}")
    chain = bk.load_chain(chain_dir, point)
    bk.check_backing(chain)
    m = chain.last
    image = vms.db.find_imported(m.vm.image)
    if image is None:
        raise NotFoundError(f"the backup's VM was made on image {m.vm.image!r}, which "
                            "this host does not have; import it again (`fusuma image "
                            f"import {m.vm.image} FILE`) to restore.")
    if image.sha256 != m.vm.image_sha256:
        raise StateError(f"image {m.vm.image!r} here is not the one the backup's VM was "
                         "made on (its checksum differs); import that image under its "
                         "name to restore.")
    entry = next((e for e in m.disks if e.drive == BOOT_DRIVE), None)
    raws = [e for e in m.disks if e is not entry]
    names = [bk.raw_disk_of(e) for e in raws]
    if entry is None or None in names:
        raise bk.CorruptManifest(f"backup {chain_dir} holds disks this fusuma cannot "
                                 "restore.")
    part = partition or m.vm.partition
    # Each raw disk backed up becomes a new raw disk of NEW's own, NEW-NAME, in the
    # storage directory every host has.
    made_disks = {f"{new}-{n}": e for n, e in zip(names, raws, strict=True)}
    spec = build(VmSpec, "vm", name=new, partition=part,
                 vcpus=m.vm.vcpus, memory_mib=m.vm.memory_mib, image=m.vm.image,
                 boot=m.vm.boot, disk_size=str(entry.virtual_size), qos=m.vm.qos,
                 machine=m.vm.machine, nics=[{"network": n} for n in m.vm.networks],
                 disks=list(made_disks))
    _absent(vms, new)
    _disks_absent(vms, new, list(made_disks))
    # The new VM's job from before its record exists to after its files are whole: its
    # state says "being restored" meanwhile, and a restore whose process dies is undone
    # by the next command on the VM or its partition's supervisor (fusuma.recovery).
    with vms.parts.job(vm_obj(new), JobKind.RESTORE, source=spec.partition) as jh:
        _absent(vms, new)                  # (made while the job was taken)
        made = False
        try:
            jh.phase(DISKS, backup=str(chain_dir), point=m.point, disks=list(made_disks))
            for name, e in made_disks.items():
                if say:
                    say(f"writing disk {name}")
                _make_disk(vms, chain, name, e, part)
            jh.phase(DEFINE)
            rec = vms.create(spec)
            if say:
                say(f"flattening {len(chain.manifests)} point(s) into VM {new}'s disk")
            jh.phase(FLATTEN)
            tmp = vms.paths.vm_dir(new) / ".restore.qcow2"
            bk.flatten(chain, BOOT_DRIVE, tmp, Path(image.path), image.format, rec.uid)
            jh.phase(NVRAM)
            os.replace(tmp, disk_path(vms.paths, new))
            if m.nvram is not None:
                _copy_nvram(chain.file(m, m.nvram), nvram_path(vms.paths, new), rec.uid)
            made = True
        finally:
            if not made:
                undo(vms, new, list(made_disks))
    if start:
        if say:
            say(f"starting VM {new}")
        try:
            vms.start(new)
        except BaseException:
            with contextlib.suppress(FusumaError):
                vms.delete(new, force=True)
            raise
    return Restored(vm=new, partition=rec.partition, source_vm=m.vm.name,
                    dest=str(chain_dir), point=m.point, points=len(chain.manifests),
                    seconds=round(time.monotonic() - t0, 3), disk_bytes=entry.virtual_size,
                    disks=list(made_disks))


def _absent(vms: VmManager, new: str) -> None:
    if vms.db.find_vm(new) is not None:
        raise ConflictError(f"a VM named {new!r} already exists; give the restored VM "
                            "another name.")


def _disk_file(vms: VmManager, name: str) -> Path:
    from fusuma.host.storage import default_dir

    return default_dir(vms.paths) / f"{name}.img"


def _disks_absent(vms: VmManager, new: str, names: list[str]) -> None:
    for name in names:
        check_name("disk", name)
        if vms.db.find_disk(name) is not None or _disk_file(vms, name).exists():
            raise ConflictError(f"the restore makes disk {name!r} for VM {new!r} (at "
                                f"{_disk_file(vms, name)}), and one of that name exists; "
                                "give the restored VM another name.")


def _make_disk(vms: VmManager, chain: bk.Chain, name: str, e: bk.DiskEntry,
               partition: str) -> None:
    """Register raw disk ``name`` (a new sparse file as large as the backed-up disk)
    and write the backup's copy into it."""
    from fusuma.spec import DiskSpec, build

    path = _disk_file(vms, name)
    vms.parts.add_disk(build(DiskSpec, "disk", name=name, path=str(path),
                             partition=partition, size_mib=-(-e.virtual_size // 2**20)))
    os.truncate(path, e.virtual_size)        # its exact size (the file is still new)
    bk.to_raw(chain, e.drive, path)


def undo(vms: VmManager, new: str, disks: list[str] | None = None) -> None:
    """Remove VM ``new`` that a restore was making, and the raw ``disks`` it made for
    it (under that restore's job, or by the recovery of one whose process died:
    ``fusuma.recovery``)."""
    from fusuma.state.lock import host_lock

    with host_lock(vms.paths.home):
        if vms.db.find_vm(new) is not None:
            vms.finish_delete(new)
    for name in disks or []:
        d = vms.db.find_disk(name)
        # Only a disk the restore made: its file, created by fusuma, where it put it.
        if d is not None and d.created_file and d.path == str(_disk_file(vms, name)):
            vms.parts.drop_disk(name)


def _copy_nvram(src: Path, dst: Path, uid: int) -> None:
    tmp = dst.with_name(".restore-nvram")
    fd = os.open(src, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    try:
        out = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW
                      | os.O_CLOEXEC, 0o600)
        try:
            while chunk := os.read(fd, bk.CHUNK):
                bk.write_all(out, chunk)
            os.fchown(out, uid, uid)
            os.fsync(out)
        finally:
            os.close(out)
    finally:
        os.close(fd)
    os.replace(tmp, dst)
