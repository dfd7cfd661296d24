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
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import os
import statistics
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from fusuma.capacity import SUPERVISOR_MIB, vm_footprint
from fusuma.errors import FusumaError, GuestAgentError, ResourceError, SpecError
from fusuma.governor import measure
from fusuma.governor.policy import Thresholds
from fusuma.host.accel import probe_accel
from fusuma.partition.manager import PartitionManager
from fusuma.qemu import process
from fusuma.spec import PartitionSpec, Qos, VmSpec
from fusuma.state import VmRecord
from fusuma.vm import VmManager
from fusuma_bench.report import meta

LOG = logging.getLogger(__name__)

POLICIES = ("default", "nice", "governor", "partition")
QUICK_POLICIES = ("default", "governor")
LOADS = ("idle", "cpu")
QUICK_LOADS = ("cpu",)
DEFAULT_DUMMIES = (0, 1, 2, 4, 8, 16)
QUICK_DUMMIES = (0, 4)
TEST_S = 5.0
QUICK_TEST_S = 3.0
RUNS = 3
QUICK_RUNS = 1
COUNTER_READS = 3        # tries per dummy counter read before it counts as unread
PROGRESS_S = 5.0
TARGET_MIB = 256
DUMMY_MIB = 128
NICE = -5
MARGIN_MIB = 64
BOOT_TIMEOUT_S = 600.0
TESTS = ("cpu", "syscall", "pipe", "spawn", "copy")
PROBE_REPS = 5
SETTLE_S = 3.0

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


@dataclass(frozen=True)
class Config:
    dummies: list[int]
    policies: list[str]
    loads: list[str]
    test_s: float
    progress_s: float = PROGRESS_S
    runs: int = 1           # workload runs per point; the rates are their medians
    target_emulator: str = "shared"   # the target's emulator threads (VmSpec.emulator)


@dataclass(frozen=True)
class Layout:
    """Where a policy puts the VMs and how it treats them."""

    partitions: list[PartitionSpec]
    target_partition: str
    dummy_partition: str
    target_qos: Qos
    dummy_qos: Qos
    nice: bool


@dataclass(frozen=True)
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


class Bench:
    """One run of the experiment: every policy, dummy count and load in ``cfg``."""

    def __init__(self, parts: PartitionManager, vms: VmManager, cfg: Config,
                 progress: Progress) -> None:
        self.parts = parts
        self.vms = vms
        self.cfg = cfg
        self.say = progress
        self.accel = probe_accel("auto").name
        self.cores: list[int] = []
        self.probe_m = 0
        self.cpu_test = ""
        self.solo: Score | None = None
        self.skipped: dict[str, str] = {}    # policy -> why its layout could not run
        # Every run of the target alone on the shared 2-core layout (the solo run and
        # the 0-dummy runs of default, nice and governor): their mean is the baseline,
        # so one unlucky solo run does not shift every index.
        self.alone: list[Score] = []
        self.results: list[dict[str, Any]] = []
        self.scores: list[Score] = []
        self.dummy_progress: list[dict[str, Any]] = []
        self.running: list[str] = []        # dummies booted in the current layout
        self.layout: Layout | None = None

    # -- checks -------------------------------------------------------------------------
    def check_host(self) -> None:
        existing = [p.name for p in self.parts.db.partitions()]
        if existing:
            raise ResourceError(f"the scheduler benchmark needs both cores but partition(s) "
                                f"{', '.join(existing)} exist; remove them first "
                                "(`fusuma down`).")
        if len(self.parts.host.cpus) < 2:
            raise ResourceError("the scheduler benchmark needs two cores; this host has "
                                f"{len(self.parts.host.cpus)}.")
        self.cores = list(self.parts.host.cpus[:2])
        need = partition_mib(self.accel, max(self.cfg.dummies), True) + SUPERVISOR_MIB
        avail = self.parts.host.memory_available_for_partitions_mib
        if need > avail:
            raise ResourceError(f"{max(self.cfg.dummies)} dummy VMs and the target need "
                                f"{need} MiB but only {avail} MiB is available for "
                                "partitions; use fewer --dummies.")

    # -- the run ------------------------------------------------------------------------
    def run(self) -> dict[str, Any]:
        self.check_host()
        started = time.monotonic()
        self.say(f"solo: the target alone on cores {self.cores}")
        with_layout = layout("default", self.cores, 0, self.accel)
        self.setup(with_layout, "default")
        try:
            self.calibrate()
            self.solo = self.measure_target()
            self.alone.append(self.solo)
            self.say(f"solo rates: {_rates_text(self.solo.rates)}")
        finally:
            self.teardown()
        for policy in self.cfg.policies:
            try:
                self.one_policy(policy)
            except ResourceError as exc:
                if self.cfg.target_emulator == "shared":
                    raise
                self.skipped[policy] = str(exc)
                self.say(f"policy {policy} skipped: {exc}")
        return self.result(time.monotonic() - started)

    def one_policy(self, policy: str) -> None:
        lay = layout(policy, self.cores, max(self.cfg.dummies), self.accel)
        self.say(f"policy {policy}: partitions "
                 + ", ".join(f"{p.name} (cores {p.cpus})" for p in lay.partitions))
        try:
            self.setup(lay, policy)
            counts = sorted(set(self.cfg.dummies))
            if 0 in counts:
                score = self.measure_target()
                if lay.target_partition == lay.dummy_partition:
                    self.alone.append(score)
                for load in self.cfg.loads:
                    self.record(policy, 0, load, score, note="no dummies: one run "
                                "serves every load")
            positive = [n for n in counts if n > 0]
            if "idle" in self.cfg.loads:
                for n in positive:
                    self.boot_dummies(n)
                    self.record(policy, n, "idle", self.measure_target())
            if "cpu" in self.cfg.loads and positive:
                self.boot_dummies(positive[-1])
                self.start_busy()
                for i, n in enumerate(reversed(positive)):
                    self.keep_dummies(n)
                    self.record(policy, n, "cpu", self.measure_target())
                    if i == 0:
                        self.measure_progress(policy, n)
        finally:
            self.teardown()

    # -- layout -------------------------------------------------------------------------
    def setup(self, lay: Layout, policy: str) -> None:
        self.layout = lay
        self.running = []
        for p in lay.partitions:
            self.parts.create(p)
        self.vms.create(VmSpec(name=TARGET, partition=lay.target_partition,
                               memory_mib=TARGET_MIB, qos=lay.target_qos,
                               emulator=self.cfg.target_emulator))
        self.vms.start(TARGET, wait_agent=BOOT_TIMEOUT_S)
        if lay.nice:
            self.renice()
        self.say(f"{policy}: target booted ({lay.target_qos})")

    def teardown(self) -> None:
        self.say("removing the benchmark's partitions")
        for name in (SHARED, PART_A, PART_B):
            if self.parts.db.find_partition(name) is None:
                continue
            try:
                self.parts.delete(name, force=True)
            except FusumaError as exc:
                self.say(f"cleanup of partition {name} failed: {exc}")
                LOG.warning("cleanup of partition %s failed: %s", name, exc)
        self.running = []

    def renice(self) -> int:
        """nice -5 for every thread of the target's QEMU (setpriority per thread)."""
        pid = self.vms.db.vm(TARGET).pid
        done = 0
        for tid in process.threads(pid or 0):
            try:
                os.setpriority(os.PRIO_PROCESS, tid, NICE)
                done += 1
            except OSError:
                continue
        return done

    def boot_dummies(self, n: int) -> None:
        assert self.layout is not None
        new = [dummy(i) for i in range(len(self.running), n)]
        if not new:
            return
        self.say(f"booting {len(new)} dummy VM(s) ({len(self.running)} -> {n})")
        for name in new:
            if self.parts.db.find_vm(name) is None:
                self.vms.create(VmSpec(name=name, partition=self.layout.dummy_partition,
                                       memory_mib=DUMMY_MIB,
                                       qos=self.layout.dummy_qos))
            self.vms.start(name)
        self.wait_agents(new)
        self.running += new
        time.sleep(SETTLE_S)     # the guests' last boot steps are not the dummies' load
        if self.layout.nice:
            self.renice()

    def wait_agents(self, names: list[str]) -> None:
        assert self.layout is not None
        client = self.parts.client(self.layout.dummy_partition)
        errors: list[BaseException] = []

        def wait(name: str) -> None:
            try:
                client.call("wait-agent", rpc_timeout=BOOT_TIMEOUT_S + 10, vm=name,
                            timeout=BOOT_TIMEOUT_S)
            except BaseException as exc:
                errors.append(exc)

        threads = [threading.Thread(target=wait, args=(n,)) for n in names]
        for th in threads:
            th.start()
        for th in threads:
            th.join()
        if errors:
            raise errors[0]

    def start_busy(self) -> None:
        self.say(f"starting a busy loop in {len(self.running)} dummy VM(s)")
        for name in self.running:
            out = self.vms.exec(name, ["/bin/sh", "-c", BUSY], timeout=120)
            if out.exit_code != 0:
                raise GuestAgentError(f"could not start the busy loop in {name!r}: "
                                      f"{out.stderr.decode(errors='replace').strip()}")

    def keep_dummies(self, n: int) -> None:
        """Kill the dummies beyond the first ``n`` and spread the rest evenly again."""
        assert self.layout is not None
        extra = self.running[n:]
        if not extra:
            return
        for name in extra:
            self.vms.kill(name)
        self.running = self.running[:n]
        self.parts.client(self.layout.dummy_partition).call("repin")
        if self.layout.target_partition != self.layout.dummy_partition:
            self.parts.client(self.layout.target_partition).call("repin")

    # -- measuring ----------------------------------------------------------------------
    def calibrate(self) -> None:
        """Choose the probe's M so its reps take about one test's time alone."""
        out = self.vms.exec(TARGET, ["/bin/sh", "-c", "test -x /usr/bin/probe"], timeout=60)
        if out.exit_code != 0:
            self.cpu_test = ("busybox arithmetic loop (the guest image has no /usr/bin/probe "
                             "yet)")
            return
        m = 20_000_000
        res = self.vms.exec(TARGET, ["/usr/bin/probe", "--test", "register", "--reps", "1",
                                     "--m", str(m)], timeout=120)
        try:
            doc = json.loads(res.stdout.decode().strip().splitlines()[0])
            ns = float(doc["wall_ns"][0])
        except (ValueError, KeyError, IndexError, TypeError):
            self.cpu_test = ("busybox arithmetic loop (/usr/bin/probe is in the image but "
                             f"its register test failed: {res.stderr.decode()[:100]!r})")
            return
        per_rep_s = self.cfg.test_s / PROBE_REPS
        self.probe_m = max(1_000_000, int(m * per_rep_s * 1e9 / max(ns, 1.0)))
        self.cpu_test = (f"probe --test register --reps {PROBE_REPS} --m {self.probe_m} "
                         "(median rep)")

    def measure_target(self) -> Score:
        """``runs`` runs of the workload at one point, combined."""
        return combine([self.workload() for _ in range(max(1, self.cfg.runs))])

    def workload(self) -> Score:
        pid = self.vms.db.vm(TARGET).pid or 0
        steal0 = measure.host_steal_s()
        before = measure.read(pid)
        t0 = time.monotonic()
        timeout = 120 + 60 * self.cfg.test_s
        out = self.vms.exec(TARGET, ["/bin/sh", "-c", WORKLOAD, "sh", f"{self.cfg.test_s:g}",
                                     str(self.probe_m)], timeout=timeout)
        wall = time.monotonic() - t0
        load = measure.load(before, measure.read(pid))
        steal1 = measure.host_steal_s()
        steal = (None if steal0 is None or steal1 is None else
                 100.0 * (steal1 - steal0) / max(wall, 1e-3) / max(1, len(self.cores)))
        text = out.stdout.decode(errors="replace")
        if out.exit_code != 0:
            raise GuestAgentError(f"the scheduler workload in {TARGET!r} exited "
                                  f"{out.exit_code}: {out.stderr.decode(errors='replace')[:200]}")
        counts, elapsed = parse_workload(text, self.probe_m)
        rates = {t: counts[t] / elapsed[t] for t in counts}
        return Score(rates, counts, elapsed, load.cpu_pct, load.wait_pct, wall,
                     vcpu_pct=load.vcpu_pct, other_cpu_pct=load.other_cpu_pct,
                     other_wait_pct=load.other_wait_pct, steal_pct=steal)

    def baseline(self) -> dict[str, float]:
        """Per test, the mean rate of the runs of the target alone."""
        return {t: statistics.fmean(s.rates[t] for s in self.alone) for t in TESTS}

    def record(self, policy: str, n: int, load: str, score: Score, note: str | None = None
               ) -> None:
        """Keep one run; its index is computed at the end against the final baseline."""
        idx = index(score.rates, self.baseline())
        row: dict[str, Any] = {
            "policy": policy, "dummies": n, "dummy_load": load,
            "tests": {t: {"count": score.counts[t], "elapsed_s": round(score.elapsed_s[t], 3),
                          "rate_per_s": round(score.rates[t], 3)} for t in TESTS},
            "target_cpu_pct": round(score.target_cpu_pct, 1),
            "target_wait_pct": round(score.target_wait_pct, 1),
            "target_vcpu_pct": round(score.vcpu_pct, 1),
            "target_other_cpu_pct": round(score.other_cpu_pct, 1),
            "target_other_wait_pct": round(score.other_wait_pct, 2),
            "host_steal_pct": None if score.steal_pct is None else round(score.steal_pct, 2),
            "runs": len(score.run_rates) or 1,
            "wall_s": round(score.wall_s, 1)}
        if note:
            row["note"] = note
        if policy == "governor":
            row["governor_decisions"], row["governor"] = self.governor_state()
        self.results.append(row)
        self.scores.append(score)
        self.say(f"{policy} {n} {load} dummies: index {idx:.1f} so far (target cpu "
                 f"{score.target_cpu_pct:.0f}%, vCPU wait {score.target_wait_pct:.0f}%)")

    def governor_state(self) -> tuple[list[dict[str, Any]], dict[str, Any]]:
        """The governor's recent decisions and how it stands: ticks and errors (an empty
        decision list means "nothing to do" only if it ticked without errors) and what
        it holds for the target."""
        assert self.layout is not None
        try:
            st = self.parts.client(self.layout.target_partition).call(
                "governor-status", rpc_timeout=10, limit=20)
        except FusumaError as exc:
            return [{"error": str(exc)}], {"error": str(exc)}
        target = next((v for v in st.get("vms", []) if v.get("name") == TARGET), None)
        return list(st.get("decisions", [])), {
            "ticks": st.get("ticks"), "errors": st.get("errors"),
            "last_error": st.get("last_error"),
            "host_pressure_pct": st.get("host_pressure_pct"), "target": target}

    def read_counters(self) -> tuple[dict[str, tuple[float, int]], dict[str, str]]:
        """Each running dummy's busy-loop counter, and why a counter could not be read."""
        out: dict[str, tuple[float, int]] = {}
        unread: dict[str, str] = {}
        for name in self.running:
            why = ""
            for _ in range(COUNTER_READS):
                res = self.vms.exec(name, ["/bin/cat", "/tmp/busy.n"], timeout=60)
                text = res.stdout.decode(errors="replace").strip()
                if res.exit_code == 0 and text.isdigit():
                    out[name] = (time.monotonic(), int(text))
                    break
                why = (f"exit {res.exit_code}, stdout {text[:40]!r}, stderr "
                       f"{res.stderr.decode(errors='replace').strip()[:80]!r}")
            else:
                unread[name] = why
                LOG.warning("dummy %s: busy-loop counter unreadable: %s", name, why)
        return out, unread

    def measure_progress(self, policy: str, n: int) -> None:
        """The dummies' own progress while the target is idle (after the governor has
        had time to give back what it took for the target)."""
        settle = Thresholds().relax_ticks + 2.0
        self.say(f"{policy}: dummy progress with the target idle ({settle:g} s to settle)")
        time.sleep(settle)
        pids = {v.name: v.pid for v in self.vms.db.vms() if v.name in self.running and v.pid}
        before = {name: measure.read(pid) for name, pid in pids.items()}
        first, unread = self.read_counters()
        time.sleep(self.cfg.progress_s)
        second, unread2 = self.read_counters()
        unread.update(unread2)
        cpus = {name: measure.load(before[name], measure.read(pid)).cpu_pct
                for name, pid in pids.items()}
        per_name: dict[str, float | None] = {}
        for name in self.running:
            if name in first and name in second:
                (t0, c0), (t1, c1) = first[name], second[name]
                per_name[name] = (c1 - c0) / max(t1 - t0, 1e-3)
            else:
                per_name[name] = None
        rates = [r for r in per_name.values() if r is not None]
        row = {"policy": policy, "dummies": n, "dummy_load": "cpu", "target": "idle",
               "iterations_per_s": round(sum(rates), 1),
               "per_dummy_min": round(min(rates), 1) if rates else None,
               "per_dummy": [round(r, 1) for r in rates],
               "progressing": sum(1 for r in rates if r > 0), "read": len(rates),
               "per_dummy_named": {name: {"iterations_per_s": None if r is None
                                          else round(r, 1),
                                          "cpu_pct": round(cpus.get(name, 0.0), 1)}
                                   for name, r in per_name.items()},
               "unread": unread,
               "dummy_cpu_pct": round(sum(cpus.values()), 1), "settle_s": settle}
        self.dummy_progress.append(row)
        self.say(f"{policy}: {row['progressing']}/{n} dummies progressing "
                 f"({len(rates)} read), {row['iterations_per_s']} iterations/s in all, "
                 f"CPU {row['dummy_cpu_pct']:.0f}%")

    def result(self, elapsed: float) -> dict[str, Any]:
        assert self.solo is not None
        base = self.baseline()
        for row, score in zip(self.results, self.scores, strict=True):
            row["index"] = round(index(score.rates, base), 2)
            row["run_indexes"] = [round(index(r, base), 2) for r in score.run_rates]
            for t in TESTS:
                row["tests"][t]["relative"] = round(score.rates[t] / base[t], 4)
        c = self.cfg
        return {"meta": meta(self.accel, benchmark="scheduler", dummies=c.dummies,
                             policies=c.policies, loads=c.loads, test_s=c.test_s,
                             progress_s=c.progress_s, runs=c.runs, tests=list(TESTS),
                             target_emulator=c.target_emulator,
                             skipped_policies=self.skipped,
                             pipe_test="ping-pong round trips over two FIFOs",
                             cores=self.cores,
                             target_mib=TARGET_MIB, dummy_mib=DUMMY_MIB, nice=NICE,
                             cpu_test=self.cpu_test, probe_m=self.probe_m,
                             governor=Thresholds().as_json(), duration_s=round(elapsed, 1),
                             index="100 x geometric mean over the tests of rate / baseline "
                                   "rate; baseline = mean rate of the target-alone runs"),
                "solo": {"tests": {t: {"rate_per_s": round(base[t], 3)} for t in TESTS},
                         "runs": sum(len(s.run_rates) or 1 for s in self.alone),
                         "run_indexes": [round(index(r, base), 2) for s in self.alone
                                         for r in (s.run_rates or (s.rates,))],
                         "target_cpu_pct": round(min(s.target_cpu_pct for s in self.alone), 1),
                         "target_wait_pct": round(max(s.target_wait_pct
                                                      for s in self.alone), 1)},
                "results": self.results, "dummy_progress": self.dummy_progress}


def _rates_text(rates: dict[str, float]) -> str:
    return ", ".join(f"{t} {r:.1f}/s" for t, r in rates.items())


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


def run(parts: PartitionManager, vms: VmManager, cfg: Config,
        progress: Progress = lambda s: None) -> dict[str, Any]:
    return Bench(parts, vms, cfg, progress).run()
