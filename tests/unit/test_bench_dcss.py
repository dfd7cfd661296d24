"""The dcss benchmark's arithmetic and its report, on made-up numbers."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from fusuma.memshare.smaps import parse_smaps
from fusuma_bench import dcss, report_dcss

AB = """Server Software:        Apache/2.4.62
Complete requests:      2000
Failed requests:        3
Requests per second:    273.41 [#/sec] (mean)
"""


def test_parse_ab() -> None:
    assert dcss.parse_ab(AB) == (273.41, 3)
    with pytest.raises(ValueError):
        dcss.parse_ab("apr_socket_recv: Connection refused (111)")


def test_slope_is_least_squares() -> None:
    assert dcss.slope([(1, 300.0), (2, 500.0), (4, 900.0), (8, 1700.0)]) == pytest.approx(200)
    assert dcss.slope([(1, 1.0)]) is None


def point(mode: str, load: str, n: int, total: float, rps: float | None = None,
          guest: float = 0.0) -> dcss.Point:
    return dcss.Point(mode, load, n, total, guest or total / 2, total, 0.0, None, rps, 0, 1.0)


def test_derive_and_summary_against_mode_none() -> None:
    pts = [point("none", "idle", 1, 300), point("none", "idle", 2, 500),
           point("none", "idle", 4, 900),
           point("ksm", "idle", 1, 300), point("ksm", "idle", 2, 400),
           point("ksm", "idle", 4, 600),
           point("none", "apache2", 1, 300, 250), point("none", "apache2", 2, 500, 240),
           point("segment", "apache2", 1, 290, 245), point("segment", "apache2", 2, 470, 236)]
    res = dcss.derive(pts)
    row = next(r for r in res if (r["mode"], r["load"], r["vms"]) == ("ksm", "idle", 4))
    assert row["per_vm_mib"] == 100.0                 # (600 - 300) / 3
    assert row["saving_pct"] == 50.0                  # none: (900 - 300) / 3 = 200
    first = next(r for r in res if (r["mode"], r["load"], r["vms"]) == ("ksm", "idle", 1))
    assert first["per_vm_mib"] == 300 and first["saving_pct"] == 0.0
    assert set(res[0]) >= {"mode", "load", "vms", "total_pss_mib", "per_vm_mib",
                           "saving_pct", "requests_per_s"}
    summ = {(r["mode"], r["load"]): r for r in dcss.summarize(res)}
    assert summ[("ksm", "idle")]["slope_pss_mib"] == 100.0
    assert summ[("ksm", "idle")]["saving_pss_pct"] == 50.0
    assert summ[("segment", "apache2")]["saving_pss_pct"] == 10.0    # 180 vs 200
    assert summ[("segment", "apache2")]["requests_vs_none_pct"] == -1.8   # 240.5/245
    assert summ[("none", "idle")]["requests_per_s"] is None


SMAPS = """\
7f0000000000-7f0010000000 rw-s 00000000 00:1a 5 /dev/shm/fusuma/vm.ram
Rss:              100000 kB
Pss:               90000 kB
7f1000000000-7f1000400000 r--s 00000000 fd:01 7 /h/segments/usr.erofs
Rss:                4096 kB
Pss:                1024 kB
7f2000000000-7f2010200000 rw-p 00000000 00:00 0
Rss:                2048 kB
Pss:                2048 kB
7f3000000000-7f3002000000 rwxp 00000000 00:00 0
Rss:               30000 kB
Pss:               30000 kB
"""


def test_guest_kib_counts_ram_and_segments_not_qemu() -> None:
    maps = parse_smaps(SMAPS)
    shared = dcss.guest_kib(maps, 256, "/dev/shm/fusuma/vm.ram", {"/h/segments/usr.erofs"})
    assert shared == 90000 + 1024       # RAM file + segment; anonymous memory is QEMU's
    private = dcss.guest_kib(maps, 258, None, set())
    assert private == 2048              # the anonymous mapping of the RAM's size


def result_file(tmp_path: Path, idle_saving: float, rps_delta: float | None) -> Path:
    summary = [
        {"mode": "none", "load": "idle", "slope_pss_mib": 200.0, "slope_guest_mib": 100.0,
         "requests_per_s": None, "saving_pss_pct": 0.0, "saving_guest_pct": 0.0,
         "requests_vs_none_pct": None},
        {"mode": "segment", "load": "idle", "slope_pss_mib": 190.0,
         "slope_guest_mib": 90.0, "requests_per_s": None, "saving_pss_pct": 5.0,
         "saving_guest_pct": 10.0, "requests_vs_none_pct": None},
        {"mode": "ksm", "load": "idle", "slope_pss_mib": 100.0, "slope_guest_mib": 50.0,
         "requests_per_s": None, "saving_pss_pct": idle_saving, "saving_guest_pct": 50.0,
         "requests_vs_none_pct": None},
        {"mode": "ksm", "load": "apache2", "slope_pss_mib": 100.0, "slope_guest_mib": 50.0,
         "requests_per_s": 250.0, "saving_pss_pct": 45.0, "saving_guest_pct": 50.0,
         "requests_vs_none_pct": rps_delta},
    ]
    data = {"meta": {"git_revision": "abc", "date": "d", "host": "h", "host_cores": 2,
                     "accel": "tcg", "qemu": "QEMU 7.2", "memory_mib": 256, "image": "x",
                     "counts": [1, 2], "requests": 10, "ab_concurrency": 4},
            "results": [{"mode": "none", "load": "idle", "vms": 1, "total_pss_mib": 200.0,
                         "per_vm_mib": 200.0, "saving_pct": 0.0, "guest_mib": 100.0,
                         "segments_pss_mib": 0.0, "ksm_saved_mib": None,
                         "requests_per_s": None}],
            "summary": summary, "paper": dcss.PAPER}
    path = tmp_path / "dcss.json"
    path.write_text(json.dumps(data))
    return path


def test_report_verdicts(tmp_path: Path) -> None:
    rows = report_dcss.targets(report_dcss.load(result_file(tmp_path, 52.0, -2.0)))
    verdicts = {t: k for t, _, k in rows}
    assert verdicts["saving per added VM, idle, best mode >= 40%"] == "PASS"
    assert verdicts["saving per added VM, apache2, best mode >= 50%"] == "FAIL"
    assert verdicts["apache2 requests/s within 5% of none"] == "PASS"
    rows = report_dcss.targets(report_dcss.load(result_file(tmp_path, 30.0, None)))
    verdicts = {t: k for t, _, k in rows}
    assert verdicts["saving per added VM, idle, best mode >= 40%"] == "FAIL"
    assert verdicts["apache2 requests/s within 5% of none"] == "NOT MEASURED"


def test_report_renders_markdown_and_plot(tmp_path: Path) -> None:
    md, png = report_dcss.render(result_file(tmp_path, 52.0, -2.0), tmp_path / "out")
    text = md.read_text()
    assert "Table 1" in text and "NSS+DCSS" in text and "34.8%" in text
    assert png.stat().st_size > 1000


def test_report_refuses_other_files(tmp_path: Path) -> None:
    bad = tmp_path / "x.json"
    bad.write_text('{"meta": {}}')
    with pytest.raises(Exception, match="not a `fusuma bench dcss` result file"):
        report_dcss.load(bad)
