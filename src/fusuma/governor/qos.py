"""QoS classes: what each class gets from the scheduler, its floor, and admission.

    guaranteed   its vCPUs' worth of CPU is reserved: a high weight, never a quota; the
                 governor may raise the weight further and give its vCPUs cores of
                 their own. A partition admits guaranteed VMs only while their vCPUs
                 fit in its cores.
    burstable    the default: an ordinary weight, may use any idle CPU; the governor may
                 cap it with a quota while a guaranteed VM waits, never below its floor.
    best-effort  runs on otherwise idle CPU: ``cpu.idle`` where the kernel has it,
                 else the minimal weight plus SCHED_IDLE for its QEMU threads.
"""

from __future__ import annotations

import contextlib
import enum
import os
from collections.abc import Iterable

from fusuma.errors import ResourceError
from fusuma.frozen import frozen
from fusuma.host.cgroups import CPU_PERIOD_US, CPU_WEIGHT_DEFAULT, CPU_WEIGHT_MAX, CpuPolicy
from fusuma.state import VmRecord


class QosClass(enum.StrEnum):
    GUARANTEED = "guaranteed"
    BURSTABLE = "burstable"
    BEST_EFFORT = "best-effort"


QOS_NAMES = tuple(q.value for q in QosClass)

# Weights on cgroup v2's scale (v1: x 10.24 as cpu.shares).
GUARANTEED_WEIGHT = 1000          # 10x a burstable VM, before the governor acts
GUARANTEED_BOOST_WEIGHT = CPU_WEIGHT_MAX
BURSTABLE_WEIGHT = CPU_WEIGHT_DEFAULT
# The governor never caps a burstable VM below this many CPUs per vCPU.
BURSTABLE_FLOOR_CPUS = 0.1


@frozen
class ClassPolicy:
    """A class's starting point and the floor the governor never goes below."""

    qos: QosClass
    base: CpuPolicy
    floor_weight: int
    floor_cpus_per_vcpu: float | None   # lowest quota per vCPU; None: never capped
    sched_idle_fallback: bool            # SCHED_IDLE threads where cpu.idle is missing


CLASSES: dict[QosClass, ClassPolicy] = {
    QosClass.GUARANTEED: ClassPolicy(QosClass.GUARANTEED, CpuPolicy(weight=GUARANTEED_WEIGHT),
                                     GUARANTEED_WEIGHT, None, False),
    QosClass.BURSTABLE: ClassPolicy(QosClass.BURSTABLE, CpuPolicy(weight=BURSTABLE_WEIGHT),
                                    BURSTABLE_WEIGHT, BURSTABLE_FLOOR_CPUS, False),
    QosClass.BEST_EFFORT: ClassPolicy(QosClass.BEST_EFFORT, CpuPolicy(weight=1, idle=True),
                                      1, None, True),
}


def qos_class(value: str) -> QosClass:
    try:
        return QosClass(value)
    except ValueError:
        raise ResourceError(f"unknown QoS class {value!r}; use one of "
                            f"{', '.join(QOS_NAMES)}.") from None


def quota_us(cpus: float, period_us: int = CPU_PERIOD_US) -> int:
    """A CFS quota for ``cpus`` CPUs per period (at least the kernel's 1 ms)."""
    return max(1000, round(cpus * period_us))


def policy_for(qos: QosClass, weight: int | None = None,
               cap_cpus: float | None = None) -> CpuPolicy:
    """The cgroup policy of a VM of class ``qos`` with the governor's adjustments."""
    base = CLASSES[qos].base
    return CpuPolicy(weight=weight if weight is not None else base.weight,
                     quota_us=None if cap_cpus is None else quota_us(cap_cpus),
                     idle=base.idle)


def guaranteed_vcpus(vms: Iterable[VmRecord], but: str | None = None) -> int:
    """vCPUs of the guaranteed VMs among ``vms`` (leaving out the one named ``but``)."""
    return sum(v.vcpus for v in vms if v.qos == QosClass.GUARANTEED and v.name != but)


def check_admission(partition: str, cores: int, vms: Iterable[VmRecord],
                    new: VmRecord) -> None:
    """Refuse a guaranteed VM ``new`` whose vCPUs would make the partition's guaranteed
    vCPUs exceed its cores; ``vms`` are the partition's VMs now."""
    if new.qos != QosClass.GUARANTEED:
        return
    held = guaranteed_vcpus(vms, but=new.name)
    new_vm, new_vcpus = new.name, new.vcpus
    if held + new_vcpus > cores:
        raise ResourceError(
            f"partition {partition!r} has {cores} core(s) and its guaranteed VMs already "
            f"reserve {held} vCPU(s), so guaranteed VM {new_vm!r} with {new_vcpus} vCPU(s) "
            "does not fit; give it fewer vCPUs, make it burstable (--qos burstable) or grow "
            "the partition.")


def check_cores(partition: str, cores: int, vms: Iterable[VmRecord]) -> None:
    """Refuse giving a partition fewer cores than its guaranteed VMs have vCPUs."""
    held = guaranteed_vcpus(vms)
    if held > cores:
        raise ResourceError(f"partition {partition!r} would have {cores} core(s) but its "
                            f"guaranteed VMs reserve {held} vCPU(s); keep at least {held} "
                            "core(s) or make some of them burstable first.")


def set_sched_idle(tids: Iterable[int]) -> int:
    """SCHED_IDLE for these threads (best effort: threads come and go); how many took it."""
    done = 0
    for tid in tids:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.sched_setscheduler(tid, os.SCHED_IDLE, os.sched_param(0))
            done += 1
    return done


def vcpu_order(vms: Iterable[VmRecord]) -> list[VmRecord]:
    """The order in which a partition's VMs get their vCPUs' cores, round-robin: the
    guaranteed ones first, so that their vCPUs hold the partition's first cores and the
    cores after them hold none (where ``emulator = "isolated"`` threads go)."""
    return sorted(vms, key=lambda v: (v.qos != QosClass.GUARANTEED, v.name))


def emulator_cores(vm: VmRecord, cores: list[int], vms: Iterable[VmRecord]) -> list[int]:
    """Where ``vm``'s emulator threads (QEMU's threads but its vCPUs) may run in a
    partition with ``cores`` and VMs ``vms`` (``vm`` among them or being added)."""
    from fusuma.host.topology import format_cpulist, parse_cpulist

    if vm.emulator == "shared":
        return list(cores)
    if vm.emulator == "isolated":
        held = guaranteed_vcpus([*[v for v in vms if v.name != vm.name], vm])
        free = list(cores)[held:]
        if not free:
            raise ResourceError(
                f"VM {vm.name!r} asks for isolated emulator threads, but the "
                f"{len(cores)} core(s) of partition {vm.partition!r} all hold guaranteed "
                f"vCPUs ({held}); give the partition a core more, or use emulator = "
                "\"shared\" or a core list.")
        return free
    wanted = parse_cpulist(vm.emulator)
    outside = [c for c in wanted if c not in cores]
    if outside:
        raise ResourceError(
            f"VM {vm.name!r} pins its emulator threads to core(s) {format_cpulist(outside)}, "
            f"which partition {vm.partition!r} (cores {format_cpulist(list(cores))}) does not "
            "have; name cores of its partition, or use shared or isolated.")
    return wanted


def check_emulators(partition: str, cores: list[int], vms: Iterable[VmRecord]) -> None:
    """Refuse a partition layout (cores, VMs) in which some VM's emulator placement
    cannot be met."""
    vms = list(vms)
    for v in vms:
        emulator_cores(v.with_(partition=partition), cores, vms)
