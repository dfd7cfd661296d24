"""The memory governor's policy as data: situations -> decisions (fusuma.governor.mempolicy).

Each case gives the host, the VMs, what the governor did before, and expects the actions
taken (VM, action, balloon target) in order; the invariants (never a guaranteed VM,
never below a floor) are checked on every case."""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest

from fusuma.governor.mempolicy import (
    CgroupPressure,
    HostMemory,
    MemControl,
    MemState,
    MemThresholds,
    MemVm,
    decide,
)

TH = MemThresholds()
NOW = 1000.0


def g(name: str, ram: int = 1024, resident: float = 900.0, **kw: object) -> MemVm:
    return MemVm(name, "guaranteed", ram, ram, resident, balloon=True, page_reporting=True,
                 agent=True, **kw)  # type: ignore[arg-type]


def b(name: str, ram: int = 1024, floor: int = 256, resident: float = 900.0,
      psi: float | None = None, **kw: object) -> MemVm:
    opts: dict[str, object] = {"balloon": True, "page_reporting": True, "agent": True}
    opts.update(kw)
    return MemVm(name, "burstable", ram, floor, resident, CgroupPressure(psi_pct=psi),
                 **opts)  # type: ignore[arg-type]


TRIMMED = NOW - 1           # asked to trim a second ago: not again this tick
SHORT = HostMemory(free_mib=1000, target_free_mib=1500)          # 500 MiB short
ROOMY = HostMemory(free_mib=4000, target_free_mib=1500)


@dataclass
class Case:
    name: str
    host: HostMemory
    vms: list[MemVm]
    controls: dict[str, MemControl] = field(default_factory=dict)
    state: MemState = field(default_factory=MemState)
    # (vm, action, balloon target after it or None)
    want: list[tuple[str, str, int | None]] = field(default_factory=list)
    stuck: bool = False


CASES = [
    Case("enough free memory: nothing to do", ROOMY, [g("g0"), b("b0")]),
    Case("short: trim the burstable VMs first, never the guaranteed one", SHORT,
         [g("g0"), b("b0"), b("b1")],
         want=[("b0", "trim", None), ("b1", "trim", None)]),
    Case("short and trimmed: balloon, cheapest first, one step (25% of RAM) each",
         SHORT, [g("g0"), b("b0", psi=5.0), b("b1", psi=0.0)],
         controls={"b0": MemControl(1024, trimmed_at=TRIMMED),
                   "b1": MemControl(1024, trimmed_at=TRIMMED)},
         want=[("b1", "inflate", 1024 - 256), ("b0", "inflate", 1024 - 244)]),
    Case("a VM without free page reporting is ballooned at once", SHORT,
         [b("b0", page_reporting=False)],
         want=[("b0", "inflate", 1024 - 256)]),
    Case("never below the floor", SHORT, [b("b0", floor=900, page_reporting=False)],
         want=[("b0", "inflate", 900)]),
    Case("balloons at their floors: drop caches through the agent", SHORT,
         [b("b0", page_reporting=False), b("b1", page_reporting=False, agent=False)],
         controls={"b0": MemControl(256), "b1": MemControl(256)},
         want=[("b0", "drop-caches", None)]),
    Case("nothing left: said once", SHORT,
         [g("g0"), b("b0", page_reporting=False, agent=False)],
         controls={"b0": MemControl(256)},
         want=[("-", "no-step-left", None)], stuck=True),
    Case("nothing left, said already: quiet", SHORT,
         [b("b0", page_reporting=False, agent=False)],
         controls={"b0": MemControl(256)}, state=MemState(stuck=True), stuck=True),
    Case("only guaranteed VMs: none is touched", SHORT, [g("g0"), g("g1")],
         want=[("-", "no-step-left", None)], stuck=True),
    Case("a guaranteed VM found ballooned gets its RAM back", ROOMY, [g("g0")],
         controls={"g0": MemControl(512)}, want=[("g0", "deflate", 1024)]),
    Case("a balloon below the floor is put back to the floor", SHORT,
         [b("b0", page_reporting=False, agent=False)], controls={"b0": MemControl(100)},
         want=[("b0", "deflate", 256), ("-", "no-step-left", None)], stuck=True),
    Case("pressure by PSI alone counts as short", HostMemory(4000, 1500, psi_pct=30.0),
         [b("b0")], want=[("b0", "trim", None)]),
    Case("roomy, but not for long enough: keep the balloons", ROOMY,
         [b("b0")], controls={"b0": MemControl(512)}, state=MemState(roomy_ticks=2)),
    Case("roomy long enough: give back a step, the most pressed VM first", ROOMY,
         [b("b0", psi=1.0), b("b1", psi=8.0)],
         controls={"b0": MemControl(512), "b1": MemControl(512)},
         state=MemState(roomy_ticks=4),
         want=[("b1", "deflate", 768), ("b0", "deflate", 768)]),
    Case("give back no more than the room there is",
         HostMemory(free_mib=1900, target_free_mib=1500),       # 400 - 256 = 144 MiB
         [b("b0"), b("b1")], controls={"b0": MemControl(512), "b1": MemControl(512)},
         state=MemState(roomy_ticks=4), want=[("b0", "deflate", 656)]),
    Case("a pressed VM on a host that is not short gets a step back at once",
         HostMemory(free_mib=1600, target_free_mib=1500), [b("b0", psi=40.0), b("b1")],
         controls={"b0": MemControl(512), "b1": MemControl(512)},
         want=[("b0", "deflate", 768)]),
    Case("short no more: the shortage's end is said once, with how long it lasted", ROOMY,
         [b("b0")], controls={"b0": MemControl(512)}, state=MemState(short_since=NOW - 8),
         want=[("-", "recovered", None)]),
    Case("cgroup v1: a failed charge is pressure", HostMemory(1600, 1500),
         [MemVm("b0", "burstable", 1024, 256, 700.0,
                CgroupPressure(usage_mib=700, limit_mib=1100, failcnt_delta=3),
                balloon=True)],
         controls={"b0": MemControl(512)}, want=[("b0", "deflate", 768)]),
]


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_policy(case: Case) -> None:
    ctl, state, decisions = decide(case.vms, case.controls, case.state, case.host, TH, NOW)
    got = [(d.vm, d.action, int(d.numbers["balloon_mib"] or 0)
            if "balloon_mib" in d.numbers else None) for d in decisions]
    assert got == case.want
    assert state.stuck == case.stuck
    for v in case.vms:
        if v.memory_class == "guaranteed":
            assert ctl[v.name].balloon_mib == v.ram_mib
            assert all(d.action not in ("trim", "drop-caches", "inflate")
                       for d in decisions if d.vm == v.name)
        else:
            assert v.floor_mib <= ctl[v.name].balloon_mib <= v.ram_mib
    for d in decisions:
        assert d.reason and "host_free_mib" in d.numbers


def test_a_burst_is_met_then_given_back() -> None:
    """Ticks of a burst and its end: trim, then balloon step by step to the floor, then
    back after the host has been roomy for relax_ticks."""
    vms = [g("g0"), b("b0", page_reporting=True)]
    ctl: dict[str, MemControl] = {}
    state = MemState()
    actions = []
    for i in range(6):
        ctl, state, ds = decide(vms, ctl, state, SHORT, TH, NOW + i)
        actions += [(d.action, ctl[d.vm].balloon_mib if d.vm in ctl else None) for d in ds]
    assert actions == [("trim", 1024), ("inflate", 768), ("inflate", 512),
                       ("inflate", 256), ("drop-caches", 256), ("no-step-left", None)]
    for i in range(TH.relax_ticks + 3):
        ctl, state, ds = decide(vms, ctl, state, ROOMY, TH, NOW + 10 + i)
    assert ctl["b0"].balloon_mib == 1024 and ctl["g0"].balloon_mib == 1024
    assert not state.stuck and state.short_since is None


def test_the_recovered_decision_says_how_long_the_host_was_short() -> None:
    vms = [b("b0", page_reporting=False)]
    ctl: dict[str, MemControl] = {}
    state = MemState()
    for i in range(3):
        ctl, state, _ = decide(vms, ctl, state, SHORT, TH, NOW + 2 * i)
    assert state.short_since == NOW
    ctl, state, ds = decide(vms, ctl, state, ROOMY, TH, NOW + 6)
    assert [d.action for d in ds] == ["recovered"] and state.short_since is None
    assert ds[0].numbers["short_s"] == 6.0 and "met again after 6.0 s short" in ds[0].reason
    _, state, ds = decide(vms, ctl, state, ROOMY, TH, NOW + 8)
    assert ds == []
