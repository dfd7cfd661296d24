"""A partition and its supervisor through the CLI, without systemd (FUSUMA_SYSTEMD=0):
the cgroups straight under /sys/fs/cgroup, held by the kernel's cpuset partitions."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from kit import CGROUP, Fusuma, cgroup_of, threads_allowed

PREFIX = "cg2-direct"


@pytest.fixture
def fz() -> Iterator[Fusuma]:
    f = Fusuma({"FUSUMA_SYSTEMD": "0", "FUSUMA_HOME": "/var/lib/cg2-direct",
                "FUSUMA_RUNTIME_DIR": "/run/cg2-direct", "FUSUMA_SHM_DIR": "/dev/shm/cg2-direct",
                "FUSUMA_CGROUP_PREFIX": PREFIX})
    yield f
    f.run("down", check=False)
    assert not (CGROUP / PREFIX).exists()


def test_partition_with_its_supervisor_on_a_cpuset_partition(fz: Fusuma) -> None:
    fz.run("partition", "create", "p0", "--cpus", "1", "--memory", "256")
    p0 = fz.part("p0")
    assert p0["cores_held_by"] == "cpuset partition root" and p0["state"] == "running"
    sup = p0["supervisor_pid"]
    assert cgroup_of(sup) == CGROUP / PREFIX / "p0" / "supervisor"
    assert set(threads_allowed(sup).values()) == {"1"}
    # The last core too: no partition can be a root any more, and fusuma says so.
    res = fz.run("partition", "create", "p1", "--cpus", "0", "--memory", "256")
    assert "not a cpuset partition: the partitions cover every core" in res.err
    table = fz.run("ps").out.splitlines()
    held = table[0].split().index("CORES_HELD_BY")   # the columns before it: one word
    assert [ln.split()[held] for ln in table[1:3]] == ["shared", "shared"], table
    fz.run("partition", "delete", "p1")
    assert fz.part("p0")["cores_held_by"] == "cpuset partition root"
    assert set(threads_allowed(sup).values()) == {"1"}
