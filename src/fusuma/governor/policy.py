"""The governor's decisions: a pure function from measurements to controls.

Once a tick (about a second) :func:`decide` gets each VM's :class:`~.measure.Load` and
what the governor has done so far (a :class:`Control` per VM), and returns the new
controls and the :class:`Decision` records that explain every change.

A guaranteed VM is *short* when its vCPUs wait on a runqueue more than
``wait_high_pct`` of the time. Each tick it stays short the governor takes the next
step that can still help, cheapest for the other VMs first:

1. raise its weight to the maximum;
2. where the partition has a spare core, give its vCPUs cores of their own (other
   VMs' threads move to the remaining cores: they lose no CPU time, only the core);
3. otherwise cap the burstable VMs with a quota, halving it each tick (from what they
   use now), never below their class's floor.

Best-effort VMs are never touched: they already run only on idle CPU. When a
guaranteed VM has been calm (wait under ``wait_low_pct``) for ``relax_after`` ticks the
caps it asked for are removed; when it is also idle, its weight and cores are given
back. A VM that needs the caps again soon after doubles its ``relax_after`` (up to
``relax_max_ticks``), so the governor does not oscillate.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable
from dataclasses import field
from typing import Any

from fusuma.frozen import frozen
from fusuma.governor.measure import Load
from fusuma.governor.qos import (
    CLASSES,
    GUARANTEED_BOOST_WEIGHT,
    QosClass,
)


@frozen
class Thresholds:
    wait_high_pct: float = 10.0   # a guaranteed vCPU waiting more than this is short
    wait_low_pct: float = 3.0     # ... and calm below this
    idle_pct: float = 5.0         # a guaranteed VM whose vCPUs run less is idle
    relax_ticks: int = 5          # calm ticks before a step is undone
    relax_max_ticks: int = 60
    throttle_factor: float = 0.5  # each throttle step multiplies the cap by this
    backoff_window_s: float = 30.0  # re-throttling this soon after relaxing backs off

    def as_json(self) -> dict[str, float]:
        return {k: float(v) for k, v in dataclasses.asdict(self).items()}


@frozen
class VmInput:
    """One running VM as the governor sees it this tick."""

    name: str
    qos: QosClass
    vcpus: int
    load: Load | None           # None until there are two readings


@frozen
class Control:
    """What the governor has done to one VM (a fresh Control is the class's base)."""

    qos: QosClass
    vcpus: int
    weight: int
    cap_cpus: float | None = None        # quota in CPUs (burstable only)
    dedicated: tuple[int, ...] = ()      # cores its vCPUs have to themselves
    wants_caps: bool = False             # a guaranteed VM that asked to cap others
    calm: int = 0
    relax_after: int = 5
    relaxed_at: float | None = None
    short: bool = False
    stuck: bool = False                  # short with no step left (said once)

    @classmethod
    def base(cls, qos: QosClass, vcpus: int, relax_ticks: int = 5) -> Control:
        return cls(qos=qos, vcpus=vcpus, weight=CLASSES[qos].base.weight,
                   relax_after=relax_ticks)

    def floor_cpus(self) -> float | None:
        per = CLASSES[self.qos].floor_cpus_per_vcpu
        return None if per is None else per * self.vcpus

    def as_json(self) -> dict[str, Any]:
        return {"qos": self.qos.value, "vcpus": self.vcpus, "weight": self.weight,
                "cap_cpus": None if self.cap_cpus is None else round(self.cap_cpus, 3),
                "floor_cpus": self.floor_cpus(), "dedicated_cores": list(self.dedicated),
                "short": self.short, "capping_others": self.wants_caps,
                "calm_ticks": self.calm, "relax_after_ticks": self.relax_after}


@frozen
class Decision:
    """One change the governor made, why, and the numbers it saw."""

    at: float                 # wall-clock time
    vm: str
    action: str
    reason: str
    numbers: dict[str, float | None] = field(default_factory=dict)

    def as_json(self) -> dict[str, Any]:
        return {"at": round(self.at, 3), "vm": self.vm, "action": self.action,
                "reason": self.reason,
                "numbers": {k: None if v is None else round(v, 2)
                            for k, v in self.numbers.items()}}


def _numbers(load: Load | None, **extra: float | None) -> dict[str, float | None]:
    out: dict[str, float | None] = {}
    if load is not None:
        out = {"wait_pct": load.wait_pct, "vcpu_pct": load.vcpu_pct, "cpu_pct": load.cpu_pct,
               "run_delay_ms": load.run_delay_ms, "pressure_pct": load.pressure_pct}
    out.update(extra)
    return out


class _Tick:
    """The working state of one call to :func:`decide`."""

    def __init__(self, inputs: list[VmInput], controls: dict[str, Control],
                 cores: list[int], th: Thresholds, now: float) -> None:
        self.th = th
        self.now = now
        self.cores = cores
        self.inputs = {v.name: v for v in inputs}
        self.decisions: list[Decision] = []
        self.reserved: set[int] = set()
        self.ctl: dict[str, Control] = {}
        for v in inputs:
            old = controls.get(v.name)
            if old is None or old.qos != v.qos or old.vcpus != v.vcpus:
                old = Control.base(v.qos, v.vcpus, th.relax_ticks)
            self.ctl[v.name] = old

    def say(self, vm: str, action: str, reason: str, **extra: float | None) -> None:
        self.decisions.append(Decision(self.now, vm, action, reason,
                                       _numbers(self.inputs[vm].load, **extra)))

    def change(self, vm: str, **changes: Any) -> Control:
        self.ctl[vm] = dataclasses.replace(self.ctl[vm], **changes)
        return self.ctl[vm]

    # -- cores ------------------------------------------------------------------------
    def taken(self, but: str | None = None) -> set[int]:
        return {c for n, ctl in self.ctl.items() if n != but for c in ctl.dedicated}

    def spare_for(self, vm: str) -> tuple[int, ...] | None:
        """Cores for ``vm``'s vCPUs alone, leaving at least one core for everything
        else; None when the partition has none to spare."""
        need = self.ctl[vm].vcpus
        free = [c for c in self.cores if c not in self.taken(vm) and c not in self.reserved]
        if len(free) - need < 1:
            return None
        return tuple(free[-need:])

    # -- steps --------------------------------------------------------------------------
    def drop_lost_cores(self) -> None:
        for name, ctl in self.ctl.items():
            if ctl.dedicated and not set(ctl.dedicated) <= set(self.cores):
                self.change(name, dedicated=())
                self.say(name, "release-core", "the partition no longer has core(s) "
                         f"{list(ctl.dedicated)}")

    def cappable(self) -> list[str]:
        """Burstable VMs whose cap can still go down."""
        out = []
        for name, ctl in self.ctl.items():
            floor = ctl.floor_cpus()
            if ctl.qos != QosClass.BURSTABLE or floor is None:
                continue
            if ctl.cap_cpus is None or ctl.cap_cpus > floor + 1e-9:
                out.append(name)
        return out

    def cap_step(self, because: str) -> bool:
        """Lower every burstable VM's cap one step; False if none could go lower."""
        did = False
        for name in self.cappable():
            ctl = self.ctl[name]
            load = self.inputs[name].load
            floor = ctl.floor_cpus() or 0.0
            use = load.cpu_pct / 100 if load is not None else float(ctl.vcpus)
            current = ctl.cap_cpus if ctl.cap_cpus is not None else float(ctl.vcpus)
            new = max(floor, min(current, use) * self.th.throttle_factor)
            if ctl.cap_cpus is not None and new >= ctl.cap_cpus - 1e-9:
                continue
            self.change(name, cap_cpus=new)
            self.say(name, "throttle", f"guaranteed VM {because} is short of CPU; capping "
                     f"burstable {name} at {new:.2f} CPU (floor {floor:.2f})",
                     cap_cpus=new, floor_cpus=floor)
            did = True
        return did

    def escalate(self, name: str, load: Load) -> None:
        ctl = self.ctl[name]
        wait = f"its vCPUs waited {load.wait_pct:.0f}% of the time"
        if ctl.weight < GUARANTEED_BOOST_WEIGHT:
            self.change(name, weight=GUARANTEED_BOOST_WEIGHT, stuck=False)
            self.say(name, "raise-weight", f"{wait} (over {self.th.wait_high_pct:g}%); "
                     f"weight {ctl.weight} -> {GUARANTEED_BOOST_WEIGHT}",
                     weight=GUARANTEED_BOOST_WEIGHT)
            return
        if not ctl.dedicated:
            cores = self.spare_for(name)
            if cores is not None:
                self.change(name, dedicated=cores, stuck=False)
                self.say(name, "own-core", f"{wait} at maximum weight; its vCPUs get "
                         f"core(s) {list(cores)} to themselves, other VMs move off them",
                         cores=float(len(cores)))
                return
            if not ctl.wants_caps and ctl.relaxed_at is not None and (
                    self.now - ctl.relaxed_at < self.th.backoff_window_s):
                ctl = self.change(name, relax_after=min(self.th.relax_max_ticks,
                                                      ctl.relax_after * 2))
            self.change(name, wants_caps=True)
            if self.cap_step(name):
                self.change(name, stuck=False)
                return
        if not ctl.stuck:
            self.change(name, stuck=True)
            why = ("on its own core(s): the wait comes from threads outside its "
                   "partition's VMs or its own QEMU threads" if ctl.dedicated else
                   "no spare core and every burstable VM is at its floor")
            self.say(name, "no-step-left", f"{wait}, but {why}")

    def relax(self, name: str, load: Load | None) -> None:
        ctl = self.ctl[name]
        if ctl.calm < ctl.relax_after:
            return
        idle = load is None or load.vcpu_pct < self.th.idle_pct
        if ctl.wants_caps:
            self.change(name, wants_caps=False, relaxed_at=self.now)
        if idle and (ctl.dedicated or ctl.weight != CLASSES[ctl.qos].base.weight):
            base = CLASSES[ctl.qos].base.weight
            self.change(name, dedicated=(), weight=base, relax_after=self.th.relax_ticks)
            self.say(name, "restore", f"idle for {ctl.calm} ticks: weight back to {base}"
                     + (f", core(s) {list(ctl.dedicated)} given back" if ctl.dedicated
                        else ""), weight=base)

    def uncap_all(self) -> None:
        for name, ctl in self.ctl.items():
            if ctl.cap_cpus is not None:
                self.change(name, cap_cpus=None)
                self.say(name, "unthrottle", "no guaranteed VM is short any more; cap "
                         f"{ctl.cap_cpus:.2f} CPU removed")


def decide(inputs: list[VmInput], controls: dict[str, Control], cores: list[int],
           th: Thresholds, now: float, reserved: Iterable[int] = ()
           ) -> tuple[dict[str, Control], list[Decision]]:
    """New controls for ``inputs`` (VMs gone since the last tick are dropped) and the
    decisions that changed something. ``reserved``: cores held for isolated emulator
    threads, never handed to a VM's vCPUs as cores of their own."""
    t = _Tick(inputs, controls, cores, th, now)
    t.reserved = set(reserved)
    t.drop_lost_cores()
    for v in sorted(inputs, key=lambda v: v.name):
        if v.qos != QosClass.GUARANTEED or v.load is None:
            continue
        ctl = t.ctl[v.name]
        if v.load.wait_pct > th.wait_high_pct:
            t.change(v.name, short=True, calm=0)
            t.escalate(v.name, v.load)
            continue
        quiet = v.load.wait_pct < th.wait_low_pct
        # "no step left" is said once until the VM is calm again, not at every wobble.
        t.change(v.name, short=False, calm=ctl.calm + 1 if quiet else ctl.calm,
                 stuck=ctl.stuck and not quiet)
        t.relax(v.name, v.load)
    if not any(c.wants_caps for c in t.ctl.values()):
        t.uncap_all()
    return t.ctl, t.decisions


def affinity_plan(controls: dict[str, Control], vcpu_tids: dict[str, list[int]],
                  other_tids: dict[str, list[int]], cores: list[int],
                  emulator: dict[str, list[int]] | None = None) -> dict[int, list[int]]:
    """Thread id -> cores while some guaranteed VM has cores of its own.

    Its vCPU threads get one dedicated core each; every other VM's vCPUs are spread
    round-robin over the remaining cores and its other threads may use all of them; a
    VM's own helper threads may also use its dedicated cores. Empty without dedications
    (the supervisor's own round-robin pinning then stands).
    """
    taken = sorted({c for ctl in controls.values() for c in ctl.dedicated})
    if not taken:
        return {}
    shared = [c for c in cores if c not in taken] or list(cores)
    plan: dict[int, list[int]] = {}
    offset = 0
    for name in sorted(vcpu_tids):
        ctl = controls.get(name)
        own = list(ctl.dedicated) if ctl is not None else []
        for i, tid in enumerate(vcpu_tids[name]):
            if own:
                plan[tid] = [own[i % len(own)]]
            else:
                plan[tid] = [shared[offset % len(shared)]]
                offset += 1
        for tid in other_tids.get(name, []):
            # A VM's emulator threads pinned apart (emulator = isolated or a core list)
            # stay there; else the shared cores and its own.
            plan[tid] = sorted((emulator or {}).get(name) or set(shared) | set(own))
    return plan
