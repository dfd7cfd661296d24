"""`fusuma bench density` for real: a tiny run, and a budget smaller than one VM."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.conftest import Host

pytestmark = [pytest.mark.integration, pytest.mark.timeout(420)]


def test_bench_density_tiny_run_writes_a_result_and_report(host: Host,
                                                           tmp_path: Path) -> None:
    out = tmp_path / "density"
    res = host.run("bench", "density", "--modes", "none,segment", "--budget-mib", "400",
                   "--requests", "20", "--report", str(out), timeout=400)
    data = json.loads((out / "density.json").read_text())
    m = data["meta"]
    assert m["benchmark"] == "density" and m["git_revision"] and m["accel"]
    assert m["budget_mib"] == 400 and m["modes"] == ["none", "segment"]
    rows = {r["mode"]: r for r in data["results"]}
    assert set(rows) == {"none", "segment"}
    for r in rows.values():
        assert 1 <= r["vms"] <= 2, r
        assert r["host_mib"][-1]["vms"] == r["vms"]
        assert max(p["mib"] for p in r["host_mib"]) <= 400
        assert r["stop"] == "budget" and r["note"] is None
        # each VM answered HTTP; the request loop ran over them
        assert r["start_ms_median"] > 0 and r["requests"] == 20, r
        assert r["failed_requests"] == 0 and r["page_reporting"] is True
        # the guest RAM files are in the total, once each
        assert len(r["files"]["tmpfs_files"]) == r["vms"]
    if rows["none"]["vms"] == 2 and rows["segment"]["vms"] == 2:
        assert rows["segment"]["saving_pct"] is not None
    assert "target segment alone saves >= 25% per added VM vs none" in res.out
    assert (out / "report.md").read_text().startswith("# Density on fusuma")
    assert (out / "density.png").stat().st_size > 1000
    # nothing of the run is left: no partition, segment or template
    assert host.ps()["partitions"] == [] and host.ps()["vms"] == []
    assert host.run("segment", "list", "--json").json() == []


def test_bench_density_budget_smaller_than_one_vm_is_one_sentence(
        host: Host, tmp_path: Path) -> None:
    out = tmp_path / "density.json"
    res = host.fail("bench", "density", "--modes", "none", "--budget-mib", "64",
                    "--requests", "5", "--json", str(out))
    errors = [ln for ln in res.err.splitlines() if ln.startswith("fusuma: error:")]
    assert len(errors) == 1, res.err
    assert "a budget of 64 MiB is smaller than one VM: one Debian VM of 256 MiB took " \
        in errors[0] and "give --budget-mib" in errors[0], errors
    assert not out.exists()
    assert host.ps()["partitions"] == [] and host.ps()["vms"] == []
