"""Backups of a VM's disks: where they are kept, what a backup holds, and its manifest.

A backup is a directory, its **chain**: one subdirectory per point, ``0001`` the full
backup and ``0002``, ``0003``... each an incremental one on the point before::

    DEST/
      0001/boot.qcow2  nvram.fd  manifest.json     full: every cluster of the disk
      0002/boot.qcow2  nvram.fd  manifest.json     incremental: what changed since 0001,
                                                   its qcow2 backing file ../0001/boot.qcow2

Each disk file is a compressed qcow2 that QEMU's ``blockdev-backup`` wrote through a
descriptor root opened: ``boot.qcow2`` the VM's thin disk, ``disk-NAME.qcow2`` each raw
disk NAME attached to it (whole in every point, an incremental one too: a raw file
keeps no dirty bitmap, so it has no backing file); ``nvram.fd`` is a copy of the VM's
UEFI variables (UEFI VMs only). ``manifest.json`` is written **last**, to a temporary
name, fsynced and renamed: a point without its manifest does not exist (the next backup
removes it), so a backup killed at any moment never looks whole. The manifest records
the VM's configuration (for a restore), each file's SHA-256 and size, and the chain up
to it (each earlier point's manifest checksum), so a restore proves the whole chain
before reading it.

Where DEST may be: a bare NAME is ``FUSUMA_HOME/backups/NAME`` (the only form the API
takes: no role names a host path); root's CLI may also give an absolute path inside a
storage directory (fusuma.host.storage). DEST and its points are 0700 and root's; the
disk files in them are created by root (``O_EXCL|O_NOFOLLOW`` under a pinned directory)
and handed to QEMU as descriptors, so QEMU, which runs as the VM's uid, never opens a
path of the backup and cannot reach another file through it.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import re
import shutil
import stat
import subprocess
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from fusuma.errors import ConflictError, HostError, ImageError, NotFoundError, SpecError
from fusuma.frozen import frozen
from fusuma.host import storage
from fusuma.names import check_name
from fusuma.paths import PRIVATE_DIR, Paths
from fusuma.state import Database

FORMAT = 1                  # the manifest's own version
MANIFEST = "manifest.json"
NVRAM = "nvram.fd"
POINT_RE = re.compile(r"[0-9]{4}")
MAX_POINTS = 9999
MAX_MANIFEST = 1 << 20      # a manifest is small; a larger file is not one
BITMAP_PREFIX = "fusuma-backup-"
CHUNK = 4 * 2**20


def backups_dir(paths: Paths) -> Path:
    """Where a backup named by a bare NAME is kept: FUSUMA_HOME/backups."""
    return paths.home / "backups"


def point_name(n: int) -> str:
    return f"{n:04d}"


def raw_disk_file(disk: str) -> str:
    """The file in a point that holds raw disk ``disk`` (a checked fusuma name)."""
    return f"disk-{disk}.qcow2"


def raw_disk_of(entry: DiskEntry) -> str | None:
    """The raw disk's name an entry holds (None: the thin disk, or not a raw disk's)."""
    m = re.fullmatch(r"disk-(.+)\.qcow2", entry.file)
    if m is None or entry.drive != f"disk-{m.group(1)}" or entry.backing is not None:
        return None
    return m.group(1)


def bitmap_name(chain: str, point: int) -> str:
    """The persistent dirty bitmap on each disk that tracks writes since ``point`` of
    ``chain``: the next incremental backup copies what it marks."""
    return f"{BITMAP_PREFIX}{chain}-{point_name(point)}"


# -- the manifest ---------------------------------------------------------------------
@frozen
class DiskEntry:
    drive: str              # QEMU's drive id (disk-fusuma-boot)
    file: str               # the qcow2 in the point's directory
    virtual_size: int
    sha256: str = ""
    size: int = 0
    backing: str | None = None     # the previous point's file, relative (incremental)


@frozen
class VmConfig:
    """What a restore needs to define the VM again."""

    name: str
    partition: str
    memory_mib: int
    vcpus: int
    boot: str               # bios | uefi
    image: str              # the imported image its thin disk was made on
    image_sha256: str
    machine: str | None
    qos: str
    networks: list[str] = field(default_factory=list)   # each NIC's network, in order


@frozen
class Manifest:
    chain: str              # the chain's id (a hex string)
    point: int
    kind: str               # full | incremental
    taken_at: float
    seconds: float
    vm: VmConfig
    disks: list[DiskEntry]
    nvram: DiskEntry | None
    bitmap: str             # the bitmap that tracks writes since this point
    previous: list[str]     # each earlier point's manifest SHA-256, 0001 first
    frozen: bool            # the guest agent froze the filesystems at the point
    format: int = FORMAT

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=2, sort_keys=True) + "\n"


class CorruptManifest(ImageError):
    """A manifest that cannot be read, or does not match its files."""


def parse_manifest(text: str, where: str) -> Manifest:
    """A manifest's text, checked field by field; one sentence if it is not one."""
    try:
        d = json.loads(text)
        if not isinstance(d, dict) or d.get("format") != FORMAT:
            raise ValueError(f"format {d.get('format') if isinstance(d, dict) else '?'}")
        vm = VmConfig(**d["vm"])
        disks = [DiskEntry(**x) for x in d["disks"]]
        nvram = None if d["nvram"] is None else DiskEntry(**d["nvram"])
        m = Manifest(chain=str(d["chain"]), point=int(d["point"]), kind=str(d["kind"]),
                     taken_at=float(d["taken_at"]), seconds=float(d["seconds"]), vm=vm,
                     disks=disks, nvram=nvram, bitmap=str(d["bitmap"]),
                     previous=[str(p) for p in d["previous"]], frozen=bool(d["frozen"]))
        for e in [*m.disks, *([m.nvram] if m.nvram else [])]:
            if "/" in e.file or e.file.startswith(".") or not re.fullmatch(r"[0-9a-f]{64}",
                                                                          e.sha256):
                raise ValueError(f"file entry {e.file!r}")
        if m.kind not in ("full", "incremental") or not re.fullmatch(r"[0-9a-f]{32}",
                                                                       m.chain):
            raise ValueError("kind or chain")
        if len(m.previous) != m.point - 1 or not m.disks:
            raise ValueError("chain length")
    except (ValueError, KeyError, TypeError) as exc:
        raise CorruptManifest(f"the backup manifest {where} is corrupt ({exc}); this "
                              "point cannot be used.") from exc
    return m


# -- where a backup is --------------------------------------------------------------
def locate(paths: Paths, db: Database, dest: str, *, anywhere: bool) -> Path:
    """The chain directory DEST names: a bare NAME in FUSUMA_HOME/backups; with
    ``anywhere`` (root's CLI) also an absolute path inside a storage directory."""
    if "/" not in dest:
        return backups_dir(paths) / check_name("backup", dest)
    if not anywhere:
        raise SpecError(f"backup {dest!r} names a path; over the API a backup is a name "
                        "(kept in FUSUMA_HOME/backups).")
    place = storage.locate(paths, db, dest)
    return place.path


def _pin_dir(path: Path) -> int:
    """An ``O_PATH`` descriptor of directory ``path`` itself, checked to be a real
    directory of root's that only root may write, and where it was looked for."""
    fd = os.open(path, os.O_PATH | os.O_NOFOLLOW | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        st = os.fstat(fd)
        if st.st_uid != 0 or stat.S_IMODE(st.st_mode) & 0o022:
            raise SpecError(f"{path} is not a directory of root's that only root may "
                            "write; fusuma keeps backups only in such a directory.")
        if os.readlink(f"/proc/self/fd/{fd}") != str(path):
            raise SpecError(f"{path} was moved while it was looked at.")
        return fd
    except BaseException:
        os.close(fd)
        raise


def points(chain_dir: Path) -> list[int]:
    """The complete points of a chain directory (each with its manifest), in order."""
    out = []
    with contextlib.suppress(FileNotFoundError, NotADirectoryError):
        for p in chain_dir.iterdir():
            if POINT_RE.fullmatch(p.name) and (p / MANIFEST).is_file():
                out.append(int(p.name))
    return sorted(out)


def read_point(chain_dir: Path, n: int) -> tuple[Manifest, str]:
    """Point ``n``'s manifest and its SHA-256."""
    where = chain_dir / point_name(n) / MANIFEST
    try:
        fd = os.open(where, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError as exc:
        raise CorruptManifest(f"the backup manifest {where} cannot be read "
                              f"({exc.strerror}).") from exc
    with os.fdopen(fd, "rb") as f:
        data = f.read(MAX_MANIFEST + 1)
    if len(data) > MAX_MANIFEST:
        raise CorruptManifest(f"the backup manifest {where} is corrupt (larger than "
                              f"{MAX_MANIFEST} bytes).")
    try:
        text = data.decode()
    except UnicodeDecodeError as exc:
        raise CorruptManifest(f"the backup manifest {where} is corrupt (not UTF-8)."
                              ) from exc
    m = parse_manifest(text, str(where))
    if m.point != n:
        raise CorruptManifest(f"the backup manifest {where} is corrupt (it names point "
                              f"{m.point}).")
    return m, hashlib.sha256(data).hexdigest()


def is_backup(chain_dir: Path) -> bool:
    """Whether ``chain_dir`` is a backup: a directory holding point directories and
    nothing else (a point without its manifest is a backup that never finished)."""
    try:
        names = [p.name for p in chain_dir.iterdir()]
    except OSError:
        return False
    return bool(names) and all(POINT_RE.fullmatch(n) or n.startswith(".tmp-") for n in names) \
        and bool(points(chain_dir))


# -- a new point --------------------------------------------------------------------
@dataclass
class NewPoint:
    """A point being written: its directory (pinned) and the number it gets."""

    chain_dir: Path
    number: int
    dir_fd: int
    created_chain: bool

    @property
    def path(self) -> Path:
        return self.chain_dir / point_name(self.number)

    def close(self) -> None:
        with contextlib.suppress(OSError):
            os.close(self.dir_fd)


def sweep(chain_dir: Path) -> list[str]:
    """Remove the points that never got a manifest (a backup killed or failed); the
    names removed."""
    gone = []
    with contextlib.suppress(FileNotFoundError, NotADirectoryError):
        for p in chain_dir.iterdir():
            if POINT_RE.fullmatch(p.name) and not (p / MANIFEST).exists() \
                    and not p.is_symlink() and p.is_dir():
                shutil.rmtree(p, ignore_errors=True)
                gone.append(p.name)
    return gone


def begin(chain_dir: Path, *, incremental: bool) -> tuple[NewPoint, Manifest | None]:
    """Make the directory of the next point of ``chain_dir`` (0700, root's); for an
    incremental backup, the last point's manifest (checked). One sentence, nothing
    made, when DEST does not fit."""
    parent = chain_dir.parent
    parent.mkdir(mode=PRIVATE_DIR, parents=True, exist_ok=True)
    last: Manifest | None = None
    created = False
    if chain_dir.is_symlink():
        raise SpecError(f"{chain_dir} is a symbolic link; give the backup directory "
                        "itself.")
    if not chain_dir.exists():
        if incremental:
            raise NotFoundError(f"there is no backup at {chain_dir} to add to; take a full "
                                "backup first (leave out --incremental).")
        os.mkdir(chain_dir, PRIVATE_DIR)
        created = True
    elif not chain_dir.is_dir():
        raise ConflictError(f"{chain_dir} exists and is not a backup; give a new "
                            "directory or the directory of a backup.")
    else:
        sweep(chain_dir)
        if not is_backup(chain_dir):
            raise ConflictError(f"{chain_dir} exists and is not a backup; give a new "
                                "directory or the directory of a backup.")
        if not incremental:
            raise ConflictError(f"{chain_dir} holds a backup already; add --incremental "
                                "to add to it, or give a new directory for a full backup.")
        last, _ = read_point(chain_dir, points(chain_dir)[-1])
    try:
        dfd = _pin_dir(chain_dir)
    except BaseException:
        if created:
            with contextlib.suppress(OSError):
                os.rmdir(chain_dir)
        raise
    try:
        number = 1 if last is None else last.point + 1
        if number > MAX_POINTS:
            raise ConflictError(f"backup {chain_dir} has {MAX_POINTS} points; take a full "
                                "backup into a new directory.")
        os.mkdir(point_name(number), PRIVATE_DIR, dir_fd=dfd)
        pfd = os.open(point_name(number), os.O_PATH | os.O_DIRECTORY | os.O_NOFOLLOW
                      | os.O_CLOEXEC, dir_fd=dfd)
    except BaseException:
        os.close(dfd)
        if created:
            shutil.rmtree(chain_dir, ignore_errors=True)
        raise
    os.close(dfd)
    return NewPoint(chain_dir, number, pfd, created), last


def abandon(pt: NewPoint) -> None:
    """Remove a point that will not be completed (and its chain, if this backup made
    it and it holds nothing else)."""
    pt.close()
    shutil.rmtree(pt.path, ignore_errors=True)
    if pt.created_chain:
        with contextlib.suppress(OSError):
            os.rmdir(pt.chain_dir)


def create_target(pt: NewPoint, name: str, virtual_size: int, uid: int,
                  backing: str | None) -> int:
    """Create the qcow2 ``name`` in the point (root makes it: ``O_EXCL|O_NOFOLLOW`` in
    the pinned directory, then ``qemu-img create`` formats that inode through
    /proc/self/fd) and return a read-write descriptor of it for QEMU. ``backing``: the
    previous point's file, recorded relative (the chain moves as one directory)."""
    fd = os.open(name, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC,
                 0o600, dir_fd=pt.dir_fd)
    try:
        argv = ["qemu-img", "create", "-q", "-f", "qcow2", "-o", "compression_type=zlib"]
        if backing is not None:
            # -u: not opened now (it is root's file, QEMU never reads it: the target is
            # attached without its backing); recorded for restores and qemu-img check.
            argv += ["-u", "-b", backing, "-F", "qcow2"]
        argv += [f"/proc/self/fd/{fd}", str(virtual_size)]
        proc = subprocess.run(argv, capture_output=True, text=True, check=False,
                              pass_fds=(fd,), timeout=60)
        if proc.returncode != 0:
            raise ImageError(f"cannot create backup file {pt.path / name}: "
                             f"{proc.stderr.strip()}.")
        # QEMU writes it through the descriptor under its own uid; the owner is the
        # VM's so that nothing but root and that QEMU can open it.
        os.fchown(fd, uid, uid)
        return fd
    except BaseException:
        os.close(fd)
        raise


def copy_nvram(pt: NewPoint, source: Path) -> DiskEntry:
    """Copy the VM's NVRAM file into the point (not followed if a link)."""
    src = os.open(source, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    try:
        dst = os.open(NVRAM, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW
                      | os.O_CLOEXEC, 0o600, dir_fd=pt.dir_fd)
        try:
            h = hashlib.sha256()
            size = 0
            while chunk := os.read(src, CHUNK):
                h.update(chunk)
                size += len(chunk)
                write_all(dst, chunk)
            os.fsync(dst)
        finally:
            os.close(dst)
    finally:
        os.close(src)
    return DiskEntry(drive="nvram", file=NVRAM, virtual_size=size, sha256=h.hexdigest(),
                     size=size)


def write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view):]


def digest_fd(fd: int) -> tuple[str, int]:
    """SHA-256 and size of an open file, read from its start."""
    h = hashlib.sha256()
    size = 0
    while chunk := os.pread(fd, CHUNK, size):
        h.update(chunk)
        size += len(chunk)
    return h.hexdigest(), size


def commit(pt: NewPoint, m: Manifest) -> None:
    """Write the point's manifest last: a temporary file, fsync, rename, fsync the
    directory. Before the rename the point does not exist."""
    tmp = f".tmp-{MANIFEST}"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC,
                 0o600, dir_fd=pt.dir_fd)
    try:
        write_all(fd, m.to_json().encode())
        os.fsync(fd)
    finally:
        os.close(fd)
    os.rename(tmp, MANIFEST, src_dir_fd=pt.dir_fd, dst_dir_fd=pt.dir_fd)
    d = os.open(pt.path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    try:
        os.fsync(d)
    finally:
        os.close(d)


# -- reading a chain back -----------------------------------------------------------
@frozen
class Chain:
    """A chain checked whole: its points' manifests, 0001 first, up to the one asked."""

    directory: Path
    manifests: list[Manifest]

    @property
    def last(self) -> Manifest:
        return self.manifests[-1]

    def file(self, m: Manifest, entry: DiskEntry) -> Path:
        return self.directory / point_name(m.point) / entry.file


def _file_digest(path: Path) -> tuple[str, int]:
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise OSError(0, "not a regular file")
        return digest_fd(fd)
    finally:
        os.close(fd)


def load_chain(chain_dir: Path, upto: int | None = None, *,
               verify_files: bool = True) -> Chain:
    """Every point of the backup at ``chain_dir`` up to ``upto`` (default the last),
    each manifest's chain link and (``verify_files``) each file's checksum checked;
    one sentence for the first thing wrong."""
    if not chain_dir.is_dir() or chain_dir.is_symlink():
        raise NotFoundError(f"there is no backup at {chain_dir}.")
    have = points(chain_dir)
    if not have:
        raise NotFoundError(f"{chain_dir} is not a backup (it holds no point with a "
                            "manifest).")
    last = have[-1] if upto is None else upto
    if last not in have:
        raise NotFoundError(f"backup {chain_dir} has no point {last} (it has "
                            f"{', '.join(str(p) for p in have)}).")
    manifests: list[Manifest] = []
    sums: list[str] = []
    for n in range(1, last + 1):
        if n not in have:
            raise CorruptManifest(f"backup {chain_dir} is broken: point {point_name(n)}, "
                                  f"which later points build on, is missing.")
        m, digest = read_point(chain_dir, n)
        if manifests and (m.chain != manifests[0].chain or m.previous != sums):
            raise CorruptManifest(f"backup {chain_dir} is broken: point {point_name(n)} "
                                  "does not follow the points before it (a point was "
                                  "replaced or changed).")
        if n == 1 and m.kind != "full":
            raise CorruptManifest(f"backup {chain_dir} is broken: its first point is not "
                                  "a full backup.")
        manifests.append(m)
        sums.append(digest)
    chain = Chain(chain_dir, manifests)
    if verify_files:
        for m in manifests:
            for e in [*m.disks, *([m.nvram] if m.nvram else [])]:
                path = chain.file(m, e)
                try:
                    digest, size = _file_digest(path)
                except OSError as exc:
                    raise CorruptManifest(f"backup {chain_dir} is broken: {path} cannot be "
                                          f"read ({exc.strerror}).") from exc
                if (digest, size) != (e.sha256, e.size):
                    raise CorruptManifest(f"backup {chain_dir} is broken: {path} is not "
                                          "the file the backup wrote (its checksum "
                                          "differs).")
    return chain


def check_backing(chain: Chain) -> None:
    """Each disk file's backing file is exactly the one its manifest names (what
    ``qemu-img convert`` will follow), and nothing else: no external data file."""
    from fusuma.images.store import PROBE_LIMITS

    for m in chain.manifests:
        for e in m.disks:
            path = chain.file(m, e)
            proc = subprocess.run(["prlimit", *PROBE_LIMITS, "qemu-img", "info", "-U",
                                   "--output=json", "-f", "qcow2", str(path)],
                                  capture_output=True, text=True, check=False, timeout=60)
            try:
                info: dict[str, Any] = json.loads(proc.stdout) if proc.returncode == 0 \
                    else {}
            except ValueError:
                info = {}
            data = (info.get("format-specific") or {}).get("data") or {}
            if info.get("format") != "qcow2" or info.get("backing-filename") != e.backing \
                    or (isinstance(data, dict) and data.get("data-file")):
                raise CorruptManifest(f"backup {chain.directory} is broken: {path} is not "
                                      "the qcow2 its manifest describes.")


def flatten(chain: Chain, drive: str, out: Path, base: Path, base_format: str,
            uid: int) -> None:
    """The chain's disk ``drive`` (its last point, read through the earlier ones) as
    ``out``: a qcow2 on ``base`` (the image the VM's thin disk is made on), owned by
    ``uid``. Two steps: ``qemu-img convert`` flattens the chain into a qcow2 of its
    own (``convert -B`` would copy only the top point's clusters), then a safe
    ``qemu-img rebase`` puts it on the base, writing zeros wherever the guest's disk
    reads zeros and the base does not."""
    entry = next(e for e in chain.last.disks if e.drive == drive)
    top = chain.file(chain.last, entry)
    steps = [
        ["qemu-img", "convert", "-q", "-f", "qcow2", "-O", "qcow2", "-o",
         "lazy_refcounts=on", str(top), str(out)],
        ["qemu-img", "rebase", "-q", "-f", "qcow2", "-b", str(base), "-F", base_format,
         str(out)],
    ]
    for argv in steps:
        # It ends with its caller: a restore killed mid-way leaves no qemu-img writing
        # into the VM directory its recovery removes.
        proc = subprocess.run(["setpriv", "--pdeathsig", "KILL", *argv],
                              capture_output=True, text=True, check=False)
        if proc.returncode != 0:
            with contextlib.suppress(FileNotFoundError):
                out.unlink()
            raise HostError(f"cannot restore the disk from {top}: "
                            f"{proc.stderr.strip() or argv[1] + ' failed'}.")
    os.chown(out, uid, uid)
    os.chmod(out, 0o600)


def to_raw(chain: Chain, drive: str, out: Path) -> None:
    """The chain's raw disk ``drive`` (its last point's file, whole: no backing) written
    into the existing, zeroed raw file ``out`` (as large as the disk: a new disk's
    sparse file) by ``qemu-img convert``."""
    entry = next(e for e in chain.last.disks if e.drive == drive)
    src = chain.file(chain.last, entry)
    argv = ["qemu-img", "convert", "-q", "-n", "--target-is-zero", "-f", "qcow2",
            "-O", "raw", str(src), str(out)]
    # It ends with its caller, as flatten's: a restore killed mid-way leaves no writer.
    proc = subprocess.run(["setpriv", "--pdeathsig", "KILL", *argv], capture_output=True,
                          text=True, check=False)
    if proc.returncode != 0:
        raise HostError(f"cannot restore the disk from {src}: "
                        f"{proc.stderr.strip() or 'qemu-img convert failed'}.")


def now() -> float:
    return time.time()
