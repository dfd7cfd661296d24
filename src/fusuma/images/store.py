"""The image store: disk images a user imports, kept read-only, and the thin disks
(qcow2 overlays) VMs get on them.

``fusuma image import NAME FILE`` copies FILE into FUSUMA_HOME/images (0700, root's),
hashing it on the way, and only then asks ``qemu-img info`` about the copy (under
resource limits: an image is untrusted input), so what is checked is what is kept:
qcow2 or raw only, no backing file, no external data file, no encryption. The copy is
made 0444 and recorded with its SHA-256. A VM made from it gets an overlay of its own
(``qemu-img create -b``), created in milliseconds, owned by its QEMU's uid; QEMU gets
both files as descriptors (fusuma.qemu.privilege), never the store's path.

Where FILE may come from: root's CLI names any file root can read; over the API only
a regular file of its own inside a storage directory (fusuma.host.storage), opened
without following a symlink, as for disks.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import logging
import os
import stat
import subprocess
import threading
import time
from pathlib import Path

from fusuma.errors import ConflictError, HostError, ImageError, SpecError, StateError
from fusuma.frozen import frozen
from fusuma.host import storage
from fusuma.names import check_name
from fusuma.paths import PRIVATE_DIR, Paths
from fusuma.state import Database
from fusuma.state.records import ImageRecord

LOG = logging.getLogger(__name__)

FORMATS = ("qcow2", "raw")
CHUNK = 4 * 2**20
HOLE = 64 * 2**10          # zero blocks of this size stay holes in the copy
# qemu-img on an untrusted image: bounded address space and CPU time, as OpenStack
# bounds it (a crafted qcow2 can make it allocate or loop).
PROBE_LIMITS = ("--as=1073741824", "--cpu=30")
TMP_PREFIX = ".import-"


def store_dir(paths: Paths) -> Path:
    """Where imported images are kept: FUSUMA_HOME/images."""
    return paths.home / "images"


@frozen
class ImageInfo:
    """What ``qemu-img info`` says of a file, and why fusuma will not use it (None:
    it will)."""

    format: str
    virtual_size: int
    refused: str | None


def parse_info(text: str) -> ImageInfo:
    """``qemu-img info --output=json``'s answer, checked."""
    try:
        d = json.loads(text)
        fmt = str(d["format"])
        size = int(d["virtual-size"])
    except (ValueError, KeyError, TypeError) as exc:
        raise ImageError(f"qemu-img info gave an answer fusuma cannot read: {exc}.") from exc
    why = None
    convert = "convert it with `qemu-img convert -O qcow2 FILE NEW.qcow2` and import that"
    if fmt not in FORMATS:
        why = f"is in format {fmt}, which fusuma does not import (qcow2 or raw); {convert}"
    elif d.get("backing-filename") or d.get("full-backing-filename"):
        why = (f"has a backing file ({d.get('backing-filename')}); fusuma imports only "
               f"whole images: {convert}")
    elif d.get("encrypted"):
        why = f"is encrypted; {convert} without encryption"
    else:
        data = (d.get("format-specific") or {}).get("data") or {}
        if isinstance(data, dict) and data.get("data-file"):
            why = (f"keeps its data in an external file ({data.get('data-file')}); "
                   f"{convert}")
    if why is None and size <= 0:
        why = "has no size"
    return ImageInfo(fmt, size, why)


def probe(path: Path, fmt: str | None = None) -> ImageInfo:
    """Ask ``qemu-img info`` about ``path`` (with ``fmt``: read it as that format)."""
    argv = ["prlimit", *PROBE_LIMITS, "qemu-img", "info", "--output=json", "-U"]
    if fmt is not None:
        argv += ["-f", fmt]
    try:
        proc = subprocess.run([*argv, str(path)], capture_output=True, text=True,
                              check=False, timeout=60)
    except FileNotFoundError as exc:
        raise HostError("qemu-img is not on this host: apt-get install qemu-utils.") from exc
    except subprocess.TimeoutExpired as exc:
        raise ImageError(f"qemu-img info did not answer about {path} in 60 s.") from exc
    if proc.returncode != 0:
        lines = proc.stderr.strip().splitlines()
        raise ImageError(f"qemu-img cannot read the image: "
                         f"{lines[-1] if lines else 'exit status ' + str(proc.returncode)}.")
    return parse_info(proc.stdout)


def _open_source(paths: Paths, db: Database, source: str, anywhere: bool) -> int:
    """A descriptor of the file to import, read-only. ``anywhere`` (root's CLI): any
    regular file; else a fit file inside a storage directory, not followed if a link."""
    if anywhere:
        # Looked at without opening it (O_PATH): a FIFO or a device is never opened.
        try:
            pinned = os.open(source, os.O_PATH | os.O_CLOEXEC)
        except OSError as exc:
            raise SpecError(f"cannot open {source}: {exc.strerror}.") from exc
        try:
            if not stat.S_ISREG(os.fstat(pinned).st_mode):
                raise SpecError(f"{source} is not a regular file; give an image file.")
            return storage.reopen(pinned, os.O_RDONLY)
        finally:
            os.close(pinned)
    place = storage.locate(paths, db, source)
    try:
        pinned, st = storage.pin(place.path)
    except FileNotFoundError:
        raise SpecError(f"image file {place.path} does not exist.") from None
    except OSError as exc:
        raise HostError(f"cannot open {place.path}: {exc.strerror}.") from exc
    try:
        why = storage.unfit(st)
        if why is None and os.readlink(f"/proc/self/fd/{pinned}") != str(place.path):
            why = "was moved while it was looked at (a directory on its way was replaced)"
        if why is not None:
            raise SpecError(f"image file {place.path} {why}.")
        return storage.reopen(pinned, os.O_RDONLY)
    finally:
        os.close(pinned)


def _copy(src: int, dst: int) -> tuple[str, int]:
    """Copy ``src`` to ``dst`` keeping holes where the source reads zeros; the source's
    SHA-256 and size."""
    h = hashlib.sha256()
    zero = bytes(HOLE)
    size = 0
    while True:
        chunk = os.read(src, CHUNK)
        if not chunk:
            break
        h.update(chunk)
        view = memoryview(chunk)
        for at in range(0, len(chunk), HOLE):
            block = view[at:at + HOLE]
            if block == zero[:len(block)]:
                os.lseek(dst, len(block), os.SEEK_CUR)
                continue
            while block:
                block = block[os.write(dst, block):]
        size += len(chunk)
    os.ftruncate(dst, size)
    os.fsync(dst)
    return h.hexdigest(), size


def sha256_of(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(CHUNK):
            h.update(chunk)
    return h.hexdigest()


def sweep(paths: Paths, db: Database) -> list[str]:
    """Remove what imports killed mid-way left in the store (each run of ``image
    import`` and ``image list`` does it first): a partial copy no live import holds
    (an import holds its copy's flock until it ends), and an image file no record
    names (an import killed between its rename and its commit). The file names
    removed."""
    directory = store_dir(paths)
    if not directory.is_dir():
        return []
    gone = []
    for p in directory.glob(f"{TMP_PREFIX}*"):
        try:
            fd = os.open(p, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK)
        except OSError:
            continue
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            continue                   # an import copies into it now
        else:
            with contextlib.suppress(FileNotFoundError):
                p.unlink()
                gone.append(p.name)
        finally:
            os.close(fd)
    # Inside a write transaction: an import between its rename and its commit holds
    # one, so its file has its record by the time this looks.
    with db.transaction():
        kept = {Path(r.path).name for r in db.images()}
        for p in directory.iterdir():
            if p.suffix.lstrip(".") in FORMATS and p.name not in kept \
                    and not p.name.startswith(TMP_PREFIX) and p.is_file():
                p.unlink()
                gone.append(p.name)
    for name in gone:
        LOG.warning("removed %s from the image store: left by an import that did not "
                    "finish", name)
    return gone


def check_new_name(db: Database, name: str) -> None:
    """Refuse a name an image of the store or a built kind has."""
    from fusuma.images.builder import KINDS

    check_name("image", name)
    if name in KINDS:
        raise ConflictError(f"{name!r} is the name of an image fusuma builds; give the "
                            "imported image another name.")
    if db.find_imported(name) is not None:
        raise ConflictError(f"an image named {name!r} already exists; delete it first "
                            f"(`fusuma image delete {name}`) or give another name.")


def import_image(paths: Paths, db: Database, name: str, source: str, *,
                 anywhere: bool, fmt: str | None = None) -> ImageRecord:
    """Copy ``source`` into the store as image ``name``, check it and record it;
    nothing is left of a refused or failed import."""
    check_new_name(db, name)
    if fmt is not None and fmt not in FORMATS:
        raise SpecError(f"format {fmt!r} is not one fusuma imports; use qcow2 or raw.")
    directory = store_dir(paths)
    directory.mkdir(mode=PRIVATE_DIR, parents=True, exist_ok=True)
    os.chmod(directory, PRIVATE_DIR)
    sweep(paths, db)
    src = _open_source(paths, db, source, anywhere)
    tmp = directory / f"{TMP_PREFIX}{name}-{os.getpid()}-{threading.get_native_id()}"
    dst = -1
    try:
        dst = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW
                      | os.O_CLOEXEC, 0o600)
        # Held until the copy is renamed or removed: a sweep leaves it alone.
        fcntl.flock(dst, fcntl.LOCK_EX)
        digest, size = _copy(src, dst)
        info = probe(tmp, fmt)
        if info.refused is not None:
            raise SpecError(f"image {source} {info.refused}.")
        final = directory / f"{name}.{info.format}"
        os.chmod(tmp, 0o444)
        with db.transaction():
            check_new_name(db, name)
            # A file of that name without a record is an import killed after its
            # rename: the store is root's alone, so it is replaced.
            rec = ImageRecord(name=name, path=str(final), format=info.format,
                              virtual_size=info.virtual_size, file_size=size,
                              sha256=digest, source=str(source))
            db.add_image(rec)
            os.rename(tmp, final)
    except OSError as exc:
        raise HostError(f"cannot import {source}: {exc.strerror or exc}.") from exc
    finally:
        os.close(src)
        with contextlib.suppress(FileNotFoundError):
            tmp.unlink()
        if dst >= 0:
            os.close(dst)
    LOG.info("imported image %s from %s (%s, %d bytes)", name, source, info.format, size)
    return rec


def delete_image(db: Database, name: str) -> None:
    """Delete imported image ``name`` and its file; refused while a VM's disk is an
    overlay of it."""
    rec = db.imported(name)
    # A template of a VM of the image keeps a disk layer on it.
    kept = sorted(t.name for t in db.templates() if t.image == name)
    if kept:
        raise StateError(f"image {name!r} is the base of template(s) {', '.join(kept)}; "
                         "delete them first.")
    users = db.users_of_image(name)
    if users:
        raise StateError(f"image {name!r} is the base of VM(s) {', '.join(users)}; "
                         "delete them first.")
    with db.transaction():
        if db.users_of_image(name):
            raise StateError(f"image {name!r} got a VM meanwhile; try again.")
        db.remove_image(name)
    with contextlib.suppress(FileNotFoundError):
        Path(rec.path).unlink()


def verify(rec: ImageRecord) -> str | None:
    """Why the stored file of ``rec`` is not the one imported (None: it is)."""
    try:
        st = os.stat(rec.path, follow_symlinks=False)
    except OSError as exc:
        return f"cannot read {rec.path}: {exc.strerror}"
    if not stat.S_ISREG(st.st_mode) or st.st_size != rec.file_size:
        return f"{rec.path} is not the file imported (its size changed)"
    if stat.S_IMODE(st.st_mode) & 0o222 or st.st_uid != 0:
        return f"{rec.path} is writable or not root's (mode {stat.S_IMODE(st.st_mode):04o})"
    return None


# -- thin disks ---------------------------------------------------------------------
SIZE_UNITS = {"": 1, "K": 2**10, "M": 2**20, "G": 2**30, "T": 2**40}


def parse_size(text: str) -> int:
    """Bytes from ``8G``, ``512M``, ``1073741824``; one sentence if malformed."""
    t = text.strip().upper().removesuffix("B").removesuffix("I")
    unit = t[-1:] if t[-1:] in SIZE_UNITS and t[-1:] else ""
    number = t[:-1] if unit else t
    if not number.isdigit() or int(number) <= 0:
        raise SpecError(f"disk size {text!r} is not a size; give one such as 8G or 512M.")
    return int(number) * SIZE_UNITS[unit]


def create_overlay(base: ImageRecord, path: Path, size: int | None, uid: int) -> None:
    """A qcow2 overlay at ``path`` on ``base`` (``size`` bytes, at least the base's;
    None: the base's), 0600 and owned by ``uid`` (the VM's QEMU); never replaces a
    file."""
    if size is not None and size < base.virtual_size:
        raise SpecError(f"disk size {size} bytes is smaller than image {base.name!r} "
                        f"({base.virtual_size} bytes); a disk can only be as large or "
                        "larger.")
    why = verify(base)
    if why is not None:
        raise StateError(f"image {base.name!r}: {why}; delete it and import it again.")
    if path.exists() or path.is_symlink():
        raise ConflictError(f"{path} exists already.")
    path.parent.mkdir(mode=PRIVATE_DIR, parents=True, exist_ok=True)
    argv = ["qemu-img", "create", "-q", "-f", "qcow2", "-F", base.format, "-b", base.path,
            "-o", "lazy_refcounts=on", str(path)]
    if size is not None:
        argv.append(str(size))
    t0 = time.monotonic()
    proc = subprocess.run(argv, capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        with contextlib.suppress(FileNotFoundError):
            path.unlink()
        raise ImageError(f"cannot create the disk {path}: {proc.stderr.strip()}.")
    os.chown(path, uid, uid)
    os.chmod(path, 0o600)
    LOG.info("thin disk %s on image %s in %.1f ms", path, base.name,
             (time.monotonic() - t0) * 1000)


# A firmware-booted VM's own files, in its directory: its thin disk on the image, its
# NVRAM (UEFI) and its cloud-init seed. Here, below both fusuma.vm (which makes them)
# and fusuma.supervisor (which opens them for QEMU).
DISK = "disk.qcow2"
NVRAM = "nvram.fd"
SEED = "seed.iso"
SEED_INPUTS = "seed.json"     # what the seed says, for a template's clones
FRESH = "clone-fresh"         # a clone whose disk is still its template's (images.layers)
FILES = (DISK, NVRAM, SEED, SEED_INPUTS, FRESH)
# A UEFI VM's NVRAM as each of its snapshots found it (fusuma.images.snapshots): a raw
# file cannot hold internal snapshots, so a copy per snapshot, root's, in this directory.
SNAPSHOTS = "snapshots"


# A VM placed in a shared storage directory (``vm create --storage DIR``) keeps its
# thin disk, NVRAM and seed in DIR/vm-NAME; this file in its own directory says where
# (the directory's path, one line). Its other files (logs, seed inputs, snapshots'
# NVRAM copies) stay in FUSUMA_HOME/vms/NAME.
PLACED = "storage"
PLACED_FILES = (DISK, NVRAM, SEED)
# What a move between hosts leaves in DIR/vm-NAME to prove the destination sees the
# very directory the source does (fusuma.vm.shared).
MOVE_TOKEN = ".move-token"


def placed_dir(directory: Path, vm: str) -> Path:
    """Where VM ``vm``'s files go in storage directory ``directory``."""
    return directory / f"vm-{vm}"


def placed_in(paths: Paths, vm: str) -> Path | None:
    """The directory in a storage directory that holds VM ``vm``'s files (None: they
    are in its own directory)."""
    try:
        text = (paths.vm_dir(vm) / PLACED).read_text().strip()
    except FileNotFoundError:
        return None
    return Path(text) if text else None


def files_dir(paths: Paths, vm: str) -> Path:
    """The directory of VM ``vm``'s thin disk, NVRAM and seed."""
    return placed_in(paths, vm) or paths.vm_dir(vm)


def disk_path(paths: Paths, vm: str) -> Path:
    return files_dir(paths, vm) / DISK


def nvram_path(paths: Paths, vm: str) -> Path:
    return files_dir(paths, vm) / NVRAM


def snapshot_nvram_path(paths: Paths, vm: str, snapshot: str) -> Path:
    """Where snapshot ``snapshot`` of UEFI VM ``vm`` keeps its copy of the NVRAM (the
    snapshot's name is a checked fusuma name)."""
    return paths.vm_dir(vm) / SNAPSHOTS / f"{snapshot}.{NVRAM}"


def seed_path(paths: Paths, vm: str) -> Path:
    return files_dir(paths, vm) / SEED
