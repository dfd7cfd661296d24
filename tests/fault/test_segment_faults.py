"""Bad input around segments, mergeable VMs, ports and KSM: one clear sentence, a
non-zero exit, and nothing half-created."""

from __future__ import annotations

import contextlib
import os
import subprocess
from pathlib import Path

import pytest

from tests.conftest import Host
from tests.fault.test_bad_input import assert_one_sentence

pytestmark = [pytest.mark.fault, pytest.mark.timeout(300)]


def segment_files(host: Host) -> list[Path]:
    d = host.home / "segments"
    return sorted(d.iterdir()) if d.exists() else []


def test_segment_from_a_missing_directory(host: Host, tmp_path: Path) -> None:
    res = host.fail("segment", "create", "s", "--from", str(tmp_path / "nope"))
    assert_one_sentence(res.err)
    assert res.code == 13 and "is not a directory" in res.err
    assert segment_files(host) == []
    assert host.run("segment", "list", "--json").json() == []


def test_segment_from_an_image_without_a_root_image(host: Host) -> None:
    res = host.fail("segment", "create", "s", "--from-image", "minimal")
    assert_one_sentence(res.err)
    assert "has no root filesystem image" in res.err
    assert segment_files(host) == []


def test_segment_name_twice_and_bad_name(host: Host, tmp_path: Path) -> None:
    (tmp_path / "t").mkdir()
    (tmp_path / "t" / "f").write_text("x")
    host.run("segment", "create", "s", "--from", str(tmp_path / "t"))
    res = host.fail("segment", "create", "s", "--from", str(tmp_path / "t"))
    assert_one_sentence(res.err)
    assert res.code == 4 and "already exists" in res.err
    res = host.fail("segment", "create", "Bad Name", "--from", str(tmp_path / "t"))
    assert_one_sentence(res.err)
    assert [p.name for p in segment_files(host)] == ["s.erofs"]


def test_segment_on_a_full_disk(host: Host, tmp_path: Path) -> None:
    """A 1 MiB tmpfs as the segment directory: mkfs.erofs runs out of space."""
    seg_dir = host.home / "segments"
    seg_dir.mkdir(parents=True)
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(seg_dir)],
                   check=True)
    try:
        (tmp_path / "big").mkdir()
        (tmp_path / "big" / "blob").write_bytes(os.urandom(3 * 2**20))
        res = host.fail("segment", "create", "big", "--from", str(tmp_path / "big"))
        assert_one_sentence(res.err)
        assert res.code == 13 and "no space left" in res.err.lower()
        assert list(seg_dir.iterdir()) == []
        assert host.run("segment", "list", "--json").json() == []
    finally:
        subprocess.run(["umount", str(seg_dir)], check=False)


def test_vm_with_unknown_segment_or_bad_ports(host: Host) -> None:
    host.run("partition", "create", "p0", "--cpus", host.core(0), "--memory", "1024")
    res = host.fail("vm", "create", "a", "-p", "p0", "--segment", "ghost")
    assert_one_sentence(res.err)
    assert res.code == 3 and "no segment named 'ghost'" in res.err
    res = host.fail("vm", "create", "a", "-p", "p0", "--port", "80")
    assert_one_sentence(res.err)
    assert res.code == 2 and "HOSTPORT:GUESTPORT" in res.err
    res = host.fail("vm", "create", "a", "-p", "p0", "--segment", "s:relative")
    assert_one_sentence(res.err)
    assert "absolute path" in res.err
    host.run("vm", "create", "a", "-p", "p0", "--port", "18755:80")
    res = host.fail("vm", "create", "b", "-p", "p0", "--port", "18755:22")
    assert_one_sentence(res.err)
    assert res.code == 4 and "already forwarded to VM 'a'" in res.err
    assert [v["name"] for v in host.ps()["vms"]] == ["a"]


def test_mergeable_with_shared_ram_in_a_spec(host: Host, tmp_path: Path) -> None:
    spec = tmp_path / "spec.toml"
    spec.write_text('[[partition]]\nname="p0"\ncpus="0"\nmemory_mib=1024\n'
                    '[[vm]]\nname="k"\npartition="p0"\nmergeable=true\nshared_ram=true\n')
    res = host.fail("up", str(spec))
    assert_one_sentence(res.err)
    assert res.code == 2 and "mergeable = true needs private RAM" in res.err
    assert host.ps() == {"partitions": [], "vms": [], "networks": []}


def test_segment_file_gone_before_start(host: Host, tmp_path: Path) -> None:
    (tmp_path / "t").mkdir()
    (tmp_path / "t" / "f").write_text("x")
    seg = host.run("segment", "create", "s", "--from", str(tmp_path / "t"), "--json").json()
    host.run("partition", "create", "p0", "--cpus", host.core(0), "--memory", "1024")
    host.run("vm", "create", "a", "-p", "p0", "--segment", "s")
    Path(seg["path"]).unlink()
    res = host.fail("vm", "start", "a")
    assert_one_sentence(res.err)
    assert "its file" in res.err and "re-create the segment" in res.err
    assert host.vm("a")["state"] == "stopped" and host.vm("a")["pid"] is None
    assert not host.our_pids() or all(
        "qemu" not in Path(f"/proc/{p}/cmdline").read_text(errors="replace")
        for p in host.our_pids())


def test_ksm_missing_on_this_host(host: Host, tmp_path: Path) -> None:
    host.env["FUSUMA_KSM_ROOT"] = str(tmp_path / "no-ksm")
    for args in (("share", "ksm", "on"), ("share", "ksm", "status")):
        res = host.fail(*args)
        assert_one_sentence(res.err)
        assert res.code == 7 and "KSM is not available on this host" in res.err


def test_analyze_a_pid_that_does_not_exist(host: Host) -> None:
    pid = 2**22 + 17
    with contextlib.suppress(OSError):
        assert not Path(f"/proc/{pid}").exists()
    res = host.fail("share", "analyze", str(pid))
    assert_one_sentence(res.err)
    assert res.code == 3 and f"no process with pid {pid}" in res.err


def test_bench_dcss_refuses_beside_partitions(host: Host) -> None:
    host.run("partition", "create", "p0", "--cpus", host.core(0), "--memory", "512")
    res = host.fail("bench", "dcss", "--quick")
    assert_one_sentence(res.err)
    assert "needs every core" in res.err and "p0" in res.err
    assert [p["name"] for p in host.ps()["partitions"]] == ["p0"]
    assert host.run("segment", "list", "--json").json() == []
