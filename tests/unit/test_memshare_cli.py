"""`fusuma share ...` through click's CliRunner, with a fake KSM sysfs tree
(FUSUMA_KSM_ROOT) and a temporary FUSUMA_HOME; no VM runs."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from click.testing import CliRunner, Result

from fusuma.cli import share as share_mod
from fusuma.errors import NotFoundError, SpecError, StateError
from fusuma.memshare.ksm import KSM_RISK, ZERO_COPY_NOTE
from fusuma.ops.context import Ctx
from fusuma.paths import Paths
from fusuma.state import PartitionRecord, VmRecord
from fusuma.views import share as share_view
from tests.unit.memshare_fake import make_ksm


@pytest.fixture
def ctx(tmp_path: Path) -> Ctx:
    return Ctx(Paths(home=tmp_path / "home", runtime=tmp_path / "run",
                     shm=tmp_path / "shm", cache=tmp_path / "cache", cgroup_prefix="t"))


@pytest.fixture
def ksm_root(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    root = make_ksm(tmp_path / "ksm", pages_sharing=512, pages_shared=20, full_scans=3)
    monkeypatch.setenv("FUSUMA_KSM_ROOT", str(root))
    return root


def run(ctx: Ctx, *args: str) -> Result:
    return CliRunner().invoke(share_mod.share, list(args), obj=ctx)


def flat(text: str) -> str:
    return " ".join(text.split())


def test_ksm_help_states_the_risk_and_zero_copy(ctx: Ctx) -> None:
    for args in (["ksm", "--help"], ["ksm", "on", "--help"]):
        res = run(ctx, *args)
        assert res.exit_code == 0
        assert flat(KSM_RISK) in flat(res.output)
    assert flat(ZERO_COPY_NOTE) in flat(run(ctx, "ksm", "--help").output)
    off = flat(run(ctx, "ksm", "off", "--help").output)
    assert "stay merged" in off and "--unmerge" in off


def test_ksm_status_json(ctx: Ctx, ksm_root: Path) -> None:
    res = run(ctx, "ksm", "status", "--json")
    assert res.exit_code == 0, res.output
    data = json.loads(res.stdout)
    assert data["run"] == 0 and data["state"] == "stopped"
    assert data["pages_sharing"] == 512 and data["full_scans"] == 3
    assert data["saved_mib"] == round(512 * data["page_size"] / 2**20, 1)


def test_ksm_status_text(ctx: Ctx, ksm_root: Path) -> None:
    res = run(ctx, "ksm", "status")
    assert res.exit_code == 0, res.output
    assert "KSM stopped (run=0)" in res.output
    assert "pages_sharing 512" in res.output and "3 full scan(s)" in res.output


def test_ksm_on_off_unmerge_write_sysfs(ctx: Ctx, ksm_root: Path) -> None:
    res = run(ctx, "ksm", "on", "--pages-to-scan", "1000", "--sleep-ms", "10", "--json")
    assert res.exit_code == 0, res.output
    assert (ksm_root / "run").read_text() == "1\n"
    assert (ksm_root / "pages_to_scan").read_text() == "1000\n"
    assert (ksm_root / "sleep_millisecs").read_text() == "10\n"
    assert json.loads(res.stdout)["state"] == "running"
    assert "side channel" in res.stderr

    res = run(ctx, "ksm", "off")
    assert res.exit_code == 0 and (ksm_root / "run").read_text() == "0\n"
    assert "merged pages stay merged" in res.output and "--unmerge" in res.output

    res = run(ctx, "ksm", "off", "--unmerge")
    assert res.exit_code == 0 and (ksm_root / "run").read_text() == "2\n"
    assert "stay merged" not in res.output


def test_ksm_on_rejects_zero_pages_to_scan(ctx: Ctx, ksm_root: Path) -> None:
    res = run(ctx, "ksm", "on", "--pages-to-scan", "0")
    assert res.exit_code == 2
    assert (ksm_root / "run").read_text() == "0\n"


def test_ksm_missing_on_this_host(ctx: Ctx, tmp_path: Path,
                                  monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FUSUMA_KSM_ROOT", str(tmp_path / "none"))
    res = run(ctx, "ksm", "status")
    assert res.exit_code != 0
    assert "KSM is not available on this host" in str(res.exception)


def test_analyze_own_process_json(ctx: Ctx) -> None:
    res = run(ctx, "analyze", str(os.getpid()), "--json")
    assert res.exit_code == 0, res.output
    data = json.loads(res.stdout)
    assert set(data) == {"pid", "comm", "by_mode", "total_rss_kib", "shareable_fraction"}
    assert data["pid"] == os.getpid() and "r-xp" in data["by_mode"]
    assert 0.0 <= data["shareable_fraction"] <= 1.0


def test_analyze_text_table(ctx: Ctx) -> None:
    res = run(ctx, "analyze", str(os.getpid()))
    assert res.exit_code == 0, res.output
    assert "MODE" in res.output and "r-xp" in res.output
    assert "shareable (resident in mappings that are not writable):" in res.output


def test_analyze_argument_errors(ctx: Ctx) -> None:
    for args in ([], ["1", "--vm", "x"]):
        res = run(ctx, "analyze", *args)
        assert isinstance(res.exception, SpecError)
        assert "either a PID or --vm VM" in str(res.exception)
    res = run(ctx, "analyze", "999999999")
    assert isinstance(res.exception, NotFoundError)
    assert "no process with pid 999999999" in str(res.exception)
    res = run(ctx, "analyze", "--vm", "nosuch")
    assert isinstance(res.exception, NotFoundError)


def test_analyze_vm_that_is_not_running(ctx: Ctx) -> None:
    ctx.db.add_partition(PartitionRecord("p0", [0], 1024))
    ctx.db.add_vm(VmRecord(name="web1", partition="p0", vcpus=1, memory_mib=256))
    res = run(ctx, "analyze", "--vm", "web1")
    assert isinstance(res.exception, StateError)
    assert "VM 'web1' is stopped" in str(res.exception)
    assert "fusuma vm start web1" in str(res.exception)


def test_report_without_vms(ctx: Ctx, ksm_root: Path) -> None:
    res = run(ctx, "report", "--json")
    assert res.exit_code == 0, res.output
    data = json.loads(res.stdout)
    assert data["vms"] == [] and data["totals"]["vms"] == 0
    assert data["savings_mib"]["ksm"] == round(512 * data["ksm"]["page_size"] / 2**20, 1)
    text = run(ctx, "report").output
    assert "no running VMs" in text and "saved by KSM" in text


def test_report_with_a_vm_and_a_segment(ctx: Ctx, ksm_root: Path,
                                        monkeypatch: pytest.MonkeyPatch) -> None:
    # This test process stands in for a QEMU; a shared library it maps is the segment.
    ctx.paths.segments_dir.mkdir(parents=True)
    maps = [line.split() for line in Path("/proc/self/maps").read_text().splitlines()]
    lib = next(f[5] for f in maps
               if len(f) == 6 and f[1] == "r-xp" and ".so" in Path(f[5]).name)
    (ctx.paths.segments_dir / "libx.erofs").symlink_to(lib)
    assert share_view.segment_files(ctx) == {"libx": ctx.paths.segments_dir / "libx.erofs"}
    monkeypatch.setattr(share_view, "running_vms", lambda c: [("vm1", os.getpid())])
    res = run(ctx, "report", "--json")
    assert res.exit_code == 0, res.output
    data = json.loads(res.stdout)
    [row] = data["vms"]
    assert row["name"] == "vm1" and row["pid"] == os.getpid() and row["pss_mib"] > 0
    assert "libx" in row["segments"] and row["segments"]["libx"]["mappings"] >= 1
    saved = data["savings_mib"]["segments"]
    assert saved == pytest.approx(row["segments_rss_mib"] - row["segments_pss_mib"], abs=0.11)
    assert data["segments"]["libx"]["vms"] == 1
    text = run(ctx, "report").output
    assert "vm1" in text and "KSM_MERGED_MIB" in text and "libx: 1 VM(s)" in text


def test_running_vms_skips_stopped(ctx: Ctx) -> None:
    ctx.db.add_partition(PartitionRecord("p0", [0], 1024))
    ctx.db.add_vm(VmRecord(name="idle", partition="p0", vcpus=1, memory_mib=256))
    assert share_view.running_vms(ctx) == []
