"""A host whose Lease expired may still run its VMs (a slow or restarted agent, not a
dead host): nothing another host does while it is "lost" may end the only copy.

Case from a cluster run: h0's agent restarted slowly, its Lease expired, the VM was
marked Lost; the user named h1 in spec.host; h1's create failed (the VM's files on
shared storage exist already) but left status.host = h1; h0, back, took that for "the
VM runs on h1" and ended its running copy, so the guest ran nowhere.
"""

from __future__ import annotations

from typing import Any

import pytest

from fusuma.cluster import hostmove
from fusuma.cluster.owners import Owner
from fusuma.cluster.reconcile import VmReconciler
from fusuma.errors import FusumaError
from fusuma.state import VmState
from tests.unit.test_hostmove import FakeAgent, FakeHost, FakeKube, Obj, Rec

UID = "uid-1"
CONFLICT = ("/nfs/vm-vm0 exists already (a VM named 'vm0' on another host, or one "
            "deleted while its host was down); pick another name or remove it.")


def lost_vm(state: str = "Lost", host: str = "h0") -> Obj:
    return {"metadata": {"name": "vm0", "namespace": "default", "uid": UID,
                         "generation": 3},
            "spec": {"host": "h1", "partition": "p0", "running": True},
            "status": {"host": host, "partition": "p0", "state": state,
                       "observedGeneration": 2}}


class Creating(FakeHost):
    """A host whose create of the VM fails as a taken name on shared storage does."""

    def __init__(self) -> None:
        super().__init__()
        self.created: list[Any] = []

    def create(self, spec: Any) -> Any:
        self.created.append(spec)
        raise FusumaError(CONFLICT)


def agent(host: str, obj: Obj, here: FakeHost) -> FakeAgent:
    a = FakeAgent(host, FakeKube(obj), here)
    a.owners.owned.clear()
    return a


def test_a_failed_create_gives_the_status_back_to_the_host_that_had_it() -> None:
    here = Creating()
    a = agent("h1", lost_vm(), here)
    r = VmReconciler(a)
    r.reconcile(a.kube.get(None, "vm0"))
    st = a.kube.obj["status"]
    assert len(here.created) == 1
    assert (st["host"], st["partition"], st["state"]) == ("h0", "p0", "Failed"), st
    assert st["message"] == CONFLICT
    assert "vm0" not in a.owners.owned
    # Not tried again at once, though the controller marks it Lost again meanwhile
    # (h0's Lease is still expired): one try per RETRY_FAILED_S.
    a.kube.obj["status"]["state"] = "Lost"
    r.reconcile(a.kube.get(None, "vm0"))
    r.reconcile(a.kube.get(None, "vm0"))
    assert len(here.created) == 1
    # A new spec is tried at once.
    a.kube.obj["metadata"]["generation"] = 4
    r.reconcile(a.kube.get(None, "vm0"))
    assert len(here.created) == 2


def test_the_host_back_moves_its_copy_when_the_create_elsewhere_failed(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """h0, back, holds the only copy: it moves it to the host the user named (a live
    move), rather than ending it as stale."""
    here = FakeHost()
    here.db.vms["vm0"] = Rec("vm0", "p0", VmState.RUNNING)
    a = agent("h0", {**lost_vm("Failed", "h0")}, here)
    a.owners.owned["vm0"] = Owner(UID, "default", "vm0")
    begun: list[str] = []
    monkeypatch.setattr(hostmove, "begin", lambda ag, rec, v, local: begun.append(v.name))
    VmReconciler(a).reconcile(a.kube.get(None, "vm0"))
    assert begun == ["vm0"]
    assert here.deleted == [] and "vm0" in here.db.vms
    assert a.emitted == []


@pytest.mark.parametrize("state, dropped", [("Creating", False), ("Running", True),
                                            ("Stopped", True)])
def test_a_copy_is_stale_only_once_the_other_host_holds_the_vm(
        monkeypatch: pytest.MonkeyPatch, state: str, dropped: bool) -> None:
    """While h1 is still creating it (a create that may yet fail and give it back),
    h0 keeps its copy; once h1 runs or holds it, h0's copy is stale and ends."""
    from fusuma.vm import shared

    monkeypatch.setattr(shared, "detach", lambda paths, name: None)
    here = FakeHost()
    here.db.vms["vm0"] = Rec("vm0", "p0", VmState.RUNNING)
    a = agent("h0", lost_vm(state, "h1"), here)
    a.owners.owned["vm0"] = Owner(UID, "default", "vm0")
    monkeypatch.setattr(hostmove, "begin", lambda *args: pytest.fail("no move begins"))
    VmReconciler(a).reconcile(a.kube.get(None, "vm0"))
    assert here.deleted == (["vm0"] if dropped else [])
    assert [r for r, _ in a.emitted] == (["StaleCopyRemoved"] if dropped else [])
