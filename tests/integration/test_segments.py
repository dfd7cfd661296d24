"""Shared segments, the Debian image and KSM with real QEMU guests, real KSM."""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import Host

pytestmark = [pytest.mark.integration, pytest.mark.timeout(600)]

KSM = Path("/sys/kernel/mm/ksm")


def sh(host: Host, vm: str, script: str) -> str:
    res = host.run("vm", "exec", vm, "--json", "--", "/bin/sh", "-c", script).json()
    assert res["exit_code"] == 0, res
    out: str = res["stdout"]
    return out


def meminfo_kib(host: Host, vm: str, field: str) -> int:
    line = sh(host, vm, f"grep '^{field}:' /proc/meminfo")
    return int(line.split()[1])


@pytest.fixture
def ksm_restored() -> Iterator[None]:
    """Put the host's KSM settings back as they were."""
    names = ("run", "pages_to_scan", "sleep_millisecs")
    saved = {n: (KSM / n).read_text().strip() for n in names}
    yield
    # pages_to_scan and sleep_millisecs can only change while run allows it; write
    # them first, run last.
    for n in ("pages_to_scan", "sleep_millisecs", "run"):
        with contextlib.suppress(OSError):
            (KSM / n).write_text(saved[n])


def test_segment_is_shared_with_dax_and_survives_zero_copy_migration(
        host: Host, tmp_path: Path) -> None:
    tree = tmp_path / "tools"
    (tree / "bin").mkdir(parents=True)
    blob = os.urandom(4 * 2**20)
    (tree / "data.bin").write_bytes(blob)
    (tree / "bin" / "hello").write_text("#!/bin/sh\necho hello from a segment\n")
    (tree / "bin" / "hello").chmod(0o755)
    seg = host.run("segment", "create", "tools", "--from", str(tree), "--json").json()
    assert seg["size_mib"] >= 4 and seg["size_mib"] % 2 == 0, seg   # padded to 2 MiB
    assert Path(seg["path"]).is_file()

    host.run("partition", "create", "p0", "--cpus", host.core(0), "--memory", "1024")
    host.run("partition", "create", "p1", "--cpus", host.core(1), "--memory", "1024")
    host.run("vm", "create", "a", "-p", "p0", "--segment", "tools", "--start")
    host.run("vm", "create", "b", "-p", "p1", "--segment", "tools:/opt/tools", "--start")
    mounts = sh(host, "a", "grep ' /mnt/tools ' /proc/mounts")
    assert "erofs" in mounts and "dax=always" in mounts and "ro" in mounts.split()[3]
    assert "hello from a segment" in sh(host, "b", "/opt/tools/bin/hello")

    # Reading the file through DAX leaves the guest's page cache as it was.
    before = meminfo_kib(host, "a", "Cached")
    digest = sh(host, "a", "md5sum /mnt/tools/data.bin").split()[0]
    after = meminfo_kib(host, "a", "Cached")
    assert digest == hashlib.md5(blob).hexdigest()
    assert after - before < 1024, (before, after)
    assert sh(host, "b", "md5sum /opt/tools/data.bin").split()[0] == digest
    with pytest.raises(AssertionError):                   # read-only for every guest
        sh(host, "a", "echo x > /mnt/tools/data.bin")

    # Both QEMUs map the same host pages: the report splits them and counts the saving.
    rep = host.run("share", "report", "--json").json()
    tools = rep["segments"]["tools"]
    assert tools["vms"] == 2 and tools["rss_mib"] >= 8 and tools["saved_mib"] >= 3.5, tools
    vm_a = host.vm("a")
    assert vm_a["segments"] == ["tools:/mnt/tools"]
    assert vm_a["host_memory"]["segments"]["tools"]["pss_mib"] > 0

    # A VM with segments still moves zero-copy: the segment is a shared named file.
    mig = host.run("migrate", "a", "--to", "p1", "--json").json()
    assert mig["mode"] == "zero-copy" and mig["bytes_sent"] < 2**20, mig
    assert sh(host, "a", "md5sum /mnt/tools/data.bin").split()[0] == digest

    err = host.fail("segment", "delete", "tools").err
    assert "attached to VM(s) a, b" in err
    assert Path(seg["path"]).is_file()
    host.run("vm", "delete", "a", "--force")
    host.run("vm", "delete", "b", "--force")
    host.run("segment", "delete", "tools")
    assert not Path(seg["path"]).exists()
    assert host.run("segment", "list", "--json").json() == []


def _http(port: int, timeout: float = 120) -> str:
    deadline = time.monotonic() + timeout
    while True:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/", timeout=10) as r:
                body: str = r.read().decode(errors="replace")
                return body
        except OSError:
            if time.monotonic() > deadline:
                raise
            time.sleep(1)


def mounts(host: Host, vm: str) -> dict[str, list[str]]:
    """The guest's /proc/mounts by mount point: [device, type, options]."""
    out = {}
    for line in sh(host, vm, "cat /proc/mounts").splitlines():
        dev, point, fstype, opts = line.split()[:4]
        out[point] = [dev, fstype, opts]
    return out


def test_debian_guest_serves_apache2_with_its_root_from_a_segment(
        host: Host, tmp_path: Path) -> None:
    (tmp_path / "tools").mkdir()
    (tmp_path / "tools" / "hello").write_text("hello\n")
    host.run("segment", "create", "root", "--from-image", "debian")
    host.run("segment", "create", "tools", "--from", str(tmp_path / "tools"))
    host.run("partition", "create", "p0", "--cpus", host.core(0), "--memory", "1536")
    host.run("partition", "create", "p1", "--cpus", host.core(1), "--memory", "1024")
    host.run("vm", "create", "web", "-p", "p0", "--image", "debian", "--segment", "root:/",
             "--segment", "tools", "--port", "18711:80", "--start")
    host.run("vm", "create", "plain", "-p", "p0", "--image", "debian", "--port",
             "18712:80", "--start")
    assert "Apache2 Debian Default Page" in _http(18711)
    assert "Apache2 Debian Default Page" in _http(18712)
    # / is an overlay: Debian's root read-only from the segment (erofs, DAX) below, a
    # small tmpfs above.
    web = mounts(host, "web")
    assert web["/"][1] == "overlay" and "lowerdir=/run/fusuma/lower" in web["/"][2]
    assert web["/run/fusuma/lower"][:2] == ["/dev/pmem0", "erofs"]
    assert "dax=always" in web["/run/fusuma/lower"][2]
    assert web["/run/fusuma/rw"][1] == "tmpfs" and "size=65536k" in web["/run/fusuma/rw"][2]
    # Another segment is still mounted after the switch to that root.
    assert web["/mnt/tools"][1] == "erofs" and "dax=always" in web["/mnt/tools"][2]
    assert sh(host, "web", "cat /mnt/tools/hello") == "hello\n"
    # Without a segment, the root is the image's erofs on a read-only virtio-blk disk.
    plain = mounts(host, "plain")
    assert plain["/"][1] == "overlay"
    lower = plain["/run/fusuma/lower"]
    assert lower[0].startswith("/dev/vd") and lower[1] == "erofs" and "dax" not in lower[2]
    for vm in ("web", "plain"):
        sh(host, vm, "test -x /usr/local/bin/probe")
    # /etc is writable and private to each VM.
    sh(host, "web", "echo web > /etc/fusuma-test")
    assert sh(host, "web", "cat /etc/fusuma-test") == "web\n"
    assert sh(host, "plain", "cat /etc/fusuma-test 2>/dev/null || echo absent").strip() \
        == "absent"

    # The forwarded port follows a zero-copy move (the new QEMU takes it over once the
    # old one has exited).
    mig = host.run("migrate", "web", "--to", "p1", "--json").json()
    assert mig["mode"] == "zero-copy" and host.vm("web")["partition"] == "p1"
    assert "Apache2 Debian Default Page" in _http(18711, timeout=30)
    assert sh(host, "web", "cat /etc/fusuma-test") == "web\n"   # in the guest's RAM

    ana: dict[str, Any] = host.run("share", "analyze", "--vm", "web", "--json").json()
    assert set(ana) == {"pid", "comm", "by_mode", "total_rss_kib", "shareable_fraction"}
    assert ana["pid"] == host.vm("web")["pid"]
    assert sum(ana["by_mode"].values()) == ana["total_rss_kib"] > 0
    assert 0.0 < ana["shareable_fraction"] < 1.0
    assert ana["by_mode"].get("r--s", 0) > 0          # the segment, mapped read-only shared

    host.run("vm", "delete", "web", "--force")
    host.run("vm", "delete", "plain", "--force")
    host.run("segment", "delete", "root")
    host.run("segment", "delete", "tools")


def test_debian_guest_whose_root_cannot_be_mounted_says_so_and_stops(
        host: Host, tmp_path: Path) -> None:
    (tmp_path / "t").mkdir()
    (tmp_path / "t" / "f").write_text("x")
    seg = host.run("segment", "create", "bad", "--from", str(tmp_path / "t"),
                   "--json").json()
    # Not an erofs image any more (the file keeps its size and owner).
    Path(seg["path"]).write_bytes(b"\0" * Path(seg["path"]).stat().st_size)
    host.run("partition", "create", "p0", "--cpus", host.core(0), "--memory", "512")
    host.run("vm", "create", "v", "-p", "p0", "--image", "debian", "--segment", "bad:/",
             "--start")
    deadline = time.monotonic() + 120
    while host.vm("v")["pid"] is not None:
        assert time.monotonic() < deadline, "the VM without a root did not stop"
        time.sleep(1)
    console = (host.home / "vms" / "v" / "console.log").read_text(errors="replace")
    assert "fusuma-guest: cannot mount the root filesystem: segment bad is not an erofs " \
        "image; powering off" in console
    assert "fusuma-guest: ready" not in console
    host.run("vm", "delete", "v", "--force")
    host.run("segment", "delete", "bad")


def test_mergeable_vms_merge_with_ksm_and_refuse_zero_copy(host: Host,
                                                          ksm_restored: None) -> None:
    host.run("share", "ksm", "on", "--pages-to-scan", "4000", "--sleep-ms", "20")
    assert (KSM / "run").read_text().strip() == "1"
    host.run("partition", "create", "p0", "--cpus", host.core(0), "--memory", "1024")
    host.run("partition", "create", "p1", "--cpus", host.core(1), "--memory", "1024")
    for vm in ("k0", "k1"):
        host.run("vm", "create", vm, "-p", "p0", "--mergeable", "--start")
    vm0 = host.vm("k0")
    assert vm0["mergeable"] and not vm0["shared_ram"]
    # Two identical guests: KSM finds their identical pages within a few scans.
    deadline = time.monotonic() + 120
    merged: list[float] = [0.0, 0.0]
    while time.monotonic() < deadline:
        rep = host.run("share", "report", "--json").json()
        merged = [v["ksm_merged_mib"] or 0.0 for v in rep["vms"]]
        if all(m >= 4 for m in merged):
            break
        time.sleep(3)
    assert all(m >= 4 for m in merged), merged
    assert rep["savings_mib"]["ksm"] >= 4
    table = host.run("ps").out
    assert "KSM_MIB" in table

    err = host.fail("migrate", "k0", "--to", "p1").err
    assert "mergeable" in err and "--mode copy" in err
    assert host.vm("k0")["partition"] == "p0"
    mig = host.run("migrate", "k0", "--to", "p1", "--mode", "copy", "--json").json()
    assert mig["mode"] == "copy"
    assert host.vm("k0")["partition"] == "p1"
    host.run("share", "ksm", "off")
    assert (KSM / "run").read_text().strip() == "0"


def test_bench_dcss_small_run_writes_a_result_and_report(host: Host, tmp_path: Path,
                                                         ksm_restored: None) -> None:
    out = tmp_path / "dcss"
    res = host.run("bench", "dcss", "--vms", "1", "--modes", "none,segment",
                   "--loads", "apache2", "--requests", "50", "--ab-runs", "1",
                   "--report", str(out), timeout=900)
    data = json.loads((out / "dcss.json").read_text())
    assert data["meta"]["benchmark"] == "dcss" and data["meta"]["git_revision"]
    assert [(r["mode"], r["vms"]) for r in data["results"]] == [("none", 1), ("segment", 1)]
    for r in data["results"]:
        assert r["total_pss_mib"] > 50 and r["requests_per_s"] > 0
        assert r["failed_requests"] == 0
    seg = data["results"][1]
    assert seg["segments_pss_mib"] > 0 and data["results"][0]["segments_pss_mib"] == 0
    assert (out / "report.md").read_text().startswith("# DCSS on fusuma")
    assert (out / "dcss.png").stat().st_size > 1000
    assert "written to" in res.out
    # everything it made is gone
    assert host.ps() == {"partitions": [], "vms": [], "networks": []}
    assert host.run("segment", "list", "--json").json() == []
