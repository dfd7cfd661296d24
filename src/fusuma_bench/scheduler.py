"""`fusuma bench scheduler`: the dummy-VM experiment of the KVM scheduler study
(papers README §2) on fusuma, with the governor as one of the policies.

A 1-vCPU target VM runs a small UnixBench-like mix in the guest while 0..16 dummy VMs
(128 MiB, like the paper's Puppy Linux) run beside it on the host's first two cores,
either idle after boot or CPU-bound (a busy loop started in each guest). The target's
score is an index: the geometric mean over the tests of its rate divided by its rate
when it ran alone, times 100. "Alone" is the mean of every run without dummies on the
shared 2-core layout (a solo run first, then each policy's 0-dummy run), so one run
disturbed by other work on the host does not shift every index.

Tests, each for a fixed time measured with the guest's clock (so a starved guest
scores lower, it does not run longer): ``cpu`` (the probe's register test where the
image has /usr/bin/probe, else a busybox arithmetic loop), ``syscall`` (open/close of
/dev/null by a shell builtin), ``pipe`` (ping-pong: one line to an echoing shell and
back over two FIFOs, so every round trip costs exactly two context switches), ``spawn``
(fork+exec of /bin/true) and ``copy`` (cp of a 256 KiB file in /tmp). Each point is
measured ``runs`` times and every test's rate is the median over the runs: one run of a
few seconds on this host varies by about +-10% on its own.

Policies: ``default`` (every VM in one 2-core partition, equal weight), ``nice``
(the same, the target's QEMU threads at nice -5), ``governor`` (the same partition,
target guaranteed, dummies best-effort) and ``partition`` (the target alone in a
1-core partition, the dummies in another). With the governor it also measures the
dummies' own progress (a counter in each busy loop) while the target is idle.

It needs both cores, so it refuses to run beside any partition, and it removes
everything it made in ``finally``.

The run itself (partitions, VMs, measurements) is fusuma_bench.scheduler_run; this
module holds the configuration, layouts, workload and scoring, testable without a VM.
"""

from __future__ import annotations

import dataclasses
import json
import math
import statistics
from collections.abc import Callable, Sequence
from typing import Any

from fusuma.capacity import SUPERVISOR_MIB, vm_footprint
from fusuma.errors import GuestAgentError, SpecError
from fusuma.frozen import frozen
from fusuma.governor.policy import Thresholds
from fusuma.governor.qos import CLASSES, QOS_NAMES, QosClass
from fusuma.spec import PartitionSpec, Qos
from fusuma.state import VmRecord

POLICIES = ("default", "nice", "governor", "partition")
QUICK_POLICIES = ("default", "governor")
LOADS = ("idle", "cpu")
QUICK_LOADS = ("cpu",)
DEFAULT_DUMMIES = (0, 1, 2, 4, 8, 16)
QUICK_DUMMIES = (0, 4)
TEST_S = 5.0
# The dummies' progress is read over at least this long: a dummy writes its counter
# every 2000 rounds of its loop, which a dummy starved to a fraction of a TCG core
# can take over a second to reach; a shorter window says it made no progress when
# it made some (a --test-seconds 0.5 run under load: 1 of 2 "progressing").
MIN_PROGRESS_S = 2.0
QUICK_TEST_S = 3.0
RUNS = 3
QUICK_RUNS = 1
COUNTER_READS = 3        # tries per dummy counter read before it counts as unread
TARGET_MIB = 256
DUMMY_MIB = 128
NICE = -5
MARGIN_MIB = 64
BOOT_TIMEOUT_S = 600.0
TESTS = ("cpu", "syscall", "pipe", "spawn", "copy")
PROBE_REPS = 5
# Newly booted dummies count as settled once their QEMUs use less than QUIET_CORES each
# (an idle guest uses about 0.02 under TCG), waiting at most QUIET_MAX_S.
QUIET_CORES = 0.1
QUIET_MAX_S = 10.0
# Before the dummies' progress is read, the governor gives back what it took for the
# target: polled every RELEASE_POLL_S, at most RELEASE_MAX_S (its longest relax, with
# back-off, and a tick to spare).
RELEASE_POLL_S = 0.5
RELEASE_MAX_S = Thresholds().relax_max_ticks + 2.0

SHARED = "bench-sched"
PART_A, PART_B = "bench-sched-a", "bench-sched-b"
TARGET = "bench-sched-target"

Progress = Callable[[str], None]


def dummy(i: int) -> str:
    return f"bench-sched-d{i:02d}"


# The workload, run by the guest's busybox sh with $1 = seconds per test, $2 = the
# probe's M (0: no probe, use the arithmetic loop). Each test prints
# "<name> <count> <centiseconds>", timed with /proc/uptime (no fork to read it).
WORKLOAD = r"""
T=$1; M=$2; S=/tmp/fz.stop
stamp() { read u _ </proc/uptime; t=${u%.*}${u#*.}; }
timer() { rm -f $S; (sleep $T; : >$S) & }
if [ "$M" -gt 0 ]; then
  /usr/bin/probe --test register --reps __REPS__ --m $M || exit 3
else
  timer; stamp; t0=$t; n=0
  while [ ! -e $S ]; do j=0; while [ $j -lt 200 ]; do j=$((j+1)); done; n=$((n+1)); done
  stamp; wait; echo "cpu $n $((t-t0))"
fi
timer; stamp; t0=$t; n=0
while [ ! -e $S ]; do : >/dev/null; n=$((n+1)); done
stamp; wait; echo "syscall $n $((t-t0))"
A=/tmp/fz.a; B=/tmp/fz.b; rm -f $A $B; mkfifo $A $B || exit 4
(while read x; do echo "$x"; done <$A >$B) &
exec 3>$A 4<$B
timer; stamp; t0=$t; n=0
while [ ! -e $S ]; do echo p >&3; read x <&4; n=$((n+1)); done
stamp; exec 3>&- 4<&-; wait; echo "pipe $n $((t-t0))"
timer; stamp; t0=$t; n=0
while [ ! -e $S ]; do /bin/true; n=$((n+1)); done
stamp; wait; echo "spawn $n $((t-t0))"
dd if=/dev/zero of=/tmp/fz.src bs=1k count=256 2>/dev/null
timer; stamp; t0=$t; n=0
while [ ! -e $S ]; do cp /tmp/fz.src /tmp/fz.dst; n=$((n+1)); done
stamp; wait; echo "copy $n $((t-t0))"
rm -f /tmp/fz.src /tmp/fz.dst $A $B $S
""".replace("__REPS__", str(PROBE_REPS))

# A CPU-bound dummy: a shell loop that writes its progress every 2000 rounds. setsid +
# closed stdio so guest-exec returns at once. The counter is overwritten in place
# (``1<>``: no O_TRUNC): with ``>`` a read that lands between the truncation and the
# write sees an empty file. The number only grows, so the new digits always cover the
# old ones.
BUSY = ("setsid sh -c 'i=0; while :; do i=$((i+1)); if [ $((i % 2000)) -eq 0 ]; then "
        "echo $i 1<>/tmp/busy.n; fi; done' </dev/null >/dev/null 2>&1 &")


@frozen
class Config:
    dummies: list[int]
    policies: list[str]
    loads: list[str]
    test_s: float
    progress_s: float = TEST_S      # between the two readings of the dummies' progress
    runs: int = 1           # workload runs per point; the rates are their medians
    target_emulator: str = "shared"   # the target's emulator threads (VmSpec.emulator)


@frozen
class Layout:
    """Where a policy puts the VMs and how it treats them."""

    partitions: list[PartitionSpec]
    target_partition: str
    dummy_partition: str
    target_qos: Qos
    dummy_qos: Qos
    nice: bool


@frozen
class Score:
    """The workload in the target: one run, or the median of several (:func:`combine`)."""

    rates: dict[str, float]          # per second
    counts: dict[str, int]
    elapsed_s: dict[str, float]
    target_cpu_pct: float            # all of the target's QEMU threads
    target_wait_pct: float           # its vCPU thread's runqueue wait
    wall_s: float
    vcpu_pct: float = 0.0            # its vCPU thread alone
    other_cpu_pct: float = 0.0       # its other threads (main loop, RCU, I/O)
    other_wait_pct: float = 0.0      # ... and their runqueue wait
    steal_pct: float | None = None   # taken by the hypervisor below this host, per CPU
    run_rates: tuple[dict[str, float], ...] = ()   # every run's rates


def combine(scores: Sequence[Score]) -> Score:
    """Several runs of one point: per test the median rate, counts and times summed,
    loads averaged."""
    if len(scores) == 1:
        return dataclasses.replace(scores[0], run_rates=(scores[0].rates,))
    steal = [s.steal_pct for s in scores if s.steal_pct is not None]
    return Score(
        rates={t: statistics.median(s.rates[t] for s in scores) for t in scores[0].rates},
        counts={t: sum(s.counts[t] for s in scores) for t in scores[0].counts},
        elapsed_s={t: sum(s.elapsed_s[t] for s in scores) for t in scores[0].elapsed_s},
        target_cpu_pct=statistics.fmean(s.target_cpu_pct for s in scores),
        target_wait_pct=statistics.fmean(s.target_wait_pct for s in scores),
        wall_s=sum(s.wall_s for s in scores),
        vcpu_pct=statistics.fmean(s.vcpu_pct for s in scores),
        other_cpu_pct=statistics.fmean(s.other_cpu_pct for s in scores),
        other_wait_pct=statistics.fmean(s.other_wait_pct for s in scores),
        steal_pct=statistics.fmean(steal) if steal else None,
        run_rates=tuple(s.rates for s in scores))


def governor_holds(status: dict[str, Any]) -> list[str]:
    """What the governor still holds, from its status (rpc.GovernorStatus): a VM's
    cores of its own, a raised weight, caps it asked for or put on a VM. Empty once it
    has given everything back."""
    held = []
    for v in status.get("vms", []):
        name = v.get("name", "?")
        if v.get("dedicated_cores"):
            held.append(f"{name}: cores {v['dedicated_cores']}")
        if v.get("capping_others"):
            held.append(f"{name}: caps on others")
        if v.get("cap_cpus") is not None:
            held.append(f"{name}: capped at {v['cap_cpus']} CPU")
        qos = v.get("qos")
        if qos in QOS_NAMES and v.get("weight") != CLASSES[QosClass(qos)].base.weight:
            held.append(f"{name}: weight {v.get('weight')}")
    return held


def partition_mib(accel: str, n: int, with_target: bool) -> int:
    target = VmRecord(name=TARGET, partition=SHARED, vcpus=1, memory_mib=TARGET_MIB,
                      accel_used=accel)
    one = VmRecord(name=dummy(0), partition=SHARED, vcpus=1, memory_mib=DUMMY_MIB,
                   accel_used=accel)
    return (SUPERVISOR_MIB + MARGIN_MIB + n * vm_footprint(one)
            + (vm_footprint(target) if with_target else 0))


def layout(policy: str, cores: list[int], n_max: int, accel: str) -> Layout:
    if policy == "partition":
        return Layout([PartitionSpec(name=PART_A, cpus=[cores[0]],
                                     memory_mib=partition_mib(accel, 0, True)),
                       PartitionSpec(name=PART_B, cpus=cores[1:],
                                     memory_mib=partition_mib(accel, max(1, n_max), False))],
                      PART_A, PART_B, "burstable", "burstable", False)
    shared = [PartitionSpec(name=SHARED, cpus=cores,
                            memory_mib=partition_mib(accel, n_max, True))]
    if policy == "governor":
        return Layout(shared, SHARED, SHARED, "guaranteed", "best-effort", False)
    return Layout(shared, SHARED, SHARED, "burstable", "burstable", policy == "nice")


def index(rates: dict[str, float], solo: dict[str, float]) -> float:
    """100 x the geometric mean of rate / solo rate over the tests both have."""
    ratios = [rates[t] / solo[t] for t in solo if solo[t] > 0 and t in rates]
    if not ratios or any(r <= 0 for r in ratios):
        return 0.0
    return 100.0 * math.exp(sum(math.log(r) for r in ratios) / len(ratios))


def parse_workload(text: str, probe_m: int) -> tuple[dict[str, int], dict[str, float]]:
    """Counts and elapsed seconds per test from the workload's output."""
    counts: dict[str, int] = {}
    elapsed: dict[str, float] = {}
    walls: list[int] = []
    for line in text.splitlines():
        line = line.strip()
        if line.startswith("{"):
            try:
                doc = json.loads(line)
            except ValueError:
                continue
            if doc.get("test") == "register":
                walls = [int(x) for x in doc.get("wall_ns", [])]
            continue
        parts = line.split()
        if len(parts) == 3 and parts[0] in TESTS and parts[1].isdigit() and parts[2].isdigit():
            counts[parts[0]] = int(parts[1])
            elapsed[parts[0]] = int(parts[2]) / 100.0
    if probe_m > 0 and walls:
        # One rep's M increments; the median rep stands for the rate.
        counts["cpu"] = probe_m
        elapsed["cpu"] = statistics.median(walls) / 1e9
    missing = [t for t in TESTS if t not in counts or elapsed.get(t, 0) <= 0]
    if missing:
        raise GuestAgentError(f"the scheduler workload printed no result for "
                              f"{', '.join(missing)}; its output was: {text.strip()[:300]!r}")
    return counts, elapsed


def parse_counts(value: str) -> list[int]:
    try:
        counts = sorted({int(v) for v in value.split(",") if v.strip()})
    except ValueError:
        counts = []
    if not counts or any(c < 0 or c > 64 for c in counts):
        raise SpecError(f"--dummies {value!r} is not a list of dummy counts (0..64), e.g. "
                        "0,1,2,4,8,16.")
    return counts


def parse_choice(value: str, allowed: Sequence[str], what: str) -> list[str]:
    items = [v.strip() for v in value.split(",") if v.strip()]
    bad = [v for v in items if v not in allowed]
    if not items or bad:
        raise SpecError(f"--{what} {value!r}: use a comma-separated list of "
                        f"{', '.join(allowed)}.")
    return [a for a in allowed if a in items]
