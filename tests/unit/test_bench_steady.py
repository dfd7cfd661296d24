"""Waiting for a steady state (fusuma_bench.steady) on a fake clock: memory readings
that hold still, and guests' CPU that goes quiet."""

from __future__ import annotations

import os

from fusuma_bench import steady


class FakeClock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t

    def sleep(self, s: float) -> None:
        self.t += s


def test_settle_waits_for_readings_that_hold_still() -> None:
    clock = FakeClock()
    readings = iter([300.0, 250.0, 230.0, 229.0, 230.5, 231.0, 500.0])
    value, waited, ok = steady.settle(lambda: next(readings), clock, clock.sleep,
                                      min_s=3, every_s=1, window=3, tol_mib=3,
                                      tol_frac=0.0, max_s=30)
    assert ok and value == 230.5 and waited == 7.0   # 3 s, then 230, 229, 230.5


def test_settle_gives_up_at_its_limit_and_says_so() -> None:
    clock = FakeClock()
    ramp = iter(range(100, 10_000, 50))
    value, waited, ok = steady.settle(lambda: float(next(ramp)), clock, clock.sleep,
                                      min_s=3, every_s=1, max_s=10)
    assert not ok and waited == 10.0 and value == 100 + 7 * 50


def test_quiet_waits_for_a_window_under_the_limit() -> None:
    clock = FakeClock()
    # CPU seconds read at the start and end of each 0.5 s window: 1.0, 0.8, then 0.02
    # cores
    readings = iter([0.0, 0.5, 0.5, 0.9, 0.9, 0.91, 5.0])
    busy, waited, ok = steady.wait_quiet(lambda: next(readings), quiet_cores=0.1,
                                         max_s=20, window_s=0.5, clock=clock,
                                         sleep=clock.sleep)
    assert ok and waited == 1.5 and abs(busy - 0.02) < 1e-9


def test_quiet_gives_up_at_its_limit_and_says_how_busy() -> None:
    clock = FakeClock()
    cpu = iter(x * 0.5 for x in range(1000))       # one core, always
    busy, waited, ok = steady.wait_quiet(lambda: next(cpu), quiet_cores=0.5, max_s=3,
                                         window_s=1.0, clock=clock, sleep=clock.sleep)
    assert not ok and waited == 3.0 and busy == 0.5


def test_qemu_cpu_counts_this_process_and_nothing_for_a_gone_one() -> None:
    mine = steady.qemu_cpu_s([os.getpid()])
    assert mine > 0
    assert steady.qemu_cpu_s([os.getpid(), 2**22 + 7]) >= mine
