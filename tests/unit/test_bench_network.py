"""The network benchmark's arithmetic (iperf3's JSON, medians, ratios, each kind of
move's figures, the downtime with and without a NIC) and its report, on made-up
numbers; the move probes' scripts against a server on loopback."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from fusuma.errors import SpecError
from fusuma_bench import netprobe, network, network_moves, report_network


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


def _seen(moved: dict[str, Any], lost: int = 30, run: int = 25, gap: float = 41.5,
          error: str | None = None, echoed: int | None = None
          ) -> netprobe.Seen[dict[str, Any]]:
    return netprobe.Seen(moved, {"sent": 3000, "received": 3000 - lost, "lost": lost,
                                 "longest_lost_run": run},
                         {"sent": 400, "echoed": 400 if echoed is None else echoed,
                          "max_gap_ms": gap, "local": 40000, "error": error})


def test_a_runs_figures_from_the_probes_and_fusumas_answer() -> None:
    s = network_moves.sample_of("zero-copy", 0, _seen({"downtime_ms": 8.5,
                                                       "qemu_downtime_ms": 7}), 3.0, 1.2)
    assert (s.echoes_sent, s.echoes_lost, s.outage_ms, s.tcp_stall_ms) == (3000, 30, 25.0,
                                                                          41.5)
    assert (s.moves, s.downtime_ms, s.qemu_downtime_ms, s.stream_whole) == (1, 8.5, 7.0,
                                                                            True)
    assert s.error is None
    # maintain --via: two moves, their downtimes summed; one unknown leaves no sum.
    via = {"moves": [{"downtime_ms": 9.0, "qemu_downtime_ms": 8.0},
                     {"downtime_ms": 10.5, "qemu_downtime_ms": None}]}
    s = network_moves.sample_of("maintain --via", 1, _seen(via), 10.0, 6.0)
    assert (s.moves, s.downtime_ms, s.qemu_downtime_ms) == (2, 19.5, None)
    # A move that outlasts the probes might hide its outage: the run fails.
    s = network_moves.sample_of("copy", 0, _seen({"downtime_ms": 1}), 6.0, 5.2)
    assert s.error is not None and "outlasted the probes" in s.error
    # A stream that broke, or lost a line, fails the run and says so.
    s = network_moves.sample_of("copy", 0, _seen({}, error="ConnectionResetError()"),
                                6.0, 1.0)
    assert s.stream_whole is False and s.error is not None and "Reset" in s.error
    s = network_moves.sample_of("copy", 0, _seen({}, echoed=399), 6.0, 1.0)
    assert s.stream_whole is False and s.error is not None


def test_a_kinds_medians_leave_failed_runs_out() -> None:
    mk = network_moves.MoveSample
    samples = [mk("copy", 5000, 480, 470.0, 490.0, True, 1, run=0, downtime_ms=476.0,
                  qemu_downtime_ms=470.0),
               mk("copy", 5000, 500, 490.0, 505.0, True, 1, run=1, downtime_ms=493.0,
                  qemu_downtime_ms=480.0),
               mk("copy", 5000, 490, 480.0, 500.0, True, 1, run=2, downtime_ms=480.0),
               mk("copy", run=3, error="the move took 6.0 s and outlasted the probes"),
               mk("zero-copy", 3000, 30, 25.0, 40.0, True, 1, run=0, downtime_ms=8.0,
                  qemu_downtime_ms=7.0)]
    row = network_moves.summarize_kind("copy", samples)
    assert (row["runs"], row["failed"], row["moves_per_run"]) == (3, 1, 1)
    assert row["echoes_lost_median"] == 490 and row["echoes_lost_max"] == 500
    assert (row["outage_ms_median"], row["outage_ms_max"]) == (480.0, 490.0)
    assert (row["tcp_stall_ms_median"], row["downtime_ms_median"]) == (500.0, 480.0)
    assert row["qemu_downtime_ms_median"] == 475.0   # the two QEMU reported
    # A failed run's stream is unknown: the kind cannot claim every stream stayed whole.
    assert row["stream_whole"] is False
    assert network_moves.summarize_kind("zero-copy", samples)["stream_whole"] is True
    empty = network_moves.summarize_kind("maintain --in-place", samples)
    assert empty["runs"] == 0 and empty["downtime_ms_median"] is None
    assert empty["stream_whole"] is False


def test_downtime_with_and_without_a_nic_side_by_side() -> None:
    ds = network_moves.DowntimeSample
    samples = [ds(True, run=r, downtime_ms=v, qemu_downtime_ms=v - 1)
               for r, v in enumerate((3.1, 3.4, 2.9, 3.3, 9.0))]
    samples += [ds(False, run=r, downtime_ms=v, qemu_downtime_ms=v - 1)
                for r, v in enumerate((2.8, 3.0, 3.2, 2.7, 3.1))]
    samples.append(ds(False, run=5, error="fusuma: error: refused"))
    d = network_moves.summarize_downtime(samples)
    assert (d["with_nic_moves"], d["without_nic_moves"]) == (5, 5)
    assert (d["with_nic_downtime_ms_median"], d["without_nic_downtime_ms_median"]) == (3.3,
                                                                                       3.0)
    assert (d["with_nic_downtime_ms_min"], d["with_nic_downtime_ms_max"]) == (2.9, 9.0)
    assert d["with_nic_qemu_downtime_ms_median"] == 2.3
    assert d["nic_minus_no_nic_ms"] == 0.3 and d["ranges_overlap"] is True
    apart = [ds(nic, run=r, downtime_ms=v)
             for nic, r, v in ((True, 0, 12.0), (True, 1, 14.0), (False, 0, 3.0),
                               (False, 1, 4.0))]
    d = network_moves.summarize_downtime(apart)
    assert d["nic_minus_no_nic_ms"] == 9.5 and d["ranges_overlap"] is False
    d = network_moves.summarize_downtime([ds(True, run=0, downtime_ms=3.0)])
    assert d["nic_minus_no_nic_ms"] is None and d["ranges_overlap"] is None


def test_each_downtime_steps_median_per_side() -> None:
    ds = network_moves.DowntimeSample
    samples = [ds(True, run=r, downtime_ms=5.0, steps_ms={"source_saved": a, "cont": b})
               for r, (a, b) in enumerate(((2.0, 0.5), (3.0, 0.7), (4.0, 0.6)))]
    samples += [ds(False, run=0, downtime_ms=3.0, steps_ms=None),
                ds(False, run=1, downtime_ms=3.0, steps_ms={"source_saved": 1.5})]
    d = network_moves.summarize_downtime(samples)
    assert d["with_nic_steps_ms_median"] == {"source_saved": 3.0, "cont": 0.6}
    assert list(d["with_nic_steps_ms_median"]) == ["source_saved", "cont"]
    assert d["without_nic_steps_ms_median"] == {"source_saved": 1.5}


def test_every_kind_of_move_has_its_row() -> None:
    res = network_moves.MovesResult(qemu_kinds="10.0.2", qemu_downtime="7.2.22")
    res.skipped["maintain --in-place"] = "needs QEMU 10.0"
    out = network_moves.summarize(res)
    kinds = {k["kind"]: k for k in out["kinds"]}
    assert list(kinds) == ["zero-copy", "copy", "maintain --via", "maintain --in-place",
                           "between hosts"]
    assert kinds["maintain --in-place"]["skipped"] == "needs QEMU 10.0"
    assert kinds["between hosts"]["skipped"] and kinds["copy"]["skipped"] is None
    assert kinds["copy"]["qemu"] == "10.0.2"
    assert out["nic_downtime"]["qemu"] == "7.2.22"
    assert out["error"] is None


@pytest.mark.skipif(os.geteuid() != 0, reason="the ICMP echo needs a raw socket (root)")
def test_the_probes_see_a_whole_stream_and_every_echo_on_loopback() -> None:
    """The two probe scripts themselves, against a line echo server on 127.0.0.1."""
    srv = socket.create_server(("127.0.0.1", 0))
    port = srv.getsockname()[1]

    def serve() -> None:
        conn, _ = srv.accept()
        with conn, conn.makefile("rwb") as f:
            for line in f:
                f.write(line)
                f.flush()
    t = threading.Thread(target=serve, daemon=True)
    t.start()
    try:
        seen = netprobe.around([], "127.0.0.1", port, 1.2, lambda: {"moved": True})
    finally:
        srv.close()
    assert seen.moved == {"moved": True}
    assert seen.stream_whole and seen.stream["sent"] > 20, seen.stream
    # Echoes the prober itself missed the moment of (a loaded host) are skipped, not
    # sent late: none of those sent is lost.
    assert seen.echo["sent"] + seen.echo["skipped"] == 1200, seen.echo
    assert seen.echo["sent"] > 600 and seen.echo["lost"] == 0, seen.echo
    assert seen.outage_ms == 0.0


def test_a_stalled_prober_skips_echoes_instead_of_losing_a_burst() -> None:
    """The prober stopped for 0.8 s (as a loaded host may leave it without a CPU):
    it skips the echoes it missed; before, it sent them in one burst when it ran again,
    and hundreds of their replies were lost: a false outage of the guest."""
    out = _stalled([netprobe.ECHO, "127.0.0.1", "1500"], 0.8)
    assert out["skipped"] >= 500 and out["sent"] + out["skipped"] == 1500, out
    assert out["lost"] == 0 and out["longest_lost_run"] == 0, out


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
            "moves": _moves()}


def _moves() -> dict[str, Any]:
    mk = network_moves.MoveSample
    res = network_moves.MovesResult(qemu_kinds="10.0.2", qemu_downtime="7.2.22")
    res.samples = [mk("zero-copy", 3000, 30, 25.0, 41.5, True, 1, run=0, downtime_ms=8.5,
                      qemu_downtime_ms=7.0, qemu="10.0.2"),
                   mk("copy", run=0, error="the move took 6.0 s and outlasted the probes")]
    res.skipped["maintain --in-place"] = "needs QEMU 10.0"
    res.downtime = [network_moves.DowntimeSample(True, run=0, downtime_ms=3.5,
                                                 qemu_downtime_ms=2.5,
                                                 steps_ms={"dest_loaded": 2.0, "taps": 0.3}),
                    network_moves.DowntimeSample(False, run=0, downtime_ms=3.0,
                                                 qemu_downtime_ms=2.0,
                                                 steps_ms={"dest_loaded": 1.5, "taps": 0.1})]
    return network_moves.summarize(res)


def test_report_from_the_result_file(tmp_path: Path) -> None:
    f = tmp_path / "network.json"
    f.write_text(json.dumps(_result()))
    paths = report_network.render(f, tmp_path / "out")
    md = paths[0].read_text()
    assert "| host -> VM | 10 | 10–10 | 2.5 | 2.5–2.5 | **4x** |" in md
    assert ("| zero-copy | 10.0.2 | 1 | 30 of 3000 | 25 | 41.5 | 8.5 | 7 | yes |"
            in md), md
    assert "| copy | 10.0.2 | 0 (1 failed) | – | – | – | – | – | **no** |" in md
    assert "maintain --in-place (needs QEMU 10.0)" in md
    assert "move copy run 0: the move took 6.0 s" in md
    assert "| tap NIC | 1 | 3.5 | 3.5–3.5 | 2.5 |" in md
    assert "Median with a NIC minus without: 0.5 ms; the two ranges do not overlap." in md
    assert "| destination QEMU: to the device state loaded | 2 | 1.5 | +0.50 |" in md, md
    assert "| the taps' handover | 0.3 | 0.1 | +0.20 |" in md
    assert [p.name for p in paths[1:]] == ["network.png", "network-moves.png"]
    assert "vm_to_nat tap run 1: iperf3: timed out" in md
    assert all(p.stat().st_size > 0 for p in paths[1:])


def test_report_of_a_run_without_moves(tmp_path: Path) -> None:
    data = _result()
    data["moves"] = None
    f = tmp_path / "network.json"
    f.write_text(json.dumps(data))
    paths = report_network.render(f, tmp_path / "out")
    assert "Not measured in this run (`--no-moves`)." in paths[0].read_text()
    assert [p.name for p in paths[1:]] == ["network.png"]


def test_report_refuses_another_benchmarks_file(tmp_path: Path) -> None:
    data = _result()
    data["meta"]["benchmark"] = "maintain"
    f = tmp_path / "x.json"
    f.write_text(json.dumps(data))
    with pytest.raises(SpecError, match="not a `fusuma bench network` result file"):
        report_network.load(f)


def test_report_says_when_the_moves_part_stopped_early(tmp_path: Path) -> None:
    data = _result()
    data["moves"]["error"] = "`fusuma vm start mv` exited 1: no such image"
    f = tmp_path / "network.json"
    f.write_text(json.dumps(data))
    md = report_network.render(f, tmp_path / "out")[0].read_text()
    assert ("**The moves part stopped early**: `fusuma vm start mv` exited 1: no such "
            "image") in md


class FakeWorld:
    """fusuma's answers in the moves part, without a VM: where each VM is, what a move
    returns; every command asked is kept."""

    ns = "fzbn-test"

    def __init__(self, cpr: bool = True) -> None:
        self.asked: list[tuple[str, ...]] = []
        self.where = {"mv": "p0", "bare": "p0"}
        self.qemu = {"p0": "7.2.22", "p1": "7.2.22"}
        self.cpr = cpr

    def nsenter(self, ns: str) -> list[str]:
        return ["nsenter", f"--net=/run/netns/{ns}", "--"]

    def fusuma(self, *args: str, timeout: float = 300, check: bool = True
               ) -> subprocess.CompletedProcess[str]:
        self.asked.append(args)
        out: Any = {}
        if args[:2] == ("vm", "show"):
            out = {"partition": self.where[args[2]], "qemu": self.qemu[self.where[args[2]]]}
        elif args[:2] == ("qemu", "list"):
            out = [{"series": "7.2"}, *([{"series": "10.0"}] if self.cpr else [])]
        elif args[0] == "migrate":
            self.where[args[1]] = args[3]
            out = {"downtime_ms": 3.0 if args[1] == "bare" else 3.5,
                   "qemu_downtime_ms": 2.0, "total_ms": 50.0}
        elif args[0] == "maintain":
            out = {"moves": [{"downtime_ms": 4.0, "qemu_downtime_ms": 3.0}] *
                   (2 if "--via" in args else 1)}
        elif args[:2] == ("partition", "create"):
            self.qemu[args[2]] = "10.0.2"
        return subprocess.CompletedProcess(list(args), 0, json.dumps(out), "")

    def guest(self, vm: str, script: str, timeout: float = 60) -> str:
        return f"2: eth0    inet {network_moves.MOVE_IP}/24 brd ..."


def _probes(monkeypatch: pytest.MonkeyPatch) -> None:
    def around(nsenter: list[str], host: str, port: int, span_s: float,
               move: Any) -> netprobe.Seen[Any]:
        assert nsenter[1] == "--net=/run/netns/fzbn-test" and host == network_moves.MOVE_IP
        return _seen(move())
    monkeypatch.setattr(netprobe, "around", around)


def test_the_moves_part_asks_fusuma_for_each_step(monkeypatch: pytest.MonkeyPatch) -> None:
    _probes(monkeypatch)
    w = FakeWorld()
    out = network_moves.run(w, move_runs=3, downtime_runs=5)
    assert out["error"] is None
    migrations = [a for a in w.asked if a[0] == "migrate"]
    # The NIC / no NIC comparison: in turn, 5 each, back and forth between p0 and p1.
    firsts = [a[1] for a in migrations[:10]]
    assert firsts == ["mv", "bare", "bare", "mv", "mv", "bare", "bare", "mv", "mv", "bare"]
    assert [a[3] for a in migrations[:10] if a[1] == "mv"] == ["p1", "p0", "p1", "p0", "p1"]
    assert all("zero-copy" in a for a in migrations[:10])
    d = out["nic_downtime"]
    assert (d["with_nic_moves"], d["without_nic_moves"]) == (5, 5)
    assert d["nic_minus_no_nic_ms"] == 0.5 and d["qemu"] == "7.2.22"
    # bare goes, both partitions are made again on QEMU 10.0, the empty one first.
    i = w.asked.index(("vm", "delete", "bare", "--force"))
    made = [a for a in w.asked[i:] if a[0] == "partition"]
    assert made == [("partition", "delete", "p0"),
                    ("partition", "create", "p0", "--cpus", "0", "--memory", "1024",
                     "--qemu", "10.0"),
                    ("partition", "delete", "p1"),
                    ("partition", "create", "p1", "--cpus", "1", "--memory", "1024",
                     "--qemu", "10.0")]
    kinds = {k["kind"]: k for k in out["kinds"]}
    for kind in network_moves.KINDS:
        assert kinds[kind]["runs"] == 3 and kinds[kind]["qemu"] == "10.0.2", kinds[kind]
    assert kinds["maintain --via"]["moves_per_run"] == 2
    assert kinds["maintain --via"]["downtime_ms_median"] == 8.0
    maint = [a for a in w.asked if a[0] == "maintain"]
    assert ("maintain", "p0", "--via", "p1", "--json") in maint
    assert ("maintain", "p0", "--in-place", "--json") in maint


def test_the_moves_part_without_qemu_10_or_when_a_step_fails(
        monkeypatch: pytest.MonkeyPatch) -> None:
    _probes(monkeypatch)
    out = network_moves.run(FakeWorld(cpr=False), move_runs=1, downtime_runs=1)
    kinds = {k["kind"]: k for k in out["kinds"]}
    assert "qemu install 10.0" in kinds["maintain --in-place"]["skipped"]
    assert kinds["copy"]["runs"] == 1 and kinds["copy"]["qemu"] == "7.2.22"

    class Broken(FakeWorld):
        def guest(self, vm: str, script: str, timeout: float = 60) -> str:
            raise network.BenchError("`fusuma vm exec mv` exited 1: no agent")
    out = network_moves.run(Broken(), move_runs=1, downtime_runs=1)
    assert out["error"] == "`fusuma vm exec mv` exited 1: no agent"
    assert all(k["runs"] == 0 for k in out["kinds"])


def test_the_cluster_echo_prober_skips_rounds_it_missed(tmp_path: Path) -> None:
    """bench cluster's prober of many guests, stopped for 0.5 s: it skips the rounds
    it missed instead of sending them in one burst (whose replies the kernel drops, a
    false outage of every guest), and loses none of those it sent."""
    from fusuma_bench.cluster_parallel import ECHO_MANY

    out = _stalled([ECHO_MANY, str(tmp_path / "never"), "10", "150", "127.0.0.1"], 0.5)
    seen = out["ips"]["127.0.0.1"]
    assert out["skipped"] >= 30 and seen["sent"] + out["skipped"] == 150, out
    assert seen["received"] == seen["sent"] and seen["longest_lost_run"] == 0, out


def _stalled(script_and_args: list[str], stall_s: float) -> Any:
    """Run a probe script, stop it for ``stall_s`` after 0.4 s (a loaded host leaving
    it without a CPU), and return what it printed."""
    p = subprocess.Popen([sys.executable, "-c", *script_and_args],
                         stdout=subprocess.PIPE, text=True)
    try:
        time.sleep(0.4)
        os.kill(p.pid, signal.SIGSTOP)
        time.sleep(stall_s)
        os.kill(p.pid, signal.SIGCONT)
        return json.loads(p.communicate(timeout=30)[0])
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()
