"""The run of `fusuma bench scheduler` (see fusuma_bench.scheduler): the scratch partitions,
the target and dummy VMs, their workloads and measurements, and the result file."""

from __future__ import annotations

import json
import logging
import os
import statistics
import time
from typing import Any

from fusuma.capacity import SUPERVISOR_MIB
from fusuma.errors import FusumaError, GuestAgentError, ResourceError
from fusuma.governor import measure
from fusuma.governor.policy import Thresholds
from fusuma.host.accel import probe_accel
from fusuma.partition.manager import PartitionManager
from fusuma.qemu import process
from fusuma.spec import VmSpec
from fusuma.supervisor import rpc
from fusuma.vm import VmManager
from fusuma_bench.agents import wait_agents
from fusuma_bench.report import meta
from fusuma_bench.scheduler import (
    BOOT_TIMEOUT_S,
    BUSY,
    COUNTER_READS,
    DUMMY_MIB,
    NICE,
    PART_A,
    PART_B,
    PROBE_REPS,
    QUIET_CORES,
    QUIET_MAX_S,
    RELEASE_MAX_S,
    RELEASE_POLL_S,
    SHARED,
    TARGET,
    TARGET_MIB,
    TESTS,
    WORKLOAD,
    Config,
    Layout,
    Progress,
    Score,
    combine,
    dummy,
    governor_holds,
    index,
    layout,
    parse_workload,
    partition_mib,
)
from fusuma_bench.steady import qemu_cpu_s, wait_quiet

LOG = logging.getLogger(__name__)


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
        # The solo run is policy default's layout with no dummy yet: when default runs
        # first, its partition and target go on into the policy (booted once for both).
        keep = self.cfg.policies[:1] == ["default"]
        self.say(f"solo: the target alone on cores {self.cores}")
        try:
            self.setup(layout("default", self.cores, max(self.cfg.dummies) if keep else 0,
                              self.accel), "default")
            self.calibrate()
            self.solo = self.measure_target()
            self.alone.append(self.solo)
            self.say(f"solo rates: {_rates_text(self.solo.rates)}")
        except BaseException:
            self.teardown()
            raise
        if not keep:
            self.teardown()
        for policy in self.cfg.policies:
            try:
                self.one_policy(policy, booted=keep and policy == "default")
            except ResourceError as exc:
                if self.cfg.target_emulator == "shared":
                    raise
                self.skipped[policy] = str(exc)
                self.say(f"policy {policy} skipped: {exc}")
        return self.result(time.monotonic() - started)

    def one_policy(self, policy: str, booted: bool = False) -> None:
        """Every dummy count and load of one policy; ``booted``: its layout and target
        are up already (from the solo run)."""
        lay = layout(policy, self.cores, max(self.cfg.dummies), self.accel)
        self.say(f"policy {policy}: partitions "
                 + ", ".join(f"{p.name} (cores {p.cpus})" for p in lay.partitions))
        try:
            if not booted:
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
                        self.measure_progress(policy, n, self.governor_released(policy))
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
        wait_agents(self.parts, [(name, self.layout.dummy_partition) for name in new],
                    BOOT_TIMEOUT_S)
        self.running += new
        # The guests' last boot steps are not the dummies' load.
        pids = [v.pid for v in self.vms.db.vms() if v.name in new and v.pid]
        busy, waited, _ = wait_quiet(lambda: qemu_cpu_s(pids), QUIET_CORES * len(new),
                                     QUIET_MAX_S)
        self.say(f"{len(new)} new dummy VM(s) use {busy:.2f} core(s) after {waited:g} s")
        if self.layout.nice:
            self.renice()

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
        self.parts.client(self.layout.dummy_partition).send(rpc.Repin())
        if self.layout.target_partition != self.layout.dummy_partition:
            self.parts.client(self.layout.target_partition).send(rpc.Repin())

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
            st = self.parts.client(self.layout.target_partition).send(
                rpc.GovernorStatus(limit=20), timeout=10).status
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

    def governor_released(self, policy: str) -> tuple[float, list[str] | None]:
        """With a guaranteed VM in the layout, wait until the governor has given back
        what it took for it (weight, cores, caps on others), at most RELEASE_MAX_S;
        (seconds waited, what it still holds: empty once released). The governor acts
        for guaranteed VMs only: without one there is nothing to wait for (None)."""
        assert self.layout is not None
        if "guaranteed" not in (self.layout.target_qos, self.layout.dummy_qos):
            return 0.0, None
        self.say(f"{policy}: waiting for the governor to give back what it took for "
                 "the target")
        client = self.parts.client(self.layout.target_partition)
        t0 = time.monotonic()
        while True:
            try:
                held = governor_holds(client.send(rpc.GovernorStatus(limit=0),
                                                  timeout=10).status)
            except FusumaError as exc:
                return round(time.monotonic() - t0, 1), [f"no governor status: {exc}"]
            waited = round(time.monotonic() - t0, 1)
            if not held or waited >= RELEASE_MAX_S:
                return waited, held
            time.sleep(RELEASE_POLL_S)

    def measure_progress(self, policy: str, n: int,
                         released: tuple[float, list[str] | None] = (0.0, None)) -> None:
        """The dummies' own progress while the target is idle, once the governor has
        given back what it took for the target (``released``, from
        :meth:`governor_released`)."""
        settle, held = released
        self.say(f"{policy}: dummy progress with the target idle (settled in {settle:g} s"
                 + (f"; the governor still holds {', '.join(held)}" if held else "") + ")")
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
               "dummy_cpu_pct": round(sum(cpus.values()), 1), "settle_s": settle,
               "governor_holds": held}
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


def run(parts: PartitionManager, vms: VmManager, cfg: Config,
        progress: Progress = lambda s: None) -> dict[str, Any]:
    return Bench(parts, vms, cfg, progress).run()
