"""A tap's queues across a move on one host: which QEMU's queues the kernel steers
frames to, switched by root at the move's decision.

A NIC's tap (``fusuma.network.link``) is multiqueue. A move's destination QEMU gets
queues of its own on the same device (``link.join_tap``), so the bridge port, the
filter rules, the lease and the guest's TCP connections never change; what changes
at the decision is which QEMU's queues are attached. The kernel knows each queue's
state (``TUNGETIFF`` answers ``IFF_DETACH_QUEUE`` for a detached one; ``fdinfo``'s
``iff:`` names the tap either way), so root asks the kernel, through a duplicate of
the QEMU's own descriptor (``pidfd_getfd``), never QEMU.

What QEMU does itself (7.2 and 10.0, ``net/tap.c``, ``hw/net/virtio-net.c``): each
tap queue starts "enabled" in QEMU's mind whatever the kernel says, and QEMU only
calls ``TUNSETQUEUE`` when its own idea changes; with several queues it disables
queues 1.. at reset or load and enables those the guest uses, and asserts that the
kernel agreed (a queue detached behind its back aborts it); queue 0, and the single
queue of a one-queue NIC, it never touches. So root detaches only the destination's
queue 0 before its QEMU starts (no frame of an established flow waits in a paused
QEMU), attaches it at the decision "forward" and detaches the source's queues then
(the source never runs again): never a queue QEMU itself switches.

A second QEMU on a tap also sets the device's virtio-net header size to its own
default while it starts (the size is the device's, not a queue's), under the source
that still runs the guest: ``restore_header`` puts the source's size back as soon as
the new QEMU is up.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import errno
import fcntl
import os
import struct
from collections.abc import Iterator
from pathlib import Path

from fusuma.errors import NetworkError
from fusuma.frozen import frozen

TUNGETIFF = 0x800454D2
TUNSETQUEUE = 0x400454D9
TUNGETVNETHDRSZ = 0x800454D7
TUNSETVNETHDRSZ = 0x400454D8
IFF_ATTACH_QUEUE = 0x0200
IFF_DETACH_QUEUE = 0x0400
SYS_PIDFD_GETFD = 438
TUN_PATH = "/dev/net/tun"

_libc = ctypes.CDLL(None, use_errno=True)


@frozen
class Queue:
    """One tap descriptor a process holds: its number there, the tap, its state."""

    fd: int
    tap: str
    attached: bool


def _ifreq(flags: int = 0) -> bytes:
    return struct.pack("16sH22x", b"", flags)


def get_iff(fd: int) -> tuple[str, bool]:
    """The tap a descriptor is a queue of, and whether that queue is attached."""
    name, flags = struct.unpack("16sH22x", fcntl.ioctl(fd, TUNGETIFF, bytes(40)))
    return name.rstrip(b"\0").decode(), not flags & IFF_DETACH_QUEUE


def set_queue(fd: int, attach: bool) -> bool:
    """Attach or detach the queue ``fd`` is; False if it already was."""
    try:
        fcntl.ioctl(fd, TUNSETQUEUE, _ifreq(IFF_ATTACH_QUEUE if attach
                                            else IFF_DETACH_QUEUE))
    except OSError as exc:
        if exc.errno == errno.EINVAL and get_iff(fd)[1] == attach:
            return False
        raise NetworkError(f"cannot {'attach' if attach else 'detach'} a queue of tap "
                           f"{get_iff(fd)[0]}: {exc.strerror}.") from exc
    return True


def header_size(fd: int) -> int:
    """The tap's virtio-net header size (the device's, whichever queue asks)."""
    return int(struct.unpack("i", fcntl.ioctl(fd, TUNGETVNETHDRSZ, bytes(4)))[0])


def set_header_size(fd: int, size: int) -> None:
    fcntl.ioctl(fd, TUNSETVNETHDRSZ, struct.pack("i", size))


@contextlib.contextmanager
def _pidfd(pid: int) -> Iterator[int | None]:
    try:
        pfd = os.pidfd_open(pid)
    except ProcessLookupError:
        yield None
        return
    try:
        yield pfd
    finally:
        os.close(pfd)


def _getfd(pfd: int, fd: int) -> int | None:
    """A duplicate of descriptor ``fd`` of the process behind ``pfd`` (the same open
    file, so the same queue); None if it has no such descriptor any more."""
    got = _libc.syscall(SYS_PIDFD_GETFD, pfd, fd, 0)
    if got < 0:
        err = ctypes.get_errno()
        if err in (errno.EBADF, errno.ESRCH):
            return None
        raise NetworkError(f"cannot reach descriptor {fd} of a QEMU: {os.strerror(err)}.")
    return int(got)


def _tun_fds(pid: int) -> list[int]:
    out = []
    with contextlib.suppress(OSError):
        for name in os.listdir(f"/proc/{pid}/fd"):
            with contextlib.suppress(OSError):
                if os.readlink(f"/proc/{pid}/fd/{name}") == TUN_PATH:
                    out.append(int(name))
    return sorted(out)


@contextlib.contextmanager
def _held(pid: int, taps: set[str]) -> Iterator[list[tuple[int, int, str, bool]]]:
    """Duplicates of ``pid``'s queues of ``taps``: (its fd, our fd, tap, attached)."""
    mine: list[tuple[int, int, str, bool]] = []
    with _pidfd(pid) as pfd:
        try:
            if pfd is not None:
                for fd in _tun_fds(pid):
                    dup = _getfd(pfd, fd)
                    if dup is None:
                        continue
                    try:
                        tap, attached = get_iff(dup)
                    except OSError:
                        os.close(dup)
                        continue
                    if tap not in taps:
                        os.close(dup)
                        continue
                    mine.append((fd, dup, tap, attached))
            yield mine
        finally:
            for _, dup, _, _ in mine:
                os.close(dup)


def queues_of(pid: int, taps: set[str]) -> list[Queue]:
    """The queues of ``taps`` that process ``pid`` holds, as the kernel sees them."""
    with _held(pid, taps) as held:
        return [Queue(fd, tap, attached) for fd, _, tap, attached in held]


def detach_all(pid: int, taps: set[str]) -> int:
    """Detach every queue of ``taps`` that ``pid`` holds (a move's source once the
    guest is decided to run elsewhere); how many were attached."""
    n = 0
    with _held(pid, taps) as held:
        for _, dup, _, attached in held:
            if attached and set_queue(dup, attach=False):
                n += 1
    return n


def attach_first(pid: int, firsts: dict[str, int]) -> int:
    """Attach queue 0 of each tap in ``firsts`` (tap -> the descriptor number ``pid``
    has it as): the queue QEMU never switches itself. How many it attached."""
    n = 0
    with _held(pid, set(firsts)) as held:
        for fd, dup, tap, attached in held:
            if firsts.get(tap) == fd and not attached and set_queue(dup, attach=True):
                n += 1
    return n


@frozen
class Switch:
    """A handover worked out before a move's pause: the descriptor numbers of every
    queue the leaving QEMUs hold of the VM's taps, and of each tap's queue 0 in the
    arriving QEMU, each as (pid, fd, tap). ``switch`` acts on exactly these, so the
    pause pays for a few system calls, not for reading every descriptor of two QEMUs."""

    leaving: tuple[tuple[int, int, str], ...]
    arriving: tuple[tuple[int, int, str], ...]

    @property
    def taps(self) -> set[str]:
        return {tap for _, _, tap in self.leaving + self.arriving}


def plan(leaving: list[int], arriving: int, taps: set[str], firsts: dict[str, int]
         ) -> Switch:
    """The handover from the QEMUs ``leaving`` to ``arriving`` (whose queue 0 of each
    tap is descriptor ``firsts[tap]``), as the kernel sees them now."""
    return Switch(tuple((pid, q.fd, q.tap) for pid in leaving for q in queues_of(pid, taps)),
                  tuple((arriving, fd, tap) for tap, fd in sorted(firsts.items())
                        if tap in taps))


def _switch_one(pid: int, fds: list[tuple[int, str]], attach: bool) -> bool:
    """Set each planned queue of ``pid``; False (having changed nothing more) at the
    first descriptor that is not the queue the plan names."""
    with _pidfd(pid) as pfd:
        if pfd is None:
            return not attach       # a leaving QEMU that is gone holds no queue
        for fd, tap in fds:
            dup = _getfd(pfd, fd)
            if dup is None:
                return False
            try:
                name, attached = get_iff(dup)
                if name != tap:
                    return False
                if attached != attach:
                    set_queue(dup, attach=attach)
            except OSError:
                return False
            finally:
                os.close(dup)
    return True


def switch(s: Switch) -> bool:
    """Detach the leaving QEMUs' queues and attach the arriving one's queue 0, as
    ``s`` planned. True if every descriptor was the queue the plan says; False if one
    was not (a QEMU ended or changed meanwhile): the caller then hands over by reading
    the QEMUs' descriptors afresh (``detach_all``, ``attach_first``), which is
    idempotent over whatever this did."""
    by_pid: dict[tuple[int, bool], list[tuple[int, str]]] = {}
    for pid, fd, tap in s.leaving:
        by_pid.setdefault((pid, False), []).append((fd, tap))
    for pid, fd, tap in s.arriving:
        by_pid.setdefault((pid, True), []).append((fd, tap))
    # Every leaving queue first: never two QEMUs' queues attached at once.
    order = sorted(by_pid, key=lambda k: k[1])
    return all(_switch_one(pid, by_pid[(pid, attach)], attach) for pid, attach in order)


def restore_header(pid: int, sizes: dict[str, int]) -> None:
    """Put each tap's virtio-net header size back to ``sizes[tap]`` (what the source
    QEMU uses), through one of ``pid``'s queues of it."""
    with _held(pid, set(sizes)) as held:
        done: set[str] = set()
        for _, dup, tap, _ in held:
            if tap not in done and header_size(dup) != sizes[tap]:
                set_header_size(dup, sizes[tap])
            done.add(tap)


class HeaderHold:
    """Each tap's virtio-net header size kept at the running QEMU's while a second QEMU
    of the VM builds its machine: that QEMU's tap setup and its virtio-net's realize
    each set the device's size to their default under the running guest, and every
    frame either way is misread (lost) until it is back: measured 44-57 ms a start on
    a quiet host, more than a move's downtime. ``start`` checks every ``interval``
    seconds, through duplicates of the running QEMU's own queues taken once, and puts
    the size back; ``stop`` (idempotent) ends that and closes them."""

    def __init__(self, pid: int, sizes: dict[str, int], interval: float = 0.001) -> None:
        self.sizes = sizes
        self.interval = interval
        self.fixed = 0           # how many times a size was put back
        self._stack = contextlib.ExitStack()
        self._fds: dict[str, int] = {}
        self._task: asyncio.Task[None] | None = None
        # Best effort: without the running QEMU's queues (it ended), nothing is held and
        # the caller's ``restore_header`` is what there is.
        with contextlib.suppress(NetworkError, OSError):
            if sizes:
                for _, dup, tap, _ in self._stack.enter_context(_held(pid, set(sizes))):
                    self._fds.setdefault(tap, dup)

    def fix(self) -> None:
        for tap, dup in self._fds.items():
            with contextlib.suppress(OSError):
                if header_size(dup) != self.sizes[tap]:
                    set_header_size(dup, self.sizes[tap])
                    self.fixed += 1

    async def _run(self) -> None:
        while True:
            self.fix()
            await asyncio.sleep(self.interval)

    def start(self) -> None:
        if self._fds and self._task is None:
            self._task = asyncio.ensure_future(self._run())

    def stop(self) -> None:
        """A last check (a new QEMU that ended after setting the size leaves the guest
        on the running QEMU with the right one), then nothing more."""
        if self._task is not None:
            self._task.cancel()
        self.fix()
        self._stack.close()
        self._fds = {}


def first_fds(cmdline: bytes) -> dict[str, int]:
    """The descriptor number of each NIC's queue 0 in a QEMU's argv (``-netdev
    tap,id=nicN,fd=K`` or ``fds=K:L``), by netdev id."""
    out: dict[str, int] = {}
    for arg in cmdline.split(b"\0"):
        text = arg.decode(errors="replace")
        if not text.startswith("tap,id="):
            continue
        opts = dict(o.partition("=")[::2] for o in text.split(","))
        first = (opts.get("fd") or opts.get("fds") or "").split(":")[0]
        if first.isdigit():
            out[opts["id"]] = int(first)
    return out


def argv_of(pid: int) -> bytes:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return b""


def header_sizes(pid: int, taps: set[str]) -> dict[str, int]:
    """Each tap's virtio-net header size, read through ``pid``'s queues of it."""
    with _held(pid, taps) as held:
        return {tap: header_size(dup) for _, dup, tap, _ in held}

