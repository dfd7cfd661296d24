"""`bench memory`'s pure parts: the fitting arithmetic (against fusuma.capacity's own
checks), the burst's figures from a decision log, the targets, and the report."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from fusuma import capacity
from fusuma.errors import ResourceError, SpecError
from fusuma_bench import memory, report_memory

OVERHEAD = 128          # 96 + a 32 MiB translation buffer


def test_fit_vms_are_burstable_and_private_ram_is_never_overcommitted() -> None:
    shared = memory.fit_vm("none", 1024, 128, OVERHEAD)
    assert shared.memory_class == "burstable" and shared.memory_min == 128
    assert capacity.guest_ram(shared, 2.0) == 128 + 448
    for mode in ("ksm", "template", "template+ksm"):
        vm = memory.fit_vm(mode, 1024, 128, OVERHEAD)
        assert not vm.shared_ram
        assert capacity.guest_ram(vm, 2.0) == 0
        assert capacity.partition_share(vm) == 1024 + OVERHEAD


@pytest.mark.parametrize(("mode", "oc", "fixed", "want"), [
    # (4096 - 64) // (128 + 1024) = 3; at 1.5: 128 + 598 = 726 -> 4032 // 854 = 4;
    # at 2: 128 + 448 = 576 -> 4032 // 704 = 5
    ("none", 1.0, 0, 3), ("none", 1.5, 0, 4), ("none", 2.0, 0, 5),
    # private RAM: its whole RAM and overhead in the partition, whatever the overcommit
    ("ksm", 1.0, 0, 3), ("ksm", 2.0, 0, 3),
    # a template's RAM comes first: (4096 - 64 - 1024) // 1152 = 2
    ("template", 2.0, 1024, 2),
])
def test_admits(mode: str, oc: float, fixed: int, want: int) -> None:
    vm = memory.fit_vm(mode, 1024, 128, OVERHEAD)
    assert memory.admits(4096, vm, oc, fixed) == want


def test_admits_is_fusumas_own_sum_at_the_edge() -> None:
    """n admitted VMs fit fusuma's sum (supervisor + shares + admitted RAM <= budget),
    n + 1 do not."""
    vm = memory.fit_vm("none", 1024, 128, OVERHEAD)
    for budget in (700, 1500, 2048, 4096, 9000):
        for oc in (1.0, 1.5, 2.0):
            n = memory.admits(budget, vm, oc)
            each = capacity.partition_share(vm) + capacity.guest_ram(vm, oc)
            assert capacity.SUPERVISOR_MIB + n * each <= budget
            assert capacity.SUPERVISOR_MIB + (n + 1) * each > budget
    assert memory.admits(100, vm, 2.0) == 0
    assert memory.admits(9000, vm, 2.0, cap=4) == 4


def test_overcommits_are_checked_and_rise() -> None:
    assert memory.parse_overcommits("2,1") == (1.0, 2.0)
    assert memory.parse_overcommits(None) == (1.0, 1.5, 2.0)
    for bad in ("0.5", "x", ",", "1,20"):
        with pytest.raises(ResourceError, match="between 1 and 16"):
            memory.parse_overcommits(bad)


def d(at: float, action: str, free: float = 900.0, **numbers: float) -> dict[str, Any]:
    return {"at": at, "vm": "-" if action in ("recovered", "no-step-left") else "b0",
            "action": action, "reason": "r",
            "numbers": {"host_free_mib": free, "target_free_mib": 1000.0, **numbers}}


def test_an_episode_runs_from_the_first_short_decision_to_recovered() -> None:
    log = [d(90, "inflate"), d(90.5, "recovered", 1100, short_s=3.0),   # before: not ours
           d(102, "trim", 950), d(104, "inflate", 880), d(106, "inflate", 860),
           d(108, "no-step-left", 850), d(115, "recovered", 1200, short_s=13.0),
           d(130, "trim", 900)]                                     # a later shortage
    ep = memory.episode(log, since=100.0, released=111.0)
    assert ep["first_short_at"] == 102 and ep["recovered_at"] == 115
    assert ep["burst_to_short_s"] == 2.0 and ep["short_s"] == 13.0
    assert ep["release_to_recovered_s"] == 4.0 and ep["burst_to_recovered_s"] == 15.0
    assert ep["steps"] == {"trim": 1, "inflate": 2, "no-step-left": 1}
    assert ep["host_free_min_mib"] == 850 and ep["target_free_mib"] == 1000.0


def test_a_shortage_that_never_ended_has_no_recovery_time() -> None:
    ep = memory.episode([d(102, "trim"), d(104, "inflate")], since=100.0, released=110.0)
    assert ep["recovered_at"] is None and ep["short_s"] is None
    assert ep["release_to_recovered_s"] is None and ep["steps"] == {"trim": 1, "inflate": 1}
    never = memory.episode([], since=100.0, released=None)
    assert never["first_short_at"] is None and never["steps"] == {}


def test_speed_ratio_is_median_alone_over_median_during() -> None:
    assert memory.speed_ratio([0.6, 0.6, 0.7, 0.6], [0.6, 0.62, 0.65]) == round(0.6 / 0.62, 4)
    assert memory.speed_ratio([], [0.6]) is None


def result(burst: dict[str, Any] | None, fit: list[dict[str, Any]] | None = None
           ) -> dict[str, Any]:
    meta = {"benchmark": "memory", "git_revision": "abc", "date": "2026-11-27", "host": "h",
            "host_cores": 2, "accel": "tcg", "partition_qemu": "10.0", "qemu": "QEMU 9",
            "image": "e7f7", "parts": ["fit", "burst"], "quick": True, "duration_s": 100.0,
            "budget_mib": 2048, "memory_mib": 1024, "floor_mib": 128, "max_vms": 24,
            "overhead_mib": 128, "tcg_tb_mib": 32, "host_room_mib": 21695,
            "segment_modes": memory.SEGMENT_SKIP, "target_margin_mib": 64}
    return {"meta": meta, "fit": fit or [], "burst": burst}


FIT = [{"mode": "none", "stop": "budget", "note": None, "per_vm_mib": 61.0,
        "first_vm_mib": 90.0, "host_mib": [{"vms": 1, "mib": 90.0}, {"vms": 2, "mib": 151.0}],
        "start_ms": [2100.0, 2300.0], "overcommits": [
            {"overcommit": 1.0, "admitted_vms": 1, "admitted_vms_computed": 1,
             "running_vms": 1, "host_mib": 90.0, "stop": "admission",
             "refusal": "the host has no room"},
            {"overcommit": 2.0, "admitted_vms": 2, "admitted_vms_computed": 2,
             "running_vms": 2, "host_mib": 151.0, "stop": "admission", "refusal": "x"}]}]
BURST = {"burst_vms": 2, "ram_mib": 384, "floor_mib": 224, "burst_mib": 96,
         "guaranteed_ram_mib": 192, "cores": {"burstable": 0, "guaranteed": 1},
         "target_free_mib": 20000, "free_before_mib": 20064.0, "released_after_s": 11.0,
         "episode": memory.episode([d(102, "trim"), d(104, "inflate"),
                                    d(113, "recovered", 20100, short_s=11.0)], 100.0, 111.0),
         "alone_s": [0.6, 0.61, 0.6], "during_s": [0.62, 0.63, 0.64],
         "alone_s_median": 0.6, "during_s_median": 0.63, "speed_ratio": 0.9524,
         "balloon_actual_min_mib": 224, "guaranteed_decisions": 0, "oom_kills": 0,
         "guest_oom_kills": 0, "guests_alive": True,
         "decisions": [d(102, "trim"), d(104, "inflate"), d(113, "recovered", 20100)]}


def test_targets_say_met_not_met_and_not_measured() -> None:
    got = {t: (m, ok) for t, m, ok in memory.targets(result(BURST, FIT))}
    assert got["guaranteed guest keeps >= 95% of its speed during the burst"] == ("95.2%", True)
    assert got["host back over its target <= 10 s after the release"] == (
        "2.0 s (short 11.0 s in all)", True)
    assert got["the host's OOM killer never ran"] == ("0", True)
    assert got["admitted VMs grow with the overcommit (shared-RAM mode none)"] == (
        "1 -> 2", True)
    slow = {**BURST, "speed_ratio": 0.8, "episode": memory.episode(
        [d(102, "trim")], 100.0, 111.0)}
    got = {t: (m, ok) for t, m, ok in memory.targets(result(slow))}
    assert got["guaranteed guest keeps >= 95% of its speed during the burst"][1] is False
    assert got["host back over its target <= 10 s after the release"] == (
        "never back within the run", False)
    assert got["admitted VMs grow with the overcommit (shared-RAM mode none)"][1] is None
    failed = {t: ok for t, _, ok in memory.targets(result({"failed": "boom"}))}
    assert set(failed.values()) == {None}


def test_report_renders_tables_and_both_plots(tmp_path: Path) -> None:
    f = tmp_path / "memory.json"
    f.write_text(json.dumps(result(BURST, FIT)))
    paths = report_memory.render(f, tmp_path / "out")
    assert [p.name for p in paths] == ["report.md", "memory-fit.png", "memory-burst.png"]
    md = paths[0].read_text()
    assert md.startswith("# Memory as a governed resource")
    assert "| none | 2 | 2 | 2 | 2 | 151.0 | admission: x |" in md
    assert "| release to `recovered` | 2.0 s |" in md
    assert "**PASS**" in md and "**NOT MEASURED**" not in md
    assert all(p.stat().st_size > 1000 for p in paths[1:])


def test_report_of_a_failed_burst_says_so_and_draws_no_burst_plot(tmp_path: Path) -> None:
    f = tmp_path / "memory.json"
    f.write_text(json.dumps(result({"failed": "the guest died"})))
    paths = report_memory.render(f, tmp_path / "out")
    assert [p.name for p in paths] == ["report.md"]
    md = paths[0].read_text()
    assert "FAILED: the guest died" in md and "**NOT MEASURED**" in md


def test_a_file_of_another_benchmark_is_one_sentence(tmp_path: Path) -> None:
    f = tmp_path / "x.json"
    f.write_text(json.dumps({"meta": {"benchmark": "density"}, "results": []}))
    with pytest.raises(SpecError, match="not a `fusuma bench memory` result file"):
        report_memory.load(f)
