"""What fusuma says when a stock host cannot give it what it needs, and that it leaves
nothing half made: a systemd that refuses the slice, and a cgroup v2 tree without the
cpuset controller (a container's cgroup namespace)."""

from __future__ import annotations

import os
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest
from kit import CGROUP, FUSUMA, Fusuma, show, systemctl

MASKED_SLICE = "fusuma-cg2-masked.slice"


@pytest.fixture
def masked() -> Iterator[Fusuma]:
    systemctl("mask", "--runtime", MASKED_SLICE)
    f = Fusuma({"FUSUMA_HOME": "/var/lib/cg2-masked", "FUSUMA_CGROUP_PREFIX": "cg2-masked",
                "FUSUMA_RUNTIME_DIR": "/run/cg2-masked"})
    yield f
    systemctl("unmask", "--runtime", MASKED_SLICE)
    f.run("down", check=False)


def test_a_systemd_that_refuses_the_slice(masked: Fusuma) -> None:
    unit = "fusuma-supervisor@cg2-masked:p0.service"
    res = masked.fail("partition", "create", "p0", "--cpus", "1", "--memory", "256")
    err = res.err.strip().splitlines()
    assert err[-1].startswith("fusuma: error: the supervisor of partition 'p0' did not "
                              "start: "), res.err
    assert f"systemd refused to start {unit} in {MASKED_SLICE}" in err[-1], res.err
    assert "masked" in err[-1]
    # Nothing half made: no partition, no unit, no drop-in, no cgroup.
    assert masked.ps()["partitions"] == []
    assert show(unit, "ActiveState") == "inactive"
    for d in ("/run/systemd/system", "/run/systemd/system.control"):
        assert not list(Path(d).glob("fusuma-supervisor@cg2-masked*")), d
    assert not list(CGROUP.glob("**/fusuma-supervisor@cg2-masked*"))


NOCPUSET = CGROUP / "cg2-nocpuset"


@pytest.fixture
def nocpuset() -> Iterator[Path]:
    inner = NOCPUSET / "inner"
    inner.mkdir(parents=True)
    yield inner
    for d in (inner, NOCPUSET):
        d.rmdir()


def test_a_cgroup_tree_without_the_cpuset_controller(nocpuset: Path) -> None:
    # Like a container: fusuma's /sys/fs/cgroup is a cgroup whose parent hands it no
    # controller (its own cgroup namespace and cgroup2 mount).
    assert (nocpuset / "cgroup.controllers").read_text().strip() == ""
    env = {"FUSUMA_HOME": "/var/lib/cg2-nocpuset", "FUSUMA_RUNTIME_DIR": "/run/cg2-nocpuset",
           "FUSUMA_CGROUP_PREFIX": "cg2-nocpuset"}
    cli = " ".join([*FUSUMA, "partition", "create", "p0", "--cpus", "1", "--memory", "256"])
    script = (f"echo $$ > {nocpuset}/cgroup.procs && exec unshare --cgroup --mount sh -c "
              f"'umount -l /sys/fs/cgroup && mount -t cgroup2 cgroup2 /sys/fs/cgroup && "
              f"exec {cli}'")
    p = subprocess.run(["/bin/sh", "-c", script], capture_output=True, text=True,
                       env={**os.environ, **env}, timeout=300)
    assert p.returncode != 0, p.stdout
    err = p.stderr.strip().splitlines()[-1]
    assert err.startswith("fusuma: error: the cgroup v2 hierarchy at /sys/fs/cgroup does "
                          "not offer the cpuset controller (it offers: none)"), p.stderr
    assert Fusuma(env).ps()["partitions"] == []
    assert [p.name for p in nocpuset.iterdir() if p.is_dir()] == []
