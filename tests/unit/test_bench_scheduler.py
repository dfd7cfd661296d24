"""The scheduler benchmark's pure parts: layouts, parsing, the index, the report."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest

from fusuma.errors import GuestAgentError, SpecError
from fusuma_bench import report_scheduler, scheduler, scheduler_run

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


def _score(rates: dict[str, float]) -> scheduler.Score:
    return scheduler.Score(rates, {t: 1 for t in rates}, {t: 1.0 for t in rates},
                           100.0, 0.0, 1.0)


def test_runs_are_combined_by_their_median_rate() -> None:
    runs = [_score({"pipe": 10.0, "cpu": 5.0}), _score({"pipe": 100.0, "cpu": 6.0}),
            _score({"pipe": 12.0, "cpu": 7.0})]
    s = scheduler.combine(runs)
    # One bimodal outlier (100) does not move the point; a mean would have (40.7).
    assert s.rates == {"pipe": 12.0, "cpu": 6.0}
    assert s.counts == {"pipe": 3, "cpu": 3} and len(s.run_rates) == 3
    one = scheduler.combine(runs[:1])
    assert one.rates == runs[0].rates and one.run_rates == (runs[0].rates,)


def test_busy_loop_counter_is_never_truncated() -> None:
    # ">" truncates before it writes: a read in between sees an empty file, and that
    # dummy was reported as not progressing (issue 6).
    assert "echo $i 1<>/tmp/busy.n" in scheduler.BUSY
    assert "echo $i >" not in scheduler.BUSY


@pytest.mark.skipif(shutil.which("busybox") is None, reason="needs busybox")
def test_in_place_counter_overwrite_in_busybox(tmp_path: Path) -> None:
    f = tmp_path / "busy.n"
    subprocess.run(["busybox", "sh", "-c", f"for i in 998 999 1000; do echo $i 1<>{f}; done"],
                   check=True, timeout=30)
    assert f.read_text() == "1000\n"


@pytest.mark.skipif(shutil.which("busybox") is None, reason="needs busybox")
def test_workload_runs_in_busybox_and_pipe_is_a_ping_pong(tmp_path: Path) -> None:
    script = scheduler.WORKLOAD.replace("/tmp/", f"{tmp_path}/")
    out = subprocess.run(["busybox", "sh", "-c", script, "sh", "0.2", "0"],
                         capture_output=True, text=True, timeout=60, check=True)
    counts, elapsed = scheduler.parse_workload(out.stdout, 0)
    assert counts["pipe"] > 0 and elapsed["pipe"] > 0
    assert list(tmp_path.iterdir()) == []          # FIFOs and files removed


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


@pytest.mark.parametrize(("progressing", "read", "verdict"), [
    (15, 15, "NOT MEASURED"),    # issue 6: one counter unread, every read one moved
    (14, 15, "FAIL"),            # a counter that was read and did not move
    (16, 16, "PASS"),
])
def test_unread_dummy_counters_are_not_counted_as_standing_still(
        tmp_path: Path, progressing: int, read: int, verdict: str) -> None:
    data = _result(97.0, 12.0, progressing)
    data["dummy_progress"][0].update(read=read, unread={} if read == 16 else {
        "bench-sched-d07": "exit 0, stdout '', stderr ''"})
    path = tmp_path / "s.json"
    path.write_text(json.dumps(data))
    checks = report_scheduler.checks(report_scheduler.load(path))
    assert checks[2].verdict == verdict
    md = report_scheduler.markdown(report_scheduler.load(path), path)
    assert ("bench-sched-d07" in md) == (read < 16)


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


class _FakeVms:
    """Guest agents of dummies whose counters advance by 1000 per read; ``empty`` lists
    how many reads of each dummy come back empty first (the truncation race)."""

    def __init__(self, names: list[str], empty: dict[str, int]) -> None:
        self.count = dict.fromkeys(names, 0)
        self.empty = dict(empty)
        self.db = self

    def vms(self) -> list[Any]:
        return [type("V", (), {"name": n, "pid": os.getpid()})() for n in self.count]

    def exec(self, name: str, argv: list[str], timeout: float = 60.0) -> Any:
        out = type("O", (), {"exit_code": 0, "stderr": b""})()
        if self.empty.get(name, 0) > 0:
            self.empty[name] -= 1
            out.stdout = b""
            return out
        self.count[name] += 1000
        out.stdout = f"{self.count[name]}\n".encode()
        return out


@pytest.mark.parametrize(("empty", "read", "unread"), [
    ({"d1": 1}, 3, []),                 # one empty read: the retry gets the number
    ({"d1": 99}, 2, ["d1"]),            # never readable: unread, with the reason
])
def test_dummy_progress_retries_and_names_unread_counters(
        monkeypatch: pytest.MonkeyPatch, empty: dict[str, int], read: int,
        unread: list[str]) -> None:
    monkeypatch.setattr(scheduler_run.time, "sleep", lambda s: None)
    names = ["d0", "d1", "d2"]
    cfg = scheduler.Config(dummies=[3], policies=["governor"], loads=["cpu"], test_s=1.0)
    bench = scheduler_run.Bench.__new__(scheduler_run.Bench)
    bench.vms, bench.cfg, bench.say = _FakeVms(names, empty), cfg, lambda s: None
    bench.running, bench.dummy_progress = names, []
    bench.measure_progress("governor", 3)
    row = bench.dummy_progress[0]
    assert row["read"] == read and row["progressing"] == read
    assert sorted(row["unread"]) == unread
    assert all("stdout ''" in why for why in row["unread"].values())
    assert [n for n, v in row["per_dummy_named"].items()
            if v["iterations_per_s"] is None] == unread


def test_what_the_governor_still_holds_comes_from_its_status() -> None:
    base = {"name": "d0", "qos": "best-effort", "weight": 1, "cap_cpus": None,
            "dedicated_cores": [], "capping_others": False}
    target = {**base, "name": "t", "qos": "guaranteed", "weight": 1000}
    assert scheduler.governor_holds({"vms": [target, base]}) == []
    assert scheduler.governor_holds({}) == []
    held = scheduler.governor_holds({"vms": [
        {**target, "weight": 10000, "dedicated_cores": [1], "capping_others": True},
        {**base, "name": "b", "qos": "burstable", "weight": 100, "cap_cpus": 0.25}]})
    assert held == ["t: cores [1]", "t: caps on others", "t: weight 10000",
                    "b: capped at 0.25 CPU"]
