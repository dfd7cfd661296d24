"""The scheduler benchmark's pure parts: layouts, parsing, the index, the report."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from fusuma.bench import report_scheduler, scheduler
from fusuma.errors import GuestAgentError, SpecError

OUTPUT = """cpu 600 301
syscall 40000 300
pipe 120000 302
spawn 450 300
copy 600 301
"""


def test_parse_workload_busybox_and_probe() -> None:
    counts, elapsed = scheduler.parse_workload(OUTPUT, 0)
    assert counts["cpu"] == 600 and elapsed["cpu"] == pytest.approx(3.01)
    probe = ('{"probe": 1, "test": "register", "size_kib": 0, "count": 7, '
             '"wall_ns": [500000000, 400000000, 600000000]}\n')
    counts, elapsed = scheduler.parse_workload(probe + OUTPUT.split("\n", 1)[1], 1000)
    assert counts["cpu"] == 1000 and elapsed["cpu"] == pytest.approx(0.5)
    with pytest.raises(GuestAgentError, match="no result for spawn"):
        scheduler.parse_workload(OUTPUT.replace("spawn", "nope"), 0)


def test_index_is_a_geometric_mean_of_ratios() -> None:
    solo = {"a": 10.0, "b": 100.0}
    assert scheduler.index({"a": 10.0, "b": 100.0}, solo) == pytest.approx(100.0)
    assert scheduler.index({"a": 5.0, "b": 200.0}, solo) == pytest.approx(100.0)
    assert scheduler.index({"a": 1.0, "b": 10.0}, solo) == pytest.approx(10.0)
    assert scheduler.index({"a": 0.0, "b": 10.0}, solo) == 0.0


def test_layouts() -> None:
    gov = scheduler.layout("governor", [0, 1], 16, "tcg")
    assert (gov.target_qos, gov.dummy_qos) == ("guaranteed", "best-effort")
    assert [p.cpus for p in gov.partitions] == [[0, 1]]
    part = scheduler.layout("partition", [0, 1], 16, "tcg")
    assert [p.cpus for p in part.partitions] == [[0], [1]]
    assert part.target_partition != part.dummy_partition
    assert scheduler.layout("nice", [0, 1], 4, "tcg").nice
    assert not scheduler.layout("default", [0, 1], 4, "tcg").nice
    # 16 dummies need room for 16 x (guest RAM + QEMU overhead).
    assert gov.partitions[0].memory_mib > 16 * scheduler.DUMMY_MIB


def test_argument_parsing() -> None:
    assert scheduler.parse_counts("16,0,4,4") == [0, 4, 16]
    with pytest.raises(SpecError, match="dummy counts"):
        scheduler.parse_counts("a,b")
    assert scheduler.parse_choice("governor,default", scheduler.POLICIES, "policies") == [
        "default", "governor"]
    with pytest.raises(SpecError, match="--loads"):
        scheduler.parse_choice("busy", scheduler.LOADS, "loads")


def _result(gov16: float, default16: float, progressing: int) -> dict[str, Any]:
    rows = []
    for policy, at16 in (("default", default16), ("governor", gov16)):
        for n, idx in ((0, 100.0), (16, at16)):
            rows.append({"policy": policy, "dummies": n, "dummy_load": "cpu", "index": idx,
                         "tests": {"cpu": {"relative": idx / 100}},
                         "target_cpu_pct": 50.0, "target_wait_pct": 1.0})
    return {"meta": {"benchmark": "scheduler", "tests": ["cpu"], "cores": [0, 1],
                     "accel": "tcg"},
            "solo": {"tests": {"cpu": {"rate_per_s": 1.0}}, "runs": 3,
                     "run_indexes": [98.0, 100.0, 102.0], "target_wait_pct": 0.5},
            "results": rows,
            "dummy_progress": [{"policy": "governor", "dummies": 16,
                                "progressing": progressing, "iterations_per_s": 9.0}]}


@pytest.mark.parametrize(("gov16", "default16", "progressing", "verdicts"), [
    (97.0, 12.0, 16, ["PASS", "PASS", "PASS"]),
    (80.0, 45.0, 15, ["FAIL", "FAIL", "FAIL"]),
])
def test_report_judges_the_targets(tmp_path: Path, gov16: float, default16: float,
                                   progressing: int, verdicts: list[str]) -> None:
    path = tmp_path / "s.json"
    path.write_text(json.dumps(_result(gov16, default16, progressing)))
    md, png = report_scheduler.render(path, tmp_path / "r")
    lines = [ln for ln in md.read_text().splitlines()
             if ln.startswith(("| governor:", "| default:"))]
    assert [next(v for v in ("PASS", "FAIL") if v in ln) for ln in lines] == verdicts
    assert png.read_bytes()[:4] == b"\x89PNG"


def test_report_without_16_dummies_says_not_measured(tmp_path: Path) -> None:
    data = _result(97.0, 12.0, 16)
    data["results"] = [r for r in data["results"] if r["dummies"] == 0]
    data["dummy_progress"] = []
    path = tmp_path / "s.json"
    path.write_text(json.dumps(data))
    checks = report_scheduler.checks(report_scheduler.load(path))
    assert all(c.verdict == report_scheduler.UNMEASURED for c in checks)


def test_report_refuses_another_file(tmp_path: Path) -> None:
    path = tmp_path / "x.json"
    path.write_text(json.dumps({"meta": {"benchmark": "vmbeam"}, "results": []}))
    with pytest.raises(SpecError, match="not a scheduler result file"):
        report_scheduler.load(path)
