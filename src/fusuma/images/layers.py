"""The disk of a template made from a VM that boots by firmware, and its clones' own
files.

A template keeps its VM's thin disk as it was when the guest was saved: a copy of the
overlay, made after QEMU's save inactivated it (flushed, marked clean), root's and
read-only, whose backing file is the image's base. Nothing ever writes it again. Its
NVRAM (UEFI) is copied beside it, and the seed's inputs (keys, user-data) too.

A clone gets, in its own directory, what a VM of an image gets: a qcow2 overlay (on the
template's layer, so its chain is overlay -> layer -> base), created in milliseconds
without opening the layer (``qemu-img create -u``: the layer's contents are the
guest's word, never parsed by root; its size is read from the header's one field); a
copy of the template's NVRAM; a seed with an instance id of its own, its name as the
hostname and its own NICs' MACs, as large as the template's (the guest's virtio-blk
device keeps the size it saw). And a marker, ``clone-fresh``: while it exists its disk
is the template's and its start resumes the template's guest; it is removed before
that guest runs, so every later start boots the clone's own disk by firmware.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import stat
import subprocess
import time
import uuid
from dataclasses import asdict
from pathlib import Path

from fusuma.errors import HostError, ImageError, TemplateError
from fusuma.images import seed
from fusuma.images.store import DISK, FRESH, NVRAM, SEED, SEED_INPUTS

LOG = logging.getLogger(__name__)
QCOW2_MAGIC = b"QFI\xfb"
MAX_SIZE = 2**50          # 1 PiB: a header saying more is not one fusuma made


def layer_path(tdir: Path) -> Path:
    return tdir / DISK


def qcow2_size(fd: int, what: str) -> int:
    """The virtual size in a qcow2 header (big-endian at byte 24), checked."""
    head = os.pread(fd, 32, 0)
    if len(head) < 32 or head[:4] != QCOW2_MAGIC:
        raise ImageError(f"{what} is not a qcow2 image.")
    size = int.from_bytes(head[24:32], "big")
    if not 0 < size <= MAX_SIZE or size % 512:
        raise ImageError(f"{what} has a qcow2 header with an impossible size ({size}).")
    return size


def copy_sparse(src: Path, dst: Path, mode: int) -> int:
    """Copy ``src`` (not followed if a link) to the new file ``dst`` (``mode``, root's),
    its holes kept, durably; the bytes of data copied. ``copy_file_range`` shares the
    blocks where the file system can (a reflink)."""
    fd = os.open(src, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise HostError(f"{src} is not a regular file.")
        out = os.open(dst, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW
                      | os.O_CLOEXEC, 0o600)
        copied = 0
        try:
            os.ftruncate(out, st.st_size)
            at = 0
            while at < st.st_size:
                try:
                    start = os.lseek(fd, at, os.SEEK_DATA)
                except OSError:          # ENXIO: no data after ``at``
                    break
                end = os.lseek(fd, start, os.SEEK_HOLE)
                pos = start
                while pos < end:
                    n = os.copy_file_range(fd, out, end - pos, pos, pos)
                    if n <= 0:
                        raise HostError(f"copying {src} stopped at byte {pos}.")
                    pos += n
                copied += end - start
                at = end
            os.fchmod(out, mode)
            os.fsync(out)
        finally:
            os.close(out)
    finally:
        os.close(fd)
    return copied


def freeze(vm_dir: Path, tdir: Path, uefi: bool, files: Path | None = None) -> int:
    """Copy a saved VM's thin disk (its QEMU saved and inactivated it), NVRAM and seed
    inputs from ``vm_dir`` (its disk, NVRAM and seed from ``files``, if they are on
    shared storage) into template dir ``tdir``, read-only; the bytes of the layer's
    data. The caller removes ``tdir`` on failure."""
    inputs = vm_dir / SEED_INPUTS
    files = files or vm_dir
    if not inputs.is_file():
        raise TemplateError(f"{vm_dir.name!r}'s cloud-init seed was written by an older "
                            "fusuma, which kept not what it said; delete and create the "
                            "VM again to make templates of it.")
    copied = copy_sparse(files / DISK, layer_path(tdir), 0o400)
    fd = os.open(layer_path(tdir), os.O_RDONLY | os.O_CLOEXEC)
    try:
        qcow2_size(fd, f"VM {vm_dir.name!r}'s disk")
    finally:
        os.close(fd)
    if uefi:
        copy_sparse(files / NVRAM, tdir / NVRAM, 0o400)
    said = seed.load_inputs(inputs)
    iso_bytes = (files / SEED).stat().st_size
    _write_json(tdir / SEED_INPUTS, {**asdict(said), "iso_bytes": iso_bytes})
    return copied


def _write_json(path: Path, data: object) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC,
                 0o400)
    try:
        os.write(fd, json.dumps(data).encode())
        os.fsync(fd)
    finally:
        os.close(fd)


def make_clone_files(tdir: Path, vdir: Path, name: str, uid: int,
                     macs: tuple[str, ...]) -> str:
    """A clone's overlay on the layer in ``tdir``, its NVRAM (when the template has
    one), its seed and its fresh marker, in ``vdir`` (which the caller removes on
    failure); returns the clone's instance id."""
    layer = layer_path(tdir)
    fd = os.open(layer, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    try:
        size = qcow2_size(fd, f"the template's layer {layer}")
    finally:
        os.close(fd)
    overlay = vdir / DISK
    if overlay.exists() or overlay.is_symlink():
        raise ImageError(f"{overlay} exists already.")
    # -u: the layer is not opened (its size is given), so root parses nothing of it.
    argv = ["qemu-img", "create", "-q", "-u", "-f", "qcow2", "-F", "qcow2", "-b",
            str(layer), "-o", "lazy_refcounts=on", str(overlay), str(size)]
    t0 = time.monotonic()
    proc = subprocess.run(argv, capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        raise ImageError(f"cannot create the disk {overlay}: {proc.stderr.strip()}.")
    ms = (time.monotonic() - t0) * 1000
    os.chown(overlay, uid, uid)
    os.chmod(overlay, 0o600)
    if (tdir / NVRAM).exists():
        copy_sparse(tdir / NVRAM, vdir / NVRAM, 0o600)
        os.chown(vdir / NVRAM, uid, uid)
    inputs = json.loads((tdir / SEED_INPUTS).read_text())
    instance_id = f"{name}-{uuid.uuid4().hex[:12]}"
    mine = seed.Seed(instance_id=instance_id, hostname=name,
                     ssh_keys=tuple(inputs.get("ssh_keys") or ()),
                     user_data=inputs.get("user_data"), macs=macs)
    seed.write(mine, vdir / SEED, size=int(inputs["iso_bytes"]))
    seed.save_inputs(mine, vdir / SEED_INPUTS)
    (vdir / FRESH).touch(mode=0o600)
    LOG.info("clone %s: overlay on %s in %.1f ms", name, layer, ms)
    return instance_id


def fresh(vdir: Path) -> bool:
    """Whether a clone's disk is still its template's (its next start resumes the
    template's guest)."""
    return (vdir / FRESH).exists()


def used(vdir: Path) -> None:
    """The clone's guest runs from now on: its later starts boot its own disk."""
    with contextlib.suppress(FileNotFoundError):
        (vdir / FRESH).unlink()
