"""QEMU's block layer as snapshots and backups read it: ``query-block`` parsed into
typed drives (their top node, format, size, internal snapshots and dirty bitmaps) and
QEMU's jobs (``query-jobs``: a snapshot's save or load, a backup's copy) awaited to
their end and dismissed; and a thin disk mirrored to another host's QEMU during a move
(libvirt's way: the destination serves its fresh overlay over NBD, the source mirrors
its top layer there with ``blockdev-mirror``, ``sync: top``, and ends the mirror once
the guest is paused before the switch).

Both answers come from a QEMU, which runs guest-driven code: each is checked against
the shape QEMU documents (a list of objects, names that are strings, sizes and counts
that are non-negative integers, a job status QEMU defines) and refused in one sentence
otherwise (:class:`QemuError`), never taken on trust. A job's failure is one sentence
too (:class:`JobFailed`), with QEMU's own words cut to one line.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
from collections.abc import Callable, Collection
from typing import Any

from fusuma.errors import ImageError, QemuError
from fusuma.frozen import frozen
from fusuma.qemu.qmp import Qmp

#: More entries than this in one answer is not a QEMU fusuma started.
MAX_ITEMS = 4096
#: QEMU's words in a sentence of fusuma's, at most this long.
MAX_WORDS = 300
#: QEMU's job states (qapi/job.json ``JobStatus``).
JOB_STATES = frozenset({"undefined", "created", "running", "paused", "ready", "standby",
                        "waiting", "pending", "aborting", "concluded", "null"})


# -- query-block ------------------------------------------------------------------------
@frozen
class DiskSnapshot:
    """One internal snapshot of a qcow2 disk, as qemu-img or QEMU lists it."""

    name: str
    vm_state_size: int          # bytes of RAM and device state (0: disk only)
    date: float                 # when it was taken (seconds since the epoch)


def parse_snapshots(items: object) -> list[DiskSnapshot]:
    """``snapshots`` of ``qemu-img info --output=json`` or of QMP ``query-block``'s
    image, checked (none listed: none)."""
    if items is None:
        return []
    if not isinstance(items, list) or len(items) > MAX_ITEMS:
        raise ImageError("the disk's snapshot table is not a list.")
    out = []
    for s in items:
        if not isinstance(s, dict) or not isinstance(s.get("name"), str):
            raise ImageError("the disk's snapshot table has an entry without a name.")
        size, sec = s.get("vm-state-size", 0), s.get("date-sec", 0)
        if type(size) is not int or type(sec) is not int or size < 0:
            raise ImageError(f"snapshot {s['name']!r} of the disk has malformed fields.")
        out.append(DiskSnapshot(s["name"], size, float(sec)))
    return out


@frozen
class Bitmap:
    """A dirty bitmap of a drive: its name, whether QEMU keeps it in the image, and
    whether it is inconsistent (its QEMU ended without saving it: it no longer says
    which clusters changed)."""

    name: str
    persistent: bool
    inconsistent: bool


@frozen
class Drive:
    """A drive with a medium as ``query-block`` shows it: its id, its top node and
    format, its size in bytes, the internal snapshots and the dirty bitmaps of its
    image."""

    id: str
    node: str
    format: str
    virtual_size: int
    snapshots: tuple[DiskSnapshot, ...]
    bitmaps: tuple[Bitmap, ...]

    def has(self, name: str) -> bool:
        """Whether its image holds internal snapshot ``name``."""
        return any(s.name == name for s in self.snapshots)

    def bitmap(self, name: str) -> Bitmap | None:
        return next((b for b in self.bitmaps if b.name == name), None)


def _refuse(what: str) -> QemuError:
    return QemuError(f"QEMU's answer to query-block is malformed: {what}.")


def _str(d: dict[str, Any], key: str, where: str, default: str | None = None) -> str:
    v = d.get(key, default)
    if not isinstance(v, str):
        raise _refuse(f"{where} has no {key} string")
    return v


def _bitmaps(items: object, where: str) -> tuple[Bitmap, ...]:
    if items is None:
        return ()
    if not isinstance(items, list) or len(items) > MAX_ITEMS:
        raise _refuse(f"{where}'s dirty-bitmaps is not a list")
    out = []
    for m in items:
        if not isinstance(m, dict):
            raise _refuse(f"{where} has a dirty bitmap that is not an object")
        name = _str(m, "name", f"a dirty bitmap of {where}")
        flags = [m.get(k, False) for k in ("persistent", "inconsistent")]
        count = m.get("count", 0)
        if any(type(f) is not bool for f in flags) or type(count) is not int or count < 0:
            raise _refuse(f"dirty bitmap {name!r} of {where} has malformed fields")
        out.append(Bitmap(name, *flags))
    return tuple(out)


def parse_block(reply: object) -> dict[str, Drive]:
    """``query-block``'s answer, checked: every drive with a medium, by id (a drive
    without one, an empty CD-ROM, is left out)."""
    if not isinstance(reply, list) or len(reply) > MAX_ITEMS:
        raise _refuse("not a list of drives")
    out: dict[str, Drive] = {}
    for b in reply:
        if not isinstance(b, dict):
            raise _refuse("a drive is not an object")
        dev = _str(b, "device", "a drive")
        ins = b.get("inserted")
        if ins is None:
            continue
        if not isinstance(ins, dict) or not isinstance(ins.get("image"), dict):
            raise _refuse(f"drive {dev!r} has a medium without an image")
        image = ins["image"]
        size = image.get("virtual-size")
        if type(size) is not int or size < 0:
            raise _refuse(f"drive {dev!r} has no size")
        if dev in out:
            raise _refuse(f"drive {dev!r} is listed twice")
        try:
            snaps = tuple(parse_snapshots(image.get("snapshots")))
        except ImageError as exc:
            raise _refuse(f"drive {dev!r}: {exc}".rstrip(".")) from exc
        # QEMU < 4.2 lists the bitmaps beside the medium, later ones in it.
        maps = ins.get("dirty-bitmaps", b.get("dirty-bitmaps"))
        out[dev] = Drive(id=dev, node=_str(ins, "node-name", f"drive {dev!r}", ""),
                         format=_str(image, "format", f"drive {dev!r}",
                                     ins.get("drv") if isinstance(ins.get("drv"), str)
                                     else None),
                         virtual_size=size, snapshots=snaps,
                         bitmaps=_bitmaps(maps, f"drive {dev!r}"))
    return out


async def drives(qmp: Qmp) -> dict[str, Drive]:
    """Every drive with a medium, by id (``query-block``, checked)."""
    return parse_block(await qmp.execute("query-block"))


# -- jobs -----------------------------------------------------------------------------
@frozen
class Job:
    """A QEMU job as ``query-jobs`` shows it (block jobs included: a backup's copy)."""

    id: str
    type: str
    status: str
    done: int                   # current-progress
    total: int                  # total-progress (an estimate: it may grow)
    error: str | None

    @property
    def concluded(self) -> bool:
        return self.status == "concluded"


class JobFailed(QemuError):
    """A QEMU job ended with an error (``job``, ``error``: QEMU's words, one line)."""

    def __init__(self, message: str, job: str, error: str) -> None:
        super().__init__(message)
        self.job = job
        self.error = error


def one_line(text: str) -> str:
    """QEMU's words as part of one of fusuma's sentences: one line, bounded."""
    line = " ".join(text.split())
    return line if len(line) <= MAX_WORDS else line[:MAX_WORDS - 1] + "…"


def parse_jobs(reply: object) -> dict[str, Job]:
    """``query-jobs``'s answer, checked, by id."""
    def refuse(what: str) -> QemuError:
        return QemuError(f"QEMU's answer to query-jobs is malformed: {what}.")

    if not isinstance(reply, list) or len(reply) > MAX_ITEMS:
        raise refuse("not a list of jobs")
    out: dict[str, Job] = {}
    for j in reply:
        if not isinstance(j, dict) or not isinstance(j.get("id"), str):
            raise refuse("a job has no id")
        jid = j["id"]
        status, kind = j.get("status"), j.get("type")
        done, total = j.get("current-progress", 0), j.get("total-progress", 0)
        err = j.get("error")
        if status not in JOB_STATES or not isinstance(kind, str):
            raise refuse(f"job {jid!r} has no known status")
        if type(done) is not int or type(total) is not int or done < 0 or total < 0:
            raise refuse(f"job {jid!r} has a malformed progress")
        if err is not None and not isinstance(err, str):
            raise refuse(f"job {jid!r} has an error that is not a string")
        if jid in out:
            raise refuse(f"job {jid!r} is listed twice")
        out[jid] = Job(jid, kind, str(status), done, total,
                       None if err is None else one_line(err))
    return out


async def jobs(qmp: Qmp, timeout: float = 30.0) -> dict[str, Job]:
    """QEMU's jobs by id (``query-jobs``, checked)."""
    return parse_jobs(await qmp.execute("query-jobs", timeout=timeout))


Progress = Callable[[int, int], None]


async def wait(qmp: Qmp, ids: Collection[str], timeout: float, what: str, *,
               missing_ok: bool = False, progress: Progress | None = None) -> None:
    """Wait until every job of ``ids`` has concluded, and dismiss each. ``what`` names
    them in a sentence ("the backup", "snapshot-save"). Raises :class:`JobFailed` for
    the first that failed (every one is dismissed first), and QemuError when QEMU no
    longer lists one (``missing_ok``: it is taken as ended; a job QEMU ran and
    dismissed on its own) or they do not end within ``timeout`` seconds.
    ``progress(done, total)``, summed over the jobs, after each look."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    delay = 0.05
    want = set(ids)
    while True:
        # A snapshot job runs in QEMU's main loop: its monitor answers only between
        # steps, or after the whole save or load.
        now = await jobs(qmp, max(30.0, deadline - loop.time()))
        lost = want - now.keys()
        if lost and not missing_ok:
            raise QemuError(f"VM {qmp.vm!r}: QEMU lost the job of {what} "
                            f"({', '.join(sorted(lost))}).")
        mine = [now[i] for i in sorted(want & now.keys())]
        if progress is not None:
            progress(sum(j.done for j in mine), sum(j.total for j in mine))
        if all(j.concluded for j in mine):
            for j in mine:
                await qmp.execute("job-dismiss", {"id": j.id})
            failed = next((j for j in mine if j.error is not None), None)
            if failed is not None and failed.error is not None:
                stop = "" if failed.error.endswith(".") else "."
                raise JobFailed(f"VM {qmp.vm!r}: {what} failed: {failed.error}{stop}",
                                failed.id, failed.error)
            return
        if loop.time() > deadline:
            raise QemuError(f"VM {qmp.vm!r}: {what} did not end within {timeout:.0f} s.")
        await asyncio.sleep(delay)
        delay = min(delay * 2, 0.5)


# -- a disk mirrored to another host's QEMU over NBD (a move between hosts) --------------
#: The name of the export the destination serves the moving guest's disk under.
EXPORT = "fusuma-disk"
#: The source's mirror job and its NBD node.
MIRROR_JOB = "fusuma-mirror"
NBD_NODE = "fusuma-nbd"
_LISTEN_FD = "fusuma-nbd-listen"


async def serve(qmp: Qmp, listen: str, node: str, tls_creds: str | None = None,
                tls_authz: str | None = None) -> int:
    """Destination: serve ``node`` writable over NBD (export :data:`EXPORT`) on a new
    port of address ``listen`` (the kernel picks it; returned), under TLS when given
    ``tls_creds`` (letting in only ``tls_authz``'s identity). QEMU activates the node
    for the export, as libvirt's incoming mirror relies on."""
    host = listen.strip("[]")
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        s.listen(8)
        port = int(s.getsockname()[1])
        await qmp.get_fd(s.fileno(), _LISTEN_FD)
    args: dict[str, Any] = {"addr": {"type": "fd", "data": {"str": _LISTEN_FD}},
                            "max-connections": 1}
    if tls_creds is not None:
        args["tls-creds"] = tls_creds
        if tls_authz is not None:
            args["tls-authz"] = tls_authz
    await qmp.execute("nbd-server-start", args)
    try:
        await qmp.execute("block-export-add", {"type": "nbd", "id": EXPORT,
                                               "node-name": node, "name": EXPORT,
                                               "writable": True})
    except QemuError:
        with contextlib.suppress(QemuError):
            await qmp.execute("nbd-server-stop")
        raise
    return port


async def stop_serving(qmp: Qmp) -> None:
    """Destination, before its guest runs: no one writes its disk from outside any
    more (the export is removed, the server stopped). Best effort on a QEMU that no
    longer has them."""
    with contextlib.suppress(QemuError):
        await qmp.execute("block-export-del", {"id": EXPORT, "mode": "hard"})
    with contextlib.suppress(QemuError):
        await qmp.execute("nbd-server-stop")


async def mirror_start(qmp: Qmp, node: str, host: str, port: int,
                       tls_creds: str | None = None, tls_hostname: str | None = None,
                       speed: int = 0) -> None:
    """Source: mirror ``node``'s top layer (``sync: top``: the destination has the
    same base) to the destination's export at ``host``:``port``, under TLS to
    ``tls_hostname`` when given ``tls_creds``; ``speed`` bytes/s at most (0: no
    limit; fault injection in tests). What an earlier move left in this QEMU (its
    supervisor killed mid-mirror) is cleared first."""
    await mirror_abort(qmp)
    nbd: dict[str, Any] = {"driver": "nbd", "node-name": NBD_NODE, "export": EXPORT,
                           "server": {"type": "inet", "host": host.strip("[]"),
                                      "port": str(port)}}
    if tls_creds is not None:
        nbd["tls-creds"] = tls_creds
        if tls_hostname:
            nbd["tls-hostname"] = tls_hostname
    await qmp.execute("blockdev-add", nbd)
    args: dict[str, Any] = {"job-id": MIRROR_JOB, "device": node, "target": NBD_NODE,
                            "sync": "top", "auto-dismiss": False}
    if speed > 0:
        args["speed"] = speed
    try:
        await qmp.execute("blockdev-mirror", args)
    except QemuError:
        with contextlib.suppress(QemuError):
            await qmp.execute("blockdev-del", {"node-name": NBD_NODE})
        raise


async def mirror_ready(qmp: Qmp, timeout: float) -> None:
    """Wait until the mirror job copied the whole top layer (QEMU says "ready": from
    then on it copies each guest write as it comes); :class:`JobFailed` if it ended
    with an error (the destination went away), QemuError if not in ``timeout``."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    delay = 0.05
    while True:
        job = (await jobs(qmp)).get(MIRROR_JOB)
        if job is None:
            raise QemuError(f"VM {qmp.vm!r}: QEMU lost the mirror of its disk.")
        if job.status == "ready":
            return
        if job.status in ("concluded", "aborting", "null"):
            await wait(qmp, [MIRROR_JOB], timeout, "the mirror of its disk")
            raise QemuError(f"VM {qmp.vm!r}: the mirror of its disk ended early.")
        if loop.time() > deadline:
            raise QemuError(f"VM {qmp.vm!r}: the mirror of its disk was not ready within "
                            f"{timeout:.0f} s.")
        await asyncio.sleep(delay)
        delay = min(delay * 2, 0.5)


async def mirror_finish(qmp: Qmp, timeout: float) -> None:
    """Source, its guest paused: end the ready mirror with the destination's disk the
    same as this one (a ``block-job-cancel`` of a ready mirror copies what is left and
    ends without switching this QEMU to the copy), then drop the NBD node."""
    await qmp.execute("block-job-cancel", {"device": MIRROR_JOB})
    await wait(qmp, [MIRROR_JOB], timeout, "the mirror of its disk")
    await qmp.execute("blockdev-del", {"node-name": NBD_NODE})


def names(reply: object, command: str, key: str, what: str) -> set[str]:
    """The ``key`` strings of an answer of QEMU's that is a list of objects
    (``command``'s, each ``what``), checked; QemuError in one sentence if malformed."""
    def refuse(why: str) -> QemuError:
        return QemuError(f"QEMU's answer to {command} is malformed: {why}.")

    if not isinstance(reply, list) or len(reply) > MAX_ITEMS:
        raise refuse("not a list")
    out = set()
    for item in reply:
        if not isinstance(item, dict) or not isinstance(item.get(key), str):
            raise refuse(f"{what} has no {key}")
        out.add(item[key])
    return out


def parse_exports(reply: object) -> set[str]:
    """``query-block-exports``'s answer, checked: the ids of the exports served."""
    return names(reply, "query-block-exports", "id", "an export")


async def serving(qmp: Qmp) -> bool:
    """Destination: whether this QEMU serves the moving guest's disk (:data:`EXPORT`).
    Asked by a supervisor that adopts an incoming QEMU another one prepared."""
    return EXPORT in parse_exports(await qmp.execute("query-block-exports"))


async def mirror_left(qmp: Qmp) -> bool:
    """Source: whether this QEMU still holds a move's mirror job (in any state: an
    earlier move's, whose supervisor was killed mid-mirror)."""
    return MIRROR_JOB in await jobs(qmp)


async def mirror_abort(qmp: Qmp) -> None:
    """Source, the move going back: end the mirror at once (what the destination got
    is thrown away with it) and drop the NBD node; best effort."""
    with contextlib.suppress(QemuError):
        await qmp.execute("block-job-cancel", {"device": MIRROR_JOB, "force": True})
    with contextlib.suppress(QemuError):
        await wait(qmp, [MIRROR_JOB], 30.0, "the mirror of its disk", missing_ok=True)
    with contextlib.suppress(QemuError):
        await qmp.execute("blockdev-del", {"node-name": NBD_NODE})
