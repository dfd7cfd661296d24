"""The governor's decisions, measurements and QoS rules, with fake numbers only."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from fusuma.errors import ResourceError
from fusuma.governor.measure import (
    Load,
    Reading,
    ThreadStat,
    host_steal_s,
    load,
    read_threads,
    vcpu_threads,
)
from fusuma.governor.policy import (
    Control,
    Decision,
    Thresholds,
    VmInput,
    affinity_plan,
    decide,
)
from fusuma.governor.qos import (
    BURSTABLE_FLOOR_CPUS,
    GUARANTEED_BOOST_WEIGHT,
    GUARANTEED_WEIGHT,
    QosClass,
    check_admission,
    check_cores,
    policy_for,
)
from fusuma.host.cgroups import CpuStat
from fusuma.state import VmRecord

G, B, E = QosClass.GUARANTEED, QosClass.BURSTABLE, QosClass.BEST_EFFORT
TH = Thresholds(relax_ticks=3)


def busy(wait: float, vcpu: float = 60.0, cpu: float | None = None) -> Load:
    return Load(interval_s=1.0, vcpus=1, cpu_pct=cpu if cpu is not None else vcpu + 5,
                vcpu_pct=vcpu, wait_pct=wait, run_delay_ms=1.0, throttled_ms=None,
                pressure_pct=None)


IDLE = busy(0.0, vcpu=0.5)


class Run:
    """Feeds decide() tick after tick, like the loop does."""

    def __init__(self, cores: list[int]) -> None:
        self.cores = cores
        self.controls: dict[str, Control] = {}
        self.now = 1000.0
        self.log: list[Decision] = []

    def tick(self, *vms: VmInput) -> list[Decision]:
        self.now += 1.0
        self.controls, out = decide(list(vms), self.controls, self.cores, TH, self.now)
        self.log += out
        return out


def actions(ds: list[Decision]) -> list[tuple[str, str]]:
    return [(d.vm, d.action) for d in ds]


def test_nothing_happens_without_a_short_guaranteed_vm() -> None:
    run = Run([0, 1])
    for _ in range(5):
        assert run.tick(VmInput("g", G, 1, busy(2.0)), VmInput("b", B, 1, busy(80.0)),
                        VmInput("e", E, 1, busy(90.0))) == []
    assert run.controls["g"].weight == GUARANTEED_WEIGHT
    assert run.controls["b"].cap_cpus is None


def test_short_guaranteed_vm_gets_weight_then_its_own_core() -> None:
    run = Run([0, 1])
    others = (VmInput("b", B, 1, busy(50.0, cpu=100.0)), VmInput("e", E, 1, busy(90.0)))
    first = run.tick(VmInput("g", G, 1, busy(40.0)), *others)
    assert actions(first) == [("g", "raise-weight")]
    assert run.controls["g"].weight == GUARANTEED_BOOST_WEIGHT
    assert first[0].numbers["wait_pct"] == 40.0     # the reason carries the measurement
    second = run.tick(VmInput("g", G, 1, busy(40.0)), *others)
    assert actions(second) == [("g", "own-core")]
    assert run.controls["g"].dedicated == (1,)
    # A core of its own is enough: nobody is capped.
    assert run.controls["b"].cap_cpus is None
    # Still short on its own core: said once, and no burstable VM pays for it.
    third = run.tick(VmInput("g", G, 1, busy(40.0)), *others)
    assert actions(third) == [("g", "no-step-left")]
    assert "own core" in third[0].reason
    assert run.tick(VmInput("g", G, 1, busy(40.0)), *others) == []
    assert run.controls["b"].cap_cpus is None


def test_without_a_spare_core_burstable_vms_are_capped_down_to_their_floor() -> None:
    run = Run([0])
    b = VmInput("b", B, 2, busy(30.0, cpu=100.0))
    e = VmInput("e", E, 1, busy(90.0))
    assert actions(run.tick(VmInput("g", G, 1, busy(50.0)), b, e)) == [("g", "raise-weight")]
    caps = []
    for _ in range(10):
        run.tick(VmInput("g", G, 1, busy(50.0)), b, e)
        caps.append(run.controls["b"].cap_cpus)
    # From its use (1.0 CPU) halving each tick, never below 0.1 CPU per vCPU.
    assert caps[:3] == [0.5, 0.25, pytest.approx(0.2)]
    assert min(c for c in caps if c is not None) == pytest.approx(2 * BURSTABLE_FLOOR_CPUS)
    assert run.controls["e"].cap_cpus is None           # best-effort is never touched
    assert [d.action for d in run.log if d.vm == "g"].count("no-step-left") == 1
    assert all(d.numbers.get("floor_cpus") == pytest.approx(0.2)
               for d in run.log if d.action == "throttle")


def test_cap_starts_from_what_a_burstable_vm_uses() -> None:
    run = Run([0])
    b = VmInput("b", B, 1, busy(10.0, vcpu=35.0, cpu=40.0))
    run.tick(VmInput("g", G, 1, busy(50.0)), b)
    run.tick(VmInput("g", G, 1, busy(50.0)), b)
    assert run.controls["b"].cap_cpus == pytest.approx(0.2)


def test_caps_are_removed_once_the_pressure_is_gone() -> None:
    run = Run([0])
    b = VmInput("b", B, 1, busy(30.0, cpu=100.0))
    for _ in range(3):
        run.tick(VmInput("g", G, 1, busy(50.0)), b)
    assert run.controls["b"].cap_cpus is not None
    for _ in range(TH.relax_ticks - 1):
        assert run.tick(VmInput("g", G, 1, busy(1.0)), b) == []
    out = run.tick(VmInput("g", G, 1, busy(1.0)), b)
    assert actions(out) == [("b", "unthrottle")]
    assert run.controls["b"].cap_cpus is None
    # Busy, not idle: the raised weight stays.
    assert run.controls["g"].weight == GUARANTEED_BOOST_WEIGHT


def test_waiting_between_the_thresholds_neither_acts_nor_relaxes() -> None:
    run = Run([0])
    b = VmInput("b", B, 1, busy(30.0, cpu=100.0))
    for _ in range(2):
        run.tick(VmInput("g", G, 1, busy(50.0)), b)
    for _ in range(10):
        assert run.tick(VmInput("g", G, 1, busy(5.0)), b) == []
    assert run.controls["b"].cap_cpus is not None


def test_needing_caps_again_soon_doubles_the_wait_before_relaxing() -> None:
    run = Run([0])
    b = VmInput("b", B, 1, busy(30.0, cpu=100.0))
    for _ in range(2):
        run.tick(VmInput("g", G, 1, busy(50.0)), b)
    for _ in range(TH.relax_ticks):
        run.tick(VmInput("g", G, 1, busy(1.0)), b)
    assert run.controls["b"].cap_cpus is None
    run.tick(VmInput("g", G, 1, busy(50.0)), b)
    assert run.controls["g"].relax_after == 2 * TH.relax_ticks
    assert run.controls["b"].cap_cpus is not None


def test_idle_guaranteed_vm_gives_back_weight_and_core() -> None:
    run = Run([0, 1])
    for _ in range(2):
        run.tick(VmInput("g", G, 1, busy(40.0)), VmInput("b", B, 1, busy(40.0)))
    assert run.controls["g"].dedicated == (1,)
    for _ in range(TH.relax_ticks):
        out = run.tick(VmInput("g", G, 1, IDLE), VmInput("b", B, 1, busy(0.0)))
    assert actions(out) == [("g", "restore")]
    assert run.controls["g"].dedicated == () and run.controls["g"].weight == GUARANTEED_WEIGHT


def test_spare_core_leaves_one_core_for_the_others() -> None:
    run = Run([0, 1, 2])
    g1 = VmInput("g1", G, 2, busy(40.0))
    g2 = VmInput("g2", G, 1, busy(40.0))
    for _ in range(2):
        run.tick(g1, g2)
    assert run.controls["g1"].dedicated == (1, 2)
    assert run.controls["g2"].dedicated == ()         # only core 0 would be left


def test_resize_takes_away_a_dedicated_core() -> None:
    run = Run([0, 1])
    for _ in range(2):
        run.tick(VmInput("g", G, 1, busy(40.0)))
    run.cores = [0]
    out = run.tick(VmInput("g", G, 1, busy(1.0)))
    assert ("g", "release-core") in actions(out)
    assert run.controls["g"].dedicated == ()


def test_a_vm_without_a_measurement_yet_is_left_alone() -> None:
    run = Run([0])
    assert run.tick(VmInput("g", G, 1, None), VmInput("b", B, 1, busy(50.0))) == []


def test_affinity_plan() -> None:
    controls = {"g": Control(G, 1, GUARANTEED_BOOST_WEIGHT, dedicated=(1,)),
                "b": Control.base(B, 2), "e": Control.base(E, 1)}
    plan = affinity_plan(controls, {"g": [10], "b": [20, 21], "e": [30]},
                         {"g": [11], "b": [22], "e": [31]}, [0, 1, 2])
    assert plan[10] == [1]
    assert {plan[20][0], plan[21][0], plan[30][0]} <= {0, 2}
    assert plan[20] != plan[21]                   # spread over the shared cores
    assert plan[11] == [0, 1, 2] and plan[22] == [0, 2] and plan[31] == [0, 2]
    assert affinity_plan({"b": Control.base(B, 1)}, {"b": [1]}, {}, [0, 1]) == {}


# -- measurements -----------------------------------------------------------------------
def _t(tid: int, name: str, run: int, wait: int, slices: int) -> ThreadStat:
    return ThreadStat(tid, name, run, wait, slices)


def test_load_between_two_readings() -> None:
    a = Reading(10.0, {1: _t(1, "qemu-system-x86", 0, 0, 0), 2: _t(2, "CPU 0/TCG", 0, 0, 0),
                       3: _t(3, "CPU 1/TCG", 0, 0, 0)}, CpuStat(None, 0, 0, 0, 1000))
    b = Reading(12.0, {1: _t(1, "qemu-system-x86", 200_000_000, 0, 10),
                       2: _t(2, "CPU 0/TCG", 1_000_000_000, 500_000_000, 40),
                       3: _t(3, "CPU 1/TCG", 600_000_000, 300_000_000, 30),
                       4: _t(4, "worker", 5, 5, 1)},          # new thread: not counted
               CpuStat(None, 4, 2, 30_000_000, 501_000))
    ld = load(a, b)
    assert ld.vcpus == 2 and ld.interval_s == 2.0
    assert ld.cpu_pct == pytest.approx(90.0)          # 1.8 s of CPU in 2 s
    assert ld.vcpu_pct == pytest.approx(40.0)         # 1.6 s over 2 vCPUs x 2 s
    assert ld.wait_pct == pytest.approx(20.0)
    assert ld.run_delay_ms == pytest.approx(800 / 80)
    assert ld.throttled_ms == pytest.approx(30.0)
    assert ld.pressure_pct == pytest.approx(25.0)
    # The main loop (tid 1) on its own: 0.2 s of CPU, no wait, in 2 s.
    assert ld.other_cpu_pct == pytest.approx(10.0)
    assert ld.other_wait_pct == pytest.approx(0.0)


def test_host_steal_from_proc_stat(tmp_path: Path) -> None:
    stat = tmp_path / "stat"
    hz = os.sysconf("SC_CLK_TCK")
    stat.write_text(f"cpu  100 0 50 1000 4 0 1 {3 * hz} 0 0\ncpu0 1 2 3 4 5 6 7 8 9 10\n")
    assert host_steal_s(stat) == pytest.approx(3.0)
    stat.write_text("intr 1 2\n")
    assert host_steal_s(stat) is None
    assert host_steal_s(tmp_path / "missing") is None


def test_read_threads_from_a_fake_proc(tmp_path: Path) -> None:
    for tid, name, stat in ((7, "qemu-system-x86", "10 20 3"), (9, "CPU 1/TCG", "1 2 3"),
                            (8, "CPU 0/KVM", "4 5 6")):
        d = tmp_path / "7" / "task" / str(tid)
        d.mkdir(parents=True)
        (d / "comm").write_text(name + "\n")
        (d / "schedstat").write_text(stat + "\n")
    threads = read_threads(7, proc=tmp_path)
    assert threads[7].run_ns == 10 and threads[7].wait_ns == 20 and threads[7].vcpu is None
    assert vcpu_threads(threads) == [8, 9]
    assert read_threads(99, proc=tmp_path) == {}


# -- classes and admission --------------------------------------------------------------
def _vm(name: str, vcpus: int, qos: str) -> VmRecord:
    return VmRecord(name=name, partition="p0", vcpus=vcpus, memory_mib=256, qos=qos)


def test_admission_refuses_guaranteed_vcpus_beyond_the_cores() -> None:
    vms = [_vm("a", 1, "guaranteed"), _vm("b", 4, "burstable")]
    check_admission("p0", 2, vms, _vm("c", 1, "guaranteed"))
    check_admission("p0", 2, vms, _vm("c", 8, "best-effort"))
    with pytest.raises(ResourceError, match=r"partition 'p0' has 2 core\(s\) and its "
                       r"guaranteed VMs already reserve 1 vCPU\(s\)"):
        check_admission("p0", 2, vms, _vm("c", 2, "guaranteed"))
    with pytest.raises(ResourceError, match="keep at least 2 core"):
        check_cores("p0", 1, [*vms, _vm("c", 1, "guaranteed")])


def test_class_policies() -> None:
    assert policy_for(G).weight == GUARANTEED_WEIGHT and policy_for(G).quota_us is None
    assert policy_for(E).idle and policy_for(E).weight == 1
    assert policy_for(B, cap_cpus=0.25).quota_us == 25000
    assert policy_for(B, cap_cpus=0.001).quota_us == 1000     # the kernel's minimum


def test_no_step_left_is_said_once_until_calm() -> None:
    run = Run([0, 1])
    for _ in range(3):
        run.tick(VmInput("g", G, 1, busy(40.0)))
    for wait in (5.0, 40.0, 6.0, 40.0):                  # wobbling, never calm
        run.tick(VmInput("g", G, 1, busy(wait)))
    assert [d.action for d in run.log].count("no-step-left") == 1
    run.tick(VmInput("g", G, 1, busy(1.0)))              # calm
    run.tick(VmInput("g", G, 1, busy(40.0)))
    assert [d.action for d in run.log].count("no-step-left") == 2


def test_no_core_of_its_own_out_of_the_emulators_cores() -> None:
    """A core held for isolated emulator threads is never handed to vCPUs."""
    controls: dict[str, Control] = {}
    g = VmInput("g", G, 1, busy(40.0))
    for now in (1.0, 2.0):
        controls, _ = decide([g], controls, [0, 1, 2], TH, now, reserved={2})
    assert controls["g"].dedicated == (1,)            # not core 2, though it is free
    controls = {}
    for now in (1.0, 2.0):
        controls, _ = decide([g], controls, [0, 1], TH, now, reserved={1})
    assert controls["g"].dedicated == ()              # only core 0 would be left
