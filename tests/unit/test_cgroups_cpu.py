"""Per-VM CPU policy in both cgroup drivers (set_cpu, cpu_stat) on the fake cgroupfs of
test_cgroups.py, with the cpu controller's files in the templates."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from fusuma.errors import CgroupError, SpecError
from fusuma.host.cgroups import (
    CONTROL_HEADROOM,
    CPU_WEIGHT_MAX,
    CpuPolicy,
    parse_flat_keyed,
    parse_pressure_total,
)
from fusuma.host.cgroups.v1 import SHARES_MAX, CgroupV1Driver, shares_for_weight
from fusuma.host.cgroups.v2 import vm_leaf_weight
from tests.unit.test_cgroups import (
    LIMITS,
    V1_CHILD,
    V2_CHILD,
    FakeCgroupFs,
    make_v1,
    make_v2,
    read,
)

V1_CPU = {**V1_CHILD["cpu,cpuacct"], "cpu.cfs_period_us": "100000\n",
          "cpu.cfs_quota_us": "-1\n", "cpu.idle": "0\n", "cpuacct.usage": "123456789\n",
          "cpu.stat": "nr_periods 10\nnr_throttled 4\nthrottled_time 2500000\n"}
V2_CPU = {**V2_CHILD, "cpu.weight": "100\n", "cpu.max": "max 100000\n", "cpu.idle": "0\n",
          "cpu.stat": "usage_usec 5000\nuser_usec 3000\nsystem_usec 2000\nnr_periods 7\n"
                      "nr_throttled 3\nthrottled_usec 1500\n",
          "cpu.pressure": "some avg10=1.00 avg60=0.50 avg300=0.10 total=4242\n"
                          "full avg10=0.00 avg60=0.00 avg300=0.00 total=0\n"}


def v1_with(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, cpu: dict[str, str]
            ) -> tuple[CgroupV1Driver, FakeCgroupFs, Path]:
    driver, fake, base = make_v1(tmp_path, monkeypatch, child={**V1_CHILD, "cpu,cpuacct": cpu})
    driver.create("p0", LIMITS)
    driver.create_leaf("p0", "vm.a")
    return driver, fake, base / "cpu,cpuacct" / "fusuma" / "p0" / "vm.a"


def test_v1_set_cpu_writes_shares_period_and_quota(tmp_path: Path,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    driver, _, leaf = v1_with(tmp_path, monkeypatch, V1_CPU)
    driver.set_cpu("p0", "vm.a", CpuPolicy(weight=1000, quota_us=25000))
    assert read(leaf / "cpu.shares") == "10240"
    assert read(leaf / "cpu.cfs_period_us") == "100000"
    assert read(leaf / "cpu.cfs_quota_us") == "25000"
    driver.set_cpu("p0", "vm.a", CpuPolicy())
    assert read(leaf / "cpu.shares") == "1024" and read(leaf / "cpu.cfs_quota_us") == "-1"


def test_v1_idle_is_set_after_and_cleared_before_the_weight(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    driver, fake, leaf = v1_with(tmp_path, monkeypatch, V1_CPU)
    fake.writes.clear()
    driver.set_cpu("p0", "vm.a", CpuPolicy(weight=1, idle=True))
    names = [p.name for p, _ in fake.writes]
    # The kernel refuses cpu.shares while cpu.idle is 1: shares first, then idle.
    assert names.index("cpu.shares") < names.index("cpu.idle")
    assert read(leaf / "cpu.idle") == "1"
    fake.writes.clear()
    driver.set_cpu("p0", "vm.a", CpuPolicy(weight=1, idle=True))
    assert "cpu.shares" not in [p.name for p, _ in fake.writes]
    fake.writes.clear()
    driver.set_cpu("p0", "vm.a", CpuPolicy(weight=100))
    names = [p.name for p, _ in fake.writes]
    assert names.index("cpu.idle") < names.index("cpu.shares")
    assert read(leaf / "cpu.idle") == "0" and read(leaf / "cpu.shares") == "1024"


def test_v1_without_cpu_idle_falls_back_to_minimal_shares(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    cpu = {k: v for k, v in V1_CPU.items() if k != "cpu.idle"}
    driver, _, leaf = v1_with(tmp_path, monkeypatch, cpu)
    assert not driver.cpu_idle_supported("p0", "vm.a")
    driver.set_cpu("p0", "vm.a", CpuPolicy(weight=50, idle=True))
    assert read(leaf / "cpu.shares") == "2" and not (leaf / "cpu.idle").exists()


def test_v1_cpu_stat(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    driver, _, _ = v1_with(tmp_path, monkeypatch, V1_CPU)
    st = driver.cpu_stat("p0", "vm.a")
    assert (st.usage_ns, st.nr_periods, st.nr_throttled, st.throttled_ns,
            st.pressure_some_us) == (123456789, 10, 4, 2500000, None)
    assert driver.cpu_idle_supported("p0", "vm.a")


def test_v1_missing_leaf_is_a_cgroup_error(tmp_path: Path,
                                           monkeypatch: pytest.MonkeyPatch) -> None:
    driver, _, _ = v1_with(tmp_path, monkeypatch, V1_CPU)
    with pytest.raises(CgroupError, match="does not exist"):
        driver.set_cpu("p0", "vm.nope", CpuPolicy())


def test_v2_set_cpu_and_stat(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    driver, fake, mount = make_v2(tmp_path, monkeypatch, child=V2_CPU)
    driver.create("p0", LIMITS)
    driver.create_leaf("p0", "vm.a")
    leaf = mount / "fusuma" / "p0" / "vm.a"
    driver.set_cpu("p0", "vm.a", CpuPolicy(weight=10000))
    # A VM's weight divided by CONTROL_HEADROOM: the control leaf's 10000 stays above.
    assert read(leaf / "cpu.weight") == "3906" and read(leaf / "cpu.max") == "max 100000"
    driver.set_cpu("p0", "vm.a", CpuPolicy(weight=100, quota_us=50000, period_us=50000))
    assert read(leaf / "cpu.max") == "50000 50000" and read(leaf / "cpu.weight") == "39"
    fake.writes.clear()
    driver.set_cpu("p0", "vm.a", CpuPolicy(weight=1, idle=True))
    names = [p.name for p, _ in fake.writes]
    assert names.index("cpu.weight") < names.index("cpu.idle")
    assert read(leaf / "cpu.idle") == "1" and read(leaf / "cpu.max") == "max 100000"
    st = driver.cpu_stat("p0", "vm.a")
    assert (st.usage_ns, st.nr_periods, st.nr_throttled, st.throttled_ns,
            st.pressure_some_us) == (5_000_000, 7, 3, 1_500_000, 4242)


def test_v2_without_cpu_controller_does_nothing(tmp_path: Path,
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    driver, fake, _ = make_v2(tmp_path, monkeypatch)   # V2_CHILD has no cpu.* files
    driver.create("p0", LIMITS)
    driver.create_leaf("p0", "vm.a")
    fake.writes.clear()
    driver.set_cpu("p0", "vm.a", CpuPolicy(weight=10000))
    assert fake.writes == []
    assert driver.cpu_stat("p0", "vm.a").usage_ns is None
    assert not driver.cpu_idle_supported("p0", "vm.a")


@pytest.mark.parametrize(("weight", "shares"), [(1, 2), (100, 1024), (1000, 10240),
                                                (10000, 102400)])
def test_shares_for_weight(weight: int, shares: int) -> None:
    assert shares_for_weight(weight) == shares


@pytest.mark.parametrize(("weight", "leaf"), [(1, 1), (2, 1), (100, 39), (1000, 391),
                                              (10000, 3906)])
def test_v2_vm_leaf_weight(weight: int, leaf: int) -> None:
    assert vm_leaf_weight(weight) == leaf


def test_the_control_leaf_outweighs_the_top_vm_alike_in_both_versions() -> None:
    """The same layout in v1 and v2: one level of leaves under the partition, the
    control leaf CONTROL_HEADROOM times a VM at the top weight, and the VMs' weights in
    the same ratios to each other."""
    v1 = SHARES_MAX / shares_for_weight(CPU_WEIGHT_MAX)
    v2 = CPU_WEIGHT_MAX / vm_leaf_weight(CPU_WEIGHT_MAX)
    assert v1 == CONTROL_HEADROOM and abs(v2 - CONTROL_HEADROOM) < 0.01
    for a, b in ((10000, 1000), (1000, 100), (10000, 100)):
        r1 = shares_for_weight(a) / shares_for_weight(b)
        r2 = vm_leaf_weight(a) / vm_leaf_weight(b)
        assert abs(r2 / r1 - 1) < 0.02, (a, b, r1, r2)


@pytest.mark.parametrize("kwargs", [{"weight": 0}, {"weight": 10001}, {"quota_us": 500},
                                    {"period_us": 10}])
def test_cpu_policy_rejects_impossible_values(kwargs: dict[str, Any]) -> None:
    with pytest.raises(SpecError):
        CpuPolicy(**kwargs)


def test_parsers() -> None:
    assert parse_pressure_total("some avg10=0.00 avg60=0.00 avg300=0.00 total=17\n"
                                "full avg10=0.00 avg60=0.00 avg300=0.00 total=3") == 17
    assert parse_pressure_total("garbage") is None
    assert parse_flat_keyed("a 1\nb x\nc -2\n") == {"a": 1, "c": -2}


# -- the control weight: the supervisor's leaf, a moving VM's paused QEMU ---------------

def test_v1_control_weight_is_above_any_vms(tmp_path: Path,
                                            monkeypatch: pytest.MonkeyPatch) -> None:
    driver, fake, leaf = v1_with(tmp_path, monkeypatch, V1_CPU)
    sup = leaf.parent / "supervisor"
    driver.create_leaf("p0", "supervisor")
    # The highest a VM gets: a guaranteed VM the governor raised to 10000.
    driver.set_cpu("p0", "vm.a", CpuPolicy(weight=CPU_WEIGHT_MAX))
    driver.set_control_cpu("p0", "supervisor")
    assert read(sup / "cpu.shares") == str(SHARES_MAX) == "262144"
    assert int(read(sup / "cpu.shares")) > 2 * int(read(leaf / "cpu.shares")) == 204800
    assert read(sup / "cpu.cfs_quota_us") == "-1" and read(sup / "cpu.idle") == "0"
    # A VM leaf taken from idle to control weight: idle off before the shares.
    driver.set_cpu("p0", "vm.a", CpuPolicy(weight=1, idle=True))
    fake.writes.clear()
    driver.set_control_cpu("p0", "vm.a")
    names = [p.name for p, _ in fake.writes]
    assert names.index("cpu.idle") < names.index("cpu.shares")
    assert read(leaf / "cpu.shares") == "262144" and read(leaf / "cpu.idle") == "0"
    # And back to a class's policy.
    driver.set_cpu("p0", "vm.a", CpuPolicy(weight=1000))
    assert read(leaf / "cpu.shares") == "10240"


def test_v1_control_weight_without_cpu_controller_does_nothing(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    driver, fake, _ = make_v1(tmp_path, monkeypatch)
    del driver.mounts["cpu"]
    driver.create("p0", LIMITS)
    driver.create_leaf("p0", "supervisor")
    fake.writes.clear()
    driver.set_control_cpu("p0", "supervisor")
    assert fake.writes == []
    with pytest.raises(CgroupError, match="does not exist"):
        v1_with(tmp_path / "b", monkeypatch, V1_CPU)[0].set_control_cpu("p0", "nope")


def test_v2_control_weight_is_the_top_of_the_scale_above_any_vms(tmp_path: Path,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    driver, fake, mount = make_v2(tmp_path, monkeypatch, child=V2_CPU)
    driver.create("p0", LIMITS)
    for leaf in ("supervisor", "vm.a"):
        driver.create_leaf("p0", leaf)
    sup = mount / "fusuma" / "p0" / "supervisor"
    driver.set_control_cpu("p0", "supervisor")
    assert read(sup / "cpu.weight") == "10000" == str(CPU_WEIGHT_MAX)
    # A VM at the top weight stays CONTROL_HEADROOM below it, as on v1.
    driver.set_cpu("p0", "vm.a", CpuPolicy(weight=CPU_WEIGHT_MAX))
    vm_top = int(read(mount / "fusuma" / "p0" / "vm.a" / "cpu.weight"))
    assert int(read(sup / "cpu.weight")) > 2.5 * vm_top
    assert read(sup / "cpu.max") == "max 100000" and read(sup / "cpu.idle") == "0"
    # No VM's weight is above it: CpuPolicy refuses one.
    with pytest.raises(SpecError):
        CpuPolicy(weight=CPU_WEIGHT_MAX + 1)
    vm = mount / "fusuma" / "p0" / "vm.a"
    driver.set_cpu("p0", "vm.a", CpuPolicy(weight=1, idle=True))
    driver.set_cpu("p0", "vm.a", CpuPolicy(weight=100, quota_us=10000))
    fake.writes.clear()
    driver.set_control_cpu("p0", "vm.a")
    assert read(vm / "cpu.weight") == "10000" and read(vm / "cpu.max") == "max 100000"
    assert "cpu.idle" not in [p.name for p, _ in fake.writes]
