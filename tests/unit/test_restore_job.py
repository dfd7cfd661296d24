"""A restore into a new VM holds that VM's job (``JobKind.RESTORE``), without QEMU:
a restore whose process died is undone by recovery once it had begun making the VM,
never before (a VM of that name then is another's), and nobody else takes the name
while a live restore holds it. The kill -9 of a real restore is in
tests/integration/test_backups.py."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from fusuma import recovery
from fusuma.errors import NotFoundError, StateError
from fusuma.partition.manager import PartitionManager
from fusuma.paths import Paths
from fusuma.spec import VmSpec, build
from fusuma.state import Database, Job, JobKind, JobOwner, VmRecord, vm_obj
from fusuma.state.jobs import start_time
from fusuma.state.records import PartitionRecord
from fusuma.vm import VmManager


@pytest.fixture
def parts(tmp_path: Path) -> PartitionManager:
    paths = Paths(home=tmp_path / "home", runtime=tmp_path / "run", shm=tmp_path / "shm",
                  cache=tmp_path / "cache", cgroup_prefix="fusuma-unit")
    db = Database(paths.db)
    db.add_partition(PartitionRecord("p0", [0], 1024))
    return recovery.in_process(PartitionManager(paths, db))


def dead_restore(parts: PartitionManager, name: str, phase: str) -> None:
    """A restore of VM ``name`` whose process died in ``phase``."""
    dead = JobOwner(pid=1, start=1)          # pid 1 started long before: not it
    assert parts.db.begin_job(Job(vm_obj(name), JobKind.RESTORE, phase, dead,
                                  source="p0")) is None


def define(parts: PartitionManager, name: str) -> None:
    parts.db.add_vm(VmRecord(name=name, partition="p0", vcpus=1, memory_mib=128),
                    parts.paths.vm_uids)
    d = parts.paths.vm_dir(name)
    d.mkdir(parents=True)
    (d / ".restore.qcow2").write_bytes(b"half written")


def test_a_dead_restore_that_made_its_vm_is_undone(parts: PartitionManager) -> None:
    define(parts, "half")
    dead_restore(parts, "half", "flatten")
    parts.ensure_recovered(vm_obj("half"))          # what the next command does first
    assert parts.db.find_vm("half") is None and parts.db.find_job(vm_obj("half")) is None
    assert not parts.paths.vm_dir("half").exists()


def test_a_dead_restore_that_had_not_begun_leaves_the_name_alone(
        parts: PartitionManager) -> None:
    define(parts, "mine")
    dead_restore(parts, "mine", "begin")
    parts.ensure_recovered(vm_obj("mine"))
    assert parts.db.find_vm("mine") is not None and parts.db.find_job(vm_obj("mine")) is None


def test_no_vm_is_created_under_a_name_a_live_restore_holds(
        parts: PartitionManager) -> None:
    """Another process's live restore of ``x``: `vm create x` is refused with the busy
    sentence. This process's own restore: its create passes."""
    vms = VmManager(parts.paths, parts.db, parts)
    spec = build(VmSpec, "vm", name="x", partition="p0", memory_mib=128)
    live = subprocess.Popen(["sleep", "30"])
    try:
        other = JobOwner(live.pid, start_time(live.pid) or 0)
        assert parts.db.begin_job(Job(vm_obj("x"), JobKind.RESTORE, "flatten", other,
                                      source="p0")) is None
        with pytest.raises(StateError, match="is busy: being restored from a backup"):
            vms.create(spec)
        assert parts.db.find_vm("x") is None
        parts.db.end_job(vm_obj("x"), other)
    finally:
        live.kill()
        live.wait()
    me = JobOwner.me()
    assert parts.db.begin_job(Job(vm_obj("x"), JobKind.RESTORE, "define", me,
                                  source="p0")) is None
    vms._name_free("x")                              # the restore's own create passes
    parts.db.end_job(vm_obj("x"), me)


def test_a_move_in_from_another_host_defines_the_vm_under_its_own_job(
        parts: PartitionManager) -> None:
    """A move in from another host holds the VM's name (its job) while it defines the
    VM on this host: its own create passes (the name check refused every job but a
    restore's, and each move between hosts stalled in its prepare)."""
    vms = VmManager(parts.paths, parts.db, parts)
    me = JobOwner.me()
    assert parts.db.begin_job(Job(vm_obj("y"), JobKind.HOST_MOVE_IN, "prepare", me,
                                  source="p0")) is None
    vms._name_free("y")                     # the move's own create passes
    parts.db.end_job(vm_obj("y"), me)


def test_a_failed_restore_removes_its_vm_under_its_own_job(
        parts: PartitionManager) -> None:
    """A restore that fails (not killed) removes the VM it was making while it still
    holds the VM's job (a delete job of its own would find the VM busy)."""
    from fusuma.vm.backups import undo

    define(parts, "half")
    me = JobOwner.me()
    assert parts.db.begin_job(Job(vm_obj("half"), JobKind.RESTORE, "flatten", me,
                                  source="p0")) is None
    undo(VmManager(parts.paths, parts.db, parts), "half")
    assert parts.db.find_vm("half") is None and not parts.paths.vm_dir("half").exists()
    parts.db.end_job(vm_obj("half"), me)


def test_vm_delete_of_a_vm_a_dead_restore_was_making_removes_it(
        parts: PartitionManager) -> None:
    """What a user would type: the dead restore is undone and the delete succeeds."""
    define(parts, "half")
    dead_restore(parts, "half", "nvram")
    VmManager(parts.paths, parts.db, parts).delete("half")
    assert parts.db.find_vm("half") is None and not parts.paths.vm_dir("half").exists()
    with pytest.raises(NotFoundError):
        VmManager(parts.paths, parts.db, parts).delete("half")
