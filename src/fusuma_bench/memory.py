"""`fusuma bench memory`: memory as a governed resource (issue 28), in two parts.

**fit**: for each sharing mode of `bench density` (fusuma_bench.density: none, ksm,
template, template+ksm; the segment modes share a root filesystem that the minimal
image does not have, so they are skipped and say so) and each memory overcommit of
OVERCOMMITS, how many burstable minimal guests (RAM ``memory_mib``, floor
``floor_mib``) fusuma *admits* within a host memory budget, and how many of them
actually *run* within it. fusuma is made to see a host of the budget's size: a
guaranteed VM that is defined and never started (the ballast) holds the rest of the
host's room, and the scratch partition grows by each VM's share before the VM is
defined. So "admitted" is fusuma's own answer (a `partition resize` and a `vm create`
accepted or refused, the refusal's sentence kept), set beside the arithmetic of
fusuma.capacity (:func:`admits`). "Running" is measured as `bench density` measures:
each admitted VM is started (ready when its guest agent answers), the host memory in
use is read once it has settled (fusuma.memshare.footprint: the QEMUs' own memory plus
the RAM files once), and the first VM that takes it past the budget is stopped again
(it stays defined: admitted, not running). The overcommits are tried in rising order
on the same partition (raising an overcommit never refuses a VM already admitted), so
each mode boots its guests once.

**burst**: burstable guests in a partition at overcommit 2 on one core, a guaranteed
guest in a partition of its own on the other (as the lab test of issue 28,
tests/integration/test_memory_growth.py). Once they are up, the governor's target of
free memory (FUSUMA_MEMORY_TARGET_FREE_MIB, the supervisors restarted with it) is set
TARGET_MARGIN_MIB under what the host has free: the guests' growth, not a made-up
number, makes the host short. Each burstable guest writes ``burst_mib`` into its tmpfs
(memory it allocates and touches; its RAM file takes it on the host); the governor
trims, then balloons them toward their floors; when it has nothing left to take (or
after HOLD_MAX_S) the guests free what they wrote, and the governor's decision log
says when the host is back over its target (its ``recovered`` decision). Measured:
the host's shortage from the governor's first short decision to ``recovered``
(``short_s``), from the release to ``recovered`` (``release_to_recovered_s``), the
steps taken, and the guaranteed guest's speed: a CPU-bound loop timed by the guest's
clock, the median of the runs during the burst against the median of the runs alone
before and after it, in the same run.

This module holds the configuration and the pure parts (the fitting arithmetic, the
burst's figures from a decision log, the targets); the runs are
fusuma_bench.memory_fit and fusuma_bench.memory_burst.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from fusuma.capacity import SUPERVISOR_MIB, guest_ram, partition_share
from fusuma.errors import ResourceError
from fusuma.frozen import frozen
from fusuma.state import VmRecord
from fusuma_bench.density import MODES as DENSITY_MODES

PARTS = ("fit", "burst")
OVERCOMMITS = (1.0, 1.5, 2.0)
FIT_MODES = tuple(m for m in DENSITY_MODES if "segment" not in m)
SEGMENT_SKIP = ("skipped: a segment shares a root filesystem, and the minimal image has "
                "none (its root is its initramfs); `bench density` measures the segment "
                "modes with Debian guests")
DEFAULT_BUDGET_MIB = 4096
QUICK_BUDGET_MIB = 2048
MEMORY_MIB = 1024          # a fit guest's RAM: large against its QEMU, as a real guest's
FLOOR_MIB = 128
MAX_VMS = 24               # VMs defined per mode, whatever the budget
BALLAST = "bench-memory-ballast"
# The burst (the lab test's figures: its step is 25% of the RAM, 96 MiB a tick).
BURST_PARTITION = "bench-memory-burst"
GUARANTEED_PARTITION = "bench-memory-g"
GUARANTEED = "bench-memory-g0"
BURST_PREFIX = "bench-memory-b"
BURST_RAM_MIB, BURST_FLOOR_MIB, GUARANTEED_RAM_MIB = 384, 224, 192
BURST_VMS = 2
BURST_MIB = 128            # written by each burstable guest
QUICK_BURST_MIB = 96
TARGET_MARGIN_MIB = 64     # the target: this much under what the host has free
RUNS = 5                   # timed loops alone before, and again after
QUICK_RUNS = 3
LOOP_ITERATIONS = 12000    # 0.2-0.6 s of the guest's time under TCG here (idle to loaded)
HOLD_MAX_S = 60.0          # the burst is released at the latest after this
RECOVER_MAX_S = 60.0       # ... and the host must be back within this of the release
TARGET_SPEED = 0.95        # the guaranteed guest's speed beside the burst, of alone
TARGET_RECOVER_S = 10.0    # release to the governor's `recovered`

Progress = Callable[[str], None]


@frozen
class Config:
    parts: tuple[str, ...] = PARTS
    budget_mib: int = DEFAULT_BUDGET_MIB
    modes: tuple[str, ...] = FIT_MODES
    overcommits: tuple[float, ...] = OVERCOMMITS
    memory_mib: int = MEMORY_MIB
    floor_mib: int = FLOOR_MIB
    max_vms: int = MAX_VMS
    qemu: str = "auto"
    burst_vms: int = BURST_VMS
    burst_mib: int = BURST_MIB
    runs: int = RUNS
    hold_s: float = HOLD_MAX_S
    quick: bool = False


def parse_overcommits(text: str | None) -> tuple[float, ...]:
    """``1,2`` -> (1.0, 2.0), rising, each in [1, 16]."""
    if not text:
        return OVERCOMMITS
    try:
        got = sorted({float(t) for t in text.split(",") if t.strip()})
    except ValueError:
        got = []
    if not got or any(not 1.0 <= o <= 16.0 for o in got):
        raise ResourceError(f"{text!r} is not a list of overcommits between 1 and 16, "
                            "e.g. 1,1.5,2.")
    return tuple(got)


# -- fit: the arithmetic -------------------------------------------------------------------
def fit_vm(mode: str, memory_mib: int, floor_mib: int, overhead_mib: int) -> VmRecord:
    """The VMs a fit mode defines, as fusuma records them: burstable with a floor; RAM in
    a shared file, or private (KSM, a template's clone)."""
    private = "ksm" in mode or mode.startswith("template")
    return VmRecord(name="fit", partition="fit", vcpus=1, memory_mib=memory_mib,
                    accel="auto", overhead_mib=overhead_mib, shared_ram=not private,
                    memory_class="burstable", memory_min=floor_mib)


def admits(budget_mib: int, vm: VmRecord, overcommit: float, fixed_mib: int = 0,
           cap: int | None = None) -> int:
    """How many VMs like ``vm`` fusuma admits on a host that gives ``budget_mib`` (its
    partitions' budgets plus guest RAM, fusuma.capacity): each costs its partition share
    (its QEMU's overhead; its RAM too when private) and its admitted guest RAM at
    ``overcommit``; the partition's supervisor and ``fixed_mib`` (a template's RAM) come
    first. At most ``cap``."""
    each = partition_share(vm) + guest_ram(vm, overcommit)
    n = max(0, (budget_mib - SUPERVISOR_MIB - fixed_mib) // each)
    return n if cap is None else min(n, cap)


@frozen
class OvercommitFit:
    """One overcommit of one mode: the VMs fusuma admitted, the VMs running within the
    budget, the host memory they used, why admission stopped."""

    overcommit: float
    admitted: int
    running: int
    host_mib: float | None
    stop: str                 # admission | cap
    refusal: str | None = None

    def as_json(self, computed: int) -> dict[str, Any]:
        return {"overcommit": self.overcommit, "admitted_vms": self.admitted,
                "admitted_vms_computed": computed, "running_vms": self.running,
                "host_mib": self.host_mib, "stop": self.stop, "refusal": self.refusal}


# -- burst: figures from the decision log ----------------------------------------------------
def median(xs: Sequence[float]) -> float | None:
    return round(statistics.median(xs), 4) if xs else None


def speed_ratio(alone: Sequence[float], during: Sequence[float]) -> float | None:
    """The guaranteed guest's speed during the burst, of its speed alone: the median
    loop time alone over the median during (1.0: unchanged)."""
    a, d = median(alone), median(during)
    return None if not a or not d else round(a / d, 4)


def episode(decisions: Sequence[Mapping[str, Any]], since: float,
            released: float | None) -> dict[str, Any]:
    """The shortage in a partition's decision log that began after ``since`` (wall-clock
    seconds): its first short decision, the steps taken until the governor's
    ``recovered``, and the times between. A shortage that never ended has no
    ``recovered_at`` (and no times that need it)."""
    after = sorted((d for d in decisions if d["at"] >= since), key=lambda d: d["at"])
    short = [d for d in after if d["action"] != "recovered"]
    first = short[0]["at"] if short else None
    rec = next((d for d in after if d["action"] == "recovered"
                and first is not None and d["at"] >= first), None)
    steps = [d for d in short if rec is None or d["at"] <= rec["at"]]
    counts: dict[str, int] = {}
    for d in steps:
        counts[d["action"]] = counts.get(d["action"], 0) + 1

    def since_(t: float | None, t0: float | None) -> float | None:
        return None if t is None or t0 is None else round(t - t0, 2)

    rec_at = rec["at"] if rec else None
    return {"first_short_at": first, "recovered_at": rec_at,
            "burst_to_short_s": since_(first, since),
            "short_s": rec["numbers"].get("short_s") if rec else None,
            "release_to_recovered_s": since_(rec_at, released),
            "burst_to_recovered_s": since_(rec_at, since),
            "steps": counts, "host_free_min_mib": min(
                (d["numbers"]["host_free_mib"] for d in steps
                 if d["numbers"].get("host_free_mib") is not None), default=None),
            "target_free_mib": steps[0]["numbers"].get("target_free_mib") if steps
            else None}


def targets(data: Mapping[str, Any]) -> list[tuple[str, str, bool | None]]:
    """(target, measured, met) rows; met None: not measured in this result."""
    out: list[tuple[str, str, bool | None]] = []
    b = data.get("burst")
    name = f"guaranteed guest keeps >= {TARGET_SPEED:.0%} of its speed during the burst"
    r = None if not b or "failed" in b else b.get("speed_ratio")
    out.append((name, "–" if r is None else f"{r:.1%}", None if r is None
                else r >= TARGET_SPEED))
    name = f"host back over its target <= {TARGET_RECOVER_S:g} s after the release"
    ep = None if not b or "failed" in b else b.get("episode")
    if b is None or ep is None:
        out.append((name, "–", None))
    elif ep.get("first_short_at") is None:
        out.append((name, f"– (the host was never short: least free "
                    f"{b.get('host_free_seen_min_mib')} MiB, target "
                    f"{b.get('target_free_mib')} MiB)", None))
    elif ep.get("release_to_recovered_s") is None:
        out.append((name, "never back within the run", False))
    else:
        s = ep["release_to_recovered_s"]
        out.append((name, f"{s} s (short {ep['short_s']} s in all)", s <= TARGET_RECOVER_S))
    name = "the host's OOM killer never ran"
    oom = None if not b or "failed" in b else b.get("oom_kills")
    out.append((name, "–" if oom is None else str(oom), None if oom is None else oom == 0))
    name = "admitted VMs grow with the overcommit (shared-RAM mode none)"
    none = next((m for m in data.get("fit", []) if m["mode"] == "none" and m["overcommits"]),
                None)
    if none is None or len(none["overcommits"]) < 2:
        out.append((name, "–", None))
    else:
        ns = [o["admitted_vms"] for o in none["overcommits"]]
        out.append((name, " -> ".join(str(n) for n in ns), ns[-1] > ns[0]))
    return out
