"""Emulator threads isolated from a guaranteed VM's vCPU, read from the kernel."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.conftest import Host

pytestmark = pytest.mark.integration


def allowed(pid: int, tid: int) -> str:
    for line in Path(f"/proc/{pid}/task/{tid}/status").read_text().splitlines():
        if line.startswith("Cpus_allowed_list:"):
            return line.split()[1]
    raise AssertionError("no Cpus_allowed_list")


def threads(pid: int) -> dict[int, str]:
    out = {}
    for t in Path(f"/proc/{pid}/task").iterdir():
        try:
            out[int(t.name)] = (t / "comm").read_text().strip()
        except OSError:
            continue
    return out


@pytest.mark.timeout(300)
def test_isolated_emulator_threads(host: Host) -> None:
    host.run("partition", "create", "p", "--cpus", "0-1", "--memory", "512")
    host.run("vm", "create", "g", "-p", "p", "--qos", "guaranteed", "--emulator", "isolated",
             "--memory", "128", "--start")
    host.run("vm", "exec", "g", "--", "/bin/true")
    v = host.vm("g")
    assert v["emulator"] == "isolated"
    ts = threads(v["pid"])
    vcpus = [t for t, name in ts.items() if name.startswith("CPU ")]
    others = [t for t in ts if t not in vcpus]
    assert vcpus and others
    assert {allowed(v["pid"], t) for t in vcpus} == {"0"}     # the guaranteed vCPU: core 0
    assert {allowed(v["pid"], t) for t in others} == {"1"}    # everything else: core 1
    # A guaranteed VM whose vCPUs take every core cannot have its emulator isolated.
    err = host.fail("vm", "create", "h", "-p", "p", "--qos", "guaranteed",
                    "--emulator", "isolated", "--memory", "128").err
    assert "all hold guaranteed vCPUs (2)" in err and "a core more" in err
    assert [x["name"] for x in host.ps()["vms"]] == ["g"]
    # Shrinking the partition to one core would leave g's emulator nowhere: refused.
    err = host.fail("partition", "resize", "p", "--cpus", "0").err
    assert "all hold guaranteed vCPUs" in err
    assert host.part("p")["cpus"] == [0, 1]
