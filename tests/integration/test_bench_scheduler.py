"""The dummy-VM scheduler benchmark: result file, report and plot, cleanup."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from tests.conftest import Host

pytestmark = [pytest.mark.integration, pytest.mark.timeout(900)]


def test_bench_scheduler_quick(host: Host, tmp_path: Path) -> None:
    out, rep = tmp_path / "scheduler.json", tmp_path / "report"
    # --quick's policies and load, with fewer dummies and shorter tests (the benchmark's
    # own options): every step of a run, in a smoke test's time.
    host.run("bench", "scheduler", "--quick", "--dummies", "0,2", "--test-seconds", "0.5",
             "--json", str(out), "--report", str(rep), timeout=880)
    data = json.loads(out.read_text())
    meta = data["meta"]
    assert meta["benchmark"] == "scheduler" and meta["dummies"] == [0, 2]
    assert (meta["test_s"], meta["progress_s"]) == (0.5, 2.0)    # progress: at least 2 s
    assert meta["policies"] == ["default", "governor"] and meta["loads"] == ["cpu"]
    for key in ("git_revision", "date", "host", "accel", "qemu", "cpu_test"):
        assert meta[key], key
    assert meta["cores"] == [0, 1]
    solo = data["solo"]["tests"]
    assert sorted(solo) == sorted(meta["tests"])
    assert all(math.isfinite(t["rate_per_s"]) and t["rate_per_s"] > 0 for t in solo.values())

    rows = data["results"]
    assert sorted((r["policy"], r["dummies"], r["dummy_load"]) for r in rows) == [
        ("default", 0, "cpu"), ("default", 2, "cpu"),
        ("governor", 0, "cpu"), ("governor", 2, "cpu")]
    for r in rows:
        assert math.isfinite(r["index"]) and r["index"] > 0, r
        assert sorted(r["tests"]) == sorted(meta["tests"])
        for t in r["tests"].values():
            assert t["count"] > 0 and t["elapsed_s"] > 0 and t["rate_per_s"] > 0
    gov = next(r for r in rows if r["policy"] == "governor" and r["dummies"] == 2)
    assert isinstance(gov["governor_decisions"], list)
    # An empty decision list must mean "nothing to do", not "no governor".
    assert gov["governor"]["ticks"] > 0 and gov["governor"]["errors"] == 0, gov["governor"]
    assert gov["target_other_wait_pct"] >= 0 and gov["runs"] == meta["runs"] == 1

    prog = data["dummy_progress"]
    assert [(p["policy"], p["dummies"]) for p in prog] == [("default", 2), ("governor", 2)]
    for p in prog:
        assert p["read"] == 2 and p["unread"] == {} and p["iterations_per_s"] >= 0
        assert sorted(p["per_dummy_named"]) == [f"bench-sched-d{i:02d}" for i in range(2)]
    # The dummies still progress with the target idle under the governor, once it has
    # given back what it took for the target (nothing to give back without it).
    d, g = prog
    assert g["progressing"] == 2 and g["governor_holds"] == [], g
    assert d["governor_holds"] is None and d["settle_s"] == 0, d

    # The scratch partitions are gone.
    assert host.ps() == {"partitions": [], "vms": [], "networks": []}

    text = (rep / "report.md").read_text()
    assert "## Targets" in text and "| governor |" in text
    assert (rep / "scheduler.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"

    # The report judges from the numbers: a collapsed governor row turns into FAIL.
    data["results"].append({**gov, "dummies": 16, "index": 12.0})
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps(data))
    host.run("bench", "report", "scheduler", str(bad), str(tmp_path / "bad"))
    verdicts = [line for line in (tmp_path / "bad" / "report.md").read_text().splitlines()
                if line.startswith("| governor: target >=")]
    assert verdicts and "FAIL" in verdicts[0]


def test_bench_scheduler_refuses_beside_a_partition(host: Host) -> None:
    host.run("partition", "create", "p0", "--cpus", host.core(0), "--memory", "256")
    err = host.fail("bench", "scheduler", "--quick", "--json", "/dev/null").err
    assert "needs both cores" in err and "p0" in err
    assert len(err.strip().splitlines()) == 1
    assert [p["name"] for p in host.ps()["partitions"]] == ["p0"]
