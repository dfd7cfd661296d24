"""Spec files, console log, pinning of several VMs, and the boot benchmark."""

from __future__ import annotations

import json
import math
import os
from pathlib import Path

import pytest

from tests.conftest import Host
from tests.integration.test_partitions import affinity, vcpu_tids

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]


def test_spec_file_up_down_and_disk_files(host: Host, tmp_path: Path) -> None:
    disk = tmp_path / "disks" / "data.img"
    spec = tmp_path / "host.toml"
    spec.write_text(f"""
[[storage]]
path = "{disk.parent}"

[[partition]]
name = "web"
cpus = "0-1"
memory_mib = 1536

[[disk]]
name = "data"
path = "{disk}"
partition = "web"
size_mib = 8

[[vm]]
name = "w1"
partition = "web"
memory_mib = 192
disks = ["data"]

[[vm]]
name = "w2"
partition = "web"
memory_mib = 192
""")
    out = host.run("up", str(spec), "--json").json()
    assert "start vm w2" in out["actions"] and disk.stat().st_size == 8 * 2**20
    # Two 1-vCPU VMs in a 2-core partition get a core each.
    cores = [affinity(vcpu_tids(host.vm(n)["pid"])[0]) for n in ("w1", "w2")]
    assert sorted(map(sorted, cores)) == [[0], [1]]
    log = host.run("vm", "console", "w1", "--log").out
    assert "fusuma-guest: ready" in log
    assert host.run("up", str(spec), "--json").json() == {"actions": []}
    # Changing a VM in the spec is refused without touching anything.
    spec.write_text(spec.read_text().replace("memory_mib = 192\ndisks", "memory_mib = 256\n"
                                             "disks"))
    err = host.fail("up", str(spec)).err
    assert "VM 'w1' exists with other settings (memory_mib 192 -> 256)" in err
    pids = {v["name"]: v["pid"] for v in host.ps()["vms"]}
    host.run("down")
    assert not disk.exists(), "a disk file fusuma created from size_mib must go with down"
    assert host.ps() == {"partitions": [], "vms": [], "networks": []}
    assert all(not os.path.exists(f"/proc/{p}") for p in pids.values())


def test_bench_boot_writes_result_file(host: Host, tmp_path: Path) -> None:
    out = tmp_path / "boot.json"
    host.run("bench", "boot", "--vms", "2", "--runs", "1", "--json", str(out))
    data = json.loads(out.read_text())
    meta = data["meta"]
    for key in ("git_revision", "date", "host", "accel", "qemu", "host_cpu"):
        assert meta[key], key
    assert [r["vm"] for r in data["results"]] == ["bench-boot-0", "bench-boot-1"]
    for r in data["results"]:
        assert math.isfinite(r["boot_ms"]) and 100 < r["boot_ms"] < 120_000
    assert data["summary"]["min_boot_ms"] <= data["summary"]["median_boot_ms"]
    # The scratch partition is gone.
    assert host.ps() == {"partitions": [], "vms": [], "networks": []}
