"""Migration between partitions with real guests: zero-copy, copy, maintain."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from tests.conftest import Host
from tests.integration.test_partitions import affinity, cgroup_of, vcpu_tids

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]

WRITE = ("dd if=/dev/urandom of=/tmp/blob bs=1M count=32 2>/dev/null && "
         "md5sum /tmp/blob > /tmp/blob.md5 && cat /tmp/blob.md5")


def uptime(host: Host, vm: str) -> float:
    return float(host.run("vm", "exec", vm, "--", "/bin/cat", "/proc/uptime").out.split()[0])


def intact(host: Host, vm: str) -> bool:
    res = host.run("vm", "exec", vm, "--", "/bin/sh", "-c", "md5sum -c /tmp/blob.md5",
                   check=False)
    assert "No such file" not in res.err, res.err
    return res.code == 0


def test_zero_copy_then_copy_keep_guest_and_data(host: Host) -> None:
    host.run("up")
    host.run("vm", "exec", "vm0", "--", "/bin/sh", "-c", WRITE)
    before = host.vm("vm0")
    ram = host.shm / "vm0.ram"
    assert ram.exists()
    t0 = uptime(host, "vm0")
    res = host.run("migrate", "vm0", "--to", "p1", "--json").json()
    assert (res["vm"], res["from"], res["to"], res["mode"]) == ("vm0", "p0", "p1", "zero-copy")
    for key in ("total_ms", "downtime_ms", "bytes_sent", "prepare_ms"):
        assert res[key] > 0, key
    # Only device state crosses: far less than the 32 MiB blob, let alone guest RAM.
    assert res["bytes_sent"] < 4 * 2**20
    after = host.vm("vm0")
    assert after["partition"] == "p1" and after["state"] == "running"
    assert after["pid"] != before["pid"] and not os.path.exists(f"/proc/{before['pid']}")
    assert cgroup_of(after["pid"], "cpuset") == f"/{host.prefix}/p1/vm.vm0"
    assert [affinity(t) for t in vcpu_tids(after["pid"])] == [{1}]
    assert ram.exists(), "zero-copy must keep the shared RAM file"
    assert uptime(host, "vm0") > t0, "the guest rebooted"
    assert intact(host, "vm0")
    assert after["host_memory"]["pss_mib"] > 0
    # Exactly one partition holds it.
    assert [v["partition"] for v in host.ps()["vms"] if v["name"] == "vm0"] == ["p1"]
    assert not list((host.runtime / "vms" / "vm0").glob("in-*"))

    res = host.run("migrate", "vm0", "--to", "p0", "--mode", "copy", "--json").json()
    assert res["mode"] == "copy" and res["bytes_sent"] > 32 * 2**20
    assert host.vm("vm0")["partition"] == "p0"
    assert intact(host, "vm0")
    assert not ram.exists(), "copy mode gives the destination its own RAM file"
    assert len(list(host.shm.glob("vm0*.ram"))) == 1


def test_maintain_restarts_hypervisor_and_brings_vms_back(host: Host, tmp_path: Path) -> None:
    host.run("up")
    host.run("vm", "exec", "vm0", "--", "/bin/sh", "-c", WRITE)
    old_sup = host.part("p0")["supervisor_pid"]
    old_pid = host.vm("vm0")["pid"]
    # A "new hypervisor version": another path to a QEMU binary. QEMU runs under the
    # VM's own unprivileged uid, so the path must be reachable by other users (not in
    # the root-only tmp_path): the runtime dir is 0711.
    qemu = host.runtime / "qemu-system-x86_64"
    qemu.symlink_to("/usr/bin/qemu-system-x86_64")
    res = host.run("maintain", "p0", "--via", "p1", "--qemu", str(qemu), "--json").json()
    assert [(m["from"], m["to"]) for m in res["moves"]] == [("p0", "p1"), ("p1", "p0")]
    assert all(m["downtime_ms"] > 0 for m in res["moves"])
    p0 = host.part("p0")
    assert p0["supervisor_pid"] not in (None, old_sup) and p0["qemu"] == str(qemu)
    vm0 = host.vm("vm0")
    assert vm0["partition"] == "p0" and vm0["pid"] != old_pid
    assert os.readlink(f"/proc/{vm0['pid']}/exe") == "/usr/bin/qemu-system-x86_64"
    assert str(qemu) in Path(f"/proc/{vm0['pid']}/cmdline").read_bytes().decode()
    assert intact(host, "vm0")
    assert host.vm("vm1")["partition"] == "p1"
