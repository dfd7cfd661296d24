"""A tap's queues switched between two processes the way a move switches them between
two QEMUs (``fusuma.network.queues``): planned before the pause, switched by the plan
at the decision, and refused by the plan (the caller then reads the descriptors
afresh) when a descriptor is no longer the queue it names. Real taps in a namespace
this module makes, held by real processes (``sleep``); no QEMU."""

from __future__ import annotations

import fcntl
import os
import struct
import subprocess
import threading
from collections.abc import Iterator

import pytest

from fusuma.network import link, queues
from tests.netns import netns as netns_of
from tests.stranger import enter_netns

pytestmark = pytest.mark.integration

TAP = "fzt-qtest"


@pytest.fixture
def netns() -> Iterator[str]:
    with netns_of("fzq") as ns:
        yield ns


def tap_queue(ns: str) -> int:
    """A queue of tap ``TAP`` in ``ns`` (made with the first), attached; opened from a
    thread that enters ``ns`` (setns(2) changes only the calling thread's)."""
    got: list[int | BaseException] = []

    def inside() -> None:
        try:
            enter_netns(ns)
            fd = os.open("/dev/net/tun", os.O_RDWR)
            fcntl.ioctl(fd, link.TUNSETIFF, struct.pack("16sH22x", TAP.encode(),
                                                         link.TAP_FLAGS))
            got.append(fd)
        except BaseException as exc:
            got.append(exc)

    t = threading.Thread(target=inside)
    t.start()
    t.join()
    if isinstance(got[0], BaseException):
        raise got[0]
    return got[0]


def holder(*fds: int) -> subprocess.Popen[bytes]:
    """A process holding ``fds`` at the same numbers (as a QEMU holds its taps')."""
    return subprocess.Popen(["sleep", "60"], pass_fds=fds)


@pytest.fixture
def pair(netns: str) -> Iterator[tuple[tuple[int, int], tuple[int, int]]]:
    """(source pid, its fd), (destination pid, its queue 0's fd): the source's queue
    attached, the destination's detached, as a move's prepare leaves them."""
    src_fd, dst_fd = tap_queue(netns), tap_queue(netns)
    queues.set_queue(dst_fd, attach=False)
    procs = [holder(src_fd), holder(dst_fd)]
    os.close(src_fd)
    os.close(dst_fd)
    try:
        yield (procs[0].pid, src_fd), (procs[1].pid, dst_fd)
    finally:
        for p in procs:
            p.kill()
            p.wait()


def states(pid: int) -> list[bool]:
    return [q.attached for q in queues.queues_of(pid, {TAP})]


def test_a_planned_switch_moves_the_attached_queue(
        pair: tuple[tuple[int, int], tuple[int, int]]) -> None:
    (src, src_fd), (dst, dst_fd) = pair
    plan = queues.plan([src], dst, {TAP}, {TAP: dst_fd})
    assert plan.leaving == ((src, src_fd, TAP),) and plan.arriving == ((dst, dst_fd, TAP),)
    assert (states(src), states(dst)) == ([True], [False])
    assert queues.switch(plan) is True
    assert (states(src), states(dst)) == ([False], [True])
    # Again (a recovery committing twice): the same end, no error.
    assert queues.switch(plan) is True
    assert (states(src), states(dst)) == ([False], [True])


def test_a_plan_naming_another_descriptor_is_refused_not_followed(
        pair: tuple[tuple[int, int], tuple[int, int]]) -> None:
    (src, src_fd), (dst, dst_fd) = pair
    # The destination's queue 0 is not where the plan says (say fd 0, its stdin):
    # the switch says so, and attaches nothing it was not sure of.
    wrong = queues.Switch(((src, src_fd, TAP),), ((dst, 0, TAP),))
    assert queues.switch(wrong) is False
    assert states(dst) == [False]
    # The fresh way (the caller's fallback) ends where the plan would have.
    queues.detach_all(src, {TAP})
    assert queues.attach_first(dst, {TAP: dst_fd}) == 1
    assert (states(src), states(dst)) == ([False], [True])


def test_a_leaving_process_that_ended_holds_nothing(
        pair: tuple[tuple[int, int], tuple[int, int]], netns: str) -> None:
    (_, _), (dst, dst_fd) = pair
    fd = tap_queue(netns)
    gone = holder(fd)
    os.close(fd)
    plan = queues.plan([gone.pid], dst, {TAP}, {TAP: dst_fd})
    gone.kill()
    gone.wait()
    assert queues.switch(plan) is True
    assert states(dst) == [True]
