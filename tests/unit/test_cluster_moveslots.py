"""Moves between hosts run at most ``moves_per_pair`` at once per (source, destination)
pair of hosts; the others wait their turn, first come first served, and say so in the
VM's Moved condition (fusuma.cluster.moveslots, hostmove.begin); a VM's pass runs on
the agent's threads for moves out of or into its host (Agent._pool_for)."""

from __future__ import annotations

import threading
import time
from types import SimpleNamespace
from typing import Any

import pytest
from click.testing import CliRunner

from fusuma.cluster import hostmove
from fusuma.cluster.agent import Agent
from fusuma.cluster.moveslots import DEFAULT_PER_PAIR, FORGET_S, MOVE_QUEUED, PairSlots
from fusuma.cluster.reconcile import VmReconciler
from fusuma.cluster.resources import VmView
from fusuma.state import VmState
from tests.unit.test_hostmove import world


class Clock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


def test_a_pair_runs_at_most_its_bound_and_the_others_wait_in_order() -> None:
    woken: list[int] = []
    clock = Clock()
    s = PairSlots(2, on_free=lambda: woken.append(1), clock=clock)
    assert s.take("h0", "h1", "a") is None
    assert s.take("h0", "h1", "b") is None
    c = s.take("h0", "h1", "c")
    d = s.take("h0", "h1", "d")
    assert c is not None and d is not None
    assert (c.running, c.place, d.place) == (("a", "b"), 1, 2)
    # Another pair, and the reverse direction, have slots of their own.
    assert s.take("h0", "h2", "e") is None
    assert s.take("h1", "h0", "f") is None
    # d asks again before c does: still c's turn when a slot frees.
    s.release("h0", "h1", "a")
    assert woken == [1]
    again = s.take("h0", "h1", "d")
    assert again is not None and again.place == 2
    assert s.take("h0", "h1", "c") is None
    assert s.running("h0", "h1") == ["b", "c"]
    # A waiter that stops asking (its spec changed back) leaves the queue after
    # FORGET_S; then the next one moves up.
    clock.t += FORGET_S + 1
    s.release("h0", "h1", "b")
    assert s.take("h0", "h1", "x") is None      # d did not ask for FORGET_S: gone
    assert s.take("h0", "h1", "d") is not None
    assert s.running("h0", "h1") == ["c", "x"]


def test_a_slot_is_given_back_however_the_move_ends() -> None:
    s = PairSlots(1)
    assert s.take("h0", "h1", "a") is None
    with pytest.raises(RuntimeError), s.held("h0", "h1", "a"):
        raise RuntimeError("the move failed")
    assert s.running("h0", "h1") == []
    assert s.take("h0", "h1", "b") is None
    with pytest.raises(ValueError):
        PairSlots(0)


def test_slots_taken_from_many_threads_never_exceed_the_bound() -> None:
    """12 moves of one pair ask at once, each again every millisecond until it gets a
    slot, then holds it 20 ms: 3 at most run at any time, and every one runs."""
    s = PairSlots(3)
    seen: list[int] = []
    lock = threading.Lock()

    def move(i: int) -> None:
        who = f"vm{i}"
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            if s.take("h0", "h1", who) is None:
                with s.held("h0", "h1", who):
                    with lock:
                        seen.append(len(s.running("h0", "h1")))
                    time.sleep(0.02)
                return
            time.sleep(0.001)

    threads = [threading.Thread(target=move, args=(i,)) for i in range(12)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(20)
    assert len(seen) == 12
    assert max(seen) == 3
    assert s.running("h0", "h1") == []


def running_source(monkeypatch: pytest.MonkeyPatch) -> Any:
    from fusuma.vm import view

    monkeypatch.setattr(view.process, "pid_alive", lambda pid: True)
    monkeypatch.setattr(view.process, "cmdline", lambda pid: "guest=vm0,debug-threads=on")
    return world("h0", None, VmState.RUNNING)


def test_a_move_beyond_the_bound_waits_and_says_so_then_starts(
        monkeypatch: pytest.MonkeyPatch) -> None:
    a, here = running_source(monkeypatch)
    a.move_slots = PairSlots(2)
    for other in ("default/vm7", "default/vm8"):
        assert a.move_slots.take("h0", "h1", other) is None
    hostmove.begin(a, a, VmView(a.kube.get(None, "vm0")), here.db.vms["vm0"])
    # Nothing began: no job, no request to a supervisor, no move record.
    assert here.db.jobs == [] and here.sent == []
    st = a.kube.obj["status"]
    assert "move" not in st and st["state"] == "Running"
    [cond] = [cd for cd in st["conditions"] if cd["type"] == "Moved"]
    assert (cond["status"], cond["reason"]) == ("False", MOVE_QUEUED)
    assert cond["message"] == (
        "waiting to move to host h1: 2 moves from h0 to h1 run already (at most 2 at "
        "once per pair of hosts, `fusuma cluster agent --moves-per-pair`); number 1 in "
        "the queue.")
    # The same pass again writes nothing new.
    writes = []
    monkeypatch.setattr(a.kube, "patch_status",
                        lambda *args, **kw: writes.append(args) or a.kube.obj)
    hostmove.begin(a, a, VmView(a.kube.get(None, "vm0")), here.db.vms["vm0"])
    assert writes == []
    monkeypatch.undo()
    running_source(monkeypatch)
    # A slot frees: the next pass starts the move, whose first record drops the
    # condition; the slot is given back when the move ends (here: the destination
    # never prepares, so the move goes back after its timeout).
    a.move_slots.release("h0", "h1", "default/vm7")
    monkeypatch.setattr(hostmove, "PREPARE_TIMEOUT_S", 0.05)
    seen: list[list[str]] = []

    def destination(obj: Any) -> None:
        m = (obj.get("status") or {}).get("move") or {}
        if m.get("phase") == "Preparing":
            seen.append([cd["reason"] for cd in obj["status"].get("conditions") or []])
            seen.append(a.move_slots.running("h0", "h1"))

    a.kube.on_write = destination
    hostmove.begin(a, a, VmView(a.kube.get(None, "vm0")), here.db.vms["vm0"])
    assert seen[0] == [] and seen[1] == ["default/vm8", "default/vm0"]
    assert a.move_slots.running("h0", "h1") == ["default/vm8"]
    assert a.kube.obj["status"]["lastMove"]["result"] == "failed"


def test_the_owning_host_drops_a_wait_no_longer_wanted() -> None:
    a, _ = world("h0", None, None)
    obj = a.kube.obj
    obj["status"]["conditions"] = [{"type": "Moved", "status": "False",
                                    "reason": MOVE_QUEUED, "message": "waiting"}]
    VmReconciler(a).write_status(VmView(obj), {"state": "Running"},
                                 [("Ready", True, "Running", "runs on host h0")])
    assert [cd["type"] for cd in a.kube.obj["status"]["conditions"]] == ["Ready"]


@pytest.mark.parametrize("status, move, pool", [
    ({"host": "h0"}, None, "pool"),
    ({"host": "h0"}, {"fromHost": "h0", "toHost": "h1"}, "moves_out"),
    ({"host": "h1"}, {"fromHost": "h1", "toHost": "h0"}, "moves_in"),
    ({"host": "h0", "want": "h1"}, None, "moves_out"),
    ({"host": "h1", "want": "h0"}, None, "pool"),
])
def test_a_vms_pass_runs_on_the_threads_of_its_move(status: dict[str, str],
                                                    move: dict[str, str] | None,
                                                    pool: str) -> None:
    obj = {"metadata": {"name": "vm0", "namespace": "default", "uid": "u"},
           "spec": {"host": status.get("want", status["host"])},
           "status": {"host": status["host"], **({"move": move} if move else {})}}
    agent = SimpleNamespace(host="h0", pool="pool", moves_out="moves_out",
                            moves_in="moves_in")
    assert Agent._pool_for(agent, VmView(obj)) == pool    # type: ignore[arg-type]


def test_the_agents_option_defaults_to_the_bound() -> None:
    from fusuma.cluster.command import agent

    opt = next(p for p in agent.params if p.name == "moves_per_pair")
    assert opt.default == DEFAULT_PER_PAIR
    out = CliRunner().invoke(agent, ["--help"])
    assert "--moves-per-pair" in out.output
