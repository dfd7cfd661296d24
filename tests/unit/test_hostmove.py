"""fusuma.cluster.hostmove's steps against a fake API server and a fake host: the
source's whole half, and what a restarted agent does with a move it finds recorded."""

from __future__ import annotations

import copy
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import pytest

from fusuma.cluster import hostmove
from fusuma.cluster.context import AgentConfig
from fusuma.cluster.kube import ADDRESS, HOST
from fusuma.cluster.moveslots import PairSlots
from fusuma.cluster.owners import Owner
from fusuma.cluster.resources import VmView
from fusuma.paths import Paths
from fusuma.state import Decision, JobKind, MovePhase, VmState
from fusuma.supervisor import rpc

Obj = dict[str, Any]
UID = "uid-1"
HOSTS = {"h0": "10.0.0.1", "h1": "10.0.0.2"}


def merge(into: Obj, patch: Obj) -> None:
    """A JSON merge patch, as the API server applies it."""
    for k, val in patch.items():
        if val is None:
            into.pop(k, None)
        elif isinstance(val, dict) and isinstance(into.get(k), dict):
            merge(into[k], val)
        else:
            into[k] = copy.deepcopy(val)


class FakeKube:
    """One FusumaVM; ``on_write`` plays the other agent after each write."""

    def __init__(self, obj: Obj) -> None:
        self.obj = obj
        self.on_write: Any = lambda obj: None
        self.address_lists: list[str] = []

    def get(self, kind: Any, name: str, ns: str | None = None) -> Obj:
        return copy.deepcopy(self.obj)

    def find(self, kind: Any, name: str, ns: str | None = None) -> Obj | None:
        """The FusumaHosts: each registered at its address."""
        assert kind is HOST
        addr = HOSTS.get(name)
        return {"metadata": {"name": name}, "status": {"address": addr}} if addr else None

    def patch_status(self, kind: Any, name: str, status: Obj, ns: str | None = None) -> Obj:
        merge(self.obj.setdefault("status", {}), status)
        self.on_write(self.obj)
        return copy.deepcopy(self.obj)

    def replace(self, kind: Any, obj: Obj, sub: str | None = None) -> Obj:
        self.obj = copy.deepcopy(obj)
        self.on_write(self.obj)
        return copy.deepcopy(self.obj)

    def list(self, kind: Any, namespace: str | None = None,
             label_selector: str | None = None) -> tuple[list[Obj], str]:
        """The FusumaAddresses the source hands on after the move: none here
        (tests/unit/test_cluster_addresses.py checks the handing on)."""
        assert kind is ADDRESS
        self.address_lists.append(str(label_selector))
        return [], "1"


@dataclass
class FakeJob:
    db: FakeDb
    kind: str
    phases: list[tuple[str, dict[str, Any]]] = field(default_factory=list)

    def phase(self, phase: str, **detail: Any) -> None:
        self.phases.append((phase, detail))

    def __enter__(self) -> FakeJob:
        self.db.held = self
        return self

    def __exit__(self, *exc: object) -> None:
        self.db.held = None


@dataclass
class FakeDb:
    vms: dict[str, Any] = field(default_factory=dict)
    decisions: list[str] = field(default_factory=list)
    jobs: list[FakeJob] = field(default_factory=list)
    held: FakeJob | None = None
    shared: list[str] = field(default_factory=list)

    def find_job(self, obj: str) -> None:
        return None

    def find_partition(self, name: str) -> Any:
        return name

    def shared_storage_dirs(self) -> list[str]:
        return list(self.shared)

    def find_vm(self, name: str) -> Any:
        return self.vms.get(name)

    def snapshots(self, vm: str, every: bool = False) -> list[Any]:
        return []

    def nics(self, vm: str) -> list[Any]:
        return []

    def vm(self, name: str) -> Any:
        return self.vms[name]

    def decide(self, obj: str, decision: str) -> str:
        assert self.held is not None, "a decision is mirrored only under the host's job"
        self.decisions.append(decision)
        return decision

    def transition(self, name: str, state: VmState, expect: Any = None, **kw: Any) -> None:
        self.vms[name] = replace(self.vms[name], state=state, **kw)


@dataclass(frozen=True)
class Rec:
    name: str
    partition: str
    state: VmState
    pid: int | None = 100
    error: str | None = None
    boot: str = "kernel"
    image: str = "minimal"
    template: str | None = None


class FakeHost:
    """A host's Ctx: its DB, its supervisors (answers by request type), its VMs."""

    def __init__(self) -> None:
        self.db = FakeDb()
        # No VM's files are anywhere here (fusuma.images.store.placed_in finds none).
        self.paths = Paths(home=Path("/nonexistent/fusuma-unit"), runtime=Path("/nonexistent"),
                           shm=Path("/nonexistent"), cache=Path("/nonexistent"),
                           cgroup_prefix="fusuma-unit")
        self.sent: list[Any] = []
        self.deleted: list[str] = []
        self.parts = self
        self.vms = self
        self.answers: dict[type, Any] = {
            rpc.ResumeSource: rpc.Resumed(pid=100, resume_ts=1.0),
            rpc.MigrateOut: rpc.Streamed(t0=10.0, stop_ts=10.5, qemu_total_ms=600.0,
                                         qemu_downtime_ms=40.0, bytes_sent=2**25,
                                         source_pid=100, paused=False)}

    def job(self, obj: str, kind: str, **kw: Any) -> FakeJob:
        j = FakeJob(self.db, kind)
        self.db.jobs.append(j)
        return j

    def client(self, part: str) -> FakeHost:
        return self

    def supervisor_pid(self, part: str) -> int:
        return 1        # each partition's supervisor runs

    def send(self, req: Any, timeout: float | None = None) -> Any:
        self.sent.append(req)
        return self.answers.get(type(req))

    def delete(self, name: str, force: bool = False) -> None:
        assert self.db.held is None, "a delete takes a job of its own"
        self.deleted.append(name)
        self.db.vms.pop(name, None)


class FakeOwners:
    def __init__(self) -> None:
        self.owned: dict[str, Owner] = {"vm0": Owner(UID, "default", "vm0")}

    def get(self, kind: str, name: str) -> Owner | None:
        return self.owned.get(name)

    def set(self, kind: str, name: str, owner: Owner) -> None:
        self.owned[name] = owner

    def remove(self, kind: str, name: str) -> None:
        self.owned.pop(name, None)


class FakeAgent:
    def __init__(self, host: str, kube: FakeKube, here: FakeHost) -> None:
        self.host = host
        self.address = "10.0.0.1"
        self.kube = kube
        self.here = here
        self.events = self       # its own event recorder
        self.emitted: list[tuple[str, str]] = []
        self.owners = FakeOwners()
        self.vm_rec = self
        self.move_failed: dict[str, tuple[int, float]] = {}
        self.vms_informer = self
        self.hosts_informer = self
        self.cfg = AgentConfig(host=host)
        self.move_slots = PairSlots(self.cfg.moves_per_pair)
        self.creds_fetched = 0

    def move_creds(self) -> None:
        self.creds_fetched += 1

    def ctx(self) -> FakeHost:
        return self.here

    def emit(self, obj: Obj, reason: str, message: str, type_: str | None = None) -> None:
        self.emitted.append((reason, message))

    def get(self, ns: str, name: str) -> Obj | None:
        return self.kube.get(None, name) if name == "vm0" else {"kind": "FusumaHost"}

    def put(self, obj: Obj) -> None:
        pass

    def host_lost(self, host: str) -> bool:
        return False

    def fail(self, *a: Any, **kw: Any) -> None:
        raise AssertionError(f"refused: {a}")

    def add_finalizer(self, kind: Any, obj: Obj) -> None:
        pass


def world(host: str, move: Obj | None, state: VmState | None) -> tuple[FakeAgent, FakeHost]:
    obj: Obj = {"metadata": {"name": "vm0", "namespace": "default", "uid": UID,
                             "generation": 2},
                "spec": {"host": "h1", "partition": "p0"},
                "status": {"host": "h0", "state": "Running",
                           **({"move": move} if move else {})}}
    here = FakeHost()
    if state is not None:
        here.db.vms["vm0"] = Rec("vm0", "p0", state)
    return FakeAgent(host, FakeKube(obj), here), here


def recorded(a: FakeAgent, what: str = "move") -> Obj:
    return dict(a.kube.obj["status"].get(what) or {})


@pytest.mark.parametrize("state, template, says", [
    (VmState.STOPPED, None, "VM 'vm0' boots by firmware from a thin disk of this host: "
     "start it, then move it to host 'h1' (its disk is mirrored there as it runs)."),
    (VmState.RUNNING, "t0", "VM 'vm0' is a clone of template 't0', whose disk layer is a "
     "file of this host that host 'h1' does not have: it moves between partitions of "
     "this host only.")])
def test_a_stopped_vm_booted_by_firmware_or_a_clone_is_not_moved_between_hosts(
        monkeypatch: pytest.MonkeyPatch, state: VmState, template: str | None,
        says: str) -> None:
    """A stopped one would be defined anew there, on an empty disk; a clone's disk is
    a layer on its template's, a file of this host: one sentence, nothing started,
    nothing deleted."""
    from fusuma.vm import view

    monkeypatch.setattr(view.process, "pid_alive", lambda pid: True)
    monkeypatch.setattr(view.process, "cmdline", lambda pid: "guest=vm0,debug-threads=on")
    a, here = world("h0", None, state)
    here.db.vms["vm0"] = replace(here.db.vms["vm0"], boot="uefi", image="deb",
                                 template=template)
    failed: list[tuple[Any, ...]] = []
    monkeypatch.setattr(a, "fail", lambda *args, **kw: failed.append(args), raising=False)
    hostmove.begin(a, a, VmView(a.kube.get(None, "vm0")), here.db.vms["vm0"])
    [(_, reason, message)] = failed
    assert reason == "MoveFailed"
    assert message == says
    assert here.db.jobs == [] and here.sent == [] and here.deleted == []
    assert "vm0" in here.db.vms


def test_the_source_half_runs_its_steps_and_records_each_phase(
        monkeypatch: pytest.MonkeyPatch) -> None:
    from fusuma.vm import view

    # The local view asks the process whether the guest runs: say it does.
    monkeypatch.setattr(view.process, "pid_alive", lambda pid: True)
    monkeypatch.setattr(view.process, "cmdline", lambda pid: "guest=vm0,debug-threads=on")
    a, here = world("h0", None, VmState.RUNNING)
    phases: list[str] = []

    def destination(obj: Obj) -> None:
        """The other agent: prepared once asked, forward and switched once streamed."""
        m = obj["status"].get("move") or {}
        phases.append(m.get("phase"))
        if m.get("phase") == "Preparing":
            m.update(phase="Prepared", uri="tcp:10.0.0.2:4444", tls=True, channels=2)
        elif m.get("phase") == "Streamed":
            m.update(phase="Switched", decision="forward", decidedBy="h1", resumeTs=10.6)

    a.kube.on_write = destination
    hostmove.begin(a, a, VmView(a.kube.get(None, "vm0")), here.db.vms["vm0"])
    [job] = here.db.jobs
    assert job.kind == JobKind.HOST_MOVE
    assert [p for p, _ in job.phases] == [MovePhase.PREPARE, MovePhase.STREAMING,
                                          MovePhase.STREAMED]
    assert all(isinstance(p, MovePhase) for p, _ in job.phases)
    assert phases[:3] == ["Preparing", "Streaming", "Streamed"]
    assert here.db.decisions == [Decision.FORWARD]
    assert [type(r) for r in here.sent] == [rpc.MigrateOut, rpc.Release]
    assert here.sent[0].uri == "tcp:10.0.0.2:4444"
    assert (here.sent[0].tls_peer, here.sent[0].plain_tcp, here.sent[0].channels) == \
        ("h1", False, 2)
    assert a.creds_fetched == 1
    assert here.deleted == ["vm0"] and "vm0" not in a.owners.owned
    last = recorded(a, "lastMove")
    assert not recorded(a)
    assert (last["result"], last["phase"], last["decision"], last["from"], last["to"]) == \
        ("ok", "Done", "forward", "h0/p0", "h1/p0")
    assert last["downtimeMs"] == 100.0 and last["totalMs"] == 600.0
    assert [r for r, _ in a.emitted] == ["MoveStarted", "Moved"]
    # Then the addresses this host holds for the VM go to the destination.
    assert a.kube.address_lists == [
        f"fusuma.io/vm-uid={a.kube.obj['metadata']['uid']},fusuma.io/host=h0"]


MID_MOVE = {"id": "m1", "kind": "between-hosts", "mode": "copy", "fromHost": "h0",
            "toHost": "h1", "from": "h0/p0", "to": "h1/p0", "phase": "Streaming",
            "startedAt": "2024-01-01T00:00:00Z"}


def test_a_restarted_source_decides_back_and_resumes_its_guest() -> None:
    a, here = world("h0", dict(MID_MOVE), VmState.MIGRATING)
    hostmove.step(a, a, VmView(a.kube.get(None, "vm0")))
    [job] = here.db.jobs
    assert job.kind == JobKind.HOST_MOVE
    assert here.db.decisions == [Decision.BACK]
    assert [type(r) for r in here.sent] == [rpc.ResumeSource]
    assert here.db.vms["vm0"].state == VmState.RUNNING and not here.deleted
    last = recorded(a, "lastMove")
    assert (last["result"], last["phase"], last["decision"]) == ("failed", "Failed", "back")
    assert "the agent restarted mid-move" in last["message"]
    assert a.kube.obj["status"]["state"] == "Running" and not recorded(a)
    assert [r for r, _ in a.emitted] == ["MoveFailed"]
    assert "default/vm0>h1" in a.move_failed     # that destination waits a minute


def test_a_restarted_source_follows_forward_and_forgets_the_guest() -> None:
    a, here = world("h0", {**MID_MOVE, "phase": "Switched", "decision": "forward",
                           "resumeTs": 5.0}, VmState.MIGRATING)
    hostmove.step(a, a, VmView(a.kube.get(None, "vm0")))
    assert here.db.decisions == [Decision.FORWARD]
    assert [type(r) for r in here.sent] == [rpc.Release]
    assert here.deleted == ["vm0"]
    last = recorded(a, "lastMove")
    assert (last["result"], last["phase"], last["decision"]) == ("ok", "Done", "forward")
    assert not recorded(a)


def test_a_source_keeps_the_record_of_a_forward_move_until_the_guest_runs_there(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """"forward" is recorded, the source's QEMU ends, and the destination's agent dies
    before it runs the guest (its incoming QEMU holds it, paused): once its Lease
    expires the source no longer waits, but the record stays, so that the agent,
    restarted, still finds the decision and runs the guest; the source's next pass then
    finishes the move. (Clearing it left the guest paused there, and the FusumaVM on a
    host that no longer had it.)"""
    a, here = world("h0", {**MID_MOVE, "phase": "Streamed", "decision": "forward",
                           "decidedBy": "h1"}, VmState.MIGRATING)
    monkeypatch.setattr(a, "host_lost", lambda host: host == "h1")
    hostmove.step(a, a, VmView(a.kube.get(None, "vm0")))
    assert [type(r) for r in here.sent] == [rpc.Release] and here.deleted == ["vm0"]
    assert recorded(a)["decision"] == "forward" and not recorded(a, "lastMove")
    assert a.kube.obj["status"]["host"] == "h0" and a.emitted == []
    # The destination's agent is back: it ran the guest and says so.
    monkeypatch.setattr(a, "host_lost", lambda host: False)
    merge(a.kube.obj["status"], {"move": {"phase": "Switched", "resumeTs": 5.0},
                                 "host": "h1", "state": "Running"})
    hostmove.step(a, a, VmView(a.kube.get(None, "vm0")))
    last = recorded(a, "lastMove")
    assert (last["result"], last["phase"], last["decision"]) == ("ok", "Done", "forward")
    assert not recorded(a) and a.kube.obj["status"]["host"] == "h1"
    assert [type(r) for r in here.sent] == [rpc.Release]


def test_a_destination_finding_the_move_called_off_undoes_its_prepare() -> None:
    a, here = world("h1", {**MID_MOVE, "decision": "back"}, VmState.STARTING)
    hostmove.step(a, a, VmView(a.kube.get(None, "vm0")))
    [job] = here.db.jobs
    assert job.kind == JobKind.HOST_MOVE_IN
    assert here.db.decisions == [Decision.BACK]
    assert [type(r) for r in here.sent] == [rpc.IncomingAbort]
    assert here.deleted == ["vm0"] and "vm0" not in a.owners.owned


def test_a_destination_interrupted_while_preparing_calls_the_move_off_at_once() -> None:
    """The destination's agent started its incoming QEMU and died (or lost the API
    server) before the record said Prepared: the source never learns where to stream.
    Taken up again, the destination calls the move off and undoes its prepare, rather
    than wait for a stream that never comes while the source waits PREPARE_TIMEOUT_S
    (the kill matrix between hosts, Preparing x destination agent, took 60 s)."""
    a, here = world("h1", {**MID_MOVE, "phase": "Preparing"}, VmState.STARTING)
    # Were it waited for, the stream fails at once here (the test never hangs).
    here.answers[rpc.RemoteIncomingWait] = rpc.StreamState(status="failed")
    hostmove.step(a, a, VmView(a.kube.get(None, "vm0")))
    assert [type(r) for r in here.sent] == [rpc.IncomingAbort]
    assert here.db.decisions == [Decision.BACK]
    assert here.deleted == ["vm0"] and "vm0" not in a.owners.owned
    move = recorded(a)
    assert (move["decision"], move["decidedBy"], move["phase"]) == ("back", "h1", "Failed")
    assert move["message"] == "host h1's agent was interrupted while preparing the move"


def test_a_destination_whose_qemu_died_after_forward_says_the_guest_is_lost_there(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """"forward" is recorded and the incoming QEMU, the only copy of the guest, is
    killed before it runs it: the destination's next pass finds no QEMU to commit. It
    says the guest is lost on this host (crashed here, Failed in the FusumaVM, which
    names this host), so that the source finishes the move and the VM is started
    again here; before, each pass raised, and the FusumaVM named the source for ever."""
    from fusuma.errors import NotFoundError

    a, here = world("h1", {**MID_MOVE, "phase": "Streamed", "decision": "forward",
                           "decidedBy": "h1"}, VmState.STARTING)
    answer = here.send

    def send(req: Any, timeout: float | None = None) -> Any:
        if isinstance(req, rpc.RemoteIncomingWait):
            here.sent.append(req)
            raise NotFoundError("no incoming QEMU of 'vm0' in partition 'p0'.")
        return answer(req, timeout)

    monkeypatch.setattr(here, "send", send)
    hostmove.step(a, a, VmView(a.kube.get(None, "vm0")))
    assert here.db.vms["vm0"].state == VmState.CRASHED and not here.deleted
    st = a.kube.obj["status"]
    assert (st["host"], st["state"], st.get("pid")) == ("h1", "Failed", None), st
    why = ("the guest was lost: its QEMU on host h1 exited after the move was decided "
           "forward, before it ran the guest.")
    assert st["message"] == why
    move = recorded(a)
    assert (move["phase"], move["decision"], move["message"]) == ("Switched", "forward", why)
    assert [r for r, _ in a.emitted] == ["GuestLost"]


def test_a_destination_whose_guest_crashed_after_the_switch_leaves_the_move_alone() -> None:
    """The guest ran here (the record says Switched) and its QEMU crashed before the
    source finished the move: a crash like any other (the VM is started again as a
    crashed one is), not a guest lost "before it ran" (which the record said)."""
    a, here = world("h1", {**MID_MOVE, "phase": "Switched", "decision": "forward",
                           "decidedBy": "h1"}, VmState.CRASHED)
    hostmove.step(a, a, VmView(a.kube.get(None, "vm0")))
    assert here.sent == [] and here.db.jobs == [] and a.emitted == []
    assert recorded(a)["phase"] == "Switched" and "message" not in recorded(a)


def test_a_source_that_cannot_write_the_first_record_keeps_its_guest_running(
        monkeypatch: pytest.MonkeyPatch) -> None:
    from fusuma.vm import view

    monkeypatch.setattr(view.process, "pid_alive", lambda pid: True)
    monkeypatch.setattr(view.process, "cmdline", lambda pid: "guest=vm0,debug-threads=on")
    a, here = world("h0", None, VmState.RUNNING)

    def refuse(kind: Any, name: str, status: Obj, ns: str | None = None) -> Obj:
        raise RuntimeError("the API server is gone")

    a.kube.patch_status = refuse  # type: ignore[method-assign]
    with pytest.raises(RuntimeError):
        hostmove.begin(a, a, VmView(a.kube.get(None, "vm0")), here.db.vms["vm0"])
    assert here.db.vms["vm0"].state == VmState.RUNNING
    assert not recorded(a) and here.sent == []


def _refused_move(monkeypatch: pytest.MonkeyPatch, prepared: Obj) -> tuple[FakeAgent, FakeHost]:
    """The source's half when the destination's record says ``prepared``."""
    from fusuma.vm import view

    monkeypatch.setattr(view.process, "pid_alive", lambda pid: True)
    monkeypatch.setattr(view.process, "cmdline", lambda pid: "guest=vm0,debug-threads=on")
    a, here = world("h0", None, VmState.RUNNING)

    def destination(obj: Obj) -> None:
        m = obj["status"].get("move") or {}
        if m.get("phase") == "Preparing":
            m.update(phase="Prepared", **prepared)

    a.kube.on_write = destination
    hostmove.begin(a, a, VmView(a.kube.get(None, "vm0")), here.db.vms["vm0"])
    return a, here


def test_the_source_streams_only_to_the_destination_hosts_registered_address(
        monkeypatch: pytest.MonkeyPatch) -> None:
    # Someone who may write the FusumaVM's status publishes another address: nothing is
    # sent there, the move goes back, the guest runs on here.
    a, here = _refused_move(monkeypatch, {"uri": "tcp:10.0.0.66:4444", "tls": True})
    assert [type(r) for r in here.sent] == [rpc.ResumeSource]
    assert here.db.decisions == [Decision.BACK]
    assert here.db.vms["vm0"].state == VmState.RUNNING
    last = recorded(a, "lastMove")
    assert last["result"] == "failed"
    assert ("published tcp:10.0.0.66:4444, but host h1 is registered at 10.0.0.2: the "
            "guest's memory goes to the registered address only, so the move is refused"
            ) in last["message"]


def test_the_source_refuses_a_destination_that_offers_the_stream_in_the_clear(
        monkeypatch: pytest.MonkeyPatch) -> None:
    a, here = _refused_move(monkeypatch, {"uri": "tcp:10.0.0.2:4444", "tls": False})
    assert [type(r) for r in here.sent] == [rpc.ResumeSource]
    assert "offers the stream in the clear" in recorded(a, "lastMove")["message"]


@pytest.mark.parametrize(("published", "want"), [
    ("tcp:10.0.0.2:4444", "tcp:10.0.0.2:4444"),
    ("tcp:[10.0.0.2]:1", "tcp:10.0.0.2:1"),
])
def test_stream_uri_takes_the_port_and_the_registered_address(published: str,
                                                              want: str) -> None:
    a, _ = world("h0", None, None)
    assert hostmove.stream_uri(a, "h1", published) == want


@pytest.mark.parametrize("published", ["unix:/x:1", "tcp:10.0.0.2:", "tcp:10.0.0.2:99999",
                                       "tcp:10.0.0.1:4444", ""])
def test_stream_uri_refuses_anything_else(published: str) -> None:
    a, _ = world("h0", None, None)
    with pytest.raises(hostmove.MigrationError):
        hostmove.stream_uri(a, "h1", published)
    with pytest.raises(hostmove.MigrationError, match="registered no address"):
        hostmove.stream_uri(a, "h9", "tcp:10.0.0.9:1")


@pytest.mark.parametrize("channels", [0, 9, "2", True])
def test_the_source_refuses_a_channel_count_out_of_bounds(
        monkeypatch: pytest.MonkeyPatch, channels: object) -> None:
    a, here = _refused_move(monkeypatch, {"uri": "tcp:10.0.0.2:4444", "tls": True,
                                          "channels": channels})
    assert [type(r) for r in here.sent] == [rpc.ResumeSource]
    assert "channels, not 1 to 8" in recorded(a, "lastMove")["message"]


def test_a_destination_refuses_a_record_with_devices_fusuma_does_not_make() -> None:
    # The source's record names a device kind fusuma never makes (a 9p share of the
    # destination's /): refused before anything is defined or started there.
    import json

    ds = {"version": 1, "machine": "pc-q35-7.2",
          "machine_props": [["sata", "off"], ["smbus", "off"], ["vmport", "off"],
                            ["i8042", "off"]], "cpu": "max", "smp": 1, "memory": "128M",
          "serial": "con0", "devices": [
              {"driver": "virtio-9p-pci", "props": [["fsdev", "root"], ["mount_tag", "r"]]}]}
    move = {**MID_MOVE, "phase": "Preparing",
            "record": {"machine": "pc-q35-7.2", "devices": json.dumps(ds)}}
    a, here = world("h1", move, None)
    a.owners.owned.clear()
    created: list[Any] = []
    here.create = created.append  # type: ignore[attr-defined]
    hostmove.step(a, a, VmView(a.kube.get(None, "vm0")))
    assert created == [] and "vm0" not in here.db.vms and "vm0" not in a.owners.owned
    assert not any(isinstance(r, rpc.RemoteIncoming) for r in here.sent)
    m = recorded(a)
    assert (m["decision"], m["decidedBy"], m["phase"]) == ("back", "h1", "Failed")
    assert "the recorded device set is refused: device 0 is 'virtio-9p-pci', not a " \
        "device kind fusuma makes" in m["message"]
    assert m["message"].endswith("nothing was started on host h1")


def test_a_destination_prepares_from_the_record_as_it_is_now_not_an_older_view() -> None:
    """A pass may begin with an older version of the FusumaVM (a watch's events queued
    while the agent was busy or stopped): the record was rewritten since. The
    destination reads it afresh and judges what the API server holds now."""
    import json

    ds = {"version": 1, "machine": "pc-q35-7.2",
          "machine_props": [["sata", "off"], ["smbus", "off"], ["vmport", "off"],
                            ["i8042", "off"]], "cpu": "max", "smp": 1, "memory": "128M",
          "serial": "con0", "devices": [
              {"driver": "virtio-9p-pci", "props": [["fsdev", "root"]]}]}
    move = {**MID_MOVE, "phase": "Preparing", "record": {"machine": "pc-q35-7.2"}}
    a, _ = world("h1", move, None)
    a.owners.owned.clear()
    older = VmView(a.kube.get(None, "vm0"))        # the view the pass began with
    a.kube.obj["status"]["move"]["record"] = {"machine": "pc-q35-7.2",
                                              "devices": json.dumps(ds)}
    hostmove.step(a, a, older)
    m = recorded(a)
    assert (m["decision"], m["phase"]) == ("back", "Failed"), m
    assert "'virtio-9p-pci', not a device kind fusuma makes" in m["message"]
    # A view of a move that is no longer the one recorded: nothing is done this pass.
    a2, here2 = world("h1", {**MID_MOVE, "phase": "Preparing", "record": {}}, None)
    a2.owners.owned.clear()
    stale = VmView(a2.kube.get(None, "vm0"))
    a2.kube.obj["status"]["move"]["id"] = "another"
    hostmove.step(a2, a2, stale)
    assert not here2.sent and recorded(a2)["id"] == "another"
    assert "decision" not in recorded(a2)
