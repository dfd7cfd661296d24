"""Bad input to overcommit by policy: one sentence each, nothing half-made. One
namespace and one partition for the module (no guest boots): each case leaves it as it
found it."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.conftest import Host
from tests.fault.test_bad_input import assert_one_sentence

pytestmark = [pytest.mark.fault, pytest.mark.timeout(180)]


@pytest.fixture
def part(shared_logs: Host) -> Iterator[Host]:
    """Partition ``a`` at overcommit 2.0 with no VMs, before and after each case."""
    h = shared_logs
    if not h.ps()["partitions"]:
        h.run("partition", "create", "a", "--cpus", h.core(0), "--memory", "512",
              "--memory-overcommit", "2")
    yield h
    for v in h.ps()["vms"]:
        h.run("vm", "delete", v["name"], "--force")


def test_a_floor_above_the_ram(part: Host) -> None:
    err = part.fail("vm", "create", "v", "-p", "a", "--memory", "128",
                    "--memory-class", "burstable", "--memory-min", "256").err
    assert_one_sentence(err)
    assert "memory floor 256 MiB is above its RAM (128 MiB); give --memory-min 128" in err
    assert part.ps()["vms"] == []


def test_a_burstable_vm_without_a_floor(part: Host) -> None:
    err = part.fail("vm", "create", "v", "-p", "a", "--memory-class", "burstable").err
    assert_one_sentence(err)
    assert "a burstable VM needs a floor" in err and "--memory-min" in err
    assert part.ps()["vms"] == []


def test_an_overcommit_below_one(part: Host, tmp_path: Path) -> None:
    err = part.fail("partition", "create", "b", "--cpus", part.core(1), "--memory", "256",
                    "--memory-overcommit", "0.5").err
    assert_one_sentence(err)
    assert "partition 'b': memory overcommit 0.5 is below 1.0" in err
    err = part.fail("partition", "resize", "a", "--memory-overcommit", "0.9").err
    assert_one_sentence(err)
    assert "memory overcommit 0.9 is below 1.0" in err
    spec = tmp_path / "spec.toml"
    spec.write_text("[host]\nmemory_overcommit = 0.5\n")
    err = part.fail("up", str(spec)).err
    assert_one_sentence(err)
    assert f"{spec}: host.memory_overcommit: memory overcommit 0.5 is below 1.0" in err
    assert [(p["name"], p["memory_overcommit"]) for p in part.ps()["partitions"]] == \
        [("a", 2.0)]


def test_a_guaranteed_vm_that_does_not_fit(part: Host) -> None:
    # Two 16 GiB burstable VMs with 64 MiB floors fit at 2.0 (64 + 16320 / 2 each) on
    # this 24 GiB host, beyond what 1.0 admits; a guaranteed 8 GiB VM beside them does
    # not, and the sentence shows the sum that refuses it.
    for name in ("b0", "b1"):
        part.run("vm", "create", name, "-p", "a", "--memory", "16384",
                 "--memory-class", "burstable", "--memory-min", "64")
    err = part.fail("vm", "create", "g", "-p", "a", "--memory", "8192").err
    assert_one_sentence(err)
    assert "a 512 + b0 burstable RAM 8224 + b1 burstable RAM 8224 + g RAM 8192 = 25152 >" \
        in err
    assert "--memory-class burstable --memory-min" in err
    assert sorted(v["name"] for v in part.ps()["vms"]) == ["b0", "b1"]
    # Lowering the overcommit under which they were admitted is refused the same way.
    err = part.fail("partition", "resize", "a", "--memory-overcommit", "1").err
    assert_one_sentence(err)
    assert "partition 'a' at memory overcommit 1: the host would need a 512 + b0 " \
        "burstable RAM 16384 + b1 burstable RAM 16384 = 33280 >" in err
    assert part.part("a")["memory_overcommit"] == 2.0
