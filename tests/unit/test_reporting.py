"""Free page reporting: the device, the defaults per host, and where a QEMU's memory goes."""

from __future__ import annotations

from pathlib import Path

import pytest

from fusuma.errors import CgroupError, SpecError, StateError
from fusuma.memshare import reporting
from fusuma.qemu.cmdline import build_argv, device_set, has_page_reporting
from fusuma.state.db import VmRecord
from tests.unit.test_cgroups import LIMITS, make_v1, make_v2
from tests.unit.test_cmdline import cfg, opt


class Host:
    def __init__(self, separate: bool) -> None:
        self.separate_memory = separate


V1, V2 = Host(True), Host(False)


def test_balloon_with_reporting_is_a_recorded_device_and_sets_the_order() -> None:
    ds = device_set(cfg(page_reporting=True))
    assert has_page_reporting(ds)
    argv = build_argv(cfg(page_reporting=True))
    assert "virtio-balloon-pci,id=balloon0,free-page-reporting=on" in opt(argv, "-device")
    assert "page_reporting.page_reporting_order=5" in opt(argv, "-append")[0]
    plain = build_argv(cfg())
    assert not any("balloon" in d for d in opt(plain, "-device"))
    assert "page_reporting" not in opt(plain, "-append")[0]


def test_a_moving_vm_keeps_what_it_booted_with() -> None:
    # The destination is built from the recorded set, whatever its config says now.
    booted = device_set(cfg(page_reporting=True))
    argv = build_argv(cfg(page_reporting=False, devices=booted))
    assert any(d.startswith("virtio-balloon-pci") for d in opt(argv, "-device"))
    old = device_set(cfg())
    argv = build_argv(cfg(page_reporting=True, devices=old))
    assert not any(d.startswith("virtio-balloon-pci") for d in opt(argv, "-device"))


def test_order_override(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FUSUMA_PAGE_REPORTING_ORDER", "9")
    assert "page_reporting_order=9" in opt(build_argv(cfg(page_reporting=True)),
                                           "-append")[0]
    monkeypatch.setenv("FUSUMA_PAGE_REPORTING_ORDER", "99")
    assert "page_reporting_order=5" in opt(build_argv(cfg(page_reporting=True)),
                                           "-append")[0]


def test_defaults_per_host() -> None:
    assert reporting.resolve(None, True, None, V1) is True
    assert reporting.resolve(None, True, None, V2) is False
    assert reporting.resolve(None, False, None, V2) is True     # private RAM
    assert reporting.resolve(False, True, None, V1) is False
    assert reporting.resolve(True, False, None, V2) is True
    with pytest.raises(SpecError, match="cgroup v2 cannot give"):
        reporting.resolve(True, True, None, V2)
    # A clone must never give the template's pages back.
    assert reporting.resolve(None, False, "t", V1) is False
    with pytest.raises(SpecError, match="clone of a template"):
        reporting.resolve(True, False, "t", V1)


def test_wanted_for_records_from_before() -> None:
    rec = VmRecord("a", "p0", 1, 256)
    assert reporting.wanted(rec, V1) is True
    assert reporting.wanted(rec, V2) is False
    assert reporting.wanted(rec.with_(page_reporting=False), V1) is False


def test_trim_refused_without_the_device() -> None:
    rec = VmRecord("a", "p0", 1, 256, devices=device_set(cfg()).dumps())
    with pytest.raises(StateError, match="booted without page reporting"):
        reporting.refuse_without_device(rec)
    rec = rec.with_(devices=device_set(cfg(page_reporting=True)).dumps())
    reporting.refuse_without_device(rec)


def test_negotiated_reads_the_guest_features() -> None:
    yes = {"guest-features": {"dev-features": [
        "VIRTIO_BALLOON_F_STATS_VQ: Guest statistics virtqueue",
        "VIRTIO_BALLOON_F_REPORTING: Page reporting virtqueue enabled"]}}
    assert reporting.negotiated(yes)
    assert not reporting.negotiated({"guest-features": {"dev-features": []}})
    assert not reporting.negotiated({})


def test_resident_of_shared_ram_is_the_files_blocks(tmp_path: Path) -> None:
    ram = tmp_path / "a.ram"
    with open(ram, "wb") as f:
        f.truncate(8 << 20)
        f.seek(1 << 20)
        f.write(b"x" * (1 << 20))
    rec = VmRecord("a", "p0", 1, 8, ram_path=str(ram))
    got = reporting.resident_bytes(rec, None)
    assert got is not None and (1 << 20) <= got < (2 << 20)


def test_v1_puts_qemu_memory_in_the_ram_group(tmp_path: Path,
                                              monkeypatch: pytest.MonkeyPatch) -> None:
    driver, _fake, base = make_v1(tmp_path, monkeypatch)
    assert driver.separate_memory
    driver.create("p0", LIMITS)
    driver.create_leaf("p0", "vm.a")
    driver.create_ram_group("a-1234", 300 << 20)
    driver.attach("p0", "vm.a", 4242, ram_stem="a-1234")
    mem = base / "memory" / "fusuma"
    assert (mem / "guest.ram" / "a-1234" / "cgroup.procs").read_text().strip() == "4242"
    assert "4242" not in (mem / "p0" / "vm.a" / "cgroup.procs").read_text()
    assert (base / "cpuset" / "fusuma" / "p0" / "vm.a" / "cgroup.procs"
            ).read_text().strip() == "4242"


def test_v2_cannot_separate_memory(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    driver, _fake, _mount = make_v2(tmp_path, monkeypatch)
    assert not driver.separate_memory
    driver.create("p0", LIMITS)
    driver.create_leaf("p0", "vm.a")
    with pytest.raises(CgroupError, match="cannot put a process's memory"):
        driver.attach("p0", "vm.a", 4242, ram_stem="a-1234")
