"""Bad input: one clear sentence, a non-zero exit, and nothing half-created.

These run the real CLI against real cgroups; the ones that reach QEMU use the real
binary (or its absence)."""

from __future__ import annotations

import os
import signal
from pathlib import Path

import pytest

from tests.conftest import Host

pytestmark = [pytest.mark.fault, pytest.mark.timeout(180)]


def assert_one_sentence(err: str) -> None:
    lines = [ln for ln in err.strip().splitlines() if ln.strip()]
    errors = [ln for ln in lines if ln.startswith(("fusuma: error: ", "Error: "))]
    # Besides the error, only progress lines and the TCG fallback notice may appear.
    others = [ln for ln in lines if ln not in errors
              and not ln.startswith("... ") and "TCG" not in ln]
    assert len(errors) == 1 and not others, f"expected one error sentence, got:\n{err}"
    assert "Traceback" not in err


def assert_nothing(host: Host) -> None:
    ps = host.ps()
    assert ps == {"partitions": [], "vms": [], "networks": []}, ps
    assert not host.our_cgroups(), host.our_cgroups()
    assert not host.our_pids()


def write(tmp: Path, text: str) -> Path:
    p = tmp / "spec.toml"
    p.write_text(text)
    return p


def test_overlapping_cores_in_spec(host: Host, tmp_path: Path) -> None:
    spec = write(tmp_path, '[[partition]]\nname="a"\ncpus="0"\nmemory_mib=512\n'
                           '[[partition]]\nname="b"\ncpus="0-1"\nmemory_mib=512\n')
    err = host.fail("up", str(spec)).err
    assert_one_sentence(err)
    assert f"{spec}: partition[1].cpus: core 0 is already given to partition 'a'" in err
    assert_nothing(host)


def test_overlapping_cores_on_create(host: Host) -> None:
    host.run("partition", "create", "a", "--cpus", "0", "--memory", "512")
    err = host.fail("partition", "create", "b", "--cpus", "0", "--memory", "512").err
    assert_one_sentence(err)
    assert "core(s) 0 belong to partition 'a'" in err
    assert [p["name"] for p in host.ps()["partitions"]] == ["a"]


def test_nonexistent_cores(host: Host, tmp_path: Path) -> None:
    err = host.fail("partition", "create", "a", "--cpus", "0,4096", "--memory", "512").err
    assert_one_sentence(err)
    assert "core(s) 4096 do not exist" in err
    spec = write(tmp_path, '[[partition]]\nname="a"\ncpus=[99]\nmemory_mib=512\n')
    err = host.fail("up", str(spec)).err
    assert_one_sentence(err)
    assert "partition[0].cpus: core(s) 99 do not exist" in err
    assert_nothing(host)


def test_memory_beyond_host(host: Host) -> None:
    err = host.fail("partition", "create", "a", "--cpus", "0", "--memory", "99999999").err
    assert_one_sentence(err)
    assert "only" in err and "MiB is left on this host" in err
    assert_nothing(host)


def test_unknown_partition(host: Host) -> None:
    for args in (("partition", "resize", "nope", "--memory", "512"),
                 ("partition", "delete", "nope"), ("partition", "restart", "nope"),
                 ("vm", "create", "v", "-p", "nope")):
        err = host.fail(*args).err
        assert_one_sentence(err)
        assert "no partition named 'nope'" in err
    assert_nothing(host)


def test_duplicate_names(host: Host, tmp_path: Path) -> None:
    spec = write(tmp_path, '[[partition]]\nname="a"\ncpus="0"\nmemory_mib=512\n'
                           '[[partition]]\nname="a"\ncpus="1"\nmemory_mib=512\n')
    err = host.fail("up", str(spec)).err
    assert_one_sentence(err)
    assert "partition[1].name: duplicate partition name 'a'" in err
    assert_nothing(host)
    host.run("partition", "create", "a", "--cpus", "0", "--memory", "512")
    err = host.fail("partition", "create", "a", "--cpus", "1", "--memory", "512").err
    assert_one_sentence(err)
    assert "already exists" in err
    assert len(host.ps()["partitions"]) == 1


@pytest.mark.parametrize(("text", "expect"), [
    ("[[partition]\nname=", "not valid TOML"),
    ('[[partition]]\nname="a"\ncpus="0"\n', "partition[0].memory_mib: required key is missing"),
    ('[[partition]]\nname="a"\ncpus="0"\nmemory_mib=512\ncolour="red"\n',
     "partition[0].colour: unknown key"),
    ('[[partition]]\nname="a"\ncpus="zero"\nmemory_mib=512\n', "partition[0].cpus"),
    ('[[partition]]\nname="a"\ncpus="0"\nmemory_mib=512\n[[vm]]\nname="v"\npartition="b"\n',
     "vm[0].partition: no partition named 'b'"),
    ('[[partition]]\nname="a"\ncpus="0"\nmemory_mib="lots"\n', "partition[0].memory_mib"),
])
def test_malformed_spec_names_file_and_key(host: Host, tmp_path: Path, text: str,
                                           expect: str) -> None:
    spec = write(tmp_path, text)
    err = host.fail("up", str(spec)).err
    assert_one_sentence(err)
    assert str(spec) in err and expect in err, err
    assert_nothing(host)


def test_missing_spec_file(host: Host, tmp_path: Path) -> None:
    err = host.fail("up", str(tmp_path / "nope.toml")).err
    assert_one_sentence(err)
    assert "cannot read spec file" in err


@pytest.mark.parametrize("name", ["../escape", "a/b", ".hidden", "x" * 40, "UPPER", ""])
def test_names_that_would_escape(host: Host, name: str) -> None:
    host.run("partition", "create", "a", "--cpus", "0", "--memory", "512")
    err = host.fail("vm", "create", name, "-p", "a").err
    assert_one_sentence(err)
    assert "is not allowed" in err
    err = host.fail("partition", "create", name, "--cpus", "1", "--memory", "512").err
    assert_one_sentence(err)
    assert host.ps()["vms"] == []
    assert not (host.home / "escape").exists() and not (host.home.parent / "escape").exists()


def test_qemu_not_installed(host: Host, tmp_path: Path) -> None:
    err = host.fail("partition", "create", "a", "--cpus", "0", "--memory", "512",
                    "--qemu", "/nonexistent/qemu-system-x86_64").err
    assert_one_sentence(err)
    assert "does not exist or is not executable" in err
    assert_nothing(host)
    # No QEMU on PATH: a VM cannot be defined (its machine type comes from the QEMUs
    # there are); one sentence says how to install one, and nothing is left.
    empty = tmp_path / "bin"
    empty.mkdir()
    host.env["PATH"] = str(empty)
    host.run("partition", "create", "a", "--cpus", "0", "--memory", "768")
    err = host.fail("vm", "create", "v", "-p", "a").err
    assert_one_sentence(err)
    assert "is not installed" in err and "apt-get install qemu-system-x86" in err
    assert host.ps()["vms"] == []
    leaves = [*Path("/sys/fs/cgroup").glob(f"*/{host.prefix}/a/vm.*"),
              *Path("/sys/fs/cgroup").glob(f"{host.prefix}/a/vm.*")]
    assert host.our_cgroups() and not leaves, leaves


def test_guest_image_missing_rolls_back_up(host: Host, tmp_path: Path) -> None:
    host.env["FUSUMA_CACHE"] = str(tmp_path / "empty-cache")
    err = host.fail("up").err
    assert_one_sentence(err)
    assert "fusuma image build" in err
    assert_nothing(host)


def test_vm_killed_then_delete_partition_leaves_nothing(host: Host) -> None:
    host.run("partition", "create", "a", "--cpus", "0", "--memory", "768")
    host.run("vm", "create", "v", "-p", "a", "--start")
    pid = host.vm("v")["pid"]
    sup = host.part("a")["supervisor_pid"]
    os.kill(sup, signal.SIGKILL)
    err = host.fail("partition", "delete", "a").err
    assert_one_sentence(err)
    assert "still has VM(s) v" in err
    host.run("partition", "delete", "a", "--force")
    assert not os.path.exists(f"/proc/{pid}/cmdline") or not Path(
        f"/proc/{pid}/cmdline").read_bytes()
    assert_nothing(host)


def test_vm_memory_beyond_partition(host: Host) -> None:
    # The partition's budget holds its supervisor, not also a VM's QEMU.
    host.run("partition", "create", "a", "--cpus", "0", "--memory", "150")
    err = host.fail("vm", "create", "v", "-p", "a", "--memory", "128").err
    assert_one_sentence(err)
    assert "partition resize a --memory" in err
    assert host.ps()["vms"] == []


def test_vm_memory_beyond_host(host: Host) -> None:
    # Guest RAM is admitted host-wide: more than the host gives is refused with the sum.
    host.run("partition", "create", "a", "--cpus", "0", "--memory", "512")
    err = host.fail("vm", "create", "v", "-p", "a", "--memory", "999999").err
    assert_one_sentence(err)
    assert "the host would need a 512 + v RAM 999999" in err and "give it less memory" in err
    assert host.ps()["vms"] == []


def test_unusable_dev_kvm_asked_for_by_name(host: Host) -> None:
    """On this host /dev/kvm is a PVM hypervisor that cannot run a stock kernel (or is
    missing): asking for KVM by name is one sentence and leaves no VM behind; `auto`
    falls back to TCG with a notice instead (every integration test does that)."""
    from fusuma.host.accel import probe_accel

    if probe_accel("auto").name == "kvm":
        pytest.skip("this host's /dev/kvm is usable")
    host.run("partition", "create", "p0", "--cpus", "0", "--memory", "512")
    res = host.fail("vm", "create", "k", "-p", "p0", "--accel", "kvm", "--start")
    assert_one_sentence(res.err)
    assert "--accel kvm was asked for but" in res.err and "use --accel tcg" in res.err
    assert host.ps()["vms"] == []
    assert not [p for p in host.our_pids()
                if "qemu" in Path(f"/proc/{p}/cmdline").read_text(errors="replace")]
