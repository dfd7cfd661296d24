"""`bench vmbeam`'s raw QEMU row: its QEMUs' command line, and fusuma's figures read
as a ratio to it in the report."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from fusuma_bench import rawmove, report_vmbeam, vmbeam
from fusuma_bench.report import FAIL, PASS, UNMEASURED


def row(mode: str, size: int, total: float, down: float, **kw: Any) -> dict[str, Any]:
    return {"mode": mode, "memory_mib": size, "total_ms": total, "downtime_ms": down,
            "bytes_sent": 210100, "cpu_s": 0.01, "data_intact": True, "moves": 5,
            "error": None, **kw}


def result(rows: list[dict[str, Any]]) -> report_vmbeam.Result:
    return report_vmbeam.parse({"meta": {"moves": 5, "benchmark": "vmbeam"},
                                "results": rows, "moves": []})


def by_name(res: report_vmbeam.Result) -> dict[str, Any]:
    return {c.target: c for c in report_vmbeam.raw_checks(res)}


def test_fusuma_within_the_factors_of_raw_qemu_passes() -> None:
    res = result([row("raw", 256, 6.0, 2.0), row("zero-copy", 256, 8.9, 3.9),
                  row("raw", 1024, 6.0, 2.5), row("zero-copy", 1024, 8.0, 4.0)])
    got = by_name(res)
    down = got["zero-copy downtime_ms <= 2x raw QEMU's at every size"]
    total = got["zero-copy total_ms <= 1.5x raw QEMU's at every size"]
    assert down.verdict == PASS and down.measured == "1.95x (256 MiB), 1.60x (1024 MiB)"
    assert total.verdict == PASS and total.measured == "1.48x (256 MiB), 1.33x (1024 MiB)"


def test_one_size_beyond_the_factor_fails() -> None:
    res = result([row("raw", 256, 6.0, 2.0), row("zero-copy", 256, 9.1, 4.1)])
    got = by_name(res)
    assert got["zero-copy downtime_ms <= 2x raw QEMU's at every size"].verdict == FAIL
    assert got["zero-copy total_ms <= 1.5x raw QEMU's at every size"].verdict == FAIL


def test_without_a_raw_row_for_every_size_nothing_passes() -> None:
    assert {c.verdict for c in report_vmbeam.raw_checks(result(
        [row("zero-copy", 256, 8.0, 4.0)]))} == {UNMEASURED}
    assert {c.verdict for c in report_vmbeam.raw_checks(result(
        [row("raw", 256, 6.0, 2.0)]))} == {UNMEASURED}


def test_the_report_puts_raw_qemu_beside_fusuma(tmp_path: Path) -> None:
    steps = {"source_saved": 1.0, "dest_loaded": 1.0, "event": 0.1, "taps": 0.0,
             "cont": 0.3}
    rows = [row("raw", 256, 6.0, 2.0, steps_ms=steps, load_before=[0.5, 0.6, 0.7]),
            row("zero-copy", 256, 8.9, 3.9, steps_ms={**steps, "decision": 0.2})]
    f = tmp_path / "vmbeam.json"
    f.write_text(json.dumps({"meta": {"moves": 5, "benchmark": "vmbeam"}, "results": rows,
                             "moves": []}))
    text = report_vmbeam.markdown(report_vmbeam.load(f), f)
    assert "## fusuma / raw QEMU" in text
    assert "| 256 | 2.00 | 3.90 | 1.95x | 6.00 | 8.90 | 1.48x |" in text
    assert "| raw | 256 | 1.00 | 1.00 | 0.10 | - | 0.00 | 0.30 | 0.5 0.6 0.7 |" in text


def test_a_case_summary_keeps_the_median_of_each_step() -> None:
    from fusuma.migration import MigrationResult

    def res(down: float, steps: dict[str, float]) -> vmbeam.Move:
        r = MigrationResult(vm="v", source="a", to="b", mode="raw", total_ms=6.0,
                            downtime_ms=down, bytes_sent=1, prepare_ms=1.0, cpu_s=0.0,
                            qemu_total_ms=5, qemu_downtime_ms=2, steps_ms=steps)
        return vmbeam.Move(256, r, vmbeam.GuestCheck(True, True, []))
    case = vmbeam.Case("raw", 256, 3, [res(2.0, {"event": 0.1, "cont": 0.3}),
                                        res(3.0, {"event": 0.2, "cont": 0.5}),
                                        res(4.0, {"event": 0.3, "cont": 0.4})],
                       load_before=[1.0, 1.0, 1.0])
    got = vmbeam._summary(case)
    assert got["steps_ms"] == {"event": 0.2, "cont": 0.4}
    assert got["downtime_ms"] == 3.0 and got["qemu_downtime_ms"] == 2.0
    assert got["load_before"] == [1.0, 1.0, 1.0] and got["data_intact"] is True


def test_the_raw_pair_is_a_zero_copy_pair_on_two_cores(tmp_path: Path) -> None:
    img = tmp_path / "img"
    img.mkdir()
    (img / "image.json").write_text(json.dumps({"append": "console=ttyS0"}))
    cfg = rawmove.RawConfig(tmp_path, img, Path("/dev/shm/x.ram"), 1024, (0, 1))
    src = rawmove.argv(cfg, "a", tmp_path / "a.qmp", tmp_path / "a.qga", 0, False, None)
    dst = rawmove.argv(cfg, "b", tmp_path / "b.qmp", tmp_path / "b.qga", 1, True, None)
    assert src[:3] == ["taskset", "-c", "0"] and dst[:3] == ["taskset", "-c", "1"]
    ram = "memory-backend-file,id=ram0,size=1024M,mem-path=/dev/shm/x.ram,share=on,merge=off"
    assert ram in src and ram in dst
    assert "-incoming" not in src and dst[-3:] == ["-S", "-incoming", "defer"]
    # As a fusuma VM: nobody's uid, the sandbox, the guest agent's port.
    assert "--reuid" in src and str(rawmove.NOBODY) in src
    assert "-sandbox" in src and any("org.qemu.guest_agent.0" in a for a in src)
    assert [c["capability"] for c in rawmove.CAPS["capabilities"]] == ["x-ignore-shared",
                                                                       "events"]
