"""`fusuma bench cluster`'s in-host figures as data: the agent's moves (status.lastMove)
and the CLI's (`fusuma migrate --json`) read alike, their medians, steps and ratio."""

from __future__ import annotations

from fusuma.cluster.reconcile import last_move
from fusuma.migration import MigrationResult
from fusuma_bench.cluster import InHostMove, in_host_summary, step_medians


def res(down: float, steps: dict[str, float]) -> MigrationResult:
    return MigrationResult(vm="v", source="p0", to="p1", mode="zero-copy", total_ms=2 * down,
                           downtime_ms=down, bytes_sent=1, prepare_ms=50.0, cpu_s=0.0,
                           qemu_total_ms=None, qemu_downtime_ms=None, steps_ms=steps)


def test_an_agent_move_and_a_cli_move_read_the_same() -> None:
    steps = {"source_saved": 1.0, "dest_loaded": 0.5, "event": 0.25, "decision": 3.0,
             "taps": 0.01, "cont": 1.0}
    r = res(5.76, steps)
    by_agent = InHostMove.from_last_move(last_move("h0", r, "t"))
    by_cli = InHostMove.from_cli(r.as_json())
    assert by_agent == by_cli == InHostMove(5.76, 11.52, 50.0, steps)
    # As the API server gives it back: its fields sorted by name.
    lm = last_move("h0", r, "t")
    lm["steps"] = dict(sorted(lm["steps"].items()))
    assert list(InHostMove.from_last_move(lm).steps) == list(steps)


def test_medians_per_step_and_the_ratio_to_the_cli() -> None:
    agent = [InHostMove(30.0, 40.0, 90.0, {"source_saved": 2.0, "decision": 25.0,
                                           "cont": 3.0}),
             InHostMove(36.0, 50.0, 70.0, {"source_saved": 4.0, "decision": 29.0,
                                           "cont": 3.0}),
             InHostMove(12.0, 20.0, None, {"source_saved": 3.0, "decision": 6.0,
                                           "cont": 3.0, "taps": 0.5})]
    cli = [InHostMove(6.0, 10.0, 60.0, {"source_saved": 2.0, "decision": 1.0}),
           InHostMove(5.0, 9.0, 62.0, {"source_saved": 1.5, "decision": 1.5})]
    # In the order of the steps, each over the moves that report it.
    assert list(step_medians(agent).items()) == [
        ("source_saved", 3.0), ("decision", 25.0), ("taps", 0.5), ("cont", 3.0)]
    out = in_host_summary(agent, cli)
    assert out["in_host_downtime_ms_median"] == 30.0
    assert out["in_host_total_ms_median"] == 40.0
    assert out["in_host_prepare_ms_median"] == 80.0 and out["in_host_prepare_ms"] == [90.0,
                                                                                     70.0]
    assert out["in_host_step_decision_ms_median"] == 25.0
    assert out["cli_in_host_downtime_ms_median"] == 5.5
    assert out["cli_in_host_step_decision_ms_median"] == 1.25
    assert "cli_in_host_step_cont_ms_median" not in out
    assert out["in_host_agent_cli_downtime_ratio"] == round(30.0 / 5.5, 2) == 5.45
    assert out["in_host_downtime_ms"] == [30.0, 36.0, 12.0]
    assert out["cli_in_host_moves"][0] == {"downtime_ms": 6.0, "total_ms": 10.0,
                                           "prepare_ms": 60.0,
                                           "steps": {"source_saved": 2.0, "decision": 1.0}}


def test_without_cli_moves_there_is_no_ratio() -> None:
    out = in_host_summary([InHostMove(7.0, 9.0, 1.0, {})], [])
    assert out["in_host_downtime_ms_median"] == 7.0
    assert "in_host_agent_cli_downtime_ratio" not in out
    assert not [k for k in out if k.startswith("cli_")]


def test_the_parallel_case_reports_median_and_p99_beside_fusumas_figures() -> None:
    from fusuma_bench.cluster_parallel import p99, summarize

    assert p99([float(x) for x in range(1, 25)]) == 24.0
    assert p99([float(x) for x in range(1, 201)]) == 198.0
    moves = {f"b{i:02d}": {"result": "ok", "downtimeMs": 10.0 * (i + 1), "totalMs": 500.0,
                           "wallMs": 900.0, "prepareMs": 100.0} for i in range(4)}
    moves["b04"] = {"result": "failed", "message": "no"}
    out = summarize(moves, {"b00": 30.0, "b01": 50.0, "b02": 40.0, "b03": 200.0,
                            "b04": 0.0}, 4.567, {"b03"}, {"h0->h1": 4}, {"lost_ms": 12.0})
    assert (out["parallel_vms"], out["parallel_moves_ok"]) == (5, 4)
    assert out["parallel_whole_run_s"] == 4.57
    assert out["parallel_downtime_ms_median"] == 25.0
    assert out["parallel_downtime_ms_p99"] == 40.0
    assert out["parallel_downtime_ms"] == [10.0, 20.0, 30.0, 40.0]
    assert out["parallel_guest_downtime_ms_median"] == 40.0
    assert out["parallel_guest_downtime_ms_p99"] == 200.0
    assert out["parallel_moves_queued"] == 1
    assert out["parallel_most_at_once_per_pair"] == '{"h0->h1": 4}'
    assert out["guest_clock_lost_ms"] == 12.0


def test_the_guest_clock_probe_finds_the_time_its_clock_did_not_see() -> None:
    from fusuma_bench.cluster_parallel import clock_lost_ms

    # A line every 10 ms of host time; the guest's clock stops for 150 ms at t=1.0.
    lines = []
    guest = 0.0
    t = 0.0
    while t < 3.0:
        lines.append((round(t, 3), round(guest, 3)))
        step = 0.16 if abs(t - 1.0) < 1e-9 else 0.01
        t += step
        guest += 0.01
    lost, gap = clock_lost_ms(lines, 0.5, 2.0)
    assert lost == 150.0 and gap == 160.0
    assert clock_lost_ms(lines, 1.5, 2.5)[0] == 0.0


def test_a_clock_probe_that_falls_silent_is_reported_not_fatal() -> None:
    from fusuma_bench.cluster_parallel import clock_figures

    lines = [(10.0 + i, 700.0 + 3 * i) for i in range(5)]     # a guest clock 3x fast
    out = clock_figures(lines, 12.5, 20.0)
    assert (out["lines"], out["host_span_s"], out["guest_span_s"], out["rate"]) == \
        (5, 4.0, 12.0, 3.0)
    assert out["lost_ms"] == "the guest clock probe has no line before or after the span."
    assert out["lost_ms_before_moves"] == -6000.0     # 3 s of host time, 9 of guest


def test_every_target_belongs_to_a_case() -> None:
    from fusuma_bench.cluster import CASES, TARGETS, case_of

    assert {case_of(k) for k in TARGETS} == set(CASES)
