"""The network benchmark's arithmetic (iperf3's JSON, medians, ratios, the move
columns) and its report, on made-up numbers."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from fusuma.errors import SpecError
from fusuma_bench import network, report_network


def _iperf(bps: float) -> str:
    return json.dumps({"start": {}, "intervals": [],
                       "end": {"sum_sent": {"bits_per_second": bps * 1.01},
                               "sum_received": {"bits_per_second": bps}}})


def test_iperf_json_gives_the_receivers_rate_in_mbit_s() -> None:
    assert network.iperf_mbit_s(_iperf(123_456_789)) == 123.46
    with pytest.raises(network.BenchError, match="iperf3: unable to connect"):
        network.iperf_mbit_s(json.dumps({"error": "unable to connect to server"}))
    with pytest.raises(network.BenchError, match="printed no JSON"):
        network.iperf_mbit_s("iperf3: error - unable to connect\n")
    with pytest.raises(network.BenchError, match=r"no end\.sum_received"):
        network.iperf_mbit_s(json.dumps({"end": {}}))


def test_medians_and_the_ratio_per_path() -> None:
    samples = [network.Sample("host_to_vm", "tap", r, v) for r, v in enumerate((90, 100, 300))]
    samples += [network.Sample("host_to_vm", "user-mode", r, v)
                for r, v in enumerate((20, 25, 30))]
    samples += [network.Sample("vm_to_vm", "tap", 0, 50.0),
                network.Sample("vm_to_vm", "user-mode", 0, None, "iperf3: refused")]
    rows = {r["path"]: r for r in network.summarize(samples)}
    h = rows["host_to_vm"]
    assert (h["tap_mbit_s_median"], h["tap_mbit_s_min"], h["tap_mbit_s_max"]) == (100, 90, 300)
    assert h["user_mode_mbit_s_median"] == 25 and h["tap_over_user_mode"] == 4.0
    assert h["tap_runs"] == h["user_mode_runs"] == 3
    # A kind without a figure gives no ratio, never a made-up one.
    v = rows["vm_to_vm"]
    assert v["user_mode_mbit_s_median"] is None and v["tap_over_user_mode"] is None
    assert v["user_mode_runs"] == 0
    assert rows["vm_to_nat"]["tap_over_user_mode"] is None


def test_ping_loss_and_longest_tcp_stall() -> None:
    out = ("--- 10.124.1.10 ping statistics ---\n"
           "2000 packets transmitted, 1994 received, 0.3% packet loss, time 2210ms\n")
    assert network.ping_counts(out) == (2000, 6)
    with pytest.raises(network.BenchError, match="no summary"):
        network.ping_counts("ping: connect: Network is unreachable")
    iv = [{"sum": {"bytes": b, "seconds": 0.1}} for b in (5, 0, 0, 7, 0, 0, 0, 9, 0)]
    assert network.longest_stall_ms(iv) == 300.0
    assert network.longest_stall_ms([{"sum": {"bytes": 1, "seconds": 0.1}}]) == 0.0


def test_every_kind_of_move_has_its_row_and_columns() -> None:
    row = network.MoveRow("zero-copy", status="refused", reason="not supported yet")
    assert set(row.as_json()) == {"kind", "status", "reason", "ping_sent",
                                  "ping_loss_packets", "tcp_stall_ms"}
    assert {"zero-copy", "copy", "maintain --via", "maintain --in-place",
            "between hosts"} == set(network.MOVE_KINDS)


def _result() -> dict[str, Any]:
    samples = [network.Sample(p, k, 0, 10.0 if k == "tap" else 2.5)
               for p in network.PATHS for k in network.KINDS]
    samples.append(network.Sample("vm_to_nat", "tap", 1, None, "iperf3: timed out"))
    return {"meta": {"benchmark": "network", "git_revision": "abc", "date": "2026-11-26",
                     "host": "h", "host_cpu": "cpu", "host_cores": 2, "accel": "tcg",
                     "qemu": "QEMU 7.2", "iperf3": "iperf 3.12", "runs": 1,
                     "seconds_per_run": 3, "guest_image": "debian",
                     "guest_memory_mib": 256, "vcpus": 1},
            "summary": network.summarize(samples),
            "samples": [s.as_json() for s in samples],
            "moves": [network.MoveRow("zero-copy", "refused", "no").as_json()]}


def test_report_from_the_result_file(tmp_path: Path) -> None:
    f = tmp_path / "network.json"
    f.write_text(json.dumps(_result()))
    paths = report_network.render(f, tmp_path / "out")
    md = paths[0].read_text()
    assert "| host -> VM | 10 | 10–10 | 2.5 | 2.5–2.5 | **4x** |" in md
    assert "| zero-copy | refused | – | – | – | no |" in md
    assert "vm_to_nat tap run 1: iperf3: timed out" in md
    assert paths[1].name == "network.png" and paths[1].stat().st_size > 0


def test_report_refuses_another_benchmarks_file(tmp_path: Path) -> None:
    data = _result()
    data["meta"]["benchmark"] = "maintain"
    f = tmp_path / "x.json"
    f.write_text(json.dumps(data))
    with pytest.raises(SpecError, match="not a `fusuma bench network` result file"):
        report_network.load(f)
