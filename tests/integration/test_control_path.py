"""The control path is never starved (issue 27): a guaranteed VM at the highest weight
(10000, what the governor raises it to) busy on its partition's only core, and beside it
the partition's supervisor answers within milliseconds and another VM of the partition
moves, zero-copy, with a downtime of milliseconds, its destination QEMU started within
seconds even in the busy partition.

One run measures three phases with the same two VMs: the partition quiet; under the load
with the supervisor's leaf at the weight it had before the control weight (100, v1
cpu.shares 1024: written by hand, as a supervisor of that version left it); and under
the load once ``partition restart`` has put a new supervisor in, which adopts the
running QEMUs and gives its leaf the control weight. The middle phase shows that the
load does starve a supervisor at the old weight, so that the bounds of the last phase
can fail; its figures are asserted only to be worse. The figures of every phase are
printed (``-s``) as one JSON line."""

from __future__ import annotations

import json
import math
import os
import statistics
import threading
import time
from pathlib import Path
from typing import Any
from unittest import mock

import pytest

from fusuma.paths import Paths
from fusuma.supervisor import rpc
from fusuma.supervisor.client import SupervisorClient
from tests.conftest import Host
from tests.integration.test_qos import BUSY, wait_for

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]

# Bounds for the control weight's phase (TCG, 2 cores, a loaded CI host). Measured in
# one run (docs/results/control-path.md): quiet, a ping's median 0.8 ms and p99 4.7 ms;
# beside the busy VM at the old weight 54 ms and 358 ms (it waited ~70 ms per run on
# the run queue); at the control weight 0.6 ms and 4.3 ms. The bounds leave a loaded CI
# host room and still fail the old weight by 5x (median) and 12x (p99).
PING_MEDIAN_MS = 10.0
PING_P99_MS = 30.0
WAIT_PER_RUN_MS = 10.0
DOWNTIME_MS = 60.0
# A move's destination QEMU starts at the control weight: ~0.3 s under load. At its
# class's weight beside the busy VM its start took 22-29 s (and once failed the move).
PREPARE_MS = 10000.0
PINGS = 100
OLD_PINGS = 25     # ~0.1 s each at the old weight


def leaf(host: Host, partition: str, name: str) -> tuple[Path, str, str, str]:
    """The CPU weight file of a leaf, the highest weight a VM gets there (the old
    layout's and the control weight's scale) and the control weight."""
    v1 = Path(f"/sys/fs/cgroup/cpu/{host.prefix}/{partition}/{name}")
    if v1.is_dir():
        return v1 / "cpu.shares", "102400", "102400", "262144"
    v2 = Path(f"/sys/fs/cgroup/{host.prefix}/{partition}/{name}")
    return v2 / "cpu.weight", "10000", "3906", "10000"


def old_supervisor_weight(weight_file: Path) -> str:
    """The supervisor leaf's weight before the control weight: the default."""
    return "1024" if weight_file.name == "cpu.shares" else "100"


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


def pct(xs: list[float], q: float) -> float:
    """Nearest-rank percentile (p99 of 100 samples: the second largest)."""
    return sorted(xs)[max(0, math.ceil(q * len(xs)) - 1)]


def summary(xs: list[float]) -> dict[str, float]:
    return {"n": len(xs), "median": round(statistics.median(xs), 2),
            "p90": round(pct(xs, 0.9), 2), "p99": round(pct(xs, 0.99), 2),
            "max": round(max(xs), 2)}


def measure(host: Host, sup: int, hog: int | None, n: int) -> dict[str, Any]:
    """``n`` pings of partition p0's supervisor, each after 10 ms asleep (so that each
    measures a wakeup), the supervisor's run-queue wait per run meanwhile, and how much
    of a core the busy VM took."""
    with mock.patch.dict(os.environ, host.env):
        client = SupervisorClient(Paths.from_env(), "p0")
    c0, t0 = (cpu_s(hog) if hog else 0.0), time.monotonic()
    w0, r0 = schedstat(sup)
    pings = []
    for _ in range(n):
        time.sleep(0.01)
        pings.append(ping_ms(client))
    w1, r1 = schedstat(sup)
    out: dict[str, Any] = {"ping_ms": summary(pings),
                           "wait_per_run_ms": round((w1 - w0) / 1e6 / max(1, r1 - r0), 3)}
    if hog:
        out["hog_cores"] = round((cpu_s(hog) - c0) / (time.monotonic() - t0), 2)
    return out


def move(host: Host, to: str) -> dict[str, Any]:
    res = host.run("migrate", "mover", "--to", to, "--json").json()
    assert res["mode"] == "zero-copy" and host.vm("mover")["partition"] == to, res
    return {"downtime_ms": res["downtime_ms"], "prepare_ms": res["prepare_ms"],
            "steps_ms": res.get("steps_ms")}


def test_a_busy_vm_at_the_top_weight_does_not_starve_the_control_path(host: Host) -> None:
    t_start = time.monotonic()
    host.run("partition", "create", "p0", "--cpus", host.core(0), "--memory", "768")
    host.run("partition", "create", "p1", "--cpus", host.core(1), "--memory", "512")
    for name, qos in (("hog", "guaranteed"), ("mover", "burstable")):
        host.run("vm", "create", name, "-p", "p0", "--memory", "128", "--qos", qos)
        host.run("vm", "start", name, "--wait")
    weight, old_top, top_vm, control = leaf(host, "p0", "vm.hog")
    sup_weight = leaf(host, "p0", "supervisor")[0]
    hog = host.vm("hog")["pid"]
    figures: dict[str, Any] = {}

    # 1. Quiet: the partition's VMs idle.
    sup = host.part("p0")["supervisor_pid"]
    figures["quiet"] = {**measure(host, sup, None, PINGS // 2),
                        "moves": {"out": move(host, "p1"), "in": move(host, "p0")}}

    # 2. The load, and the supervisor's leaf as a supervisor before the control weight
    # left it: the busy VM at the highest weight of that version's scale.
    host.run("vm", "exec", "hog", "--", "/bin/sh", "-c", BUSY)
    weight.write_text(old_top)
    sup_weight.write_text(old_supervisor_weight(sup_weight))
    figures["old"] = {**measure(host, sup, hog, OLD_PINGS), "moves": {"out": move(host, "p1")}}

    # 3. A new supervisor (an upgrade's `partition restart`) adopts the running QEMUs in
    # that layout and gives its own leaf the control weight; the busy VM back at the
    # highest weight (adoption gave it its class's).
    host.run("partition", "restart", "p0")
    sup = host.part("p0")["supervisor_pid"]
    assert host.vm("hog")["pid"] == hog and host.vm("hog")["state"] == "running"
    weight.write_text(top_vm)
    new = measure(host, sup, hog, PINGS)
    new["moves"] = {"in": move(host, "p0"), "out": move(host, "p1")}
    late = outside_lateness_ms(0)
    new["outside_late_ms"] = {"median": round(statistics.median(late), 3),
                              "max": round(max(late), 3)}
    figures["control"] = new
    figures["weights"] = {"hog": weight.read_text().strip(),
                          "supervisor": sup_weight.read_text().strip()}
    figures["wall_s"] = round(time.monotonic() - t_start, 1)
    print("control-path " + json.dumps(figures))

    old, quiet = figures["old"], figures["quiet"]
    # The load is real: the guest's loop holds its core, at a VM's highest weight.
    for phase in (old, new):
        assert phase["hog_cores"] > 0.4, figures   # 0.9+ alone; another namespace may share
    assert figures["weights"] == {"hog": top_vm, "supervisor": control}, figures
    # It starves a supervisor at the old weight: the bounds below fail there.
    assert old["ping_ms"]["median"] > PING_MEDIAN_MS, figures
    assert old["ping_ms"]["p99"] > PING_P99_MS, figures
    # At the control weight the supervisor answers as if its core were free.
    assert new["ping_ms"]["median"] <= PING_MEDIAN_MS, figures
    assert new["ping_ms"]["p99"] <= PING_P99_MS, figures
    assert new["wait_per_run_ms"] <= WAIT_PER_RUN_MS, figures
    for name, m in [*quiet["moves"].items(), *new["moves"].items()]:
        assert m["downtime_ms"] is not None and m["downtime_ms"] <= DOWNTIME_MS, (name, figures)
        assert m["prepare_ms"] <= PREPARE_MS, (name, figures)
    # The moved VM's leaf is back at its class's weight (burstable: 100).
    moved = leaf(host, "p1", "vm.mover")[0].read_text().strip()
    assert moved in ("1024", "39"), moved
    wait_for(lambda: host.vm("mover")["state"] == "running", 10, "mover running")
