"""Waiting for a steady state before a benchmark reads its numbers, instead of sleeping
a fixed time: memory readings that hold still (:func:`settle`), and guests whose QEMUs
have gone quiet (:func:`wait_quiet`). Both are loops over a sampler, a clock and a
sleep, so they are tested without a VM; both give up at a limit and say so.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable

from fusuma.migration import cpu_seconds

# Memory (measured here, TCG, 2 cores, 256 MiB Debian guests: the host memory held
# still within 3 MiB at the first window in every step of a `bench density --quick`
# run; page reporting starts 2 s after free memory crosses its threshold): wait
# SETTLE_MIN_S, then read every SETTLE_EVERY_S until SETTLE_WINDOW readings lie within
# max(SETTLE_TOL_MIB, SETTLE_TOL_FRAC of the total), at most SETTLE_MAX_S.
SETTLE_MIN_S = 2.0
SETTLE_EVERY_S = 1.0
SETTLE_WINDOW = 3
SETTLE_TOL_MIB = 3.0
SETTLE_TOL_FRAC = 0.005
SETTLE_MAX_S = 30.0

Clock = Callable[[], float]
Sleep = Callable[[float], None]


def settle(sample: Callable[[], float], clock: Clock = time.monotonic,
           sleep: Sleep = time.sleep, min_s: float = SETTLE_MIN_S,
           every_s: float = SETTLE_EVERY_S, window: int = SETTLE_WINDOW,
           tol_mib: float = SETTLE_TOL_MIB, tol_frac: float = SETTLE_TOL_FRAC,
           max_s: float = SETTLE_MAX_S) -> tuple[float, float, bool]:
    """Read ``sample`` until ``window`` readings in a row lie within the tolerance;
    returns (the last reading, seconds waited, whether it settled before ``max_s``)."""
    start = clock()
    sleep(min_s)
    seen: list[float] = []
    while True:
        seen.append(sample())
        last = seen[-window:]
        if len(last) == window and max(last) - min(last) <= max(tol_mib,
                                                                 tol_frac * last[-1]):
            return last[-1], round(clock() - start, 1), True
        if clock() - start >= max_s:
            return seen[-1], round(clock() - start, 1), False
        sleep(every_s)


def settle_params() -> dict[str, float]:
    """The memory settle's parameters, for a result file's meta block."""
    return {"min_s": SETTLE_MIN_S, "every_s": SETTLE_EVERY_S, "window": SETTLE_WINDOW,
            "tol_mib": SETTLE_TOL_MIB, "tol_frac": SETTLE_TOL_FRAC, "max_s": SETTLE_MAX_S}


def qemu_cpu_s(pids: Iterable[int]) -> float:
    """CPU seconds (user + system) the processes used so far, together; one that is
    gone counts 0."""
    return sum(cpu_seconds(p) for p in pids)


def wait_quiet(sample: Callable[[], float], quiet_cores: float, max_s: float,
               window_s: float = 0.5, clock: Clock = time.monotonic,
               sleep: Sleep = time.sleep) -> tuple[float, float, bool]:
    """Read the CPU seconds ``sample`` returns (e.g. :func:`qemu_cpu_s` of some VMs)
    over windows of ``window_s`` until one window used less than ``quiet_cores``
    cores. Returns (the cores the last window used, seconds waited, whether it was
    quiet before ``max_s``). Under TCG a guest whose agent already answers may still
    translate and run its last boot steps for a while, on host CPU."""
    start = clock()
    while True:
        cpu0, t0 = sample(), clock()
        sleep(window_s)
        busy = (sample() - cpu0) / max(clock() - t0, 1e-6)
        waited = round(clock() - start, 1)
        if busy < quiet_cores:
            return busy, waited, True
        if waited >= max_s:
            return busy, waited, False
