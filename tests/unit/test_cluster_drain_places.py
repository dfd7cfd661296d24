"""Where a drain sends VMs (fusuma.cluster.drain, .room): into the host's other
partitions when only partitions are drained, elsewhere after a failed move, never into
room the placement controller took at the same moment; who may drain (fusuma-edit);
a host that is down. Against the fake API server of test_cluster_drain."""

from __future__ import annotations

import copy
from types import SimpleNamespace
from typing import Any

import pytest

from fusuma.cluster import drain, hostctl, room
from fusuma.cluster.controller import Placement
from fusuma.cluster.crds import rbac
from fusuma.cluster.kube import HOST, VM
from fusuma.cluster.placement import Choice, HostView, choose, fits, load
from fusuma.cluster.resources import VmView
from tests.unit.test_cluster_drain import NOW, Agent, FakeKube, Informer, cli, host, sent, vm

Obj = dict[str, Any]
LATER = "2026-01-01T00:05:01Z"         # AVOID_S (300 s) after NOW, and one second


def parts_host(name: str, parts: tuple[str, ...] = ("p0", "p1", "p2"), mem: int = 1024,
               drain_parts: tuple[str, ...] = (), **kw: Any) -> Obj:
    h = host(name, mem=mem, **kw)
    h["status"]["partitions"] = [{"name": p, "cpus": [i], "memoryMiB": mem}
                                 for i, p in enumerate(parts)]
    if drain_parts:
        h["spec"] = {**h["spec"], "drainPartitions": list(drain_parts)}
    return h


def in_part(name: str, part: str, **kw: Any) -> Obj:
    o = vm(name, **kw)
    o["status"]["partition"] = part
    o["status"]["placement"]["partition"] = part
    return o


# -- 1. a drain of partitions: into the host's other partitions ------------------------
def test_a_drained_partition_sends_its_vms_to_the_hosts_other_partitions() -> None:
    h0 = parts_host("h0", drain_parts=("p0",))
    vms = [in_part("a", "p0", spec={"sharedRam": False}), in_part("b", "p0"),
           in_part("c", "p0"), in_part("pinned", "p0", spec={"partition": "p0"}),
           in_part("d", "p1", spec={"sharedRam": False}), vm("far", on="h1")]
    p = drain.plan("h0", [h0, parts_host("h1")], vms, set(), NOW)
    # Each where most room is left (p1 holds d already); none to another host.
    assert sent(p) == {"a": "h0/p2", "b": "h0/p1"}
    st = p.status
    assert st is not None
    assert (st["state"], st["remaining"], st["waiting"], st["partitions"]) == \
        ("Draining", 4, 1, ["p0"])
    assert st["refused"] == [{"vm": "default/pinned", "message": "pinned to partition p0 "
                              "by spec.partition; name another partition of this host "
                              "there (the VM moves zero-copy) or clear it."}]
    assert st["message"] == "4 VM(s) left on partition(s) p0 of host h0: 2 moving, 1 " \
        "waiting, 1 that cannot leave."
    # The drained partition takes no new VM; the host still does, in its others.
    view = HostView.from_obj(h0, ready=True)
    assert view.schedulable and [q.name for q in view.partitions] == ["p1", "p2"]
    new = VmView(vm("new", on=None, spec={"partition": "p0"}))
    assert "h0: partition 'p0' is being drained" in str(choose(new, {"h0": view}))
    assert choose(VmView(vm("new", on=None)), {"h0": view}) == Choice("h0", "p1", 832)
    # a and b moved (zero-copy, inside h0): c goes next; pinned stays and says so.
    h0["status"]["drain"] = st
    vms[0] = in_part("a", "p2", lastMove={"result": "ok", "downtimeMs": 5.2})
    vms[1] = in_part("b", "p1", lastMove={"result": "ok", "downtimeMs": 4.9})
    p = drain.plan("h0", [h0, parts_host("h1")], vms, set(), NOW)
    assert sent(p) == {"c": "h0/p2"}
    st = p.status
    assert st is not None
    assert st["moved"] == [{"vm": "default/a", "to": "h0/p2", "downtimeMs": 5.2},
                           {"vm": "default/b", "to": "h0/p1", "downtimeMs": 4.9}]
    h0["status"]["drain"] = st
    vms[2] = in_part("c", "p2")
    st = drain.plan("h0", [h0, parts_host("h1")], vms, set(), NOW).status
    assert st is not None and st["state"] == "Blocked"
    err = hostctl.blocked("h0", st)
    assert err is not None and str(err) == (
        "partition(s) p0 of host h0 is not drained: 1 VM(s) cannot leave it (each said "
        "why above); fix them and drain again, or `fusuma host uncordon h0 --partition "
        "p0`.")
    vms.pop(3)
    st = drain.plan("h0", [h0, parts_host("h1")], vms, set(), NOW).status
    assert st is not None and st["state"] == "Drained"
    assert st["message"] == "no VM is left on partition(s) p0 of host h0 (3 moved); " \
        "`fusuma host uncordon h0 --partition p0` lets VMs be placed here again."


def test_a_partition_drain_of_a_cordoned_host_still_moves_inside_it() -> None:
    """A cordoned host takes no new VM, but a VM it holds is no new VM: a drain of its
    partitions still moves them. A drain of the whole host wins over a partition's."""
    h0 = parts_host("h0", drain_parts=("p0",))
    h0["spec"]["unschedulable"] = True
    assert sent(drain.plan("h0", [h0], [in_part("a", "p0")], set(), NOW)) == \
        {"a": "h0/p1"}
    h0["spec"]["drain"] = True
    p = drain.plan("h0", [h0, parts_host("h1")], [in_part("a", "p0")], set(), NOW)
    assert sent(p) == {"a": "h1/p0"}
    assert p.status is not None and "partitions" not in p.status


def test_the_agents_pass_places_inside_and_the_reconciler_moves_zero_copy(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """drain.run writes the new partition as the VM's placement; the VM's reconciler
    takes it as a change of partition and moves it zero-copy (fusuma.migration)."""
    import fusuma.migration
    from fusuma.cluster.reconcile import VmReconciler
    from fusuma.migration import MigrationResult
    from fusuma.vm import view
    from tests.unit.test_hostmove import UID, FakeAgent, FakeHost
    from tests.unit.test_hostmove import FakeKube as OneVm

    kube = FakeKube([parts_host("h0", parts=("p0", "p1"), drain_parts=("p0",))],
                    [in_part("vm0", "p0")])
    a = Agent("h0", kube)
    drain.run(a)     # type: ignore[arg-type]
    obj = kube.vms[("default", "vm0")]
    assert obj["status"]["placement"]["partition"] == "p1"
    assert a.emitted == [("vm0", "Drained", "partition p0 of host h0 is drained: moving "
                          "zero-copy to p1")]
    # The hold it took first is in the room ledger.
    [hold] = room.Ledger(kube, "h0").read()     # type: ignore[arg-type]
    assert (hold.vm, hold.host, hold.partition) == ("default/vm0", "h0", "p1")
    here = FakeHost()
    rec = SimpleNamespace(name="vm0", partition="p0", state="running", pid=100,
                          shared_ram=True)
    here.db.vms["vm0"] = rec
    mine = copy.deepcopy(obj)
    mine["metadata"]["uid"] = UID
    agent = FakeAgent("h0", OneVm(mine), here)
    asked: list[tuple[str, str, str]] = []

    def migrate(parts: Any, name: str, to: str, mode: str) -> MigrationResult:
        asked.append((name, to, mode))
        here.db.vms["vm0"] = SimpleNamespace(**{**vars(rec), "partition": to})
        return MigrationResult(vm=name, source="p0", to=to, mode=mode, total_ms=9.0,
                               downtime_ms=4.0, bytes_sent=0, prepare_ms=50.0, cpu_s=0.0,
                               qemu_total_ms=None, qemu_downtime_ms=None, steps_ms=None)

    monkeypatch.setattr(fusuma.migration, "migrate", migrate)
    monkeypatch.setattr(view.VmView, "state", property(lambda self: "running"))
    got = VmReconciler(agent)._move_partition(      # type: ignore[arg-type]
        here, VmView(mine), rec, VmView(mine).want_partition or "")
    assert asked == [("vm0", "p1", "zero-copy")] and got is not None


def test_the_cli_drains_a_partition_and_says_what_is_wrong(
        monkeypatch: pytest.MonkeyPatch) -> None:
    kube = FakeKube([parts_host("h0", parts=("p0", "p1")), host("h1")], [])
    r = cli(kube, monkeypatch, "drain", "h0", "--partition", "p0")
    assert r.exit_code == 0, r.output
    assert kube.hosts["h0"]["spec"] == {"drainPartitions": ["p0"]}
    assert "partition(s) p0 of host h0 are draining" in r.output
    r = cli(kube, monkeypatch, "drain", "h0", "--partition", "p9")
    assert str(r.exception) == "host h0 has no partition p9 (it has: p0, p1); `kubectl " \
        "get fusumapartitions` shows them."
    r = cli(kube, monkeypatch, "drain", "h0", "--partition", "p0", "--partition", "p1")
    assert str(r.exception).startswith("draining p0, p1 would leave host h0 no partition "
                                       "to move their VMs to: create a FusumaPartition")
    assert kube.hosts["h0"]["spec"] == {"drainPartitions": ["p0"]}
    r = cli(kube, monkeypatch, "uncordon", "h0", "--partition", "p0")
    assert r.exit_code == 0, r.output
    assert kube.hosts["h0"]["spec"] == {}


# -- 2. a failed move: re-placed elsewhere, that destination avoided a while -----------
def test_a_failed_move_is_sent_elsewhere_and_its_destination_avoided_a_while() -> None:
    hosts = [host("h0", drain_=True), host("h1", avail=9000), host("h2")]
    msg = "move to h1 failed (the stream broke); the VM stays on h0."
    failed = vm("a", placement={"host": "h1", "partition": "p0"},
                lastMove={"result": "failed", "to": "h1/p0", "message": msg})
    p = drain.plan("h0", hosts, [failed], set(), NOW)
    # h1 has the most room, but a's move there failed: h2.
    assert sent(p) == {"a": "h2/p0"}
    st = p.status
    assert st is not None
    note = ("move to h1 failed (the stream broke); the VM stays on h0; sent elsewhere "
            "instead (h1 is not tried for it again for 5 minutes).")
    assert st["moving"] == [{"vm": "default/a", "to": "h2/p0", "message": note}]
    assert st["failed"] == [{"vm": "default/a", "avoid": "h1", "at": NOW, "message": msg}]
    assert drain.describe(st) == [f"moving default/a to h2/p0: {note}"]
    # The next pass: a is placed on h2 and moving there; its note stays.
    hosts[0]["status"]["drain"] = st
    on_h2 = vm("a", placement={"host": "h2", "partition": "p0"},
               lastMove={"result": "failed", "to": "h1/p0", "message": msg})
    st2 = drain.plan("h0", hosts, [on_h2], set(), NOW).status
    assert st2 is not None and st2["moving"] == st["moving"] and st2["failed"] == \
        st["failed"]
    # The move to h2 fails as well: h1 is still avoided, and h2 now too: nowhere left,
    # it is tried at h2 again, and the sentence says so.
    hosts[0]["status"]["drain"] = st2
    msg2 = "move to h2 failed (h2's agent did not answer); the VM stays on h0."
    failed2 = vm("a", placement={"host": "h2", "partition": "p0"},
                 lastMove={"result": "failed", "to": "h2/p0", "message": msg2})
    p3 = drain.plan("h0", hosts, [failed2], set(), NOW)
    assert sent(p3) == {}
    assert p3.status is not None
    [ref] = p3.status["refused"]
    assert ref["message"].startswith(msg2[:-1] + "; no other place can take it (")
    assert "h1: where its move just failed" in ref["message"]
    assert ref["message"].endswith("so it is tried there again within a minute.")
    assert [f["avoid"] for f in p3.status["failed"]] == ["h1", "h2"]
    # Five minutes on, h1 is a destination again; h2, where a's last try failed
    # (and a is still placed), is avoided from now on.
    hosts[0]["status"]["drain"] = p3.status
    p4 = drain.plan("h0", hosts, [failed2], set(), LATER)
    assert sent(p4) == {"a": "h1/p0"}
    assert p4.status is not None
    assert p4.status["failed"] == [{"vm": "default/a", "avoid": "h2", "at": LATER,
                                    "message": msg2}]


def test_a_move_refused_for_the_vms_own_reasons_is_not_sent_around() -> None:
    """A refusal that does not name the destination (its snapshots, its storage) holds
    wherever the VM goes: said, not re-placed; one naming its destination is."""
    hosts = [host("h0", drain_=True), host("h1"), host("h2")]
    own = "cannot move 'a': VM 'a' has snapshots; delete them first."
    a = vm("a", placement={"host": "h1", "partition": "p0"}, message=own,
           conditions=[{"type": "Ready", "status": "False", "reason": "MoveFailed",
                        "message": own}])
    p = drain.plan("h0", hosts, [a], set(), NOW)
    assert sent(p) == {}
    assert p.status is not None and p.status["refused"] == [{"vm": "default/a",
                                                             "message": own}]
    dead = "cannot move 'a' to host 'h1': it is not a registered, live host."
    a["status"]["conditions"][0]["message"] = dead
    assert sent(drain.plan("h0", hosts, [a], set(), NOW)) == {"a": "h2/p0"}


def test_a_failed_move_inside_the_host_goes_to_another_partition() -> None:
    h0 = parts_host("h0", drain_parts=("p0",))
    why = "move to partition 'p1' failed: the destination QEMU did not start."
    a = in_part("a", "p0", conditions=[{"type": "Ready", "status": "False",
                                        "reason": "MoveFailed", "message": why}])
    a["status"]["placement"]["partition"] = "p1"
    p = drain.plan("h0", [h0], [a], set(), NOW)
    assert sent(p) == {"a": "h0/p2"}
    assert p.status is not None
    assert p.status["failed"] == [{"vm": "default/a", "avoid": "h0/p1", "at": NOW,
                                   "message": why}]
    # Placed on p2 now, with p1's failure still on its Ready condition: moving, not
    # failed again (the sentence names p1, not p2).
    h0["status"]["drain"] = p.status
    a["status"]["placement"]["partition"] = "p2"
    st = drain.plan("h0", [h0], [a], set(), NOW).status
    assert st is not None and [m["to"] for m in st["moving"]] == ["h0/p2"]
    assert st["refused"] == [] and len(st["failed"]) == 1


# -- 3. who may drain: fusuma-edit, and only that ---------------------------------------
def allowed(rules: list[Obj], verb: str, resource: str, sub: str | None) -> bool:
    """Whether RBAC ``rules`` allow ``verb`` on ``resource`` (and subresource ``sub``),
    as the API server's RBAC authorizer matches them (no resourceNames here)."""
    res = f"{resource}/{sub}" if sub else resource
    return any(res in r["resources"] and verb in r["verbs"] and "resourceNames" not in r
               for r in rules)


def test_the_edit_role_may_cordon_drain_and_uncordon_and_nothing_more_of_a_host(
        monkeypatch: pytest.MonkeyPatch) -> None:
    roles = {o["metadata"]["name"]: o for o in rbac() if o["kind"] == "ClusterRole"}
    edit = roles["fusuma-edit"]["rules"]
    # Every request `fusuma host` makes, recorded by the fake API server.
    kube = FakeKube([parts_host("h0"), host("h1")], [vm("a")])
    for args in (["list"], ["cordon", "h0"], ["drain", "h0"], ["uncordon", "h0"],
                 ["drain", "h0", "--partition", "p0"],
                 ["uncordon", "h0", "--partition", "p0"]):
        assert cli(kube, monkeypatch, *args).exit_code == 0
    made = set(kube.calls)
    assert ("patch", "fusumahosts", None) in made and ("list", "fusumavms", None) in made
    for verb, resource, sub in made:
        assert allowed(edit, verb, resource, sub), (verb, resource, sub)
    # Not the host's status (its agent's), not making, replacing or deleting a host,
    # nor anything of its partitions.
    for verb, resource, sub in [("patch", "fusumahosts", "status"),
                                ("update", "fusumahosts", "status"),
                                ("update", "fusumahosts", None),
                                ("create", "fusumahosts", None),
                                ("delete", "fusumahosts", None),
                                ("patch", "fusumapartitions", None)]:
        assert not allowed(edit, verb, resource, sub), (verb, resource, sub)
    # Still aggregated into Kubernetes' edit.
    assert roles["fusuma-edit"]["metadata"]["labels"] == {
        "rbac.authorization.k8s.io/aggregate-to-edit": "true"}
    # A FusumaHost's spec holds only what cordon and drain set.
    from fusuma.cluster.crds import crds

    fh = next(c for c in crds() if c["spec"]["names"]["kind"] == "FusumaHost")
    spec = fh["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]
    assert set(spec["properties"]) == {"unschedulable", "drain", "drainPartitions"}


# -- 4. two writers, one room ------------------------------------------------------------
class ControllerAgent:
    """What the placement controller (fusuma.cluster.controller) uses of an agent."""

    def __init__(self, me: str, kube: FakeKube, vms: Informer) -> None:
        self.host = me
        self.kube = kube
        self.hosts_informer = Informer(kube, HOST)
        self.vms_informer = vms
        self.leases_informer = SimpleNamespace(items=lambda: [])
        self.cfg = SimpleNamespace(lease_seconds=40)
        self.events = self

    def emit(self, obj: Obj, reason: str, message: str, type_: str = "Normal") -> None:
        pass


class Stale(Informer):
    """An informer that has not yet seen the other writer's placement: the VMs as they
    were when the test began (its own writes do show, as ``put`` makes them)."""

    def __init__(self, kube: FakeKube) -> None:
        super().__init__(kube, VM)
        self.snapshot = {k: copy.deepcopy(v) for k, v in kube.vms.items()}

    def items(self) -> list[Obj]:
        return [copy.deepcopy(v) for v in self.snapshot.values()]

    def get(self, ns: str, name: str) -> Obj | None:
        o = self.snapshot.get((ns, name))
        return copy.deepcopy(o) if o else None

    def put(self, obj: Obj) -> None:
        self.snapshot[(obj["metadata"]["namespace"], obj["metadata"]["name"])] = obj


def one_room() -> FakeKube:
    """h0 drains VM a; h1 has room for one VM of private RAM (64 + 256 of 400 MiB in
    its one partition); VM n is new, without a place."""
    h1 = host("h1")
    h1["status"]["partitions"] = [{"name": "p0", "cpus": [0], "memoryMiB": 400}]
    private = {"sharedRam": False}
    n = vm("n", on=None, spec=private)
    n["metadata"]["creationTimestamp"] = NOW
    return FakeKube([host("h0", drain_=True), h1], [vm("a", spec=private), n])


def on_h1(kube: FakeKube) -> list[str]:
    return sorted(n for (_, n), o in kube.vms.items()
                  if (o["status"].get("placement") or {}).get("host") == "h1")


def overcommitted(kube: FakeKube) -> str | None:
    """Why the VMs placed on h1 do not fit it (None: they fit)."""
    h1 = HostView.from_obj(kube.hosts["h1"], ready=True)
    vms = [VmView(o) for o in kube.vms.values()]
    load({"h1": h1}, vms)
    for v in h1.vms:
        why = fits(h1, h1.partitions[0], v)
        if why:
            return why
    return None


@pytest.mark.parametrize("first", ["drain", "controller"])
def test_two_writers_cannot_fill_the_same_room(monkeypatch: pytest.MonkeyPatch,
                                               first: str) -> None:
    """Each writer reads the ledger, chooses h1, and before its conditional write the
    other runs a whole pass: the first's write conflicts, it reads again, counts the
    other's hold and finds no room; h1 holds one VM."""
    kube = one_room()
    drainer = Agent("h0", kube)
    drainer.vms_informer = Stale(kube)
    placer = Placement(ControllerAgent("h2", kube, Stale(kube)))  # type: ignore[arg-type]
    passes = {"drain": lambda: drain.run(drainer),      # type: ignore[arg-type]
              "controller": placer.run_once}
    other = "controller" if first == "drain" else "drain"
    runs: list[str] = []

    def meanwhile() -> None:
        if not runs:
            runs.append(other)
            passes[other]()

    kube.on_replace = meanwhile
    passes[first]()
    assert runs == [other]
    assert len(on_h1(kube)) == 1, on_h1(kube)
    assert overcommitted(kube) is None
    if first == "drain":
        # The controller won h1 for n; a is refused with the sums, n's hold counted.
        st = kube.hosts["h0"]["status"]["drain"]
        assert on_h1(kube) == ["n"] and st["refused"][0]["vm"] == "default/a"
        assert "no host has room for 'a'" in st["refused"][0]["message"]
    else:
        n = kube.vms[("default", "n")]["status"]
        assert on_h1(kube) == ["a"] and n["state"] == "Pending"
        assert n["message"].startswith("no host has room for 'n'")


def test_without_the_ledger_the_same_race_overcommits(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The test above has teeth: with every conditional write let through (no
    ledger), both writers give h1's one room away."""
    monkeypatch.setattr(room.Ledger, "take", lambda self, new: True)
    kube = one_room()
    drainer = Agent("h0", kube)
    drainer.vms_informer = Stale(kube)
    placer = Placement(ControllerAgent("h2", kube, Stale(kube)))  # type: ignore[arg-type]
    drain.run(drainer)     # type: ignore[arg-type]
    placer.run_once()
    assert on_h1(kube) == ["a", "n"]
    assert overcommitted(kube) is not None


def test_a_hold_counts_until_its_vm_shows_the_placement_or_it_expires() -> None:
    kube = one_room()
    ledger = room.Ledger(kube, "h0", clock=lambda: 1000.0)   # type: ignore[arg-type]
    assert ledger.read() == []
    h1 = HostView.from_obj(kube.hosts["h1"], ready=True)
    a = VmView(kube.vms[("default", "a")])
    assert ledger.take([room.Hold.of(a, h1, "p0", 1000.0)])
    views = {"h1": HostView.from_obj(kube.hosts["h1"], ready=True)}
    room.count(views, [a], ledger.read())
    assert [v.name for v in views["h1"].vms] == ["a"]
    # Its placement shows it: counted by load, not twice.
    a_there = copy.deepcopy(a.obj)
    a_there["status"]["placement"] = {"host": "h1", "partition": "p0"}
    views = {"h1": HostView.from_obj(kube.hosts["h1"], ready=True)}
    room.count(views, [VmView(a_there)], ledger.read())
    assert views["h1"].vms == []
    # A writer that died after its hold: gone after HOLD_S.
    later = room.Ledger(kube, "h2", clock=lambda: 1000.0 + room.HOLD_S)  # type: ignore[arg-type]
    assert later.read() == []


# -- 5. a host that is down ------------------------------------------------------------
def test_draining_a_host_that_is_down_says_what_became_of_each_vm(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """`fusuma host drain h0 --wait` of a host whose Lease expired: nothing is moved
    live (nobody is there to move it); the restartable VMs were restarted elsewhere by
    the controller, and each other VM has its sentence; exit 1 names how many."""
    down = host("h0", status={"conditions": [
        {"type": "Ready", "status": "False", "reason": "LeaseExpired",
         "lastTransitionTime": NOW}]})
    lost = {"lostFrom": "h0", "lostAt": NOW}
    pinned = ("host h0's Lease expired: the VM is lost; it is pinned there by spec.host: "
              "clear spec.host or name another host to start it elsewhere from its image.")
    fragile = ("host h0's Lease expired: the VM is lost; it is not restartable: set "
               "spec.restartable to start it elsewhere from its image, or bring the host "
               "back.")
    no_room = ("no host has room for 'big' (1 vCPU, 8000 MiB): h1/p0: 64 + big 8000 + "
               "... > 1024 MiB; add a host or partition, or ask for less.")
    kube = FakeKube([down, host("h1")], [
        vm("keeper", on="h1", spec={"restartable": True}, **lost),
        vm("big", on=None, state="Pending", message=no_room,
           spec={"restartable": True, "memoryMiB": 8000}, **lost),
        vm("pinned", state="Lost", message=pinned, spec={"host": "h0"}, **lost),
        vm("fragile", state="Lost", message=fragile, **lost)])
    r = cli(kube, monkeypatch, "drain", "h0")
    assert r.output.startswith("... host h0 is cordoned; host h0 is down (its Lease "
                               "expired): its restartable VMs are started again on other "
                               "hosts"), r.output
    r = cli(kube, monkeypatch, "drain", "h0", "--wait", "--timeout", "2")
    lines = r.output.splitlines()
    assert "... moved default/keeper to h1/p0 (restarted from its image)" in lines
    assert f"... cannot move default/pinned: {pinned}" in lines
    assert f"... cannot move default/fragile: {fragile}" in lines
    assert f"... cannot move default/big: {no_room}" in lines
    assert any(line.startswith("host h0 is down (its Lease expired)") and
               line.endswith("1 restarted, 0 starting, 3 cannot be.") for line in lines)
    assert str(r.exception).startswith("host h0 is not drained: 3 VM(s) cannot leave it")
