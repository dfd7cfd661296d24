"""Issue 18: a zero-copy move needs no spare memory.

A guest of half the host's memory runs in partition a; partition b is small. The guest
moves to b and back zero-copy (and `maintain a --via b` does the same), its data's
checksum unchanged; the kernel's counters show its RAM in its own memory cgroup before
and after, and no partition's counter holding it. 2 GiB the guest writes and frees again
go back to the host through free page reporting. A copy move, which would need a second
copy of that RAM, is refused before anything starts.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import Host
from tests.fault.movekit import qemu_pids

pytestmark = pytest.mark.integration

MIB = 2**20
CG = Path("/sys/fs/cgroup/memory")


def host_mib() -> int:
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemTotal:"):
            return int(line.split()[1]) // 1024
    raise AssertionError("no MemTotal")


def counters(host: Host) -> dict[str, Any]:
    """The kernel's own numbers: each partition's cgroup and each RAM file's."""
    top = CG / host.prefix
    out: dict[str, Any] = {}
    for p in ("a", "b"):
        out[p] = {"usage": int((top / p / "memory.usage_in_bytes").read_text()),
                  "limit": int((top / p / "memory.limit_in_bytes").read_text())}
    ram = top / "guest.ram"
    out["ram"] = {d.name: {"usage": int((d / "memory.usage_in_bytes").read_text()),
                           "limit": int((d / "memory.limit_in_bytes").read_text())}
                  for d in ram.iterdir() if d.is_dir()} if ram.is_dir() else {}
    return out


@pytest.mark.timeout(600)
def test_half_the_host_moves_out_and_back_with_no_spare_memory(host: Host) -> None:
    if not CG.is_dir():
        pytest.skip("this test reads cgroup v1 memory counters")
    big = (host_mib() // 2 + 255) // 256 * 256          # half the host or more
    if os.statvfs("/dev/shm").f_bavail * os.statvfs("/dev/shm").f_frsize < (big + 512) * MIB:
        pytest.skip("/dev/shm cannot hold a RAM file of half the host")
    host.run("partition", "create", "a", "--cpus", host.core(0), "--memory", "1024")
    host.run("partition", "create", "b", "--cpus", host.core(1), "--memory", "512")
    host.run("vm", "create", "big", "-p", "a", "--memory", str(big), "--port", "18480:80",
             "--start")
    md5 = host.run("vm", "exec", "big", "--", "/bin/sh", "-c",
                   "dd if=/dev/urandom of=/tmp/blob bs=1M count=64 2>/dev/null && "
                   "md5sum /tmp/blob > /tmp/blob.md5 && cat /tmp/blob.md5").out.split()[0]
    before = counters(host)
    # The guest's RAM is charged to its own cgroup (with its QEMU: on cgroup v1 QEMU's
    # memory membership is that group), faulted lazily, bounded by its size; partition
    # a holds only the supervisor, well inside its budget.
    assert list(before["ram"]) == ["big"]
    assert 16 * MIB < before["ram"]["big"]["usage"] < big * MIB // 4
    from fusuma.capacity import definition_overhead, lazy_ram_limit

    assert before["ram"]["big"]["limit"] == lazy_ram_limit(
        big * MIB, definition_overhead("tcg") * MIB)
    assert before["a"]["limit"] == 1024 * MIB and before["a"]["usage"] < 1024 * MIB
    assert before["a"]["usage"] < big * MIB // 4
    ps = {p["name"]: p for p in host.ps()["partitions"]}
    assert 0 < ps["a"]["memory_use"]["guest_ram_mib"] <= big
    assert ps["a"]["memory_use"]["other_mib"] >= before["a"]["usage"] / MIB

    # A copy move would hold a second copy of the RAM: refused before anything starts.
    res = host.fail("migrate", "big", "--to", "b", "--mode", "copy")
    assert "holds a second RAM file" in res.err and "(second copy)" in res.err
    assert host.vm("big")["partition"] == "a" and len(qemu_pids(host, "big")) == 1

    # Zero-copy to b (512 MiB: room for its QEMU, not for its RAM) and back.
    out = host.run("migrate", "big", "--to", "b", "--json").json()
    assert out["to"] == "b" and out["downtime_ms"] is not None
    mid = counters(host)
    assert mid["ram"]["big"]["usage"] == pytest.approx(before["ram"]["big"]["usage"],
                                                       abs=96 * MIB)
    assert mid["b"]["usage"] <= mid["b"]["limit"] == 512 * MIB
    # a holds its supervisor only (QEMUs' memory sits in their RAM file's group).
    assert mid["a"]["usage"] < 64 * MIB
    # The guest writes 2 GiB of its RAM (four times b's whole budget) while it runs in
    # b: b's counter does not hold those pages (they belong to the RAM's own group).
    host.run("vm", "exec", "big", "--timeout", "300", "--", "/bin/sh", "-c",
             "mkdir -p /mnt/t && mount -t tmpfs -o size=2048m tmpfs /mnt/t && "
             "dd if=/dev/zero of=/mnt/t/fill bs=1M 2>/dev/null; true", timeout=400)
    touched = counters(host)
    assert touched["b"]["usage"] <= 512 * MIB
    assert 2000 * MIB < touched["ram"]["big"]["usage"] <= touched["ram"]["big"]["limit"]
    ps = {p["name"]: p for p in host.ps()["partitions"]}
    assert ps["b"]["memory_use"]["guest_ram_mib"] >= 2000
    assert ps["a"]["memory_use"]["guest_ram_mib"] == 0
    # The guest frees them: page reporting hands them back (holes in the RAM file).
    host.run("vm", "exec", "big", "--", "/bin/sh", "-c",
             "rm -f /mnt/t/fill; umount /mnt/t; true")
    trim = host.run("vm", "trim", "big", "--json").json()
    freed = counters(host)
    assert freed["ram"]["big"]["usage"] < touched["ram"]["big"]["usage"] - 1800 * MIB
    assert trim["resident_after_mib"] < 1024
    vm = next(v for v in host.ps()["vms"] if v["name"] == "big")
    assert vm["ram"]["page_reporting"] is True and vm["ram"]["returned_mib"] >= 1800
    assert vm["ram"]["resident_mib"] == pytest.approx(trim["resident_after_mib"], abs=32)

    done = host.run("maintain", "b", "--via", "a", "--json").json()
    assert [m["mode"] for m in done["moves"]] == ["zero-copy", "zero-copy"]
    assert host.vm("big")["partition"] == "b"
    host.run("migrate", "big", "--to", "a")
    after = counters(host)
    assert after["ram"]["big"]["usage"] == pytest.approx(freed["ram"]["big"]["usage"],
                                                         abs=96 * MIB)
    assert after["b"]["usage"] < 512 * MIB
    assert len(qemu_pids(host, "big")) == 1
    check = host.run("vm", "exec", "big", "--", "/bin/sh", "-c", "md5sum /tmp/blob")
    assert check.out.split()[0] == md5
    host.run("vm", "delete", "big", "--force")
    assert counters(host)["ram"] == {}                     # the RAM's group went with it
