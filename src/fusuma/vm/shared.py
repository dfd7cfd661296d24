"""A firmware VM's files on shared storage (``vm create --storage DIR``).

Root declares a directory shared on each host that sees it (`fusuma storage add DIR
--shared`): the same files at the same path. A VM placed there keeps its thin disk,
NVRAM and seed in ``DIR/vm-NAME`` (fusuma.images.store ``placed_dir``), pointed at from
its own directory; a move between hosts then carries no disk: both QEMUs open the same
files, the destination's inactive until the guest runs there (fusuma.cluster.hostmove).

Which host's files they are is proved, not assumed: before such a move the source
writes a fresh random token into ``DIR/vm-NAME`` and the move's record carries it; the
destination takes the move only if it reads the same token at that very path, inside a
directory it declared shared itself. Two hosts that merely both have a directory of
that name (not the same file system) are told so in one sentence, nothing made.
"""

from __future__ import annotations

import contextlib
import os
import stat
from pathlib import Path
from typing import Any

from fusuma.errors import ConflictError, StateError
from fusuma.frozen import frozen
from fusuma.host import storage
from fusuma.images.store import MOVE_TOKEN, PLACED, PLACED_FILES, placed_dir, placed_in
from fusuma.paths import PRIVATE_DIR, Paths
from fusuma.state import Database

# The move record's key for a VM on shared storage (fusuma.cluster.hostmove).
CARRIED_PLACE = "sharedStorage"
TOKEN_BYTES = 32


def place(paths: Paths, db: Database, vm: str, directory: str) -> Path:
    """Make ``DIR/vm-NAME`` for new VM ``vm`` in shared storage directory
    ``directory`` (checked) and point at it from the VM's own directory; returns it.
    Refused (nothing made) if it exists already."""
    shared = storage.shared_dir(paths, db, directory)
    where = placed_dir(shared, vm)
    try:
        os.mkdir(where, PRIVATE_DIR)
    except FileExistsError:
        raise ConflictError(f"{where} exists already (a VM named {vm!r} on another host, "
                            "or one deleted while its host was down); pick another name "
                            "or remove it.") from None
    point(paths, vm, where)
    return where


def point(paths: Paths, vm: str, where: Path) -> None:
    """Record in VM ``vm``'s own directory that its files are in ``where``."""
    vdir = paths.vm_dir(vm)
    vdir.mkdir(mode=PRIVATE_DIR, parents=True, exist_ok=True)
    tmp = vdir / f".{PLACED}.new"
    tmp.write_text(f"{where}\n")
    os.replace(tmp, vdir / PLACED)


def detach(paths: Paths, vm: str) -> Path | None:
    """Forget where VM ``vm``'s files are, leaving them there (a move between hosts:
    the VM leaves this host, its files stay for the host it runs on); the place."""
    where = placed_in(paths, vm)
    with contextlib.suppress(FileNotFoundError):
        (paths.vm_dir(vm) / PLACED).unlink()
    return where


def remove(paths: Paths, vm: str) -> None:
    """Remove VM ``vm``'s files from its place in a storage directory, and the place
    (deleting the VM); nothing if it has none."""
    where = placed_in(paths, vm)
    if where is None:
        return
    for name in (*PLACED_FILES, MOVE_TOKEN, f".{MOVE_TOKEN}.new"):
        with contextlib.suppress(FileNotFoundError):
            (where / name).unlink()
    with contextlib.suppress(OSError):
        where.rmdir()
    with contextlib.suppress(FileNotFoundError):
        (paths.vm_dir(vm) / PLACED).unlink()


# -- the proof that two hosts see one directory -----------------------------------------
@frozen
class CarriedPlace:
    """What a move's record says of a VM on shared storage: the directory of its files
    and the token the source wrote there."""

    path: str
    token: str

    def as_record(self) -> dict[str, Any]:
        return {"path": self.path, "token": self.token}


def mark(paths: Paths, vm: str) -> CarriedPlace:
    """At the source, before a move between hosts: write a fresh token into the
    directory of VM ``vm``'s files (0600, root's, replacing an older one)."""
    import secrets  # (and hashlib, random): only a move between hosts writes one

    where = placed_in(paths, vm)
    if where is None:
        raise StateError(f"VM {vm!r} has no files on shared storage.")
    token = secrets.token_hex(TOKEN_BYTES)
    tmp = where / f".{MOVE_TOKEN}.new"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW | os.O_CLOEXEC,
                 0o600)
    try:
        os.write(fd, token.encode())
        os.fsync(fd)
    finally:
        os.close(fd)
    os.replace(tmp, where / MOVE_TOKEN)
    return CarriedPlace(str(where), token)


def check_carried(d: object) -> CarriedPlace:
    """A move record's ``CARRIED_PLACE``, checked for form (the source host's word)."""
    if not isinstance(d, dict):
        raise StateError("the move's record names shared storage with no fields")
    path, token = d.get("path"), d.get("token")
    if not isinstance(path, str) or not path.startswith("/") or len(path) > 4096:
        raise StateError("the move's record names shared storage with no absolute path")
    if not isinstance(token, str) or len(token) != 2 * TOKEN_BYTES \
            or any(ch not in "0123456789abcdef" for ch in token):
        raise StateError("the move's record names shared storage with no token")
    return CarriedPlace(path, token)


def check_here(db: Database, vm: str, carried: CarriedPlace, host: str) -> Path:
    """At the destination, before anything is made: the place the record names is
    ``vm-NAME`` in a directory this host declared shared, and holds the very token the
    source wrote (so it is the same directory); one sentence otherwise."""
    import hmac

    where = Path(os.path.normpath(carried.path))
    refuse = f"VM {vm!r}'s files are in {where} on its host, "
    if where.name != f"vm-{vm}" or str(where) != carried.path:
        raise StateError(refuse + f"not in a directory vm-{vm} of a storage directory.")
    shared = [Path(d) for d in db.shared_storage_dirs()]
    if where.parent not in shared:
        raise StateError(refuse + f"which is not in a directory host {host} declared "
                         "shared (`fusuma storage add DIR --shared` there, for a directory "
                         "it sees too): it moves only to a host that shares its storage.")
    try:
        fd = os.open(where / MOVE_TOKEN, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError as exc:
        raise StateError(refuse + f"and host {host} cannot read the move's token there "
                         f"({exc.strerror}): the directory is not the same one on both "
                         "hosts, so the move is refused.") from exc
    try:
        st = os.fstat(fd)
        seen = os.read(fd, 4 * TOKEN_BYTES).decode(errors="replace") \
            if stat.S_ISREG(st.st_mode) else ""
    finally:
        os.close(fd)
    if not hmac.compare_digest(seen, carried.token):
        raise StateError(refuse + f"and host {host} reads another move token there: the "
                         "directory is not the same one on both hosts, so the move is "
                         "refused.")
    return where
