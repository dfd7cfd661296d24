"""KSM control on a fake sysfs tree, /proc/PID/ksm_stat parsing, settling."""

from __future__ import annotations

from pathlib import Path

import pytest

from fusuma.errors import HostError, SpecError, StateError
from fusuma.memshare.ksm import KSM_RISK, Ksm, parse_ksm_stat, process_ksm
from tests.unit.memshare_fake import KSM_STAT, make_ksm


def test_read_settings(tmp_path: Path) -> None:
    root = make_ksm(tmp_path, run=1, pages_to_scan=500, sleep_millisecs=10,
                    pages_shared=40, pages_sharing=1000, pages_unshared=7,
                    pages_volatile=3, full_scans=12, general_profit=-4096,
                    ksm_zero_pages=24, use_zero_pages=1)
    s = Ksm(root, page_size=4096).read_settings()
    assert (s.run, s.pages_to_scan, s.sleep_millisecs) == (1, 500, 10)
    assert (s.pages_shared, s.pages_sharing, s.pages_unshared, s.pages_volatile,
            s.full_scans) == (40, 1000, 7, 3, 12)
    assert s.general_profit == -4096 and s.ksm_zero_pages == 24 and s.use_zero_pages
    # saved = (pages_sharing + ksm_zero_pages) pages, per admin-guide/mm/ksm.rst
    assert s.saved_bytes == (1000 + 24) * 4096
    out = s.as_json()
    assert out["state"] == "running" and out["saved_mib"] == 4.0
    assert out["general_profit_mib"] == 0.0


def test_optional_counters_missing_on_older_kernels(tmp_path: Path) -> None:
    root = make_ksm(tmp_path, pages_sharing=256)
    for name in ("general_profit", "ksm_zero_pages", "use_zero_pages"):
        (root / name).unlink()
    ksm = Ksm(root, page_size=4096)
    s = ksm.read_settings()
    assert s.general_profit is None and s.ksm_zero_pages is None
    assert s.use_zero_pages is None
    assert ksm.saved_bytes() == 256 * 4096
    assert s.as_json()["general_profit_mib"] is None


def test_missing_sysfs_is_one_clear_sentence(tmp_path: Path) -> None:
    ksm = Ksm(tmp_path / "ksm")
    assert not ksm.available()
    with pytest.raises(HostError) as exc:
        ksm.read_settings()
    assert str(exc.value) == (f"KSM is not available on this host: {tmp_path / 'ksm'} is "
                              "missing (kernel built without CONFIG_KSM).")
    assert exc.value.exit_code == 7
    with pytest.raises(HostError, match="CONFIG_KSM"):
        ksm.set_run(1)


def test_required_counter_missing(tmp_path: Path) -> None:
    root = make_ksm(tmp_path)
    (root / "full_scans").unlink()
    with pytest.raises(HostError, match="full_scans"):
        Ksm(root).read_settings()


def test_set_run_writes_rate_then_run(tmp_path: Path) -> None:
    root = make_ksm(tmp_path)
    ksm = Ksm(root, page_size=4096)
    s = ksm.set_run(1, pages_to_scan=2000, sleep_millisecs=5)
    assert (root / "run").read_text() == "1\n"
    assert (root / "pages_to_scan").read_text() == "2000\n"
    assert (root / "sleep_millisecs").read_text() == "5\n"
    assert (s.run, s.pages_to_scan, s.sleep_millisecs) == (1, 2000, 5)
    ksm.set_run(2)
    assert (root / "run").read_text() == "2\n"
    assert (root / "pages_to_scan").read_text() == "2000\n"     # left alone


@pytest.mark.parametrize(("kwargs", "match"), [
    ({"run": 3}, r"0 \(stop\), 1 \(run\) or 2"),
    ({"run": 1, "pages_to_scan": 0}, "pages_to_scan"),
    ({"run": 1, "sleep_millisecs": -1}, "sleep_millisecs"),
])
def test_set_run_rejects_bad_values_before_writing(tmp_path: Path, kwargs: dict[str, int],
                                                   match: str) -> None:
    root = make_ksm(tmp_path)
    with pytest.raises(SpecError, match=match):
        Ksm(root).set_run(**kwargs)
    assert (root / "run").read_text() == "0\n"
    assert (root / "pages_to_scan").read_text() == "100\n"


def test_write_refused_is_a_host_error(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    root = make_ksm(tmp_path)

    def refuse(self: Path, *a: object, **k: object) -> int:
        raise PermissionError(13, "Permission denied")

    monkeypatch.setattr(Path, "write_text", refuse)
    with pytest.raises(HostError, match=r"writing .*/run was refused; run fusuma as root"):
        Ksm(root).set_run(1)


def test_write_to_read_only_sysfs(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    root = make_ksm(tmp_path)

    def erofs(self: Path, *a: object, **k: object) -> int:
        raise OSError(30, "Read-only file system")

    monkeypatch.setattr(Path, "write_text", erofs)
    with pytest.raises(HostError, match="read-only file system"):
        Ksm(root).set_run(0)


class FakeKernel:
    """Advances KSM's counters on every sleep: one full scan per ``scan_every`` polls,
    pages_sharing following ``sharing`` (one value per completed scan)."""

    def __init__(self, root: Path, sharing: list[int], scan_every: int = 2) -> None:
        self.root = root
        self.sharing = sharing
        self.scan_every = scan_every
        self.now = 0.0
        self.polls = 0

    def clock(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.now += seconds
        self.polls += 1
        if self.polls % self.scan_every == 0:
            scans = int((self.root / "full_scans").read_text()) + 1
            (self.root / "full_scans").write_text(f"{scans}\n")
            value = self.sharing[min(scans - 1, len(self.sharing) - 1)]
            (self.root / "pages_sharing").write_text(f"{value}\n")


def test_wait_settled_needs_two_scans_and_a_steady_count(tmp_path: Path) -> None:
    root = make_ksm(tmp_path, run=1)
    kernel = FakeKernel(root, [1000, 5000, 9000, 9050, 9060])
    ksm = Ksm(root, page_size=4096, clock=kernel.clock, sleep=kernel.sleep)
    seen: list[str] = []
    s = ksm.wait_settled(timeout=60, progress=seen.append, poll=1.0)
    # 9000 -> 9050 is a 0.55% change: settled after the 4th scan
    assert s.full_scans == 4 and s.pages_sharing == 9050
    assert len(seen) == 4 and "full scan 4" in seen[-1]
    assert kernel.now == 8.0


def test_wait_settled_counts_only_new_scans(tmp_path: Path) -> None:
    # Already steady before we start: still two more scans must complete.
    root = make_ksm(tmp_path, run=1, full_scans=10, pages_sharing=7000)
    kernel = FakeKernel(root, [7000] * 20, scan_every=1)
    s = Ksm(root, clock=kernel.clock, sleep=kernel.sleep).wait_settled(timeout=60)
    assert s.full_scans == 12


def test_wait_settled_times_out(tmp_path: Path) -> None:
    root = make_ksm(tmp_path, run=1)
    kernel = FakeKernel(root, [1000 * 2**i for i in range(40)], scan_every=1)
    ksm = Ksm(root, clock=kernel.clock, sleep=kernel.sleep)
    with pytest.raises(StateError, match="did not settle within 10 s: 10 full scan"):
        ksm.wait_settled(timeout=10, poll=1.0)


def test_wait_settled_refuses_when_stopped(tmp_path: Path) -> None:
    root = make_ksm(tmp_path, run=0)
    with pytest.raises(StateError, match=r"not running \(run=0\).*share ksm on"):
        Ksm(root).wait_settled(timeout=1)


def test_parse_ksm_stat() -> None:
    k = parse_ksm_stat(KSM_STAT.format(rmap=300, merging=120, profit=-1024))
    assert (k.rmap_items, k.zero_pages, k.merging_pages, k.process_profit) == (
        300, 0, 120, -1024)
    assert k.merge_any is False and k.mergeable is True
    assert k.as_json(4096)["merging_mib"] == round(120 * 4096 / 2**20, 1)


def test_ksm_stat_of_an_older_kernel_lacks_fields(tmp_path: Path) -> None:
    k = parse_ksm_stat("ksm_rmap_items 5\n")
    assert k.rmap_items == 5
    assert k.merging_pages is None and k.process_profit is None and k.mergeable is None
    assert k.as_json(4096)["merging_mib"] is None
    assert process_ksm(1, procfs=tmp_path) is None           # no such file


def test_risk_sentence_names_the_side_channel() -> None:
    assert "side channel" in KSM_RISK and "copy-on-write" in KSM_RISK
    assert KSM_RISK.count(". ") == 0 and KSM_RISK.endswith(".")
