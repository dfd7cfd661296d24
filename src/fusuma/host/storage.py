"""Storage directories: where disk files may be, and which file each disk is.

Root declares the directories that hold guests' disk files (`fusuma storage add DIR`,
a spec's ``[[storage]]``); FUSUMA_HOME/disks is always one. A disk is registered only
as a regular file inside one of them, with one hard link, never a symlink or a device,
and its device and inode are recorded. Every start opens the path with ``O_PATH |
O_NOFOLLOW`` (which opens no file: a device's driver is never called), compares the
identity with the record, and only then opens that very inode through
``/proc/self/fd``. So a name in a request can reach no host file outside the
directories root chose, and a file swapped after registration (for a symlink to a block
device, or another file) is refused with nothing of it opened.

A disk registered by a fusuma that recorded no identity is taken over at its first
start: if it lies inside a storage directory and is a fit file, its identity is
recorded then; otherwise the start is refused with the sentence that says what to do.
"""

from __future__ import annotations

import contextlib
import os
import stat
from collections.abc import Iterable
from pathlib import Path

from fusuma.errors import ConflictError, HostError, NotFoundError, SpecError, StateError
from fusuma.frozen import frozen
from fusuma.paths import PRIVATE_DIR, Paths
from fusuma.state import Database, DiskRecord

# System trees no storage directory may be, hold or lie in: device nodes, the kernel's
# files, root's own files and the programs root runs.
SYSTEM_DIRS = tuple(Path(p) for p in (
    "/bin", "/boot", "/dev", "/etc", "/lib", "/lib32", "/lib64", "/libx32", "/proc",
    "/root", "/run", "/sbin", "/sys", "/usr", "/var/lib/dpkg"))


def default_dir(paths: Paths) -> Path:
    """The storage directory every host has: FUSUMA_HOME/disks."""
    return paths.home / "disks"


def declared(paths: Paths, db: Database, extra: Iterable[str] = ()) -> list[Path]:
    """Every storage directory: the default one first, then those root declared (and
    ``extra``, a spec's own that are not declared yet)."""
    out = [default_dir(paths)]
    for d in [*db.storage_dirs(), *extra]:
        if Path(d) not in out:
            out.append(Path(d))
    return out


def _names(dirs: list[Path]) -> str:
    return ", ".join(str(d) for d in dirs)


def _normal(path: str, what: str) -> Path:
    p = Path(path)
    if not p.is_absolute():
        raise SpecError(f"{what} {path!r} must be an absolute path.")
    if ".." in p.parts:
        raise SpecError(f"{what} {path!r} must not contain '..'; give the path itself.")
    return Path(os.path.normpath(p))


def _overlaps(a: Path, b: Path) -> bool:
    return a == b or a.is_relative_to(b) or b.is_relative_to(a)


def check_dir(paths: Paths, path: str) -> Path:
    """A directory root may declare for disk files, as its real path (symlinks
    resolved); refused: the root directory, system trees and fusuma's own directories."""
    real = Path(os.path.realpath(_normal(path, "storage directory")))
    if real == Path("/"):
        raise SpecError("the root directory cannot be a storage directory; give a "
                        "directory that holds only disk files, such as /srv/fusuma-disks.")
    for system in SYSTEM_DIRS:
        if _overlaps(real, Path(os.path.realpath(system))):
            raise SpecError(f"{real} overlaps the system directory {system}, which no "
                            "storage directory may; give a directory that holds only "
                            "disk files, such as /srv/fusuma-disks.")
    if real == Path(os.path.realpath(default_dir(paths))):
        raise ConflictError(f"{real} is the default storage directory already.")
    for own in (paths.home, paths.runtime, paths.shm, paths.cache):
        if _overlaps(real, Path(os.path.realpath(own))):
            raise SpecError(f"{real} overlaps fusuma's own directory {own} (its state, "
                            "sockets, guest RAM or images), which no storage directory "
                            f"may; disk files go in {default_dir(paths)} or a directory "
                            "of their own.")
    if real.exists() and not real.is_dir():
        raise SpecError(f"{real} is not a directory.")
    return real


def add(paths: Paths, db: Database, path: str, shared: bool = False) -> Path:
    """Declare a storage directory (created, 0700, if missing); returns its real path.
    ``shared``: other hosts see the same files at the same path (NFS, a cluster file
    system), so that VMs placed there (``vm create --storage``) move between hosts
    without their disks."""
    real = check_dir(paths, path)
    if str(real) in db.storage_dirs():
        raise ConflictError(f"{real} is a storage directory already.")
    try:
        real.mkdir(mode=PRIVATE_DIR, parents=True, exist_ok=True)
    except OSError as exc:
        raise HostError(f"cannot create the storage directory {real}: {exc.strerror}."
                        ) from exc
    db.add_storage_dir(str(real), shared)
    return real


def shared_dir(paths: Paths, db: Database, path: str) -> Path:
    """The storage directory declared shared that ``path`` names (its real path); one
    sentence if it is missing, not declared, or declared but not shared."""
    given = _normal(path, "storage directory")
    real = Path(os.path.realpath(given))
    shared = [Path(d) for d in db.shared_storage_dirs()]
    if real in shared:
        if not real.is_dir():
            raise NotFoundError(f"storage directory {real} is missing (is its file system "
                                "mounted?); mount it or pick another shared directory.")
        return real
    if str(real) in db.storage_dirs():
        raise SpecError(f"storage directory {real} is not declared shared; a VM's files go "
                        "only in a directory other hosts see too (`fusuma storage add DIR "
                        "--shared`, as root on each host).")
    raise NotFoundError(f"{given} is not a shared storage directory of this host (they "
                        f"are: {_names(shared) or 'none'}); root declares one with "
                        "`fusuma storage add DIR --shared`.")


def holds(path: str, directory: Path) -> bool:
    """Whether file ``path`` lies in ``directory`` (its own directory's real path)."""
    parent = Path(os.path.realpath(Path(path).parent))
    real = Path(os.path.realpath(directory))
    return parent == real or parent.is_relative_to(real)


def remove(paths: Paths, db: Database, path: str) -> Path:
    """Undeclare a storage directory; refused while a registered disk lies in it and in
    no other storage directory."""
    given = _normal(path, "storage directory")
    if given in (default_dir(paths), Path(os.path.realpath(default_dir(paths)))):
        raise StateError(f"{given} is the default storage directory; it cannot be removed.")
    have = db.storage_dirs()
    real = str(given) if str(given) in have else os.path.realpath(given)
    if real not in have:
        raise NotFoundError(f"{given} is not a storage directory (they are: "
                            f"{_names(declared(paths, db))}); see `fusuma storage list`.")
    others = [d for d in declared(paths, db) if str(d) != real]
    held = [d.name for d in db.disks() if holds(d.path, Path(real))
            and not any(holds(d.path, o) for o in others)]
    if held:
        raise StateError(f"storage directory {real} holds disk(s) {', '.join(held)}; "
                         "remove them first (`fusuma disk remove NAME`).")
    db.remove_storage_dir(real)
    return Path(real)


@frozen
class Place:
    """Where a disk file is: a storage directory (its real path) and the file's path
    inside it (of its real location: symlinked directories on the way resolved)."""

    directory: Path
    rel: Path

    @property
    def path(self) -> Path:
        return self.directory / self.rel


def locate(paths: Paths, db: Database, path: str, extra: Iterable[str] = ()) -> Place:
    """The disk file ``path``, checked to lie in a storage directory (its directory's
    real path is inside one); else the sentence naming them."""
    p = _normal(path, "disk path")
    dirs = declared(paths, db, extra)
    parent = Path(os.path.realpath(p.parent))
    for d in dirs:
        real = Path(os.path.realpath(d))
        if parent == real or parent.is_relative_to(real):
            return Place(real, parent.relative_to(real) / p.name)
    raise SpecError(f"disk path {p} is outside the storage directories ({_names(dirs)}); "
                    "put the file in one of them, or have root declare its directory "
                    "with `fusuma storage add DIR`.")


def claim(place: Place, size_mib: int | None) -> tuple[Identity, bool]:
    """The identity of the disk file at ``place`` and whether fusuma created it: an
    existing file that is fit to be a disk, or, with ``size_mib``, a new one. The file
    is pinned where it is found, and its location checked from the pinned descriptor,
    so a directory on the way replaced meanwhile cannot lead the registration out."""
    try:
        st, why = examine(place)
    except FileNotFoundError:
        if size_mib is None:
            raise NotFoundError(f"disk file {place.path} does not exist; give --size-mib "
                                "(size_mib) to create it.") from None
        try:
            return create_file(place, size_mib), True
        except OSError as exc:
            raise HostError(f"cannot create disk file {place.path}: {exc.strerror}."
                            ) from exc
    except OSError as exc:
        raise HostError(f"cannot open disk file {place.path}: {exc.strerror}.") from exc
    if why is not None:
        raise SpecError(f"disk file {place.path} {why}.")
    return identity_of(st), False


def examine(place: Place) -> tuple[os.stat_result, str | None]:
    """The status of the file at ``place`` (pinned, not opened) and why it cannot be a
    disk (None: it can), its location read back from the pinned descriptor, so a
    directory on the way replaced meanwhile cannot lead out. Raises OSError."""
    fd, st = pin(place.path)
    try:
        why = unfit(st)
        if why is None and os.readlink(f"/proc/self/fd/{fd}") != str(place.path):
            why = "was moved while it was looked at (a directory on its way was replaced)"
    finally:
        os.close(fd)
    return st, why


# -- which file a disk is -----------------------------------------------------------
@frozen
class Identity:
    dev: int
    ino: int

    def __str__(self) -> str:
        return f"{os.major(self.dev)}:{os.minor(self.dev)}/{self.ino}"


def unfit(st: os.stat_result) -> str | None:
    """Why a file with status ``st`` cannot be a disk (None: it can)."""
    mode = st.st_mode
    if stat.S_ISLNK(mode):
        return "is a symbolic link; a disk must be the file itself"
    if stat.S_ISBLK(mode):
        return "is a block device; a disk must be a regular file in a storage directory"
    if not stat.S_ISREG(mode):
        return "is not a regular file"
    if st.st_nlink != 1:
        return (f"has {st.st_nlink} hard links; a disk must be a file of its own (copy "
                "it instead of linking it)")
    return None


def pin(path: Path) -> tuple[int, os.stat_result]:
    """An ``O_PATH`` descriptor of ``path`` itself (a symlink is not followed; no file
    is opened for reading or writing) and its status. Raises OSError."""
    fd = os.open(path, os.O_PATH | os.O_NOFOLLOW | os.O_CLOEXEC)
    try:
        return fd, os.fstat(fd)
    except BaseException:
        os.close(fd)
        raise


def reopen(fd: int, flags: int) -> int:
    """Open the very inode ``fd`` (an ``O_PATH`` descriptor) holds."""
    return os.open(f"/proc/self/fd/{fd}", flags | os.O_CLOEXEC)


def identity_of(st: os.stat_result) -> Identity:
    return Identity(st.st_dev, st.st_ino)


def check_registered(name: str, path: Path, dev: int | None, ino: int | None) -> int:
    """Pin disk ``name``'s file and check it is the file registered; the ``O_PATH``
    descriptor (the caller closes it), or the one sentence that says why not."""
    if dev is None or ino is None:
        raise StateError(f"disk {name!r} has no recorded device and inode; start its VM "
                         "through its partition's supervisor, which takes it over.")
    try:
        fd, st = pin(path)
    except OSError as exc:
        raise HostError(f"disk {name!r}: cannot open {path}: {exc.strerror}.") from exc
    why = unfit(st)
    if why is None and identity_of(st) != Identity(dev, ino):
        why = (f"is another file than the one registered (device/inode "
               f"{identity_of(st)}, registered {Identity(dev, ino)})")
    if why is not None:
        os.close(fd)
        raise HostError(f"disk {name!r}: {path} {why}; it changed after registration, so "
                        "fusuma opens nothing of it: put the registered file back, or "
                        "remove the disk and add it again.")
    return fd


def grow(name: str, path: Path, dev: int | None, ino: int | None, size: int) -> int:
    """Grow registered raw disk ``name`` (checked as registered, never through a
    symlink) to ``size`` bytes; its size before. A raw file holds nothing to parse: it
    grows by ``ftruncate``, as ``qemu-img resize -f raw`` would. One sentence if
    ``size`` is not larger."""
    pinned = check_registered(name, path, dev, ino)
    try:
        try:
            fd = reopen(pinned, os.O_RDWR)
        except OSError as exc:
            raise HostError(f"disk {name!r}: cannot open {path}: {exc.strerror}.") from exc
    finally:
        os.close(pinned)
    try:
        old = os.fstat(fd).st_size
        if size <= old:
            raise SpecError(f"disk {name!r} is {old} bytes; a disk only grows (give more "
                            "than that).")
        os.ftruncate(fd, size)
        os.fsync(fd)
    finally:
        os.close(fd)
    return old


def take_over(paths: Paths, db: Database, rec: DiskRecord) -> DiskRecord:
    """Record the identity of a disk an older fusuma registered without one: it must
    lie in a storage directory and be a fit file; else one sentence, nothing changed."""
    if rec.dev is not None and rec.ino is not None:
        return rec
    try:
        place = locate(paths, db, rec.path)
    except SpecError as exc:
        raise StateError(f"disk {rec.name!r} was registered by an older fusuma at "
                         f"{rec.path}, outside the storage directories "
                         f"({_names(declared(paths, db))}); have root declare its "
                         "directory (`fusuma storage add DIR`) and start again.") from exc
    try:
        st, why = examine(place)
    except OSError as exc:
        raise HostError(f"disk {rec.name!r}: cannot open {rec.path}: {exc.strerror}."
                        ) from exc
    if why is not None:
        raise StateError(f"disk {rec.name!r} was registered by an older fusuma, and "
                         f"{rec.path} {why}; remove the disk (`fusuma disk remove "
                         f"{rec.name}`) and add a regular file instead.")
    ident = identity_of(st)
    other = db.disk_with_identity(ident.dev, ident.ino)
    if other is not None and other.name != rec.name:
        raise ConflictError(f"disk {rec.name!r} ({rec.path}) is the same file as disk "
                            f"{other.name!r} ({other.path}); remove one of them.")
    db.set_disk_identity(rec.name, ident.dev, ident.ino)
    return db.disk(rec.name)


def deletable(rec: DiskRecord) -> str | None:
    """Why :func:`delete_file` would not delete disk ``rec``'s file (None: it would)."""
    return delete_file(rec, dry_run=True)


def delete_file(rec: DiskRecord, *, dry_run: bool = False) -> str | None:
    """Delete the file of disk ``rec`` if it is still the file fusuma created; returns
    why not (nothing deleted), or None (deleted, or gone already). The name is looked
    up and unlinked in one open directory, so a directory swapped on the way cannot
    redirect the unlink."""
    path = Path(rec.path)
    if not rec.created_file:
        return (f"fusuma did not create {path} (it was there when disk {rec.name!r} was "
                "registered), so it does not delete it")
    try:
        dfd = os.open(path.parent, os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)
    except FileNotFoundError:
        return None
    except OSError as exc:
        return f"cannot open {path.parent}: {exc.strerror}"
    try:
        try:
            st = os.stat(path.name, dir_fd=dfd, follow_symlinks=False)
        except FileNotFoundError:
            return None
        if rec.dev is None or rec.ino is None:
            return (f"{path} has no recorded device and inode, so fusuma cannot tell it "
                    "is the file it created")
        if (st.st_dev, st.st_ino) != (rec.dev, rec.ino) or not stat.S_ISREG(st.st_mode):
            return f"{path} is no longer the file fusuma created"
        if not dry_run:
            os.unlink(path.name, dir_fd=dfd)
    finally:
        os.close(dfd)
    return None


def create_file(place: Place, size_mib: int) -> Identity:
    """A new sparse file of ``size_mib`` at ``place`` (0600; missing directories made
    0700). Walked down from the storage directory one directory at a time without
    following a symlink, so it is made inside it or not at all; never replaces what
    is there. Raises OSError."""
    flags = os.O_PATH | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
    place.directory.mkdir(mode=PRIVATE_DIR, parents=True, exist_ok=True)  # the default
    dfd = os.open(place.directory, os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        for part in place.rel.parent.parts:
            with contextlib.suppress(FileExistsError):
                os.mkdir(part, PRIVATE_DIR, dir_fd=dfd)
            nfd = os.open(part, flags, dir_fd=dfd)
            os.close(dfd)
            dfd = nfd
        name = place.rel.name
        fd = os.open(name, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW
                     | os.O_CLOEXEC, 0o600, dir_fd=dfd)
        try:
            os.ftruncate(fd, size_mib * 1024 * 1024)
            return identity_of(os.fstat(fd))
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(name, dir_fd=dfd)
            raise
        finally:
            os.close(fd)
    finally:
        os.close(dfd)
