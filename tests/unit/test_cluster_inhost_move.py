"""A move between partitions made by the agent (a FusumaVM's spec.partition changed):
what it records in status.lastMove, against a fake API server and a fake migrate."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest

from fusuma.cluster.reconcile import VmReconciler, last_move
from fusuma.cluster.resources import VmView
from fusuma.migration import MigrationResult
from fusuma.state import VmState
from tests.unit.test_hostmove import UID, FakeAgent, FakeHost, FakeKube

STEPS = {"source_saved": 1.25, "dest_loaded": 0.5, "event": 0.75, "decision": 2.0,
         "taps": 0.02, "cont": 1.1}


def result(steps: dict[str, float] | None = STEPS) -> MigrationResult:
    return MigrationResult(vm="vm0", source="p0", to="p1", mode="zero-copy",
                           total_ms=12.5, downtime_ms=5.62, bytes_sent=4096,
                           prepare_ms=80.3, cpu_s=0.01, qemu_total_ms=None,
                           qemu_downtime_ms=None, steps_ms=steps)


def test_an_agent_move_records_its_steps_and_prepare(monkeypatch: pytest.MonkeyPatch) -> None:
    import fusuma.migration
    from fusuma.vm import view

    obj = {"metadata": {"name": "vm0", "namespace": "default", "uid": UID,
                        "generation": 2},
           "spec": {"host": "h0", "partition": "p1"},
           "status": {"host": "h0", "partition": "p0", "state": "Running"}}
    here = FakeHost()
    rec = SimpleNamespace(name="vm0", partition="p0", state=VmState.RUNNING, pid=100,
                          shared_ram=True)
    here.db.vms["vm0"] = rec
    a = FakeAgent("h0", FakeKube(obj), here)
    asked: list[tuple[str, str, str]] = []

    def migrate(parts: Any, vm: str, to: str, mode: str) -> MigrationResult:
        asked.append((vm, to, mode))
        here.db.vms["vm0"] = SimpleNamespace(**{**vars(rec), "partition": to})
        return result()

    monkeypatch.setattr(fusuma.migration, "migrate", migrate)
    monkeypatch.setattr(view.VmView, "state", property(lambda self: "running"))
    got = VmReconciler(a)._move_partition(here, VmView(obj), rec, "p1")  # type: ignore[arg-type]
    assert asked == [("vm0", "p1", "zero-copy")]
    assert got is not None and got.partition == "p1"
    lm = a.kube.obj["status"]["lastMove"]
    assert lm["steps"] == {"sourceSaved": 1.25, "destLoaded": 0.5, "event": 0.75,
                           "decision": 2.0, "taps": 0.02, "cont": 1.1}
    assert (lm["prepareMs"], lm["downtimeMs"], lm["totalMs"]) == (80.3, 5.62, 12.5)
    assert (lm["kind"], lm["from"], lm["to"], lm["result"]) == ("in-host", "h0/p0",
                                                               "h0/p1", "ok")
    assert [r for r, _ in a.emitted] == ["Moved"]


def test_a_move_whose_sides_gave_no_steps_records_none() -> None:
    # An older supervisor (or an in-place move) says no steps: no empty object either.
    lm = last_move("h0", result(None), "2026-11-27T00:00:00Z")
    assert "steps" not in lm and lm["prepareMs"] == 80.3
