"""A tap's virtio-net header size is held at the running QEMU's while a move's second
QEMU builds its machine (``fusuma.network.queues.HeaderHold``).

In the lab (tests/integration/test_network_moves.py, a watcher reading the tap's size
every 0.5 ms beside the 1 ms ping): each new QEMU of a same-host move set the size
from 12 to 10 under the running guest until the supervisor's ``restore_header`` after
its QMP handshake, 44-57 ms a start on a quiet host, and the ping lost exactly that
window, more than the downtime; under load one in-place move lost 296 ms in a row.
Here a fake tap (its size a number) and a fake QEMU that sets it as QEMU's start does."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Iterator
from typing import Any

import pytest

from fusuma.errors import NetworkError
from fusuma.network import queues


class FakeTaps:
    """Tap name -> header size; descriptors 100+ are duplicates of its queues."""

    def __init__(self, **sizes: int) -> None:
        self.size = dict(sizes)
        self.by_fd = {100 + i: tap for i, tap in enumerate(sorted(sizes))}
        self.open_dups = 0

    @contextlib.contextmanager
    def held(self, pid: int, taps: set[str]) -> Iterator[list[tuple[int, int, str, bool]]]:
        self.open_dups += len(self.by_fd)
        try:
            yield [(3 + i, fd, tap, True) for i, (fd, tap) in enumerate(self.by_fd.items())
                   if tap in taps]
        finally:
            self.open_dups -= len(self.by_fd)


@pytest.fixture
def taps(monkeypatch: pytest.MonkeyPatch) -> FakeTaps:
    t = FakeTaps(**{"fzt-1-0": 12, "fzt-1-1": 12})
    monkeypatch.setattr(queues, "_held", t.held)
    monkeypatch.setattr(queues, "header_size", lambda fd: t.size[t.by_fd[fd]])
    monkeypatch.setattr(queues, "set_header_size",
                        lambda fd, n: t.size.__setitem__(t.by_fd[fd], n))
    return t


def test_a_size_the_new_qemu_sets_is_put_back_within_milliseconds(taps: FakeTaps) -> None:
    async def main() -> tuple[list[float], int]:
        hold = queues.HeaderHold(4242, dict(taps.size))
        hold.start()
        loop = asyncio.get_running_loop()
        wrong_for = []
        for _ in range(3):         # QEMU's tap setup, then its virtio-net's realize, ...
            taps.size["fzt-1-0"] = 10
            t0 = loop.time()
            while taps.size["fzt-1-0"] != 12:
                await asyncio.sleep(0)
            wrong_for.append(loop.time() - t0)
            await asyncio.sleep(0.005)
        taps.size["fzt-1-1"] = 10  # set just before the stop: its last check
        hold.stop()
        hold.stop()                # idempotent
        taps.size["fzt-1-1"] = 10  # after stop: nothing holds it any more
        await asyncio.sleep(0.01)
        return wrong_for, hold.fixed
    wrong_for, fixed = asyncio.run(main())
    assert fixed == 4 and max(wrong_for) < 0.05, wrong_for
    assert taps.size == {"fzt-1-0": 12, "fzt-1-1": 10}
    assert taps.open_dups == 0      # the duplicates are closed at stop


def test_without_the_running_qemus_queues_nothing_is_held(
        taps: FakeTaps, monkeypatch: pytest.MonkeyPatch) -> None:
    def gone(pid: int, names: set[str]) -> Any:
        raise NetworkError("cannot reach descriptor 31 of a QEMU: No such process.")
    monkeypatch.setattr(queues, "_held", gone)

    async def main() -> int:
        hold = queues.HeaderHold(4242, {"fzt-1-0": 12})
        hold.start()
        taps.size["fzt-1-0"] = 10
        await asyncio.sleep(0.01)
        hold.stop()
        return hold.fixed
    assert asyncio.run(main()) == 0 and taps.size["fzt-1-0"] == 10
    # No tap at all: nothing to hold, no task.
    assert asyncio.run(_started_task(queues.HeaderHold(4242, {}))) is False


async def _started_task(hold: queues.HeaderHold) -> bool:
    hold.start()
    running = hold._task is not None
    hold.stop()
    return running
