"""Unit tests for fusuma.host.accel against fake /dev, /sys and /proc/cpuinfo."""

from __future__ import annotations

from pathlib import Path

import pytest

from fusuma.errors import HostError, SpecError
from fusuma.host.accel import AccelChoice, probe_accel

X86_VMX = "processor\t: 0\nflags\t\t: fpu vme de pse vmx sse\n"
X86_NO_VIRT = "processor\t: 0\nflags\t\t: fpu vme de pse hypervisor sse\n"
ARM64 = "processor\t: 0\nFeatures\t: fp asimd evtstrm aes\n"


class FakeHost:
    def __init__(self, root: Path) -> None:
        self.dev = root / "dev" / "kvm"
        self.sysfs = root / "sys"
        self.cpuinfo = root / "cpuinfo"
        self.dev.parent.mkdir()
        (self.sysfs / "module").mkdir(parents=True)
        self.cpuinfo.write_text(X86_VMX)
        self.dev.write_text("")  # a regular file opens read-write like a usable /dev/kvm

    def module(self, name: str) -> None:
        (self.sysfs / "module" / name).mkdir()

    def probe(self, requested: str = "auto") -> AccelChoice:
        return probe_accel(requested, dev=self.dev, sysfs=self.sysfs, cpuinfo=self.cpuinfo)


@pytest.fixture
def host(tmp_path: Path) -> FakeHost:
    return FakeHost(tmp_path)


def test_auto_uses_kvm_on_vmx_host(host: FakeHost) -> None:
    host.module("kvm")
    host.module("kvm_intel")
    assert host.probe() == AccelChoice("kvm", None)


def test_auto_falls_back_when_dev_kvm_missing(host: FakeHost) -> None:
    host.dev.unlink()
    choice = host.probe()
    assert choice.name == "tcg"
    assert choice.notice is not None
    assert choice.notice.startswith("fusuma: ")
    assert "does not exist" in choice.notice
    assert choice.notice.endswith("using TCG (software emulation, slower)")
    assert "\n" not in choice.notice


def test_auto_falls_back_on_pvm(host: FakeHost) -> None:
    host.module("kvm")
    host.module("kvm_pvm")
    choice = host.probe()
    assert choice.name == "tcg"
    assert choice.notice == (
        f"fusuma: {host.dev} is a PVM nested hypervisor (kvm_pvm) that cannot run stock "
        "guest kernels; using TCG (software emulation, slower)"
    )


def test_auto_falls_back_when_not_openable(host: FakeHost) -> None:
    host.dev.unlink()
    host.dev.mkdir()  # opening a directory read-write fails even for root
    choice = host.probe()
    assert choice.name == "tcg"
    assert choice.notice is not None and "cannot be opened read-write" in choice.notice


def test_auto_falls_back_without_vmx_or_kvm_modules(host: FakeHost) -> None:
    host.cpuinfo.write_text(X86_NO_VIRT)
    host.module("kvm")
    choice = host.probe()
    assert choice.name == "tcg"
    assert choice.notice is not None and "no vmx/svm" in choice.notice


def test_auto_trusts_loaded_vendor_module_without_flag(host: FakeHost) -> None:
    host.cpuinfo.write_text(X86_NO_VIRT)
    host.module("kvm_amd")
    assert host.probe().name == "kvm"


def test_auto_on_non_x86_trusts_dev_kvm(host: FakeHost) -> None:
    host.cpuinfo.write_text(ARM64)
    assert host.probe() == AccelChoice("kvm", None)


def test_svm_flag_counts(host: FakeHost) -> None:
    host.cpuinfo.write_text("flags\t\t: fpu svm\n")
    assert host.probe().name == "kvm"


def test_tcg_requested_has_no_notice(host: FakeHost) -> None:
    host.module("kvm_pvm")
    assert host.probe("tcg") == AccelChoice("tcg", None)


def test_kvm_requested_and_usable(host: FakeHost) -> None:
    assert host.probe("kvm") == AccelChoice("kvm", None)
    assert host.probe(" KVM ") == AccelChoice("kvm", None)


def test_kvm_requested_on_pvm_is_host_error(host: FakeHost) -> None:
    host.module("kvm_pvm")
    with pytest.raises(HostError) as info:
        host.probe("kvm")
    message = str(info.value)
    assert message.startswith("--accel kvm was asked for but ")
    assert "PVM" in message
    assert message.endswith("; use --accel tcg")


def test_kvm_requested_without_dev_is_host_error(host: FakeHost) -> None:
    host.dev.unlink()
    with pytest.raises(HostError, match=r"does not exist.*use --accel tcg"):
        host.probe("kvm")


def test_unknown_accel_is_spec_error(host: FakeHost) -> None:
    with pytest.raises(SpecError, match="use auto, kvm or tcg"):
        host.probe("hvf")


def test_this_machine_resolves() -> None:
    # On the PVM development hosts this is TCG with a notice; elsewhere it may be KVM.
    choice = probe_accel()
    assert choice.name in ("kvm", "tcg")
    if Path("/sys/module/kvm_pvm").exists():
        assert choice.name == "tcg" and choice.notice is not None
