"""`fusuma bench images`: importing a disk image, thin disks on it, and the page cache
that VMs on one base share.

Measured, each figure the median of RUNS (after one uncounted warm-up read of the file):

- ``import``: `fusuma image import` of the image (copy into the store with its SHA-256,
  then ``qemu-img info`` of the copy), the file already in the page cache; and its two
  parts alone: the SHA-256 of the file and ``qemu-img info``. Per GiB of the file.
- ``overlay``: creating a thin disk (a qcow2 overlay, ``qemu-img create -b``) on the
  imported base, as `vm create` does.
- ``sharing``: READERS processes each read the whole disk through a thin disk of its
  own on the one base (``qemu-img bench``, cache=writeback like a VM's QEMU), the base
  dropped from the page cache before the first; the base's resident bytes after each
  (mincore, fusuma.memshare.bases). Then the same with a full copy of the image per
  reader (each copy written, flushed and dropped from the cache first, then read by
  one reader): the copies' resident bytes summed. The definition's saving,
  (READERS - 1) x the base's resident bytes, is set beside the measured one: copies
  minus shared. Readers stand in for VMs: they read every allocated block, a booting
  guest only those it needs.
- ``boot`` (not with --quick; a full OS under TCG takes a minute): BOOT_VMS VMs made
  from the image boot together by SeaBIOS in a scratch partition on the free cores:
  `vm create` (the thin disk) and start to guest agent times, then what `share report`
  says of their base: its resident bytes, the VMs holding it, the saving.
- ``firmware`` (not with --quick): one VM at a time, alone in the scratch partition:
  the image booted by SeaBIOS and by OVMF (UEFI), from the start request to its guest
  agent answering and to its sshd's banner on a port forward (127.0.0.1 to the
  guest's port 22, QEMU's user-mode network), and fusuma's own Debian image booted by
  direct kernel boot to its guest agent (another root file system, and no systemd:
  fusuma's busybox init starts Debian's qemu-ga, so it is what a kernel boot of a
  small init costs, not the imported image's own boot without firmware). Then,
  on the running UEFI VM: a disk snapshot (filesystems frozen), a ``--memory``
  snapshot (its RAM, BOOT_MEMORY_MIB) and its restore into the running VM, each
  snapshot's delete; a full backup (its throughput: the disk's virtual size, and the
  compressed bytes written, per second) and an incremental one right after.

The image: the bootable Debian disk that the tests build (fusuma.images.diskimage,
cached in FUSUMA_CACHE), or ``--image FILE``; with --quick a small qcow2 generated
here (48 MiB of random data in 64 MiB). Everything made (the imported image, thin
disks, copies, the partition and its VMs) is removed afterwards, also on failure.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import socket
import statistics
import subprocess
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from fusuma.errors import FusumaError, HostError, SpecError
from fusuma.host.accel import probe_accel
from fusuma.images import diskimage, store
from fusuma.memshare.bases import BaseUser, bases_in_use
from fusuma.memshare.footprint import drop_cache, resident_bytes
from fusuma.partition.manager import PartitionManager
from fusuma.paths import Paths
from fusuma.spec import VmSpec
from fusuma.state import Database
from fusuma.state.records import ImageRecord
from fusuma.supervisor import rpc
from fusuma.vm import VmManager
from fusuma_bench.boot import one_run, scratch_partition
from fusuma_bench.report import meta

NAME = "bench-images"          # the imported image, and the scratch partition
GIB = 2**30
READ_BLOCK = 2**20
QUICK_MIB, QUICK_DATA_MIB = 64, 48
BOOT_MEMORY_MIB = 384           # a Debian with systemd and cloud-init boots in it

Progress = Callable[[str], None]


def _ms(t0: float) -> float:
    return round((time.perf_counter() - t0) * 1000, 2)


def _stats(values: list[float], name: str) -> dict[str, float]:
    return {f"{name}_median": round(statistics.median(values), 2),
            f"{name}_min": min(values), f"{name}_max": max(values)}


def _run(argv: list[str]) -> None:
    proc = subprocess.run(argv, capture_output=True, text=True, check=False, timeout=600)
    if proc.returncode != 0:
        raise HostError(f"{argv[0]} {argv[1]} failed: {proc.stderr.strip()[-300:]}")


def generated_image(directory: Path) -> Path:
    """A small qcow2 with data that neither compresses nor reads as zeros."""
    raw, out = directory / "gen.raw", directory / "gen.qcow2"
    with open(raw, "wb") as f:
        for _ in range(QUICK_DATA_MIB):
            f.write(os.urandom(2**20))
        f.truncate(QUICK_MIB * 2**20)
    _run(["qemu-img", "convert", "-O", "qcow2", str(raw), str(out)])
    raw.unlink()
    return out


def source_image(paths: Paths, quick: bool, given: Path | None, scratch: Path) -> Path:
    if given is not None:
        return given
    if quick:
        return generated_image(scratch)
    cached = diskimage.cached(paths.cache)
    if cached is None:
        raise SpecError(f"there is no bootable disk image in {paths.cache}/images: build "
                        "it with `python -m fusuma.images.diskimage` (a few minutes), "
                        "give one with --image FILE, or use --quick.")
    return cached


def read_through(disk: Path, fmt: str, virtual_size: int) -> None:
    """Read every block of ``disk`` (``fmt``) through the page cache, as a VM's QEMU
    reads (cache=writeback); a thin disk's reads go on to its base."""
    count = -(-virtual_size // READ_BLOCK)
    _run(["qemu-img", "bench", "-q", "-f", fmt, "-t", "writeback", "-d", "8",
          "-c", str(count), "-s", str(READ_BLOCK), str(disk)])


def flushed_copy(src: Path, dst: Path) -> None:
    """A full copy of ``src``, written out and dropped from the page cache."""
    shutil.copyfile(src, dst)
    fd = os.open(dst, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
    drop_cache(dst)


def measure_import(paths: Paths, db: Database, source: Path, runs: int,
                   say: Progress) -> tuple[ImageRecord, dict[str, Any]]:
    """Import ``source`` RUNS times (the last import is kept); and its parts alone."""
    store.sha256_of(source)                     # the warm-up: the file into the cache
    sha, probe, imports = [], [], []
    rec: ImageRecord | None = None
    for r in range(runs):
        t0 = time.perf_counter()
        store.sha256_of(source)
        sha.append(_ms(t0))
        t0 = time.perf_counter()
        store.probe(source)
        probe.append(_ms(t0))
        if rec is not None:
            store.delete_image(db, NAME)
        t0 = time.perf_counter()
        rec = store.import_image(paths, db, NAME, str(source), anywhere=True)
        imports.append(_ms(t0))
        say(f"import {r + 1}/{runs}: {imports[-1]:.0f} ms")
    assert rec is not None
    gib = rec.file_size / GIB
    out: dict[str, Any] = {"import_ms": imports, "sha256_ms": sha, "probe_ms": probe,
                           **_stats(imports, "import_ms"), **_stats(sha, "sha256_ms"),
                           **_stats(probe, "probe_ms")}
    out["import_s_per_gib"] = round(out["import_ms_median"] / 1000 / gib, 3)
    out["sha256_s_per_gib"] = round(out["sha256_ms_median"] / 1000 / gib, 3)
    return rec, out


def measure_overlays(rec: ImageRecord, scratch: Path, runs: int) -> dict[str, Any]:
    times = []
    for i in range(runs):
        path = scratch / f"thin-{i}.qcow2"
        t0 = time.perf_counter()
        store.create_overlay(rec, path, None, os.getuid())
        times.append(_ms(t0))
        path.unlink()
    return {"overlay_create_ms": times, **_stats(times, "overlay_create_ms")}


def measure_sharing(rec: ImageRecord, scratch: Path, readers: int,
                    say: Progress) -> dict[str, Any]:
    base = Path(rec.path)
    drop_cache(base)
    before = resident_bytes(base)
    shared = []
    for i in range(readers):
        thin = scratch / f"reader-{i}.qcow2"
        store.create_overlay(rec, thin, None, os.getuid())
        read_through(thin, "qcow2", rec.virtual_size)
        shared.append(resident_bytes(base))
        say(f"reader {i + 1}/{readers} on the shared base: base resident "
            f"{shared[-1] / 2**20:.1f} MiB")
    drop_cache(base)
    copies: list[int] = []
    files = []
    for i in range(readers):
        copy = scratch / f"copy-{i}.{rec.format}"
        flushed_copy(base, copy)
        read_through(copy, rec.format, rec.virtual_size)
        files.append(copy)
        copies.append(sum(resident_bytes(f) for f in files))
        say(f"reader {i + 1}/{readers} on a copy of its own: copies resident "
            f"{copies[-1] / 2**20:.1f} MiB")
    for f in files:
        f.unlink()
    resident = shared[-1]
    per_shared = (shared[-1] - shared[0]) / (readers - 1) if readers > 1 else None
    per_copy = (copies[-1] - copies[0]) / (readers - 1) if readers > 1 else None
    return {"readers": readers, "base_resident_bytes_before": before,
            "shared_resident_bytes": shared, "copies_resident_bytes": copies,
            "base_resident_bytes": resident,
            "saved_bytes": (readers - 1) * resident,
            "copies_minus_shared_bytes": copies[-1] - resident,
            "added_reader_shared_bytes": per_shared, "added_reader_copy_bytes": per_copy}


def measure_boot(parts: PartitionManager, vms: VmManager, rec: ImageRecord, n: int,
                 timeout: float, say: Progress) -> dict[str, Any]:
    names = [f"{NAME}-{i}" for i in range(n)]
    drop_cache(Path(rec.path))
    with scratch_partition(parts, NAME, n, BOOT_MEMORY_MIB,
                           "booting VMs for the images benchmark", say) as free:
        create = []
        for name in names:
            t0 = time.perf_counter()
            vms.create(VmSpec(name=name, partition=NAME, memory_mib=BOOT_MEMORY_MIB,
                              image=NAME, boot="bios"))
            create.append(_ms(t0))
        say(f"booting {n} VM(s) by SeaBIOS on cores {free} (about a minute under TCG)")
        booted = one_run(vms, NAME, names, 0, timeout)
        users = [BaseUser(r.name, r.pid, NAME) for r in parts.db.vms()
                 if r.name in names and r.pid is not None]
        [use] = bases_in_use(parts.db.images(), users)
    times = [b["boot_ms"] for b in booted]
    return {"vms": n, "firmware": "bios", "guest_memory_mib": BOOT_MEMORY_MIB,
            "cores": free, "vm_create_ms": create, "boot_to_agent_ms": times,
            **_stats(times, "boot_to_agent_ms"),
            "base_resident_bytes": use.resident_bytes, "vms_holding_base": len(use.vms),
            "saved_bytes": use.saved_bytes, "error": use.error}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _ssh_banner(port: int, deadline: float, stop: threading.Event) -> float | None:
    """When (monotonic) sshd's banner first came through the forward; None: never (or
    ``stop`` was set)."""
    while time.monotonic() < deadline and not stop.is_set():
        with contextlib.suppress(OSError), \
                socket.create_connection(("127.0.0.1", port), timeout=2) as c:
            c.settimeout(2)
            if c.recv(64).startswith(b"SSH-"):
                return time.monotonic()
        time.sleep(0.2)
    return None


def _boot_one(vms: VmManager, name: str, ssh_port: int | None,
              timeout: float) -> dict[str, Any]:
    """Start VM ``name`` alone; ms from the start request to its agent (and its sshd)."""
    client = vms.parts.client(NAME)
    stop = threading.Event()
    with ThreadPoolExecutor(1) as pool:
        t0 = time.monotonic()
        vms.start(name)
        ssh = None if ssh_port is None else pool.submit(_ssh_banner, ssh_port,
                                                        t0 + timeout, stop)
        try:
            client.send(rpc.WaitAgent(name, timeout=timeout), timeout=timeout + 10)
        except BaseException:
            stop.set()                  # no waiting for sshd on a boot that failed
            raise
        agent = time.monotonic()
        ssh_at = None if ssh is None else ssh.result()
    return {"boot_to_agent_ms": round((agent - t0) * 1000, 1),
            "boot_to_ssh_ms": None if ssh_at is None else round((ssh_at - t0) * 1000, 1)}


def measure_firmware(paths: Paths, parts: PartitionManager, vms: VmManager,
                     timeout: float, say: Progress) -> dict[str, Any]:
    from fusuma.images.backup import backups_dir
    from fusuma.vm import backups as vm_backups
    from fusuma.vm import snapshots as vm_snapshots

    out: dict[str, Any] = {"guest_memory_mib": BOOT_MEMORY_MIB}
    backup = f"{NAME}-backup"
    with scratch_partition(parts, NAME, 1, BOOT_MEMORY_MIB,
                           "booting VMs for the images benchmark", say) as free:
        out["cores"] = free
        for fw in ("bios", "uefi"):
            name, port = f"{NAME}-{fw}", _free_port()
            vms.create(VmSpec(name=name, partition=NAME, memory_mib=BOOT_MEMORY_MIB,
                              image=NAME, boot=fw, ports=[f"127.0.0.1:{port}:22"]))
            say(f"booting one VM by {fw} (about a minute under TCG)")
            out[fw] = _boot_one(vms, name, port, timeout)
            say(f"{fw}: agent {out[fw]['boot_to_agent_ms']} ms, ssh "
                f"{out[fw]['boot_to_ssh_ms']} ms")
            if fw == "bios":
                vms.stop(name, timeout=10)
        vm = f"{NAME}-uefi"
        snaps: dict[str, Any] = {}
        for snap, memory in (("disk", False), ("memory", True)):
            t0 = time.perf_counter()
            made = vm_snapshots.create(vms, vm, snap, memory)
            snaps[f"{snap}_create_ms"] = _ms(t0)
            if memory:
                snaps["vmstate_bytes"] = made["vmstate_bytes"]
        t0 = time.perf_counter()
        vm_snapshots.restore(vms, vm, "memory")
        snaps["memory_restore_running_ms"] = _ms(t0)
        for snap in ("disk", "memory"):
            t0 = time.perf_counter()
            vm_snapshots.delete(vms, vm, snap)
            snaps[f"{snap}_delete_ms"] = _ms(t0)
        out["snapshots"] = snaps
        say(f"snapshots: {snaps}")
        try:
            full = vm_backups.backup(vms, vm, backup)
            inc = vm_backups.backup(vms, vm, backup, incremental=True)
        finally:
            shutil.rmtree(backups_dir(paths) / backup, ignore_errors=True)
        out["backup"] = {
            kind: {"seconds": r.seconds, "bytes": r.bytes, "disk_bytes": r.disk_bytes,
                   "disk_mib_per_s": round(r.disk_bytes / 2**20 / r.seconds, 1),
                   "written_mib_per_s": round(r.bytes / 2**20 / r.seconds, 1)}
            for kind, r in (("full", full), ("incremental", inc))}
        say(f"backups: {out['backup']}")
        vms.stop(vm, timeout=10)
        name = f"{NAME}-kernel"
        try:
            vms.create(VmSpec(name=name, partition=NAME, memory_mib=BOOT_MEMORY_MIB,
                              image="debian"))
            say("booting fusuma's Debian image by direct kernel boot")
            out["kernel"] = {"image": "debian", **_boot_one(vms, name, None, timeout)}
        except FusumaError as exc:           # its image is not built here
            out["kernel"] = {"image": "debian", "failed": str(exc)}
        say(f"kernel: {out['kernel']}")
    return out


@contextlib.contextmanager
def _scratch(paths: Paths) -> Iterator[Path]:
    paths.home.mkdir(parents=True, exist_ok=True)
    d = Path(tempfile.mkdtemp(prefix=".bench-images-", dir=paths.home))
    try:
        yield d
    finally:
        shutil.rmtree(d, ignore_errors=True)


def run(paths: Paths, db: Database, parts: PartitionManager, vms: VmManager, *,
        quick: bool, runs: int, readers: int, boot_vms: int, image: Path | None = None,
        boot_timeout: float = 400.0, progress: Progress = lambda s: None) -> dict[str, Any]:
    accel = probe_accel("auto").name
    store.check_new_name(db, NAME)
    with _scratch(paths) as scratch:
        source = source_image(paths, quick, image, scratch)
        try:
            rec, imported = measure_import(paths, db, source, runs, progress)
            overlay = measure_overlays(rec, scratch, max(runs, 5))
            progress(f"thin disk: median {overlay['overlay_create_ms_median']} ms")
            sharing = measure_sharing(rec, scratch, readers, progress)
            boot = firmware = None
            if not quick:
                try:
                    firmware = measure_firmware(paths, parts, vms, boot_timeout, progress)
                except FusumaError as exc:
                    progress(f"the firmware boots failed: {exc}")
                    firmware = {"failed": str(exc)}
            if boot_vms:
                try:
                    boot = measure_boot(parts, vms, rec, boot_vms, boot_timeout, progress)
                except FusumaError as exc:   # the figures above stand; the file says so
                    progress(f"the boot failed: {exc}")
                    boot = {"vms": boot_vms, "failed": str(exc)}
        finally:
            if db.find_imported(NAME) is not None:
                store.delete_image(db, NAME)
    summary = {"import_ms_median": imported["import_ms_median"],
               "import_s_per_gib": imported["import_s_per_gib"],
               "sha256_s_per_gib": imported["sha256_s_per_gib"],
               "probe_ms_median": imported["probe_ms_median"],
               "overlay_create_ms_median": overlay["overlay_create_ms_median"],
               "base_resident_bytes": sharing["base_resident_bytes"],
               "sharing_saved_bytes": sharing["saved_bytes"],
               "copies_minus_shared_bytes": sharing["copies_minus_shared_bytes"],
               "boot_to_agent_ms_median": None if boot is None
               else boot.get("boot_to_agent_ms_median")}
    return {"meta": meta(accel, benchmark="images", quick=quick, runs=runs,
                         readers=readers, boot_vms=boot_vms,
                         image={"source": str(source), "generated": quick and image is None,
                                "format": rec.format, "file_bytes": rec.file_size,
                                "virtual_size_bytes": rec.virtual_size,
                                "sha256": rec.sha256}),
            "import": imported, "overlay": overlay, "sharing": sharing, "boot": boot,
            "firmware": firmware, "summary": summary}
