"""The VMBeam benchmark: result file, data checks, report and plot."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from tests.conftest import Host

pytestmark = [pytest.mark.integration, pytest.mark.timeout(400)]

FIGURES = ("prepare_ms", "total_ms", "downtime_ms", "bytes_sent", "cpu_s")


def test_bench_vmbeam_quick(host: Host, tmp_path: Path) -> None:
    out, rep = tmp_path / "vmbeam.json", tmp_path / "report"
    host.run("bench", "vmbeam", "--quick", "--sizes", "128", "--moves", "2",
             "--json", str(out), "--report", str(rep), timeout=380)
    data = json.loads(out.read_text())
    meta = data["meta"]
    assert meta["benchmark"] == "vmbeam" and meta["sizes"] == [128] and meta["moves"] == 2
    for key in ("git_revision", "date", "host", "accel", "qemu"):
        assert meta[key], key
    rows = {r["mode"]: r for r in data["results"]}
    # fusuma's two kinds of move, and raw QEMU making the zero-copy one beside them.
    assert sorted(rows) == ["copy", "raw", "zero-copy"]
    for r in rows.values():
        assert r["memory_mib"] == 128 and r["moves"] == 2, r
        # A failure here is real guest memory damage: see the moves' kernel_errors.
        assert r["data_intact"] is True, [
            (m["mode"], m["to"], m["data_intact"], m["kernel_errors"][:1], m["error"])
            for m in data["moves"]]
        for key in FIGURES:
            if key == "cpu_s" and r["mode"] in ("zero-copy", "raw"):
                # 10 ms clock ticks: a ~10 ms zero-copy move may well count as 0.
                assert math.isfinite(r[key]) and r[key] >= 0, (r["mode"], key, r[key])
                continue
            assert math.isfinite(r[key]) and r[key] > 0, (r["mode"], key, r[key])
    # Zero-copy sends device state only; copy sends the touched guest RAM.
    assert rows["zero-copy"]["bytes_sent"] * 20 < rows["copy"]["bytes_sent"]
    moves = data["moves"]
    assert len(moves) == 6 and all(m["data_intact"] and m["writer_alive"] for m in moves)
    assert [m["to"] for m in moves if m["mode"] == "raw"] == ["core1", "core0"]
    assert [m["to"] for m in moves if m["mode"] == "copy"] == ["bench-vmbeam-b",
                                                               "bench-vmbeam-a"]
    # The scratch partitions are gone.
    assert host.ps() == {"partitions": [], "vms": [], "networks": []}

    text = (rep / "report.md").read_text()
    assert "| zero-copy | 128 |" in text and "## Targets" in text
    assert (rep / "vmbeam.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"

    # The report judges from the numbers: a corrupted move must turn into FAIL.
    data["results"][0]["data_intact"] = False
    data["moves"][0]["data_intact"] = False
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps(data))
    host.run("bench", "report", "vmbeam", str(bad), str(tmp_path / "bad"))
    verdicts = [line for line in (tmp_path / "bad" / "report.md").read_text().splitlines()
                if line.startswith("| data_intact")]
    assert verdicts and "FAIL" in verdicts[0]


def test_bench_vmbeam_refuses_beside_a_partition(host: Host) -> None:
    host.run("partition", "create", "p0", "--cpus", host.core(0), "--memory", "256")
    err = host.fail("bench", "vmbeam", "--quick", "--json", "/dev/null").err
    assert "needs every core" in err and "p0" in err
    assert [p["name"] for p in host.ps()["partitions"]] == ["p0"]
