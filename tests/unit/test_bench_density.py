"""The density benchmark's decisions and arithmetic, and its report, on made-up numbers."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from fusuma.errors import ResourceError, SpecError
from fusuma_bench import density, density_run, report_density


def test_modes_are_checked_and_keep_their_order() -> None:
    assert density.parse_modes(None) == list(density.MODES)
    assert density.parse_modes("segment, none,segment") == ["segment", "none"]
    with pytest.raises(ResourceError, match="unknown mode 'nss': the modes are none, "):
        density.parse_modes("none,nss")


def test_the_next_vm_starts_while_the_last_ones_cost_fits_once_more() -> None:
    budget = 600.0
    assert density.next_step([], budget, 64) == (1, None)
    # one VM: no cost per added VM known yet, so the next is tried and measured
    assert density.next_step([(1, 590.0)], budget, 64) == (1, None)
    assert density.next_step([(1, 200.0), (2, 370.0)], budget, 64) == (1, None)  # 540
    assert density.next_step([(1, 200.0), (2, 370.0), (3, 540.0)], budget, 64) == \
        (0, "budget")                                                        # 710 > 600
    # a VM that cost nothing (noise, memory handed back) predicts no growth
    assert density.next_step([(1, 200.0), (2, 590.0), (3, 580.0)], budget, 64) == (1, None)
    assert density.next_step([(1, 100.0), (2, 150.0)], budget, 2) == (0, "cap")


def test_two_vms_start_at_once_while_the_budget_is_far() -> None:
    # room 450 >= 4 x 50: two at once; the cost is per VM across a step of two
    assert density.next_step([(1, 100.0), (2, 150.0)], 600, 64) == (2, None)
    assert density.next_step([(2, 150.0), (4, 250.0)], 600, 64) == (2, None)  # 350 >= 200
    assert density.next_step([(4, 250.0), (6, 400.0)], 600, 64) == (1, None)  # 200 < 300
    assert density.next_step([(1, 100.0), (2, 150.0)], 600, 3) == (1, None)   # the cap


def test_cost_per_added_vm_and_saving_against_none() -> None:
    assert density.per_vm_mib([(1, 300.0)]) is None
    assert density.per_vm_mib([(1, 300.0), (2, 500.0), (4, 900.0)]) == 200.0
    assert density.saving_pct(50.0, 200.0) == 75.0
    assert density.saving_pct(210.0, 200.0) == -5.0
    assert density.saving_pct(None, 200.0) is None
    assert density.saving_pct(50.0, None) is None


@pytest.mark.parametrize(("mode", "part", "cap"), [
    ("none", 64 + 256 + 56 * 128, 55),       # + 55 RAM files of 256: 21568 <= 21695
    ("ksm", 64 + 256 + 55 * 384, 54),        # private RAM: all in the partition
    ("template", 64 + 256 + 54 * 384, 53),   # + the source's and the template's RAM
])
def test_capacity_stays_within_what_the_host_admits(mode: str, part: int,
                                                    cap: int) -> None:
    assert density.capacity(mode, 21695, 256, 128, 64) == (part, cap)
    assert density.capacity(mode, 21695, 256, 128, 8)[1] == 8


def test_a_budget_below_one_vm_is_one_sentence() -> None:
    msg = density.below_one_vm(100, 181.4, "none", 256)
    assert msg == ("a budget of 100 MiB is smaller than one VM: one Debian VM of 256 MiB "
                   "took 181 MiB of host memory in mode none; give --budget-mib 182 or "
                   "more (--quick uses 1536).")
    assert msg.count(". ") == 0 and msg.endswith(".")


def run(mode: str, host: list[float], tcg: list[float] | None = None,
        **kw: Any) -> density.ModeRun:
    n = len(host)
    return density.ModeRun(mode, points=[(i + 1, h) for i, h in enumerate(host)],
                           names=[f"v{i}" for i in range(n)],
                           start_ms=[900.0 + i for i in range(n)],
                           tcg_mib=tcg or [32.0 * (i + 1) for i in range(n)],
                           private_mib=[100.0] * n, **kw)


def test_derive_compares_each_mode_with_none() -> None:
    rows = density.derive([
        run("none", [200.0, 370.0, 540.0], requests_per_s=80.0),
        run("ksm", [170.0, 260.0, 350.0, 440.0, 530.0]),
        run("template", [], stop="skipped", note="not available: no template command"),
    ])
    none, ksm, tpl = rows
    assert none["per_vm_mib"] == 170.0 and none["saving_pct"] is None
    assert ksm["per_vm_mib"] == 90.0 and ksm["saving_pct"] == 47.1
    assert ksm["per_vm_without_tcg_buffer_mib"] == 58.0       # 90 - 32 per VM
    assert ksm["start_ms_median"] == 902.0 and ksm["first_vm_mib"] == 170.0
    assert tpl["vms"] == 0 and tpl["per_vm_mib"] is None and tpl["stop"] == "skipped"
    assert {"mode", "vms", "per_vm_mib", "saving_pct", "start_ms_median",
            "requests_per_s", "host_mib"} <= set(none)


class FakeDb:
    def find_partition(self, name: str) -> None:
        return None


def bench(budget: int) -> density_run.Bench:
    parts = SimpleNamespace(paths=SimpleNamespace(as_env=lambda: {}), db=FakeDb())
    cfg = density.Config(budget_mib=budget, modes=("none", "segment"))
    return density_run.Bench(parts, None, None, cfg)  # type: ignore[arg-type]


def test_the_first_mode_below_one_vm_ends_the_run_later_ones_say_it(
        monkeypatch: pytest.MonkeyPatch) -> None:
    b = bench(100)

    def fill(mode: str, r: density.ModeRun) -> None:
        r.rejected_mib, r.stop = 181.0, "budget"

    monkeypatch.setattr(b, "_fill", fill)
    with pytest.raises(ResourceError, match="a budget of 100 MiB is smaller than one VM"):
        b._mode("none", first=True)
    later = b._mode("segment", first=False)
    assert later.vms == 0 and later.stop == "below one VM"
    assert later.note is not None and "--budget-mib 182" in later.note


def test_a_failing_mode_is_recorded_and_the_run_goes_on(
        monkeypatch: pytest.MonkeyPatch) -> None:
    b = bench(1000)

    def fill(mode: str, r: density.ModeRun) -> None:
        r.points.append((1, 200.0))
        raise density.CliFailed(["vm", "create"], 2, "No such option: --template")

    monkeypatch.setattr(b, "_fill", fill)
    r = b._mode("none", first=True)
    assert r.stop == "failed" and r.note is not None and "--template" in r.note


def test_vms_that_never_answer_end_the_mode_without_blaming_the_budget(
        monkeypatch: pytest.MonkeyPatch) -> None:
    b = bench(1000)

    def fill(mode: str, r: density.ModeRun) -> None:
        r.failed_starts, r.stop, r.note = 3, "failed starts", "3 VMs did not answer"

    monkeypatch.setattr(b, "_fill", fill)
    r = b._mode("template", first=True)
    assert (r.vms, r.stop, r.note) == (0, "failed starts", "3 VMs did not answer")


def result(tmp_path: Path) -> Path:
    runs = [run("none", [200.0, 370.0, 540.0], requests_per_s=80.0, stop="budget"),
            run("segment", [230.0, 350.0, 470.0, 590.0], stop="budget"),
            run("template", [300.0, 330.0, 360.0, 390.0, 420.0, 450.0, 480.0, 510.0,
                             540.0, 570.0], stop="cap"),
            run("template+ksm", [], stop="skipped", note="not available: no command")]
    runs[2].private_mib = [25.0] * 10
    runs[2].clone_agent_ms, runs[2].clone_restore_ms = [150.0, 250.0, 400.0], [90.0, 110.0]
    data = {"meta": {"benchmark": "density", "git_revision": "abc123", "date": "2026-01-01",
                     "host": "h", "host_cores": 2, "accel": "tcg", "qemu": "QEMU 7.2",
                     "partition_qemu": "10.0", "budget_mib": 600, "quick": True,
                     "memory_mib": 256, "image": "0123456789abcdef", "max_vms": 10,
                     "requests": 200, "http_concurrency": 4, "duration_s": 600.0,
                     "tcg_tb_mib": 32},
            "results": density.derive(runs), "paper": density.PAPER}
    path = tmp_path / "density.json"
    path.write_text(json.dumps(data))
    return path


def test_targets_are_checked_against_the_numbers(tmp_path: Path) -> None:
    data = report_density.load(result(tmp_path))
    got = {t.split(" ")[0] + " " + t.split(" ")[1]: (v, k)
           for t, v, k in report_density.targets(data)}
    assert got["segment alone"] == ("29.4%", "PASS")          # 120 vs 170
    assert got["best mode"][1] == "PASS"                       # template: 30 vs 170
    fits = next((v, k) for t, v, k in report_density.targets(data) if "fits" in t)
    assert fits == ("10 vs 3 = 3.3x (template) (capped before the budget)", "PASS")
    clone = next((v, k) for t, v, k in report_density.targets(data) if "clone" in t)
    assert clone == ("25.0 / 100.0 MiB = 25% (template)", "PASS")
    agent = next((v, k) for t, v, k in report_density.targets(data) if "guest agent" in t)
    assert agent == ("250.0 ms, restored in 100.0 ms (template)", "PASS")


def test_targets_without_numbers_are_not_measured(tmp_path: Path) -> None:
    data = report_density.load(result(tmp_path))
    data["results"] = [r for r in data["results"] if r["mode"] == "none"]
    assert {k for _, _, k in report_density.targets(data)} == {report_density.UNMEASURED}


def test_report_renders_tables_paper_and_plot(tmp_path: Path) -> None:
    md, png = report_density.render(result(tmp_path), tmp_path / "report")
    text = md.read_text()
    assert "| template | 10 | cap | 300.0 | 30.0 | 82.4% |" in text
    assert "| DCSS (root fs shared) | 183 | 22.5% | segment: 120.0 MiB, saved 29.4% |" in text
    assert "| DCSS | 4.9 | 34.8% |" in text
    assert "**template+ksm**: not available: no command" in text
    assert "![host memory vs VMs](density.png)" in text
    assert png.stat().st_size > 1000


def test_report_refuses_another_benchmarks_file(tmp_path: Path) -> None:
    other = tmp_path / "dcss.json"
    other.write_text(json.dumps({"meta": {"benchmark": "dcss"}, "results": []}))
    with pytest.raises(SpecError, match="is not a `fusuma bench density` result file"):
        report_density.load(other)
