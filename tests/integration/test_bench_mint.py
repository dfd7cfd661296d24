"""The Mint benchmark, quick: nine configurations, result file, report and plots."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from tests.conftest import Host

pytestmark = [pytest.mark.integration, pytest.mark.timeout(600)]

FIGURES = ("median_ns", "min_ns", "max_ns", "median_cycles")
SIZES = {"register": [None], "copy": [256, 512, 1024], "io": [256, 512, 1024]}
TWO_PROBES = (3, 6, 7)


def test_bench_mint_quick(host: Host, tmp_path: Path) -> None:
    out, rep = tmp_path / "mint.json", tmp_path / "report"
    host.run("bench", "mint", "--quick", "--json", str(out), "--report", str(rep),
             timeout=540)
    data = json.loads(out.read_text())
    meta = data["meta"]
    assert meta["benchmark"] == "mint" and meta["quick"] is True and meta["reps"] == 10
    for key in ("git_revision", "date", "host_cpu", "accel", "qemu", "image_digest"):
        assert meta[key], key
    rows = data["results"]
    # every configuration, test and size; two probes where two run at once
    want = sorted((c, t, s or 0) for c in range(1, 10) for t, sizes in SIZES.items()
                  for s in sizes for _ in range(2 if c in TWO_PROBES else 1))
    assert sorted((r["config"], r["test"], r["size_kib"] or 0) for r in rows) == want
    for r in rows:
        for key in FIGURES:
            assert math.isfinite(r[key]) and r[key] > 0, (r, key)
        assert r["min_ns"] <= r["median_ns"] <= r["max_ns"], r
        assert len(r["ns"]) == 10 and abs(r["tsc_vs_wall"] - 1) < 0.05, r
        assert (r["vm"] is None) == (r["config"] <= 3), r
        assert (r["partition"] is None) == (r["config"] == 1), r
        if r["test"] == "io":
            assert r["fresh"] is True, r        # no block read twice in a run
        if r["config"] in (8, 9):
            assert r["hog"] == "mint-hog" and r["hog_cpu_pct"] > 5, r
        else:
            assert r["hog_cpu_pct"] is None, r
    # the two probes of a concurrent configuration are two different ones
    pairs = {(r["config"], r["vm"], r["partition"]) for r in rows if r["config"] in TWO_PROBES}
    assert len(pairs) == 6
    # everything the run made is gone: partitions, VMs, disk files
    assert host.ps() == {"partitions": [], "vms": [], "networks": []}
    assert not (host.home / "disks" / "bench-mint").exists()

    text = (rep / "report.md").read_text()
    assert "## Beside the paper" in text and "| VM vs native (4 vs 1) |" in text
    assert "| not measured |" not in text      # every ratio has both sides
    for test in SIZES:
        assert (rep / f"mint-{test}.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"

    # the report is made from the file alone
    host.run("bench", "report", "mint", str(out), str(tmp_path / "again"))
    assert (tmp_path / "again" / "report.md").read_text() == text


def test_bench_mint_refuses_beside_a_partition(host: Host) -> None:
    host.run("partition", "create", "p0", "--cpus", host.core(0), "--memory", "256")
    err = host.fail("bench", "mint", "--quick", "--json", "/dev/null").err
    assert "needs every core" in err and "p0" in err
    assert len([line for line in err.splitlines() if "error" in line]) == 1
    assert [p["name"] for p in host.ps()["partitions"]] == ["p0"]
