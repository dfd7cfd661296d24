"""`fusuma bench memory` for real, in its quickest form: mode none at overcommits 1 and
2 in a budget that admits no VM, then one; a small burst beside a guaranteed guest."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.conftest import Host

# serial: the burst times a guaranteed guest's speed and uses both cores.
pytestmark = [pytest.mark.integration, pytest.mark.serial, pytest.mark.timeout(180)]


def test_bench_memory_quickest_run_writes_a_result_and_report(host: Host,
                                                               tmp_path: Path) -> None:
    out = tmp_path / "memory"
    res = host.run("bench", "memory", "--quick", "--modes", "none", "--overcommits", "1,2",
                   "--budget-mib", "600", "--memory", "512", "--floor", "64",
                   "--max-vms", "2", "--runs", "2", "--hold-s", "16",
                   "--report", str(out), timeout=170)
    data = json.loads((out / "memory.json").read_text())
    m = data["meta"]
    assert m["benchmark"] == "memory" and m["git_revision"] and m["accel"]
    assert m["overcommits"] == [1.0, 2.0] and m["budget_mib"] == 600
    [fit] = data["fit"]
    assert fit["mode"] == "none" and fit["failed_starts"] == 0, fit
    o1, o2 = fit["overcommits"]
    # fusuma's own answer agrees with its arithmetic; the overcommit admits more
    for o in (o1, o2):
        assert o["admitted_vms"] == o["admitted_vms_computed"], o
        assert o["running_vms"] <= o["admitted_vms"], o
        assert o["host_mib"] is None or o["host_mib"] <= 600, o
    assert o1["stop"] == "admission" and o1["refusal"], o1     # refused, with its sum
    # 64 + 128 + 512 = 704 > 600 MiB at 1.0; 64 + 128 + 64 + 224 = 480 at 2.0
    assert (o1["admitted_vms"], o2["admitted_vms"]) == (0, 1), fit
    assert o2["stop"] in ("admission", "cap"), o2
    assert fit["host_mib"][-1]["vms"] == o2["running_vms"] >= 1
    b = data["burst"]
    assert "failed" not in b, b
    ep = b["episode"]
    # the growth made the host short; the governor's log says what it did and when
    assert ep["first_short_at"] is not None and ep["steps"], ep
    assert all(d["at"] >= ep["first_short_at"] - 60 for d in b["decisions"])
    assert b["balloon_actual_min_mib"] is None or b["balloon_actual_min_mib"] >= 224 - 8
    assert b["guests_alive"] is True and b["guest_oom_kills"] == 0 and b["oom_kills"] == 0
    assert b["guaranteed_decisions"] == 0
    assert len(b["alone_s"]) == 4 and len(b["during_s"]) >= 2 and b["speed_ratio"] > 0
    if ep["recovered_at"] is not None:
        assert ep["short_s"] > 0 and ep["release_to_recovered_s"] is not None
    assert "target guaranteed guest keeps >= 95% of its speed" in res.out
    assert (out / "report.md").read_text().startswith("# Memory as a governed resource")
    assert (out / "memory-fit.png").stat().st_size > 1000
    assert (out / "memory-burst.png").stat().st_size > 1000
    # nothing of the run is left
    assert host.ps()["partitions"] == [] and host.ps()["vms"] == []
