"""fusuma on a systemd host (this guest's PID 1), with its default names: `fusuma up`
installs the units, the partition's supervisor runs as fusuma-supervisor@p0.service in
fusuma.slice, and one real VM (the minimal image under nested TCG, 128 MiB) runs in the
unit's delegated cgroup, held to the partition's core and memory. Restarting the unit
(or killing the supervisor) leaves the VM running, and a restart reloads a drop-in that
a killed writer left unreloaded; deleting the partition leaves nothing. The tests share
the partition and the VM, in order."""

from __future__ import annotations

import os
import signal
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from kit import CGROUP, Fusuma, alive, cgroup_of, read, show, systemctl, threads_allowed, wait_for

from fusuma.capacity import ram_group_limit
from fusuma.host.limits import Limits
from fusuma.host.systemd import Units

UNIT = "fusuma-supervisor@p0.service"
RAM_UNIT = "fusuma-ram@fusuma.service"
SLICE = CGROUP / "fusuma.slice"
PART = SLICE / UNIT
RAM = SLICE / RAM_UNIT
UNIT_FILES = [Path("/etc/systemd/system") / n for n in
              ("fusuma.slice", "fusuma-supervisor@.service", "fusuma-ram@.service")]
MIB = 1 << 20
SPEC = """\
[[partition]]
name = "p0"
cpus = "1"
memory_mib = 384
"""


SPEC_FILE = Path("/run/fusuma-cg2/host.toml")


@pytest.fixture(scope="module")
def fz() -> Iterator[Fusuma]:
    SPEC_FILE.parent.mkdir(parents=True, exist_ok=True)
    SPEC_FILE.write_text(SPEC)
    f = Fusuma()
    yield f
    f.run("down", check=False)


def qemu_pid(fz: Fusuma, ps: dict[str, Any] | None = None) -> int:
    vm = next(v for v in (ps or fz.ps())["vms"] if v["name"] == "v0")
    assert vm["state"] == "running", vm
    return int(vm["pid"])


# The VM's QEMU, found once (`fusuma ps` takes seconds in this guest).
QEMU: dict[str, int] = {}


def test_up_installs_the_units_and_runs_the_supervisor_as_one(fz: Fusuma) -> None:
    for f in UNIT_FILES:
        f.unlink(missing_ok=True)
    systemctl("daemon-reload")
    out = fz.run("up", str(SPEC_FILE)).out
    for f in UNIT_FILES:
        assert f"install systemd unit {f}" in out, out
    assert "create partition p0" in out
    assert show(UNIT, "ActiveState") == "active"
    assert show(UNIT, "Delegate") == "yes" and show(UNIT, "KillMode") == "process"
    assert show(UNIT, "Slice") == "fusuma.slice"
    assert show(UNIT, "ControlGroup") == f"/fusuma.slice/{UNIT}"
    # The partition's limits are the unit's properties, and the kernel has them.
    assert show(UNIT, "AllowedCPUs") == "1" and read(PART / "cpuset.cpus.effective") == "1"
    assert read(PART / "memory.max") == str(384 * MIB)
    ps = fz.ps()["partitions"][0]
    sup = ps["supervisor_pid"]
    assert sup == int(show(UNIT, "MainPID"))
    assert cgroup_of(sup) == PART / "supervisor"
    assert read(PART / "supervisor" / "cgroup.type") == "threaded"
    assert ps["cores_held_by"] == "shared"
    assert fz.run("up", str(SPEC_FILE)).out.strip() == \
        "nothing to do: the host already matches the spec"


def test_vm_is_held_to_its_core_and_memory(fz: Fusuma) -> None:
    # Best effort (cpu.idle): its nested-TCG boot takes minutes of CPU, which the
    # supervisor and these tests must not wait behind.
    fz.run("vm", "create", "v0", "-p", "p0", "--memory", "128", "--qos", "best-effort",
           "--start")
    ps = fz.ps()
    pid = QEMU["v0"] = qemu_pid(fz, ps)
    assert cgroup_of(pid) == PART / "vm.v0"
    allowed = threads_allowed(pid)
    assert set(allowed.values()) == {"1"}, allowed
    assert read(PART / "vm.v0" / "cpu.idle") == "1"     # its QoS class, in the kernel
    # Guest RAM: allocated before QEMU started, charged to the file's own group.
    ram = RAM / "v0"
    assert int(read(ram / "memory.max")) == ram_group_limit(128 * MIB)
    assert int(read(ram / "memory.current")) >= 128 * MIB
    part_mem = int(read(PART / "memory.current"))
    assert 0 < part_mem < 384 * MIB
    use: dict[str, Any] = ps["partitions"][0]["memory_use"]
    assert use["guest_ram_mib"] >= 128


def test_resize_moves_the_vm_and_the_limits(fz: Fusuma) -> None:
    pid = QEMU["v0"]
    fz.run("partition", "resize", "p0", "--cpus", "0", "--memory", "448")
    assert show(UNIT, "AllowedCPUs") == "0" and read(PART / "cpuset.cpus.effective") == "0"
    assert read(PART / "memory.max") == str(448 * MIB)
    wait_for("the QEMU threads on core 0",
             lambda: set(threads_allowed(pid).values()) == {"0"}, 30)


def test_restarting_the_unit_keeps_the_vm(fz: Fusuma) -> None:
    pid = QEMU["v0"]
    old = int(show(UNIT, "MainPID"))
    systemctl("restart", UNIT)
    assert show(UNIT, "ActiveState") == "active"
    new = int(show(UNIT, "MainPID"))
    assert new != old and alive(pid) and cgroup_of(pid) == PART / "vm.v0"

    def adopted() -> bool:
        ps = fz.ps()
        vm = ps["vms"][0]
        return ps["partitions"][0]["supervisor_pid"] == new and vm["pid"] == pid and \
            vm["state"] == "running"
    wait_for("the new supervisor to adopt v0", adopted, 90)


def test_killed_supervisor_leaves_the_vm_and_is_restarted(fz: Fusuma) -> None:
    pid = QEMU["v0"]
    os.kill(int(show(UNIT, "MainPID")), signal.SIGKILL)
    wait_for("the unit to stop", lambda: show(UNIT, "ActiveState") != "active", 30)
    assert alive(pid)
    assert fz.ps()["partitions"][0]["state"] == "supervisor-down"
    # A writer killed between its drop-in and the daemon-reload (as a `partition resize`
    # killed there would leave it): the file says 480 MiB, the loaded unit 448 MiB.
    Units("fusuma").write_limits(UNIT, Limits(cpus=[0], mems=[0], memory_bytes=480 * MIB))
    assert show(UNIT, "NeedDaemonReload") == "yes"
    assert show(UNIT, "MemoryMax") == str(448 * MIB)
    fz.run("partition", "restart", "p0")
    assert show(UNIT, "ActiveState") == "active" and qemu_pid(fz) == pid
    # The restart reloaded before it started the unit: it runs with the file's limit.
    assert show(UNIT, "NeedDaemonReload") == "no"
    assert show(UNIT, "MemoryMax") == str(480 * MIB)
    assert read(PART / "memory.max") == str(480 * MIB)


def test_delete_leaves_nothing(fz: Fusuma) -> None:
    pid = QEMU["v0"]
    fz.run("partition", "delete", "p0", "--force")
    assert not alive(pid)
    assert show(UNIT, "ActiveState") == "inactive" and show(RAM_UNIT, "ActiveState") \
        == "inactive"
    assert not PART.exists() and not RAM.exists()
    for d in ("/run/systemd/system", "/run/systemd/system.control"):
        assert not list(Path(d).glob("fusuma-*")), list(Path(d).glob("fusuma-*"))
    assert not list(Path("/dev/shm/fusuma").glob("*"))
    assert fz.ps()["partitions"] == []
