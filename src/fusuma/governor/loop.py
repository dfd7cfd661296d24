"""The governor's control loop, run as an asyncio task inside a partition supervisor.

Every ``interval`` seconds it reads each running VM's threads (/proc schedstat) and
cgroup counters, asks :func:`~fusuma.governor.policy.decide` what to change, writes the
changed weights and quotas to the VMs' leaf cgroups and, while some guaranteed VM has
cores of its own, keeps every QEMU thread's affinity to the plan. Each change is kept
in a ring buffer with its reason and the numbers behind it (``governor-status``).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import time
from collections import deque
from collections.abc import Awaitable, Callable
from typing import Any

from fusuma.errors import FusumaError
from fusuma.governor import measure
from fusuma.governor.policy import Control, Decision, Thresholds, VmInput, affinity_plan, decide
from fusuma.governor.qos import QosClass, policy_for, set_sched_idle
from fusuma.host.cgroups import CgroupDriver
from fusuma.state import Database, VmRecord

INTERVAL_S = 1.0
HISTORY = 256


def _qos(value: str) -> QosClass:
    try:
        return QosClass(value)
    except ValueError:
        return QosClass.BURSTABLE


class Ticking:
    """A loop that ticks every ``interval`` seconds and keeps going when a tick fails,
    counting and keeping the last error (both governors are one)."""

    interval: float
    errors: int
    last_error: str | None
    log: logging.Logger

    async def tick(self) -> list[Decision]:
        raise NotImplementedError

    async def run(self) -> None:
        while True:
            await asyncio.sleep(self.interval)
            try:
                await self.tick()
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # keep governing; say what went wrong
                self.errors += 1
                self.last_error = repr(exc)
                self.log.exception("%s tick failed", type(self).__name__)


class Governor(Ticking):
    """One partition's governor; the supervisor owns it and feeds it its VMs."""

    def __init__(self, partition: str, cg: CgroupDriver, db: Database,
                 pids: Callable[[], dict[str, int]],
                 repin: Callable[[], Awaitable[object]],
                 leaf: Callable[[str], str], log: logging.Logger,
                 interval: float = INTERVAL_S, thresholds: Thresholds | None = None) -> None:
        self.partition = partition
        self.cg = cg
        self.db = db
        self.pids = pids
        self.repin = repin
        self.leaf = leaf
        self.log = log.getChild("governor")
        self.interval = interval
        self.th = thresholds or Thresholds()
        self.controls: dict[str, Control] = {}
        self.readings: dict[str, measure.Reading] = {}
        self.loads: dict[str, measure.Load] = {}
        self.decisions: deque[Decision] = deque(maxlen=HISTORY)
        self.ticks = 0
        self.errors = 0
        self.last_error: str | None = None
        self._host_psi: tuple[float, int] | None = None
        self.host_pressure_pct: float | None = None

    # -- class of a VM whose QEMU was just started or adopted ---------------------------
    def apply_class(self, vm: VmRecord, pid: int | None) -> None:
        """Give the VM's leaf its class's base policy (and SCHED_IDLE threads for a
        best-effort VM where the kernel has no cpu.idle). Raises CgroupError."""
        qos = _qos(vm.qos)
        leaf = self.leaf(vm.name)
        self.cg.set_cpu(self.partition, leaf, policy_for(qos))
        self.controls.pop(vm.name, None)
        self.readings.pop(vm.name, None)
        if (qos == QosClass.BEST_EFFORT and pid is not None
                and not self.cg.cpu_idle_supported(self.partition, leaf)):
            n = set_sched_idle(measure.read_threads(pid))
            self.log.info("%s: no cpu.idle on this kernel; %d QEMU thread(s) set to "
                          "SCHED_IDLE", vm.name, n)
        self.log.info("%s: QoS class %s applied to %s", vm.name, qos.value, leaf)

    # -- the loop -----------------------------------------------------------------------
    def _measure(self) -> list[VmInput]:
        recs = {v.name: v for v in self.db.vms(self.partition)}
        pids = self.pids()
        inputs: list[VmInput] = []
        for name, pid in sorted(pids.items()):
            rec = recs.get(name)
            if rec is None:
                continue
            try:
                stat = self.cg.cpu_stat(self.partition, self.leaf(name))
            except FusumaError:
                stat = None
            cur = measure.read(pid, stat)
            prev = self.readings.get(name)
            self.readings[name] = cur
            load = measure.load(prev, cur) if prev is not None and prev.threads else None
            if load is not None:
                self.loads[name] = load
            inputs.append(VmInput(name, _qos(rec.qos), rec.vcpus, load))
        for gone in set(self.readings) - set(pids):
            self.readings.pop(gone, None)
            self.loads.pop(gone, None)
        psi = measure.host_pressure()
        now = time.monotonic()
        if psi is not None and self._host_psi is not None:
            t0, p0 = self._host_psi
            self.host_pressure_pct = 100.0 * max(0, psi - p0) / max(1.0, (now - t0) * 1e6)
        self._host_psi = (now, psi) if psi is not None else None
        return inputs

    async def tick(self) -> list[Decision]:
        inputs = self._measure()
        cores = self.db.partition(self.partition).cpus
        old = self.controls
        new, decisions = decide(inputs, old, cores, self.th, time.time(),
                                 reserved=self._emulator_cores(cores))
        self.controls = new
        for d in decisions:
            self.log.info("%s %s: %s", d.vm, d.action, d.reason)
            try:
                self.db.emit_context("governor", d.action,
                                     f"/1.0/partitions/{self.partition}",
                                     {"partition": self.partition, **d.as_json()})
            except Exception as exc:  # the decision stands; its event is best effort
                self.log.warning("cannot record the governor's decision: %s", exc)
        self.decisions.extend(decisions)
        for name, ctl in new.items():
            prev = old.get(name)
            if prev is not None and (prev.weight, prev.cap_cpus) != (ctl.weight, ctl.cap_cpus):
                try:
                    self.cg.set_cpu(self.partition, self.leaf(name),
                                    policy_for(ctl.qos, ctl.weight, ctl.cap_cpus))
                except FusumaError as exc:
                    self.log.warning("cannot apply the governor's policy to %s: %s", name, exc)
        had = any(c.dedicated for c in old.values())
        if any(c.dedicated for c in new.values()):
            self.pin()
        elif had:
            await self.repin()
        self.ticks += 1
        return decisions

    def _emulator_cores(self, cores: list[int]) -> set[int]:
        """Cores held for the emulator threads of VMs that isolate or pin them."""
        from fusuma.governor.qos import emulator_cores

        recs = self.db.vms(self.partition)
        out: set[int] = set()
        for rec in recs:
            if rec.emulator != "shared":
                with contextlib.suppress(FusumaError):
                    out |= set(emulator_cores(rec, cores, recs))
        return out

    # -- affinity -----------------------------------------------------------------------
    def pin(self) -> int:
        """Hold every thread of the partition's VMs to the plan while a guaranteed VM
        has cores of its own (re-applied after the supervisor re-pins). Returns the
        number of threads moved."""
        if not any(c.dedicated for c in self.controls.values()):
            return 0
        cores = self.db.partition(self.partition).cpus
        vcpus: dict[str, list[int]] = {}
        others: dict[str, list[int]] = {}
        for name, pid in self.pids().items():
            threads = measure.read_threads(pid)
            vcpus[name] = measure.vcpu_threads(threads)
            others[name] = sorted(set(threads) - set(vcpus[name]))
        from fusuma.governor.qos import emulator_cores

        recs = {v.name: v for v in self.db.vms(self.partition) if v.name in vcpus}
        emulator: dict[str, list[int]] = {}
        for name, rec in recs.items():
            if rec.emulator != "shared":
                with contextlib.suppress(FusumaError):
                    emulator[name] = emulator_cores(rec, cores, recs.values())
        moved = 0
        for tid, want in affinity_plan(self.controls, vcpus, others, cores,
                                       emulator).items():
            with contextlib.suppress(OSError):
                if os.sched_getaffinity(tid) != set(want):
                    os.sched_setaffinity(tid, want)
                    moved += 1
        return moved

    # -- status -------------------------------------------------------------------------
    def status(self, limit: int = 50) -> dict[str, Any]:
        vms = []
        for name in sorted(set(self.controls) | set(self.loads)):
            ctl = self.controls.get(name)
            load = self.loads.get(name)
            vms.append({"name": name, **(ctl.as_json() if ctl else {}),
                        "load": load.as_json() if load else None})
        recent = list(self.decisions)[-limit:] if limit > 0 else []
        return {"partition": self.partition, "interval_s": self.interval,
                "thresholds": self.th.as_json(),
                "cores": self.db.partition(self.partition).cpus,
                "ticks": self.ticks, "errors": self.errors, "last_error": self.last_error,
                "host_pressure_pct": None if self.host_pressure_pct is None
                else round(self.host_pressure_pct, 2),
                "vms": vms, "decisions": [d.as_json() for d in recent],
                "decisions_kept": len(self.decisions)}
