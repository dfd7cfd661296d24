"""`fusuma up`'s planning step and the VM view, on a real SQLite file, no cgroups."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from fusuma.apply import plan
from fusuma.errors import SpecError
from fusuma.host.topology import HostInfo
from fusuma.partition.manager import PartitionManager
from fusuma.paths import Paths
from fusuma.spec import parse_spec
from fusuma.state import Database, PartitionRecord, VmRecord, VmState
from fusuma.vm import VmView

HOST = HostInfo(cpus=[0, 1, 2, 3], mems=[0], memory_total_mib=16384,
                memory_reserved_mib=1638)


@pytest.fixture
def env(tmp_path: Path) -> tuple[Database, PartitionManager]:
    paths = Paths(home=tmp_path, runtime=tmp_path / "run", shm=tmp_path / "shm",
                  cache=tmp_path / "cache", cgroup_prefix="unused")
    db = Database(paths.db)
    return db, PartitionManager(paths, db, HOST)


SPEC = """
[[partition]]
name = "a"
cpus = "0-1"
memory_mib = 1024
[[partition]]
name = "b"
cpus = "2-3"
memory_mib = 2048
[[vm]]
name = "v"
partition = "a"
"""


def test_plan_on_empty_host_creates_everything(env: tuple[Database, PartitionManager]) -> None:
    db, parts = env
    p = plan(db, parts, parse_spec(SPEC, "s"), "s")
    assert [x.name for x in p.create_partitions] == ["a", "b"]
    assert [v.name for v in p.create_vms] == ["v"] and p.start_vms == ["v"]


def test_plan_matching_host_is_empty_and_resizes_are_found(
        env: tuple[Database, PartitionManager]) -> None:
    db, parts = env
    db.add_partition(PartitionRecord("a", [0, 1], 1024))
    db.add_partition(PartitionRecord("b", [2, 3], 2048))
    no_vm = SPEC.split("[[vm]]")[0]
    # Partitions whose supervisor is down (here: none was ever started) get one first.
    assert plan(db, parts, parse_spec(no_vm, "s"), "s").start_supervisors == ["a", "b"]
    parts.supervisor_pid = lambda name: 1      # type: ignore[method-assign]
    assert plan(db, parts, parse_spec(no_vm, "s"), "s").empty()
    # A defined VM that is not running (here: its pid is not a QEMU) is started.
    db.add_vm(VmRecord("v", "a", 1, 256, state=VmState.RUNNING, pid=os.getpid()))
    p = plan(db, parts, parse_spec(SPEC, "s"), "s")
    assert p.start_vms == ["v"] and not p.create_vms
    swapped = no_vm.replace("memory_mib = 1024", "memory_mib = X").replace(
        "memory_mib = 2048", "memory_mib = 1024").replace("X", "2048")
    p = plan(db, parts, parse_spec(swapped, "s"), "s")
    assert sorted(ps.name for ps, _ in p.resize_partitions) == ["a", "b"]


def test_plan_refuses_changed_vm(env: tuple[Database, PartitionManager]) -> None:
    db, parts = env
    db.add_partition(PartitionRecord("a", [0, 1], 1024))
    db.add_vm(VmRecord("v", "a", 2, 256))
    with pytest.raises(SpecError, match=r"VM 'v' exists with other settings \(vcpus 2 -> 1\)"):
        plan(db, parts, parse_spec(SPEC, "s"), "s")


def test_vm_view_tells_the_truth() -> None:
    me = os.getpid()   # alive, but not a QEMU of this VM: pid reuse must not fool ps
    assert VmView(VmRecord("v", "a", 1, 256, state=VmState.RUNNING, pid=me)).state == "crashed"
    assert VmView(VmRecord("v", "a", 1, 256, state=VmState.STARTING)).state == "starting"
    assert VmView(VmRecord("v", "a", 1, 256)).state == "stopped"
    assert VmView(VmRecord("v", "a", 1, 256, state=VmState.RUNNING,
                           pid=2**22 + 7)).as_json()["pid"] is None
