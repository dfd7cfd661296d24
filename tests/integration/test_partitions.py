"""Partitions and VMs end to end: real supervisors, real QEMU guests (TCG here), real
cgroups. Each test runs the real CLI in its own namespace (see conftest.host)."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import Host

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]


def affinity(pid: int) -> set[int]:
    return set(os.sched_getaffinity(pid))


def vcpu_tids(pid: int) -> list[int]:
    """Thread ids of QEMU's vCPU threads (named "CPU n/TCG" or "CPU n/KVM")."""
    out = []
    for t in sorted(Path(f"/proc/{pid}/task").iterdir(), key=lambda p: int(p.name)):
        if (t / "comm").read_text().startswith("CPU "):
            out.append(int(t.name))
    return out


def cgroup_of(pid: int, controller: str) -> str:
    """The process's cgroup in ``controller``'s v1 hierarchy, else its v2 cgroup."""
    unified = None
    for line in Path(f"/proc/{pid}/cgroup").read_text().splitlines():
        num, ctrls, path = line.split(":", 2)
        if controller in ctrls.split(","):
            return path
        if num == "0":
            unified = path
    if unified is None:
        raise AssertionError(f"no {controller} cgroup for {pid}")
    return unified


def memory_limit(prefix: str, partition: str) -> int:
    v1 = Path(f"/sys/fs/cgroup/memory/{prefix}/{partition}/memory.limit_in_bytes")
    v2 = Path(f"/sys/fs/cgroup/{prefix}/{partition}/memory.max")
    return int((v1 if v1.exists() else v2).read_text())


def wait_for(cond, timeout: float = 20.0, what: str = "condition") -> None:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if cond():
            return
        time.sleep(0.1)
    raise AssertionError(f"timed out waiting for {what}")


def test_default_up_two_partitions_exec_and_idempotent(exclusive_host: Host) -> None:
    host = exclusive_host
    res = host.run("up")
    assert "create partition p0" in res.out and "start vm vm1" in res.out
    ps = host.ps()
    assert [p["name"] for p in ps["partitions"]] == ["p0", "p1"]
    assert [p["cpus"] for p in ps["partitions"]] == [[0], [1]]
    for p in ps["partitions"]:
        assert p["state"] == "running" and p["supervisor_pid"] > 0
        assert os.path.exists(f"/proc/{p['supervisor_pid']}")
    sup = {p["name"]: p["supervisor_pid"] for p in ps["partitions"]}
    for vm, part, core in (("vm0", "p0", 0), ("vm1", "p1", 1)):
        v = host.vm(vm)
        assert v["state"] == "running" and v["partition"] == part
        assert v["accel"] in ("tcg", "kvm") and v["vcpus"] == 1 and v["memory_mib"] == 256
        pid = v["pid"]
        # The QEMU and the supervisor live in the partition's cgroup, pinned to its core.
        assert cgroup_of(pid, "cpuset") == f"/{host.prefix}/{part}/vm.{vm}"
        assert cgroup_of(sup[part], "cpuset") == f"/{host.prefix}/{part}/supervisor"
        assert affinity(pid) == {core}
        assert [affinity(t) for t in vcpu_tids(pid)] == [{core}]
        out = host.run("vm", "exec", vm, "--", "/bin/sh", "-c", "echo hi-$(hostname); exit 3",
                       check=False)
        assert out.code == 3 and out.out == f"hi-{vm}\n"
    again = host.run("up")
    assert "nothing to do" in again.out
    # The kernel enforces the exclusivity too (cgroup v1 here; best effort on v2).
    flag = Path(f"/sys/fs/cgroup/cpuset/{host.prefix}/p0/cpuset.cpu_exclusive")
    if flag.exists():
        assert flag.read_text().strip() == "1"
    assert {p["name"]: p["supervisor_pid"] for p in host.ps()["partitions"]} == sup


def test_supervisor_kill9_leaves_vms_and_restart_readopts(host: Host) -> None:
    host.run("up")
    before = host.ps()
    sup0 = host.part("p0")["supervisor_pid"]
    sup1 = host.part("p1")["supervisor_pid"]
    vm0 = host.vm("vm0")["pid"]
    os.kill(sup0, signal.SIGKILL)
    wait_for(lambda: host.part("p0")["state"] == "supervisor-down", what="p0 down")
    # Its VM keeps running, the other partition is untouched.
    assert host.vm("vm0")["state"] == "running" and host.vm("vm0")["pid"] == vm0
    assert host.part("p1")["supervisor_pid"] == sup1
    assert host.run("vm", "exec", "vm1", "--", "/bin/true").code == 0
    err = host.fail("vm", "exec", "vm0", "--", "/bin/true")
    assert "partition restart p0" in err.err
    host.run("partition", "restart", "p0")
    p0 = host.part("p0")
    assert p0["state"] == "running" and p0["supervisor_pid"] not in (None, sup0)
    assert host.vm("vm0")["pid"] == vm0
    out = host.run("vm", "exec", "vm0", "--", "/bin/echo", "adopted")
    assert out.out == "adopted\n"
    # The new supervisor watches the adopted QEMU: a stop is seen and recorded.
    host.run("vm", "stop", "vm0")
    assert host.vm("vm0")["state"] == "stopped"
    assert before["vms"][1]["pid"] == host.vm("vm1")["pid"]


def test_qemu_crash_shows_in_ps_and_touches_nothing_else(host: Host) -> None:
    host.run("up")
    vm0 = host.vm("vm0")["pid"]
    vm1 = host.vm("vm1")["pid"]
    os.kill(vm0, signal.SIGKILL)
    # ps says "crashed" as soon as the QEMU is gone; how it ended comes with the
    # supervisor's record, after its cleanup. Every ps on the way gives a reason.
    seen: list[dict[str, Any]] = []

    def recorded() -> bool:
        seen.append(host.vm("vm0"))
        return "signal 9" in (seen[-1]["error"] or "")
    wait_for(recorded, what="vm0's crash recorded with how its QEMU ended")
    assert all(v["state"] == "crashed" and v["pid"] is None and v["error"]
               for v in seen if v["state"] != "running"), seen
    assert seen[-1]["state"] == "crashed"
    assert host.vm("vm1")["pid"] == vm1 and host.vm("vm1")["state"] == "running"
    assert host.part("p0")["state"] == "running"
    assert not list(host.shm.glob("vm0.*")), "crashed VM's RAM file was not removed"
    # A crashed VM can be started again.
    host.run("vm", "start", "vm0", "--wait")
    assert host.run("vm", "exec", "vm0", "--", "/bin/true").code == 0


def test_resize_moves_cores_and_memory_and_repins(host: Host) -> None:
    host.run("partition", "create", "a", "--cpus", "0-1", "--memory", "1024")
    host.run("vm", "create", "va", "-p", "a", "--vcpus", "2", "--start")
    pid = host.vm("va")["pid"]
    wait_for(lambda: len(vcpu_tids(pid)) == 2, what="2 vCPU threads")
    assert [affinity(t) for t in vcpu_tids(pid)] == [{0}, {1}]
    # Creating b on core 1 is refused while a holds it.
    err = host.fail("partition", "create", "b", "--cpus", "1", "--memory", "512")
    assert "belong to partition 'a'" in err.err
    host.run("partition", "resize", "a", "--cpus", "0", "--memory", "768")
    assert host.part("a")["cpus"] == [0] and host.part("a")["memory_mib"] == 768
    assert [affinity(t) for t in vcpu_tids(pid)] == [{0}, {0}]
    assert affinity(pid) == {0}
    assert memory_limit(host.prefix, "a") == 768 * 1024 * 1024
    host.run("partition", "create", "b", "--cpus", "1", "--memory", "512")
    # Growing a back onto b's core is refused; the VM keeps running on core 0.
    err = host.fail("partition", "resize", "a", "--cpus", "0-1")
    assert "belong to partition 'b'" in err.err
    assert host.part("a")["cpus"] == [0]
    assert host.run("vm", "exec", "va", "--", "/bin/true").code == 0
    # Memory below what the VM needs is refused.
    err = host.fail("partition", "resize", "a", "--memory", "150")
    assert "needs at least" in err.err


def test_disks_belong_to_one_partition(host: Host) -> None:
    host.run("partition", "create", "a", "--cpus", host.core(0), "--memory", "768")
    host.run("partition", "create", "b", "--cpus", host.core(1), "--memory", "768")
    # Without a path: d0.img in the default storage directory, FUSUMA_HOME/disks.
    host.run("disk", "add", "d0", "-p", "a", "--size-mib", "16")
    img = host.home / "disks" / "d0.img"
    assert img.stat().st_size == 16 * 1024 * 1024
    err = host.fail("vm", "create", "vb", "-p", "b", "--disk", "d0")
    assert "belongs to partition 'a'" in err.err
    host.run("vm", "create", "va", "-p", "a", "--disk", "d0", "--start")
    out = host.run("vm", "exec", "va", "--", "/bin/sh", "-c",
                   "echo data > /dev/vda && head -c 4 /dev/vda")
    assert out.out == "data"
    err = host.fail("disk", "move", "d0", "--to", "b")
    assert "attached to VM 'va'" in err.err
    host.run("vm", "stop", "va")
    host.run("vm", "detach", "va", "d0")
    host.run("disk", "move", "d0", "--to", "b")
    host.run("vm", "create", "vb", "-p", "b", "--disk", "d0", "--start")
    out = host.run("vm", "exec", "vb", "--", "/bin/sh", "-c", "head -c 4 /dev/vda")
    assert out.out == "data"
