"""In-place moves (cpr-transfer) without QEMU: the rendered argv, how an adopting
supervisor tells the two QEMUs apart, the feature gate, and the benchmark's report."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest

from fusuma.migration import MigrationResult
from fusuma.migration.inplace import has_cpr
from fusuma.qemu.cmdline import VmConfig, build_argv, cpr_channel
from fusuma.qemu.instance import Role
from fusuma.qemu.versions import Qemu, features_for
from fusuma.state import Job, JobOwner, VmRecord
from fusuma.supervisor.moves.cpr import in_place_side
from fusuma_bench import report_maintain


def cfg(**kw: object) -> VmConfig:
    base: dict[str, object] = dict(
        name="vm0", vcpus=1, memory_mib=256, accel="tcg", kernel=Path("/k"),
        initrd=Path("/i"), append="console=ttyS0", qmp_socket=Path("/r/in-1/qmp.sock"),
        qga_socket=Path("/r/in-1/qga.sock"), console_socket=Path("/r/in-1/console.sock"),
        console_log=Path("/h/console.log"), pidfile=Path("/r/in-1/qemu.pid"),
        ram_file=Path("/dev/shm/fusuma/vm0.ram"))
    base.update(kw)
    return VmConfig(**base)  # type: ignore[arg-type]


def opt(argv: list[str], flag: str) -> list[str]:
    return [argv[i + 1] for i, a in enumerate(argv) if a == flag]


def test_aux_ram_share_is_a_host_side_machine_option() -> None:
    plain = opt(build_argv(cfg()), "-machine")[0]
    shared = opt(build_argv(cfg(aux_ram_share=True)), "-machine")[0]
    assert "aux-ram-share" not in plain
    assert shared == plain + ",aux-ram-share=on"


def test_new_qemu_of_an_in_place_move_listens_on_its_cpr_channel() -> None:
    sock = Path("/r/in-1/cpr.sock")
    argv = build_argv(cfg(incoming="defer", cpr_socket=sock, aux_ram_share=True))
    assert opt(argv, "-incoming") == ["defer", cpr_channel(sock)]
    assert argv.index("-S") < argv.index("-incoming")   # paused until "forward"
    assert json.loads(opt(argv, "-incoming")[1]) == {
        "channel-type": "cpr",
        "addr": {"transport": "socket", "type": "unix", "path": "/r/in-1/cpr.sock"}}
    # Only an in-place move's destination has a cpr channel.
    assert opt(build_argv(cfg(incoming="defer")), "-incoming") == ["defer"]


def qemu(version: str) -> Qemu:
    return Qemu(series=".".join(version.split(".")[:2]), version=version,
                binary=Path("/q"), data_dirs=(), env={}, machines=("pc-q35-7.2",),
                features=features_for(version), system=False)


@pytest.mark.parametrize(("version", "ok"), [("7.2.22", False), ("9.2.0", False),
                                             ("10.0.2", True), ("10.1.0", True)])
def test_cpr_needs_qemu_10(version: str, ok: bool) -> None:
    assert has_cpr(qemu(version)) is ok


def test_adopting_supervisor_tells_old_and_new_qemu_apart() -> None:
    owner = JobOwner(pid=1, start=1)
    job = Job("vm:vm0", "migrate", "streaming", owner, source="p0", peer="p0",
              detail={"mode": "cpr-transfer", "source_pid": 100, "dest_pid": 200})
    rec = VmRecord(name="vm0", partition="p0", vcpus=1, memory_mib=256, pid=100)
    # Before "forward": the record names the old QEMU.
    assert in_place_side(job, "p0", rec, 100) is None          # the VM's own
    assert in_place_side(job, "p0", rec, 200) == Role.INCOMING
    # After: the record names the new one; the old one is leaving.
    moved = replace(rec, pid=200)
    assert in_place_side(job, "p0", moved, 200) is None
    assert in_place_side(job, "p0", moved, 100) == Role.LEAVING
    # Not an in-place move: a move between partitions, or another partition.
    across = replace(job, peer="p1")
    assert in_place_side(across, "p0", rec, 200) is None
    assert in_place_side(job, "p1", rec, 200) is None
    assert in_place_side(None, "p0", rec, 200) is None


def test_move_json_names_its_method() -> None:
    res = MigrationResult(vm="vm0", source="p0", to="p0", mode="cpr-transfer",
                          total_ms=40.0, downtime_ms=4.0, bytes_sent=90_000,
                          prepare_ms=50.0, cpu_s=0.01, qemu_total_ms=30.0,
                          qemu_downtime_ms=3.0, qemu_mode="cpr-transfer",
                          source_pid=100, dest_pid=200)
    d = res.as_json()
    assert (d["method"], d["from"], d["to"], d["qemu_mode"]) == (
        "cpr-transfer", "p0", "p0", "cpr-transfer")


def result_file(tmp: Path, zc_s: float, cpr_s: float, cpr_down: float,
                busy: bool = True, slow_cpr: float | None = None) -> Path:
    """A maintain result: every zero-copy move 3 ms, every cpr-transfer move
    ``cpr_down`` ms (but one of each 16, ``slow_cpr`` if given)."""
    def row(method: str, n: int, secs: float, down: float) -> dict[str, object]:
        return {"method": method, "vms": n, "from_qemu": "7.2.22", "to_qemu": "10.0.2",
                "maintain_s": secs, "moves": n * (2 if method == "zero-copy" else 1),
                "downtime_ms_max": down, "downtime_ms_median": down,
                "bytes_sent_median": 90_000.0, "data_intact": True, "error": None}

    rows, moves = [], []
    for n in (1, 16):
        rows += [row("zero-copy", n, zc_s * n / 16, 3.0), row("cpr-transfer", n, cpr_s * n / 16,
                                                               cpr_down)]
        moves += [{"method": "zero-copy", "vms": n, "vm": f"v{i}", "downtime_ms": 3.0,
                   "bytes_sent": 90_000} for i in range(2 * n)]
        moves += [{"method": "cpr-transfer", "vms": n, "vm": f"v{i}",
                   "downtime_ms": slow_cpr if slow_cpr is not None and i == 0 else cpr_down,
                   "bytes_sent": 90_000} for i in range(n)]
    path = tmp / "maintain.json"
    path.write_text(json.dumps({"meta": {"benchmark": "maintain", "accel": "tcg",
                                         "from_version": "7.2.22", "to_version": "10.0.2",
                                         "busy_guests": busy},
                                "results": rows, "moves": moves}))
    return path


ZC_DOWN = "zero-copy: downtime median <= 5 ms and p99 <= 10 ms, guests busy"
CPR_DOWN = "cpr-transfer: downtime median <= 5 ms and p99 <= 10 ms, guests busy"
ZC_TIME = "zero-copy: maintain of 16 VMs <= 3 s"
CPR_TIME = "cpr-transfer: maintain of 16 VMs <= 2 s"
INTACT = "data intact in every guest after every maintain (failed ones too)"


def test_report_names_the_winner_and_checks_targets(tmp_path: Path) -> None:
    path = result_file(tmp_path, zc_s=2.9, cpr_s=1.5, cpr_down=4.0)
    md, png = report_maintain.render(path, tmp_path / "out")
    text = md.read_text()
    assert png.stat().st_size > 0
    assert "16 VM(s): **cpr-transfer** in 1.50 s against 2.90 s (1.9x)" in text
    checks = {c.target: c for c in report_maintain.checks(report_maintain.load(path))}
    assert {t: c.verdict for t, c in checks.items()} == {
        ZC_TIME: "PASS", ZC_DOWN: "PASS", CPR_TIME: "PASS", CPR_DOWN: "PASS", INTACT: "PASS"}
    # Each figure beside the one its target was set against.
    assert checks[CPR_TIME].measured == "1.50 s (before: 3.37 s)"
    assert checks[ZC_TIME].measured == "2.90 s (before: 9.34 s)"
    assert checks[CPR_DOWN].measured == ("median 4.00 ms, p99 4.00 ms over 17 moves, busy "
                                         "guests (before: 6.79 ms median)")
    assert "3.37 s with downtime median 6.79 ms" in text


def test_report_fails_what_it_measured_over_target(tmp_path: Path) -> None:
    res = report_maintain.load(result_file(tmp_path, zc_s=3.5, cpr_s=2.5, cpr_down=4.0,
                                           slow_cpr=12.0))
    verdicts = {c.target: (c.verdict, c.measured) for c in report_maintain.checks(res)}
    # The median is within 5 ms, but the slowest of 17 moves is the p99 here.
    assert verdicts[CPR_DOWN] == ("FAIL", "median 4.00 ms, p99 12.00 ms over 17 moves, "
                                  "busy guests (before: 6.79 ms median)")
    assert verdicts[CPR_TIME] == ("FAIL", "2.50 s (before: 3.37 s)")
    assert verdicts[ZC_TIME] == ("FAIL", "3.50 s (before: 9.34 s)")


def test_idle_guests_cannot_pass_a_target_set_for_busy_ones(tmp_path: Path) -> None:
    res = report_maintain.load(result_file(tmp_path, zc_s=2.9, cpr_s=1.5, cpr_down=4.0,
                                           busy=False))
    verdicts = {c.target: (c.verdict, c.measured) for c in report_maintain.checks(res)}
    assert verdicts[CPR_DOWN] == ("NOT MEASURED", "median 4.00 ms, p99 4.00 ms over 17 "
                                  "moves, idle guests (before: 6.79 ms median)")
    assert verdicts[CPR_TIME][0] == "PASS"


def test_report_refuses_another_benchmarks_file(tmp_path: Path) -> None:
    other = tmp_path / "x.json"
    other.write_text(json.dumps({"meta": {"benchmark": "vmbeam"}, "results": []}))
    from fusuma.errors import SpecError

    with pytest.raises(SpecError, match="not a maintain result file"):
        report_maintain.load(other)


def test_api_maintain_is_via_or_in_place() -> None:
    from pydantic import ValidationError

    from fusuma.api.models import Maintain

    assert Maintain(via="p1").in_place is False
    assert Maintain(in_place=True, qemu="10.0").via is None
    for bad in ({}, {"via": "p1", "in_place": True}, {"via": "bad name"}):
        with pytest.raises(ValidationError):
            Maintain(**bad)
