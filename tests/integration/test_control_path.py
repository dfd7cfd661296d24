"""The control path is never starved: a guaranteed VM at the highest weight (10000,
what the governor raises it to) busy on its partition's only core, and beside it the
partition's supervisor answers within milliseconds and another VM of the partition
moves, zero-copy, with a downtime of milliseconds (issue 27), its destination QEMU
started within seconds even in the busy partition.

Before the control weight (the supervisor's leaf at weight 100, cpu.shares 1024, a
moving VM's QEMU at its class's) the supervisor waited ~100 scheduler slices per
wakeup beside such a VM; the figures of one run each way are in the commit that added
this test. The figures are printed (``-s``) as one JSON line."""

from __future__ import annotations

import json
import os
import statistics
import threading
import time
from pathlib import Path
from unittest import mock

import pytest

from fusuma.paths import Paths
from fusuma.supervisor import rpc
from fusuma.supervisor.client import SupervisorClient
from tests.conftest import Host
from tests.integration.test_qos import BUSY, wait_for

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]

# Bounds for the figures below (TCG, 2 cores, a loaded CI host): a supervisor answers
# a ping within a few ms when its core is free; ~100 slices of waiting is 100+ ms.
PING_MEDIAN_MS = 15.0
PING_P90_MS = 40.0
WAIT_PER_RUN_MS = 10.0
DOWNTIME_MS = 60.0
# A move's destination QEMU starts at the control weight: ~0.3 s under load. At its
# class's weight beside the busy VM its start took 22-29 s (and once failed the move).
PREPARE_MS = 10000.0
PINGS = 30


def leaf(host: Host, partition: str, name: str) -> tuple[Path, str, str]:
    """The CPU weight file of a leaf and the highest weight a VM gets there."""
    v1 = Path(f"/sys/fs/cgroup/cpu/{host.prefix}/{partition}/{name}")
    if v1.is_dir():
        return v1 / "cpu.shares", "102400", "262144"
    v2 = Path(f"/sys/fs/cgroup/{host.prefix}/{partition}/{name}")
    return v2 / "cpu.weight", "10000", "10000"


def ping_ms(client: SupervisorClient) -> float:
    t0 = time.perf_counter()
    assert client.send(rpc.Ping(), timeout=30.0, wait_up=0.0).pid > 0
    return (time.perf_counter() - t0) * 1000


def schedstat(pid: int) -> tuple[int, int]:
    """Run-queue wait (ns) and runs of all the process's threads (/proc schedstat)."""
    wait = runs = 0
    for t in Path(f"/proc/{pid}/task").iterdir():
        try:
            _, w, n = (t / "schedstat").read_text().split()
        except (OSError, ValueError):
            continue
        wait, runs = wait + int(w), runs + int(n)
    return wait, runs


def cpu_s(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def outside_lateness_ms(core: int, n: int = 100) -> list[float]:
    """How late a thread outside fusuma's cgroups (as the cluster agent runs), pinned to
    ``core``, wakes from 1 ms sleeps."""
    late: list[float] = []

    def run() -> None:
        os.sched_setaffinity(0, {core})
        for _ in range(n):
            t0 = time.perf_counter()
            time.sleep(0.001)
            late.append((time.perf_counter() - t0) * 1000 - 1.0)
    t = threading.Thread(target=run)
    t.start()
    t.join()
    return late


def p90(xs: list[float]) -> float:
    return sorted(xs)[int(0.9 * (len(xs) - 1))]


def test_a_busy_vm_at_the_top_weight_does_not_starve_the_control_path(host: Host) -> None:
    host.run("partition", "create", "p0", "--cpus", host.core(0), "--memory", "768")
    host.run("partition", "create", "p1", "--cpus", host.core(1), "--memory", "512")
    for name, qos in (("hog", "guaranteed"), ("mover", "burstable")):
        host.run("vm", "create", name, "-p", "p0", "--memory", "128", "--qos", qos)
        host.run("vm", "start", name, "--wait")
    weight, top_vm, control = leaf(host, "p0", "vm.hog")
    host.run("vm", "exec", "hog", "--", "/bin/sh", "-c", BUSY)
    # The highest weight a VM gets (the governor's raise), whatever it decides now.
    weight.write_text(top_vm)
    hog = host.vm("hog")["pid"]
    sup = host.part("p0")["supervisor_pid"]
    with mock.patch.dict(os.environ, host.env):
        client = SupervisorClient(Paths.from_env(), "p0")

    c0, t0 = cpu_s(hog), time.monotonic()
    w0, r0 = schedstat(sup)
    pings = []
    for _ in range(PINGS):
        pings.append(ping_ms(client))
        time.sleep(0.03)
    w1, r1 = schedstat(sup)
    hog_cores = (cpu_s(hog) - c0) / (time.monotonic() - t0)
    late = outside_lateness_ms(0)
    wait_per_run = (w1 - w0) / 1e6 / max(1, r1 - r0)

    moves = {}
    for to in ("p1", "p0"):   # out of the busy partition, and back into it
        res = host.run("migrate", "mover", "--to", to, "--json").json()
        assert res["mode"] == "zero-copy" and host.vm("mover")["partition"] == to
        moves[to] = res
    figures = {
        "hog_cores": round(hog_cores, 2), "hog_weight": weight.read_text().strip(),
        "supervisor_weight": leaf(host, "p0", "supervisor")[0].read_text().strip(),
        "ping_ms": {"median": round(statistics.median(pings), 2),
                    "p90": round(p90(pings), 2), "max": round(max(pings), 2)},
        "supervisor_wait_per_run_ms": round(wait_per_run, 3),
        "outside_late_ms": {"median": round(statistics.median(late), 3),
                            "max": round(max(late), 3)},
        "downtime_ms": {to: m["downtime_ms"] for to, m in moves.items()},
        "prepare_ms": {to: m["prepare_ms"] for to, m in moves.items()},
        "steps_ms": {to: m.get("steps_ms") for to, m in moves.items()},
    }
    print("control-path " + json.dumps(figures))
    # The load is real: the guest's loop holds its core, at a VM's highest weight.
    assert hog_cores > 0.4, figures   # 0.9+ alone; another namespace may share core 0
    assert figures["hog_weight"] == top_vm, figures
    assert statistics.median(pings) <= PING_MEDIAN_MS, figures
    assert p90(pings) <= PING_P90_MS, figures
    assert wait_per_run <= WAIT_PER_RUN_MS, figures
    for to, m in moves.items():
        assert m["downtime_ms"] is not None and m["downtime_ms"] <= DOWNTIME_MS, (to, figures)
        assert m["prepare_ms"] <= PREPARE_MS, (to, figures)
    assert figures["supervisor_weight"] == control, figures
    # The moved VM's leaf is back at its class's weight (burstable: 100, shares 1024).
    moved = leaf(host, "p0", "vm.mover")[0].read_text().strip()
    assert moved in ("1024", "100"), moved
    wait_for(lambda: host.vm("mover")["state"] == "running", 10, "mover running")
