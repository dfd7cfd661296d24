"""``qemu-img`` on a stopped VM's qcow2 disks: internal snapshots, and growth.

A disk is a file the VM's QEMU writes, so its contents are the guest's word: qemu-img
runs as the VM's own uid (never root), with bounded memory and time, and reaches the
file only through a descriptor root opened without following a symlink
(``/dev/fd/N``). The overlay's backing file is never opened (``"backing": null``): a
snapshot lives in the overlay alone (its tables point at its own clusters; unallocated
ones read from the base, which is read-only and never changes), so neither the base
nor its directory is given to qemu-img. A running VM's disks are snapshotted by its
QEMU instead (fusuma.supervisor.snapshots).

A UEFI VM's NVRAM (its variables: boot order, keys, what the guest wrote) is a raw file,
which cannot hold internal snapshots: each snapshot keeps a copy of it
(:func:`save_nvram`, in ``snapshots/`` of the VM's directory, root's), which a restore
writes back into the VM's NVRAM file (:func:`put_nvram`) before its QEMU reads it."""

from __future__ import annotations

import json
import os
import stat
import subprocess
import time
from pathlib import Path

from fusuma.errors import HostError, ImageError
from fusuma.paths import PRIVATE_DIR
from fusuma.qemu.block import DiskSnapshot, parse_snapshots

# As for an untrusted image's probe (fusuma.images.store): bounded address space and CPU.
LIMITS = ("--as=1073741824", "--cpu=600")
TIMEOUT_S = 600.0
# A qemu-img left running by a killed supervisor holds the image's lock; how long a
# recovery waits for it.
LOCKED_WAIT_S = 60.0


def _spec(fd: int) -> str:
    return "json:" + json.dumps({"driver": "qcow2", "backing": None,
                                 "file": {"driver": "file", "filename": f"/dev/fd/{fd}"}})


def _open(path: Path, write: bool) -> int:
    try:
        return os.open(path, (os.O_RDWR if write else os.O_RDONLY) | os.O_NOFOLLOW
                       | os.O_CLOEXEC)
    except OSError as exc:
        raise HostError(f"cannot open the disk {path}: {exc.strerror}.") from exc


def run(path: Path, uid: int, args: list[str], *, write: bool,
        ok: tuple[int, ...] = (0,), after: tuple[str, ...] = ()
        ) -> subprocess.CompletedProcess[str]:
    """``qemu-img ARGS <disk> AFTER`` as ``uid`` on the disk at ``path``; one sentence if
    it fails (an exit status outside ``ok``). A disk locked by another qemu-img (one a
    killed supervisor left running) is waited for, up to :data:`LOCKED_WAIT_S`."""
    deadline = time.monotonic() + LOCKED_WAIT_S
    while True:
        fd = _open(path, write)
        try:
            # setpriv, not a preexec_fn: the supervisor calls this from a thread.
            argv = ["setpriv", f"--reuid={uid}", f"--regid={uid}", "--clear-groups",
                    "prlimit", *LIMITS, "qemu-img", *args, _spec(fd), *after]
            try:
                proc = subprocess.run(argv, capture_output=True, text=True, check=False,
                                      timeout=TIMEOUT_S, pass_fds=(fd,))
            except FileNotFoundError as exc:
                raise HostError("qemu-img is not on this host: apt-get install "
                                "qemu-utils.") from exc
            except subprocess.TimeoutExpired as exc:
                raise ImageError(f"qemu-img {args[0]} on {path} did not finish in "
                                 f"{TIMEOUT_S:.0f} s.") from exc
        finally:
            os.close(fd)
        if proc.returncode in ok:
            return proc
        if "lock" in proc.stderr and time.monotonic() < deadline:
            time.sleep(0.5)
            continue
        lines = proc.stderr.strip().splitlines()
        raise ImageError(f"qemu-img {args[0]} on {path} failed: "
                         f"{lines[-1] if lines else 'exit status ' + str(proc.returncode)}.")


def _info(path: Path, uid: int) -> dict[str, object]:
    proc = run(path, uid, ["info", "--output=json"], write=False)
    try:
        info = json.loads(proc.stdout)
    except ValueError as exc:
        raise ImageError(f"qemu-img info on {path} gave an answer fusuma cannot "
                         "read.") from exc
    if not isinstance(info, dict) or info.get("format") != "qcow2":
        raise ImageError(f"{path} is not a qcow2 disk.")
    return info


def list_(path: Path, uid: int) -> list[DiskSnapshot]:
    """The internal snapshots of the qcow2 disk at ``path``."""
    return parse_snapshots(_info(path, uid).get("snapshots"))


def size_of(path: Path, uid: int) -> int:
    """The virtual size of the qcow2 disk at ``path`` (qemu-img's word, as ``uid``)."""
    size = _info(path, uid).get("virtual-size")
    if not isinstance(size, int) or isinstance(size, bool) or size <= 0:
        raise ImageError(f"qemu-img info on {path} gave no size fusuma can read.")
    return size


def grow(path: Path, uid: int, size: int) -> None:
    """Grow the qcow2 disk at ``path`` to ``size`` bytes (never shrinks: qemu-img
    refuses to without ``--shrink``)."""
    run(path, uid, ["resize"], write=True, after=(str(size),))


def create(path: Path, uid: int, name: str) -> None:
    run(path, uid, ["snapshot", "-c", name], write=True)


def apply(path: Path, uid: int, name: str) -> None:
    """Revert the disk to snapshot ``name`` (the same result however often it runs)."""
    run(path, uid, ["snapshot", "-a", name], write=True)


def delete(path: Path, uid: int, name: str) -> None:
    run(path, uid, ["snapshot", "-d", name], write=True)


def repair(path: Path, uid: int) -> str | None:
    """Make the disk's metadata whole after a writer was killed in the middle of an
    internal snapshot; what was repaired (None: it was clean).

    QEMU creates a snapshot by raising the refcount of every cluster the disk uses,
    clearing their "copied" flags and only then writing the snapshot's entry; killed
    in between, it leaves refcounts one too high and flags out of step (``qemu-img
    check``: ERROR OFLAG_COPIED, leaked clusters), and killed while it wrote the memory
    state, clusters allocated for it and never referenced. Neither touches the guest's
    data: ``qemu-img check -r`` recomputes refcounts and flags from the tables that map
    it. Only leaks: ``-r leaks``; anything else: ``-r all``, after which the check must
    be clean."""
    # Exit status 0: clean; 2: errors; 3: only leaked clusters.
    found = run(path, uid, ["check"], write=False, ok=(0, 2, 3))
    if found.returncode == 0:
        return None
    mode = "leaks" if found.returncode == 3 else "all"
    fixed = run(path, uid, ["check", "-r", mode], write=True, ok=(0,))
    lines = [ln for ln in fixed.stdout.strip().splitlines() if ln.strip()]
    return f"-r {mode}: " + ("; ".join(ln for ln in lines if "fixed" in ln.lower())
                             or (lines[-1] if lines else "repaired"))


# -- a UEFI VM's NVRAM ---------------------------------------------------------------
NVRAM_MAX = 64 << 20


def _read_nvram(path: Path) -> bytes:
    """The NVRAM file's bytes (a regular file, not followed if a link; a few MiB at
    most: OVMF's variable store)."""
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_size > NVRAM_MAX:
            raise HostError(f"{path} is not an NVRAM file (a regular file of at most "
                            f"{NVRAM_MAX >> 20} MiB).")
        with os.fdopen(os.dup(fd), "rb") as f:
            return f.read()
    finally:
        os.close(fd)


def save_nvram(nvram: Path, copy: Path) -> None:
    """Keep the NVRAM file ``nvram`` as ``copy`` (root's, 0600): written whole to a
    temporary name and renamed, so a copy that exists is complete."""
    data = _read_nvram(nvram)
    copy.parent.mkdir(mode=PRIVATE_DIR, exist_ok=True)
    tmp = copy.with_name(copy.name + ".part")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW | os.O_CLOEXEC,
                 0o600)
    with os.fdopen(fd, "wb") as f:           # writes it whole, or raises
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, copy)


def put_nvram(copy: Path, nvram: Path, uid: int) -> bool:
    """Put the kept ``copy`` in place of the VM's NVRAM file ``nvram``, owned by the
    VM's ``uid`` (0600), by a rename, so a kill leaves the old file or the new one,
    never half of each; False when there is no copy (a snapshot taken before fusuma
    kept them). Its QEMU must not be running."""
    try:
        data = _read_nvram(copy)
    except FileNotFoundError:
        return False
    tmp = copy.parent / f"{copy.name}.restore"   # on the same file system, removed with it
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW | os.O_CLOEXEC,
                 0o600)
    with os.fdopen(fd, "wb") as f:           # writes it whole, or raises
        os.fchown(fd, uid, uid)
        f.write(data)
        f.flush()
        os.fsync(fd)
    os.replace(tmp, nvram)
    return True


def drop_nvram(copy: Path) -> None:
    """Remove a snapshot's NVRAM copy (and a partial one), if any."""
    for p in (copy, copy.with_name(copy.name + ".part")):
        p.unlink(missing_ok=True)
