"""`bench maintain`'s figures of a case, as data: p99 by nearest rank, and where the
moves' time went (each step of ``wall_ms`` summed over the moves)."""

from __future__ import annotations

from fusuma_bench.maintain import Case
from fusuma_bench.report_maintain import nearest_rank as _nearest_rank


def test_p99_is_the_nearest_rank() -> None:
    assert _nearest_rank([], 0.99) is None
    assert _nearest_rank([5.0], 0.99) == 5.0
    assert _nearest_rank([float(i) for i in range(16, 0, -1)], 0.99) == 16.0
    assert _nearest_rank([float(i) for i in range(1, 101)], 0.99) == 99.0
    assert _nearest_rank([float(i) for i in range(1, 201)], 0.99) == 198.0
    assert _nearest_rank([1.0, 2.0, 3.0, 4.0], 0.5) == 2.0


def test_a_case_sums_its_moves_steps_in_their_order() -> None:
    c = Case("cpr-transfer", 2, "10.0.2", "10.0.2", maintain_s=0.3, data_intact=True)
    c.moves = [
        {"vm": "a", "downtime_ms": 5.0, "bytes_sent": 10,
         "wall_ms": {"job": 2.0, "checks": 10.0, "prepare": 60.0, "stream": 40.0,
                     "done": 3.0}},
        {"vm": "b", "downtime_ms": 7.0, "bytes_sent": 10,
         "wall_ms": {"job": 1.5, "prepare": 5.0, "stream": 41.0, "finish": 2.0}},
        {"vm": "c", "downtime_ms": None, "bytes_sent": 0},      # no steps: an old result
    ]
    j = c.as_json()
    assert j["wall_ms_sum"] == {"job": 3.5, "checks": 10.0, "prepare": 65.0,
                                "stream": 81.0, "finish": 2.0, "done": 3.0}
    assert list(j["wall_ms_sum"]) == ["job", "checks", "prepare", "stream", "finish",
                                      "done"]
    assert (j["downtime_ms_median"], j["downtime_ms_p99"], j["downtime_ms_max"]) == \
        (6.0, 7.0, 7.0)


def _result(method: str, vms: int, secs: float, pipelined: bool | None) -> dict[str, object]:
    r: dict[str, object] = {
        "method": method, "vms": vms, "from_qemu": "10.0.2", "to_qemu": "10.0.2",
        "maintain_s": secs, "moves": vms, "downtime_ms_max": 9.0,
        "downtime_ms_median": 5.0, "bytes_sent_median": 94000.0, "data_intact": True,
        "error": None}
    if pipelined is not None:
        r["pipelined"] = pipelined
    return r


def test_the_report_sets_serial_beside_pipelined_and_checks_only_pipelined() -> None:
    from fusuma_bench import report_maintain

    data = {"meta": {}, "results": [_result("cpr-transfer", 16, 3.2, False),
                                    _result("cpr-transfer", 16, 1.6, True)],
            "moves": [{"vm": "a", "method": "cpr-transfer", "downtime_ms": 50.0,
                       "pipelined": False},
                      {"vm": "a", "method": "cpr-transfer", "downtime_ms": 4.0,
                       "pipelined": True}]}
    res = report_maintain.parse(data)
    assert [r.maintain_s for r in res.rows] == [1.6]
    assert [r.maintain_s for r in res.serial] == [3.2]
    # The serial run's 50 ms move is no part of the targets' check.
    assert [m["downtime_ms"] for m in res.moves] == [4.0]
    lines = report_maintain.pipeline_lines(res)
    assert lines[-1].split(" | ")[2:5] == ["3.20", "1.60", "2.00x"]
    # A result from before the pipeline: its rows are the rows, nothing set beside.
    old = report_maintain.parse({"meta": {}, "results": [_result("zero-copy", 4, 3.0, None)],
                                 "moves": []})
    assert len(old.rows) == 1 and old.serial == []
    assert report_maintain.pipeline_lines(old) == []


def test_a_run_whose_every_maintain_failed_still_renders(tmp_path: object) -> None:
    """bench maintain wrote its result, then the report's plot raised on a log axis
    with nothing on it; it now renders the failures."""
    import json
    from pathlib import Path

    from fusuma_bench import report_maintain

    failed = {**_result("zero-copy", 16, 0.387, True), "downtime_ms_max": None,
              "downtime_ms_median": None, "error": "migration of 'vm0' failed"}
    data = {"meta": {"benchmark": "maintain"}, "results": [failed], "moves": []}
    out = Path(str(tmp_path))
    (out / "maintain.json").write_text(json.dumps(data))
    written = report_maintain.render(out / "maintain.json", out / "report")
    assert (out / "report" / "maintain.png").stat().st_size > 0
    assert "migration of 'vm0' failed" in (out / "report" / "report.md").read_text()
    assert written
