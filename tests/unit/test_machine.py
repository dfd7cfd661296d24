"""The VM state machine and jobs, on a real SQLite file shared by two connections."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from fusuma.errors import StateError
from fusuma.state import (
    Database,
    Job,
    JobOwner,
    PartitionRecord,
    VmRecord,
    VmState,
    busy_sentence,
    vm_obj,
)
from fusuma.state.machine import TRANSITIONS, valid_transition

S = VmState


def setup(tmp_path: Path) -> tuple[Database, Database]:
    db = Database(tmp_path / "state.db")
    db.add_partition(PartitionRecord("p0", [0], 1024))
    db.add_vm(VmRecord("vm0", "p0", vcpus=1, memory_mib=256))
    return db, Database(tmp_path / "state.db")


def test_every_state_has_a_row_and_no_state_is_a_dead_end() -> None:
    assert set(TRANSITIONS) == set(VmState)
    for state, targets in TRANSITIONS.items():
        assert targets, state
    assert not valid_transition(S.STOPPED, S.RUNNING)
    assert not valid_transition(S.MIGRATING, S.STOPPED)   # a move never just stops
    assert valid_transition(S.RUNNING, S.RUNNING)


def test_illegal_transition_is_refused_and_nothing_changes(tmp_path: Path) -> None:
    db, _ = setup(tmp_path)
    with pytest.raises(StateError, match="is stopped; it cannot become running"):
        db.transition("vm0", S.RUNNING, pid=7)
    assert (db.vm("vm0").state, db.vm("vm0").pid) == (S.STOPPED, None)


def test_conditional_update_one_of_two_racers_wins(tmp_path: Path) -> None:
    a, b = setup(tmp_path)
    a.transition("vm0", S.STARTING)
    a.transition("vm0", S.RUNNING, pid=1)
    a.transition("vm0", S.MIGRATING, expect={S.RUNNING})
    with pytest.raises(StateError, match="is migrating, not running"):
        b.transition("vm0", S.STOPPING, expect={S.RUNNING})
    assert b.vm("vm0").state == S.MIGRATING


def test_concurrent_processes_exactly_one_wins(tmp_path: Path) -> None:
    db, _ = setup(tmp_path)
    db.transition("vm0", S.STARTING)
    db.transition("vm0", S.RUNNING, pid=1)
    code = ("import sys; from fusuma.state import Database, VmState as S\n"
            f"db = Database(__import__('pathlib').Path({str(tmp_path / 'state.db')!r}))\n"
            "try:\n"
            "    db.transition('vm0', S.MIGRATING, expect={S.RUNNING}); print('won')\n"
            "except Exception as e: print('lost')\n")
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2] / "src")}
    procs = [subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE,
                              text=True, env=env) for _ in range(8)]
    outs = [p.communicate(timeout=60)[0].strip() for p in procs]
    assert sorted(outs) == ["lost"] * 7 + ["won"], outs


def test_set_vm_never_writes_the_state(tmp_path: Path) -> None:
    db, _ = setup(tmp_path)
    with pytest.raises(ValueError, match="not a changeable VM field"):
        db.set_vm("vm0", state="running")
    db.set_vm("vm0", disks=["d0"], qos="guaranteed")
    assert db.vm("vm0").disks == ["d0"] and db.vm("vm0").qos == "guaranteed"
    with pytest.raises(StateError):
        db.set_vm("vm0", expect=S.RUNNING, qos="burstable")
    assert db.vm("vm0").qos == "guaranteed"


def test_job_is_the_lock_and_says_who_holds_it(tmp_path: Path) -> None:
    a, b = setup(tmp_path)
    me = JobOwner.me()
    assert me.alive()
    assert a.begin_job(Job(vm_obj("vm0"), "migrate", "begin", me, "p0", "p1")) is None
    a.set_phase(vm_obj("vm0"), me, "streamed", dest_pid=5)
    held = b.begin_job(Job(vm_obj("vm0"), "stop", "begin", me))
    assert held is not None and held.phase == "streamed" and held.detail["dest_pid"] == 5
    text = busy_sentence(held)
    assert text.startswith("VM 'vm0' is busy: moving to p1 (phase: streamed) since ")
    assert f"by pid {os.getpid()}" in text
    with pytest.raises(StateError, match="busy"):
        b.remove_vm("vm0")
    a.end_job(vm_obj("vm0"), me)
    assert b.find_job(vm_obj("vm0")) is None


def test_dead_owner_is_noticed_and_only_one_takes_over(tmp_path: Path) -> None:
    a, b = setup(tmp_path)
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    dead = JobOwner(child.pid, 1)     # a start time that is not the process's
    child.wait()
    assert not dead.alive()
    a.begin_job(Job(vm_obj("vm0"), "migrate", "streaming", dead, "p0", "p1"))
    me = JobOwner.me()
    other = JobOwner(me.pid, me.start + 1)
    assert a.take_over(vm_obj("vm0"), dead, me) is not None
    assert b.take_over(vm_obj("vm0"), dead, other) is None
    with pytest.raises(StateError, match="taken over"):
        b.set_phase(vm_obj("vm0"), dead, "streamed")


def test_outcome_of_a_move_is_decided_once(tmp_path: Path) -> None:
    a, b = setup(tmp_path)
    a.begin_job(Job(vm_obj("vm0"), "migrate", "streamed", JobOwner.me(), "p0", "p1"))
    assert a.decide(vm_obj("vm0"), "forward") == "forward"
    assert b.decide(vm_obj("vm0"), "back") == "forward"
    assert b.find_job(vm_obj("vm0")).detail["decision"] == "forward"  # type: ignore[union-attr]
    assert time.time() >= b.find_job(vm_obj("vm0")).started_at  # type: ignore[union-attr]
