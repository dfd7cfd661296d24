"""The cgroup driver against this host's real cgroup filesystem.

Every test works under a unique prefix ``fusuma-test-<random>`` and proves at teardown
that no process is left in it and no directory of that prefix is left in any hierarchy.
Needs root and at least two CPUs.
"""

from __future__ import annotations

import os
import secrets
import signal
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from fusuma.errors import CgroupError, HostError
from fusuma.host.cgroups import CgroupDriver, Limits, detect, parse_mountinfo
from fusuma.host.cgroups.v1 import CgroupV1Driver
from fusuma.host.cgroups.v2 import CgroupV2Driver

pytestmark = [
    pytest.mark.integration,
    pytest.mark.skipif(os.geteuid() != 0, reason="needs root to write cgroups"),
    pytest.mark.skipif((os.cpu_count() or 1) < 2, reason="needs two CPUs"),
]

MIB = 1024 * 1024


def cgroup_mounts() -> list[Path]:
    return [m.mountpoint for m in parse_mountinfo(Path("/proc/self/mountinfo").read_text())]


def leftovers(prefix: str) -> list[Path]:
    return [p for mount in cgroup_mounts() for p in mount.glob(f"{prefix}*")]


def cpus_allowed(pid: int) -> str:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("Cpus_allowed_list:"):
            return line.split(":", 1)[1].strip()
    raise AssertionError(f"no Cpus_allowed_list in /proc/{pid}/status")


@pytest.fixture
def driver() -> Iterator[CgroupDriver]:
    prefix = f"fusuma-test-{secrets.token_hex(4)}"
    try:
        drv = detect(prefix)
    except HostError as exc:
        pytest.skip(str(exc))
    try:
        yield drv
    finally:
        for group in drv.groups():
            drv.delete(group)
        drv.remove_parent_if_empty()
        left = leftovers(prefix)
        # Last resort so a failed test does not leave directories on the host.
        for path in sorted(left, key=lambda p: len(p.parts), reverse=True):
            for sub in sorted(path.rglob("*"), key=lambda p: len(p.parts), reverse=True):
                if sub.is_dir():
                    sub.rmdir()
            path.rmdir()
        assert left == [], f"cgroups left behind: {left}"


@pytest.fixture
def spawned(driver: CgroupDriver) -> Iterator[list[subprocess.Popen[bytes]]]:
    """Processes a test starts; killed before the driver fixture cleans the cgroups."""
    children: list[subprocess.Popen[bytes]] = []
    try:
        yield children
    finally:
        for child in children:
            if child.poll() is None:
                child.kill()
            child.wait()


def test_partition_lifecycle(driver: CgroupDriver,
                             spawned: list[subprocess.Popen[bytes]]) -> None:
    driver.ensure_parent()
    driver.create("p0", Limits(cpus=[0], mems=[0], memory_bytes=256 * MIB, io_weight=200))
    driver.create_leaf("p0", "supervisor")
    driver.create_leaf("p0", "vm.test")
    assert driver.groups() == ["p0"]
    assert driver.cpus("p0") == [0]

    sleep = subprocess.Popen(["sleep", "30"])
    spawned.append(sleep)
    driver.attach("p0", "vm.test", sleep.pid)
    assert cpus_allowed(sleep.pid) == "0"
    assert driver.pids("p0") == [sleep.pid]
    for line in Path(f"/proc/{sleep.pid}/cgroup").read_text().splitlines():
        _hid, controllers, path = line.split(":", 2)
        if set(controllers.split(",")) & {"cpuset", "cpu", "memory", "blkio"}:
            assert path == f"/{driver.prefix}/p0/vm.test", line
    assert driver.memory_current("p0") >= 0

    driver.update("p0", Limits(cpus=[1], mems=[0], memory_bytes=128 * MIB))
    assert cpus_allowed(sleep.pid) == "1"
    assert driver.cpus("p0") == [1]

    with pytest.raises(CgroupError, match=f"processes {sleep.pid} are still in it"):
        driver.delete("p0")

    sleep.send_signal(signal.SIGKILL)
    sleep.wait()
    assert driver.pids("p0") == []
    driver.delete("p0")
    assert not driver.exists("p0")
    driver.remove_parent_if_empty()
    assert leftovers(driver.prefix) == []


def test_memory_limit_is_written(driver: CgroupDriver) -> None:
    driver.create("p0", Limits(cpus=[0], mems=[0], memory_bytes=256 * MIB))
    if isinstance(driver, CgroupV1Driver):
        path = driver.mounts["memory"] / driver.prefix / "p0" / "memory.limit_in_bytes"
    else:
        assert isinstance(driver, CgroupV2Driver)
        path = driver.mount / driver.prefix / "p0" / "memory.max"
    assert int(path.read_text()) == 256 * MIB


def test_exclusive_cpus_refuse_an_overlapping_sibling(driver: CgroupDriver) -> None:
    if driver.version != 1:
        pytest.skip("v1 cpu_exclusive semantics; v2 exclusivity is best effort")
    driver.create("p0", Limits(cpus=[0], mems=[0], memory_bytes=64 * MIB))
    with pytest.raises(CgroupError, match="shrink it first"):
        driver.create("p1", Limits(cpus=[0], mems=[0], memory_bytes=64 * MIB))
    assert not driver.exists("p1")  # nothing half-created

    driver.create("p1", Limits(cpus=[1], mems=[0], memory_bytes=64 * MIB))
    with pytest.raises(CgroupError, match="cannot give CPUs 0-1"):
        driver.update("p1", Limits(cpus=[0, 1], mems=[0], memory_bytes=64 * MIB))
    assert driver.cpus("p1") == [1]

    # Once the holder of CPU 0 is gone, the sibling may grow onto it.
    driver.delete("p0")
    driver.update("p1", Limits(cpus=[0, 1], mems=[0], memory_bytes=64 * MIB))
    assert driver.cpus("p1") == [0, 1]
