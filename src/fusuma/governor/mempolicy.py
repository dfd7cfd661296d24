"""The memory governor's decisions: a pure function from measurements to controls.

Once a tick :func:`decide` gets the host's free memory and its target
(:class:`HostMemory`), each running VM as a :class:`MemVm` (its memory class, floor, RAM,
what it holds now, its RAM cgroup's pressure and what the guest can do: free page
reporting, a balloon, a guest agent) and what the governor has done so far (a
:class:`MemControl` per VM), and returns the new controls and the
:class:`~fusuma.governor.policy.Decision` records that explain every change, with the
numbers behind it.

**Short of memory** is the host's free memory (``MemAvailable``) under its target, or
the host's memory pressure (PSI ``some avg10``, where the kernel has it) over
``psi_high_pct``. Each tick it stays short the governor takes the cheapest step left,
and only from burstable VMs:

1. **trim**: ask every burstable VM with free page reporting to hand its free pages
   back now (``vm trim``): nothing the guest uses is taken;
2. **balloon**: lower burstable VMs' balloon targets to cover the shortfall, at most
   ``balloon_step_pct`` of a VM's RAM per tick, never below its floor; cheapest VM first
   (the least pressure in its own RAM cgroup, then the most reclaimable memory);
3. **drop caches**: ask the guest agent of a burstable VM already at its floor to drop
   its page cache (what it costs the guest: re-reading files), at most once per
   ``drop_every_s``.

A guaranteed VM is never touched; one found ballooned (a record from before it became
guaranteed) gets its RAM back at once. When the host has had ``give_back_mib`` more than
its target free for ``relax_ticks`` ticks, balloons deflate a step per tick, the VM
under most pressure first; a burstable VM whose own RAM cgroup is under pressure while
the host is not short gets its step back first. When nothing is left to take, the
governor says so once (``no-step-left``) until the host recovers. The first tick that
finds the host no longer short says so too (``recovered``, with ``short_s``: from the
first short tick to this one), so the log shows where each shortage ended.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

from fusuma.frozen import frozen
from fusuma.governor.policy import Decision


@frozen
class MemThresholds:
    psi_high_pct: float = 10.0      # host (or a VM's RAM cgroup) pressure: short above this
    give_back_mib: int = 256        # free beyond the target before balloons deflate
    relax_ticks: int = 5            # ticks with that much free before a step is given back
    balloon_step_pct: float = 25.0  # the most a balloon moves per tick, % of the VM's RAM
    trim_every_s: float = 30.0      # a VM is asked to trim at most this often
    drop_every_s: float = 60.0      # ... and to drop its caches at most this often
    usage_high_pct: float = 95.0    # cgroup v1: usage / limit over this is pressure

    def as_json(self) -> dict[str, float]:
        return {k: float(v) for k, v in dataclasses.asdict(self).items()}


@frozen
class HostMemory:
    """The host this tick: its free memory (MiB, MemAvailable), the free memory it must
    keep (its target), and its memory pressure (PSI some avg10 %, None without PSI)."""

    free_mib: float
    target_free_mib: float
    psi_pct: float | None = None


@frozen
class CgroupPressure:
    """A VM's RAM cgroup: PSI some avg10 % (cgroup v2), else usage against its limit and
    the failures to charge since the last tick (cgroup v1 ``memory.failcnt``)."""

    psi_pct: float | None = None
    usage_mib: float | None = None
    limit_mib: float | None = None
    failcnt_delta: int = 0

    def pressed(self, th: MemThresholds) -> bool:
        if self.psi_pct is not None:
            return self.psi_pct > th.psi_high_pct
        if self.failcnt_delta > 0:
            return True
        if self.usage_mib is not None and self.limit_mib:
            return self.usage_mib * 100 / self.limit_mib > th.usage_high_pct
        return False

    def level(self) -> float:
        """A number to order VMs by (higher: more pressed)."""
        if self.psi_pct is not None:
            return self.psi_pct
        used = (self.usage_mib or 0.0) * 100 / self.limit_mib if self.limit_mib else 0.0
        return used + 100.0 * min(self.failcnt_delta, 1)


@frozen
class MemVm:
    """One running VM as the memory governor sees it this tick."""

    name: str
    memory_class: str             # guaranteed | burstable
    ram_mib: int
    floor_mib: int                # its RAM for a guaranteed VM
    resident_mib: float | None    # its guest RAM on the host now
    pressure: CgroupPressure = CgroupPressure()
    page_reporting: bool = False  # it can be asked to trim
    balloon: bool = False         # it has a virtio-balloon device
    agent: bool = False           # its guest agent answers (drop caches)

    @property
    def burstable(self) -> bool:
        return self.memory_class == "burstable" and self.floor_mib < self.ram_mib


@frozen
class MemControl:
    """What the memory governor has done to one VM."""

    balloon_mib: int              # the guest's balloon target: its RAM when not ballooned
    trimmed_at: float | None = None
    dropped_at: float | None = None

    def as_json(self) -> dict[str, Any]:
        return {"balloon_mib": self.balloon_mib, "trimmed_at": self.trimmed_at,
                "dropped_at": self.dropped_at}


@frozen
class MemState:
    """The governor's state between ticks beyond the VMs' controls."""

    roomy_ticks: int = 0          # consecutive ticks with give_back_mib beyond the target
    stuck: bool = False           # "no-step-left" said; quiet until the host recovers
    short_since: float | None = None   # the first tick of the current shortage


def _numbers(v: MemVm, host: HostMemory, **extra: float | None) -> dict[str, float | None]:
    out: dict[str, float | None] = {
        "host_free_mib": host.free_mib, "target_free_mib": host.target_free_mib,
        "host_psi_pct": host.psi_pct, "ram_mib": float(v.ram_mib),
        "floor_mib": float(v.floor_mib), "resident_mib": v.resident_mib,
        "vm_psi_pct": v.pressure.psi_pct}
    out.update(extra)
    return out


class _Tick:
    def __init__(self, vms: list[MemVm], controls: dict[str, MemControl], host: HostMemory,
                 th: MemThresholds, now: float) -> None:
        self.vms = {v.name: v for v in vms}
        self.host = host
        self.th = th
        self.now = now
        self.decisions: list[Decision] = []
        self.ctl: dict[str, MemControl] = {}
        for v in vms:
            old = controls.get(v.name)
            self.ctl[v.name] = old if old is not None else MemControl(balloon_mib=v.ram_mib)

    def say(self, vm: str, action: str, reason: str, **extra: float | None) -> None:
        self.decisions.append(Decision(self.now, vm, action, reason,
                                       _numbers(self.vms[vm], self.host, **extra)))

    def change(self, vm: str, **changes: Any) -> MemControl:
        self.ctl[vm] = dataclasses.replace(self.ctl[vm], **changes)
        return self.ctl[vm]

    def set_balloon(self, vm: str, target: int, action: str, reason: str) -> None:
        old = self.ctl[vm].balloon_mib
        self.change(vm, balloon_mib=target)
        self.say(vm, action, reason, balloon_from_mib=float(old), balloon_mib=float(target))

    def step_mib(self, v: MemVm) -> int:
        return max(1, math.ceil(v.ram_mib * self.th.balloon_step_pct / 100))

    def cheapest_first(self) -> list[MemVm]:
        """Burstable VMs, the one whose memory costs it least first: the least pressure
        in its RAM cgroup, then the most memory above its floor."""
        def reclaimable(v: MemVm) -> float:
            held = v.resident_mib if v.resident_mib is not None else float(v.ram_mib)
            return min(held, float(self.ctl[v.name].balloon_mib)) - v.floor_mib
        return sorted((v for v in self.vms.values() if v.burstable),
                      key=lambda v: (v.pressure.level(), -reclaimable(v), v.name))

    # -- the steps ----------------------------------------------------------------------
    def guard_guaranteed(self) -> None:
        for v in self.vms.values():
            ctl = self.ctl[v.name]
            if not v.burstable and ctl.balloon_mib < v.ram_mib:
                self.set_balloon(v.name, v.ram_mib, "deflate",
                                 f"{v.memory_class} VM: its RAM is never reclaimed; "
                                 f"balloon back to {v.ram_mib} MiB")
            elif v.burstable and ctl.balloon_mib < v.floor_mib:
                self.set_balloon(v.name, v.floor_mib, "deflate",
                                 f"balloon target {ctl.balloon_mib} MiB was below its "
                                 f"floor; back to {v.floor_mib} MiB")

    def recently(self, at: float | None, every: float) -> bool:
        return at is not None and self.now - at < every

    def trim(self, why: str) -> bool:
        asked = [v for v in self.cheapest_first() if v.page_reporting and not
                 self.recently(self.ctl[v.name].trimmed_at, self.th.trim_every_s)]
        for v in asked:
            self.change(v.name, trimmed_at=self.now)
            self.say(v.name, "trim", f"{why}; asking burstable {v.name} to hand its free "
                     "pages back (free page reporting)")
        return bool(asked)

    def inflate(self, why: str, shortfall: float) -> bool:
        left = shortfall
        did = False
        for v in self.cheapest_first():
            if left <= 0:
                break
            ctl = self.ctl[v.name]
            if not v.balloon or ctl.balloon_mib <= v.floor_mib:
                continue
            take = min(self.step_mib(v), ctl.balloon_mib - v.floor_mib, math.ceil(left))
            target = ctl.balloon_mib - take
            self.set_balloon(v.name, target, "inflate",
                             f"{why}; balloon of burstable {v.name} {ctl.balloon_mib} -> "
                             f"{target} MiB (floor {v.floor_mib} MiB)")
            left -= take
            did = True
        return did

    def drop_caches(self, why: str) -> bool:
        # Only where the balloon has no room left: a balloon step is cheaper for the guest.
        asked = [v for v in self.cheapest_first() if v.agent
                 and not (v.balloon and self.ctl[v.name].balloon_mib > v.floor_mib)
                 and not self.recently(self.ctl[v.name].dropped_at, self.th.drop_every_s)]
        for v in asked:
            self.change(v.name, dropped_at=self.now)
            self.say(v.name, "drop-caches", f"{why}; asking the guest agent of burstable "
                     f"{v.name} to drop its page cache")
        return bool(asked)

    def give_back(self, roomy: float) -> bool:
        """Deflate a step per VM, the most pressed first, within ``roomy`` MiB."""
        left = roomy
        did = False
        order = sorted((v for v in self.vms.values() if v.burstable),
                       key=lambda v: (-v.pressure.level(), v.name))
        for v in order:
            ctl = self.ctl[v.name]
            if left <= 0 or ctl.balloon_mib >= v.ram_mib:
                continue
            give = min(self.step_mib(v), v.ram_mib - ctl.balloon_mib, math.floor(left))
            if give <= 0:
                continue
            self.set_balloon(v.name, ctl.balloon_mib + give, "deflate",
                             f"the host has {self.host.free_mib:.0f} MiB free, "
                             f"{self.host.target_free_mib:.0f} MiB wanted: balloon of "
                             f"{v.name} {ctl.balloon_mib} -> {ctl.balloon_mib + give} MiB")
            left -= give
            did = True
        return did

    def relieve_pressed(self) -> None:
        """A burstable VM whose own RAM cgroup is under pressure, on a host that is not
        short: one step of its balloon back."""
        for v in self.vms.values():
            ctl = self.ctl[v.name]
            if v.burstable and v.pressure.pressed(self.th) and ctl.balloon_mib < v.ram_mib:
                target = min(v.ram_mib, ctl.balloon_mib + self.step_mib(v))
                self.set_balloon(v.name, target, "deflate",
                                 f"{v.name}'s own memory is under pressure and the host "
                                 f"is not short: balloon {ctl.balloon_mib} -> {target} MiB")


def short_of_memory(host: HostMemory, th: MemThresholds) -> str | None:
    """Why the host is short of memory, or None."""
    if host.free_mib < host.target_free_mib:
        return (f"the host has {host.free_mib:.0f} MiB free, under its target of "
                f"{host.target_free_mib:.0f} MiB")
    if host.psi_pct is not None and host.psi_pct > th.psi_high_pct:
        return (f"the host's memory pressure is {host.psi_pct:.1f}% (over "
                f"{th.psi_high_pct:g}%)")
    return None


def decide(vms: list[MemVm], controls: dict[str, MemControl], state: MemState,
           host: HostMemory, th: MemThresholds, now: float
           ) -> tuple[dict[str, MemControl], MemState, list[Decision]]:
    """New controls for ``vms`` (VMs gone since the last tick are dropped), the new
    state, and the decisions that changed something."""
    t = _Tick(vms, controls, host, th, now)
    t.guard_guaranteed()
    why = short_of_memory(host, th)
    if why is not None:
        shortfall = max(host.target_free_mib - host.free_mib, 0.0) or \
            float(min((t.step_mib(v) for v in t.vms.values()), default=0))
        since = now if state.short_since is None else state.short_since
        if t.trim(why) or t.inflate(why, shortfall) or t.drop_caches(why):
            return t.ctl, MemState(roomy_ticks=0, stuck=False, short_since=since), t.decisions
        if not state.stuck:
            reclaimable = sum(max(0.0, min(v.resident_mib or 0.0, t.ctl[v.name].balloon_mib)
                                  - v.floor_mib) for v in t.vms.values() if v.burstable)
            t.decisions.append(Decision(now, "-", "no-step-left",
                                        f"{why}, but every burstable VM is at its floor or "
                                        "was just asked", {
                                            "host_free_mib": host.free_mib,
                                            "target_free_mib": host.target_free_mib,
                                            "host_psi_pct": host.psi_pct,
                                            "reclaimable_mib": reclaimable}))
        return t.ctl, MemState(roomy_ticks=0, stuck=True, short_since=since), t.decisions
    if state.short_since is not None:
        t.decisions.append(Decision(now, "-", "recovered", (
            f"the host has {host.free_mib:.0f} MiB free, its target of "
            f"{host.target_free_mib:.0f} MiB met again after "
            f"{now - state.short_since:.1f} s short"), {
                "host_free_mib": host.free_mib, "target_free_mib": host.target_free_mib,
                "host_psi_pct": host.psi_pct, "short_s": round(now - state.short_since, 3)}))
    t.relieve_pressed()
    roomy = host.free_mib - host.target_free_mib - th.give_back_mib
    ticks = state.roomy_ticks + 1 if roomy > 0 else 0
    if ticks >= th.relax_ticks:
        t.give_back(roomy)
    return t.ctl, MemState(roomy_ticks=ticks, stuck=False), t.decisions
