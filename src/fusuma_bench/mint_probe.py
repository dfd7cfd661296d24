"""The probe's side of `fusuma bench mint`: its arguments, its output, its summary.

Pure functions only (no process is started here), so argv and parsing are tested as
data. The probe itself is ``fusuma/guest/probe.c``; it prints one JSON line per
(test, size) with every repetition's TSC cycles, the same converted to ns with the
calibrated TSC frequency, and CLOCK_MONOTONIC ns as a cross-check.
"""

from __future__ import annotations

import json
import statistics
from collections.abc import Sequence
from typing import Any

from fusuma.errors import FusumaError
from fusuma.frozen import frozen

TESTS = ("register", "copy", "io")
GUEST_PROBE = "/usr/bin/probe"
GUEST_DISK = "/dev/vda"          # the VM's one virtio-blk disk
# The TSC-derived time of a run and CLOCK_MONOTONIC's must agree this closely, or the
# calibration (or the clock) cannot be trusted; the slack per repetition covers the
# clock_gettime calls that only the monotonic time includes.
TSC_WALL_TOLERANCE = 0.05
TSC_WALL_SLACK_NS = 50_000


class ProbeError(FusumaError):
    """The probe failed, or printed something that is not its output."""


class TscMismatch(ProbeError):
    """A run's TSC time and CLOCK_MONOTONIC's disagree: its calibration was disturbed
    (the probe preempted between its clock reads, on a loaded host) or cannot be
    trusted; the run may be repeated."""


@frozen
class ProbeParams:
    """Repetitions and loop counts; the same in every configuration of one run."""

    reps: int
    m: int                       # register increments per repetition
    n: int                       # memcpy calls per repetition and size
    # reads per repetition and size (the paper's name)
    l: int  # noqa: E741
    sizes_kib: tuple[int, ...]

    def as_json(self) -> dict[str, Any]:
        return {"reps": self.reps, "m": self.m, "n": self.n, "l": self.l,
                "sizes_kib": list(self.sizes_kib)}

    def io_slots(self) -> int:
        """Largest-size slots one io run reads; a disk with this many never serves a
        block twice in a run."""
        return self.reps * self.l * len(self.sizes_kib)


def probe_argv(binary: str, test: str, params: ProbeParams, disk: str | None = None,
               seed: int | None = None) -> list[str]:
    """The probe command line for one test."""
    if test not in TESTS:
        raise ValueError(f"unknown probe test {test!r}")
    argv = [binary, "--test", test, "--reps", str(params.reps)]
    if test == "register":
        argv += ["--m", str(params.m)]
    else:
        argv += ["--sizes", ",".join(map(str, params.sizes_kib))]
        argv += ["--n", str(params.n)] if test == "copy" else ["--l", str(params.l)]
    if test == "io":
        if disk is None:
            raise ValueError("the io test needs a disk")
        argv += ["--disk", disk, "--verify"]
    if seed is not None:
        argv += ["--seed", str(seed)]
    return argv


@frozen
class ProbeLine:
    """One (test, size) of one probe run: every repetition."""

    test: str
    size_kib: int | None
    count: int
    tsc_hz: float
    cycles: list[int]
    ns: list[int]
    wall_ns: list[int]
    fresh: bool | None = None    # io: no block was read twice in the run

    @property
    def median_ns(self) -> float:
        return float(statistics.median(self.ns))

    @property
    def median_cycles(self) -> float:
        return float(statistics.median(self.cycles))

    @property
    def tsc_vs_wall(self) -> float:
        """Sum of TSC-derived ns over monotonic ns: 1.0 when the two clocks agree."""
        wall = sum(self.wall_ns)
        return sum(self.ns) / wall if wall else float("nan")

    def summary(self) -> dict[str, Any]:
        return {"test": self.test, "size_kib": self.size_kib, "count": self.count,
                "median_ns": self.median_ns, "min_ns": min(self.ns), "max_ns": max(self.ns),
                "median_cycles": self.median_cycles, "tsc_hz": round(self.tsc_hz),
                "tsc_vs_wall": round(self.tsc_vs_wall, 4), "fresh": self.fresh,
                "ns": list(self.ns)}


def _ints(obj: dict[str, Any], key: str, reps: int) -> list[int]:
    values = obj[key]
    if not isinstance(values, list) or len(values) != reps or not all(
            isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in values):
        raise ValueError(f"{key} is not a list of {reps} non-negative integers")
    return list(values)


def parse_line(text: str) -> ProbeLine:
    """One line of probe output; ValueError when it is not one."""
    obj = json.loads(text)
    if not isinstance(obj, dict) or obj.get("probe") != 1:
        raise ValueError("not a probe line")
    test = obj["test"]
    if test not in TESTS:
        raise ValueError(f"unknown test {test!r}")
    size = obj["size_kib"]
    if (size is None) != (test == "register") or (size is not None and
                                                  (not isinstance(size, int) or size <= 0)):
        raise ValueError(f"bad size_kib {size!r} for {test}")
    reps = int(obj["reps"])
    if reps < 1:
        raise ValueError("no repetitions")
    tsc_hz = float(obj["tsc_hz"])
    if not tsc_hz > 0:
        raise ValueError("tsc_hz is not positive")
    fresh = obj.get("fresh")
    return ProbeLine(test=test, size_kib=size, count=int(obj["count"]), tsc_hz=tsc_hz,
                     cycles=_ints(obj, "cycles", reps), ns=_ints(obj, "ns", reps),
                     wall_ns=_ints(obj, "wall_ns", reps),
                     fresh=bool(fresh) if fresh is not None else None)


def parse_output(text: str, test: str, params: ProbeParams, where: str) -> list[ProbeLine]:
    """Every line of one probe run of ``test``; ProbeError unless it holds exactly the
    expected sizes with the expected repetitions and counts, and its TSC time agrees
    with CLOCK_MONOTONIC. ``where`` names the run in the error."""
    lines: list[ProbeLine] = []
    for i, raw in enumerate(text.splitlines(), start=1):
        if not raw.strip():
            continue
        try:
            lines.append(parse_line(raw))
        except (ValueError, KeyError, TypeError) as exc:
            raise ProbeError(f"the probe in {where} printed something that is not its "
                             f"output (line {i}: {exc}): {raw[:120]!r}") from exc
    want: Sequence[int | None] = [None] if test == "register" else params.sizes_kib
    count = {"register": params.m, "copy": params.n, "io": params.l}[test]
    got = [(x.test, x.size_kib, x.count, len(x.ns)) for x in lines]
    expected = [(test, s, count, params.reps) for s in want]
    if got != expected:
        raise ProbeError(f"the probe in {where} gave {got} where {expected} was expected "
                         "as (test, size_kib, count, reps).")
    for x in lines:
        wall = sum(x.wall_ns)
        if abs(sum(x.ns) - wall) > TSC_WALL_TOLERANCE * wall + TSC_WALL_SLACK_NS * len(x.ns):
            raise TscMismatch(f"the probe in {where}: {x.test} time by the TSC is "
                             f"{x.tsc_vs_wall:.3f}x CLOCK_MONOTONIC's; the TSC calibration "
                             "cannot be trusted on this machine.")
    return lines
