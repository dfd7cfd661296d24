"""What a VM's QEMU gets from the host scheduler, read from /proc.

``/proc/PID/task/TID/schedstat`` holds three numbers per thread: nanoseconds on a CPU,
nanoseconds runnable but waiting on a runqueue (the run delay), and timeslices run.
QEMU started with ``debug-threads=on`` names its vCPU threads ``CPU n/TCG`` (or
``/KVM``), so the vCPUs are told apart from the I/O and helper threads without QMP.
Two readings make a :class:`Load`: percentages over the interval between them.
"""

from __future__ import annotations

import os
import re
import time
from pathlib import Path

from fusuma.frozen import frozen
from fusuma.host.cgroups import CpuStat, parse_pressure_total

_VCPU = re.compile(r"^CPU (\d+)/")
PROC = Path("/proc")


@frozen
class ThreadStat:
    tid: int
    name: str
    run_ns: int
    wait_ns: int
    slices: int

    @property
    def vcpu(self) -> int | None:
        """The vCPU index of a vCPU thread, None for QEMU's other threads."""
        m = _VCPU.match(self.name)
        return int(m.group(1)) if m else None


def read_threads(pid: int, proc: Path = PROC) -> dict[int, ThreadStat]:
    """Every thread of ``pid`` that could be read (threads may exit meanwhile)."""
    out: dict[int, ThreadStat] = {}
    try:
        tids = os.listdir(proc / str(pid) / "task")
    except OSError:
        return out
    for t in tids:
        base = proc / str(pid) / "task" / t
        try:
            fields = (base / "schedstat").read_text().split()
            name = (base / "comm").read_text().strip()
        except OSError:
            continue
        if len(fields) < 3:
            continue
        out[int(t)] = ThreadStat(int(t), name, int(fields[0]), int(fields[1]), int(fields[2]))
    return out


def vcpu_threads(threads: dict[int, ThreadStat]) -> list[int]:
    """Thread ids of the vCPUs in vCPU order."""
    found = sorted((s.vcpu, tid) for tid, s in threads.items() if s.vcpu is not None)
    return [tid for _, tid in found]


@frozen
class Reading:
    """One look at a VM's QEMU."""

    at: float                        # time.monotonic()
    threads: dict[int, ThreadStat]
    cgroup: CpuStat | None = None


def read(pid: int, cgroup: CpuStat | None = None) -> Reading:
    return Reading(time.monotonic(), read_threads(pid), cgroup)


@frozen
class Load:
    """A VM's share of the CPUs between two readings.

    Percentages are of one CPU; ``wait_pct`` is the run delay of its vCPU threads per
    vCPU: 100 means a vCPU waited for a CPU the whole interval.
    """

    interval_s: float
    vcpus: int
    cpu_pct: float          # all QEMU threads
    vcpu_pct: float         # vCPU threads, per vCPU
    wait_pct: float         # vCPU threads' runqueue wait, per vCPU
    run_delay_ms: float     # mean wait per timeslice, all threads
    throttled_ms: float | None
    pressure_pct: float | None   # PSI "some" of the VM's cgroup, where the kernel has it
    # QEMU's other threads (main loop, RCU, monitor I/O thread, workers): their CPU and
    # runqueue wait, summed, in % of one CPU. Under TCG the main loop delivers the
    # guest's timer and device interrupts, so its wait delays the guest although the
    # vCPU itself never waits.
    other_cpu_pct: float = 0.0
    other_wait_pct: float = 0.0

    def as_json(self) -> dict[str, float | int | None]:
        def r(x: float | None) -> float | None:
            return None if x is None else round(x, 2)
        return {"interval_s": round(self.interval_s, 3), "vcpus": self.vcpus,
                "cpu_pct": r(self.cpu_pct), "vcpu_pct": r(self.vcpu_pct),
                "wait_pct": r(self.wait_pct), "run_delay_ms": r(self.run_delay_ms),
                "throttled_ms": r(self.throttled_ms), "pressure_pct": r(self.pressure_pct),
                "other_cpu_pct": r(self.other_cpu_pct), "other_wait_pct": r(self.other_wait_pct)}


def load(prev: Reading, cur: Reading) -> Load:
    """The load between two readings of one QEMU (threads in both only)."""
    dt = max(cur.at - prev.at, 1e-6)
    common = [t for t in cur.threads if t in prev.threads]
    run = wait = slices = 0
    vrun = vwait = 0
    vcpus = 0
    for tid in common:
        a, b = prev.threads[tid], cur.threads[tid]
        d_run, d_wait = max(0, b.run_ns - a.run_ns), max(0, b.wait_ns - a.wait_ns)
        run += d_run
        wait += d_wait
        slices += max(0, b.slices - a.slices)
        if b.vcpu is not None:
            vcpus += 1
            vrun += d_run
            vwait += d_wait
    ns = dt * 1e9
    per = max(vcpus, 1)
    throttled = pressure = None
    if prev.cgroup is not None and cur.cgroup is not None:
        throttled = max(0, cur.cgroup.throttled_ns - prev.cgroup.throttled_ns) / 1e6
        if prev.cgroup.pressure_some_us is not None and cur.cgroup.pressure_some_us is not None:
            d = cur.cgroup.pressure_some_us - prev.cgroup.pressure_some_us
            pressure = 100.0 * max(0, d) / (dt * 1e6)
    return Load(interval_s=dt, vcpus=vcpus, cpu_pct=100.0 * run / ns,
                vcpu_pct=100.0 * vrun / ns / per, wait_pct=100.0 * vwait / ns / per,
                run_delay_ms=(wait / slices / 1e6) if slices else 0.0,
                throttled_ms=throttled, pressure_pct=pressure,
                other_cpu_pct=100.0 * (run - vrun) / ns,
                other_wait_pct=100.0 * (wait - vwait) / ns)


def host_pressure(path: Path = PROC / "pressure" / "cpu") -> int | None:
    """The host's PSI cpu "some" total in microseconds, None without PSI."""
    try:
        return parse_pressure_total(path.read_text())
    except OSError:
        return None


def host_steal_s(path: Path = PROC / "stat") -> float | None:
    """Seconds the hypervisor below this host took from all of its CPUs ("steal" in
    /proc/stat), None where it cannot be read. On a host that is itself a VM, a vCPU
    thread can run 100% with no runqueue wait and still make less progress."""
    try:
        fields = path.read_text().split("\n", 1)[0].split()
    except OSError:
        return None
    if len(fields) < 9 or fields[0] != "cpu":
        return None
    return int(fields[8]) / os.sysconf("SC_CLK_TCK")
