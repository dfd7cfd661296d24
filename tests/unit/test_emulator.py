"""Emulator threads (QEMU's threads but the vCPUs): shared, isolated or a core list,
with the guaranteed VMs' vCPUs on the partition's first cores."""

from __future__ import annotations

import pytest

from fusuma.errors import ResourceError, SpecError
from fusuma.governor.policy import Control, affinity_plan
from fusuma.governor.qos import (
    QosClass,
    check_emulators,
    emulator_cores,
    vcpu_order,
)
from fusuma.state import VmRecord


def vm(name: str, qos: str = "burstable", vcpus: int = 1, emulator: str = "shared"
       ) -> VmRecord:
    return VmRecord(name=name, partition="p", vcpus=vcpus, memory_mib=128, qos=qos,
                    emulator=emulator)


def test_guaranteed_vcpus_take_the_first_cores() -> None:
    vms = [vm("a"), vm("z", "guaranteed"), vm("m", "best-effort"), vm("g", "guaranteed")]
    assert [v.name for v in vcpu_order(vms)] == ["g", "z", "a", "m"]


def test_isolated_goes_where_no_guaranteed_vcpu_is() -> None:
    cores = [4, 5, 6, 7]
    g = vm("g", "guaranteed", vcpus=2, emulator="isolated")
    assert emulator_cores(g, cores, [g, vm("b")]) == [6, 7]
    assert emulator_cores(vm("s"), cores, [g]) == cores            # shared
    assert emulator_cores(vm("x", emulator="5"), cores, [g]) == [5]


def test_isolated_refused_with_the_reason() -> None:
    g = vm("g", "guaranteed", vcpus=1, emulator="isolated")
    with pytest.raises(ResourceError) as info:
        check_emulators("p", [0], [g])
    assert str(info.value) == (
        "VM 'g' asks for isolated emulator threads, but the 1 core(s) of partition 'p' "
        "all hold guaranteed vCPUs (1); give the partition a core more, or use emulator "
        "= \"shared\" or a core list.")
    with pytest.raises(ResourceError,
                       match=r"core\(s\) 3, which partition 'p' \(cores 0-1\) does not"):
        check_emulators("p", [0, 1], [vm("x", emulator="3")])
    check_emulators("p", [0, 1], [g])                              # core 1 is free


def test_spec_value() -> None:
    from fusuma.spec import VmSpec, build

    assert build(VmSpec, "vm", name="v", partition="p", emulator="3,1").emulator == "1,3"
    assert build(VmSpec, "vm", name="v", partition="p", emulator="isolated").emulator \
        == "isolated"
    with pytest.raises(SpecError, match="emulator 'elsewhere' is not shared, isolated"):
        build(VmSpec, "vm", name="v", partition="p", emulator="elsewhere")


def test_governor_plan_keeps_isolated_emulator_threads() -> None:
    ctl = {"g": Control(QosClass.GUARANTEED, 1, 10000, None, dedicated=(1,))}
    plan = affinity_plan(ctl, {"g": [10], "b": [20]}, {"g": [11], "b": [21]}, [0, 1, 2],
                         emulator={"g": [2]})
    assert plan[10] == [1] and plan[11] == [2]        # vCPU on its own core, emulator apart
    assert plan[21] == [0, 2]                          # others: the shared cores
