"""Draining a host (fusuma.cluster.drain, `fusuma host`): the drained host's agent's
decisions as data, its pass against a fake API server, what the CLI shows and its
errors. The live moves themselves are hostmove's (tests/unit/test_hostmove.py) and the
cluster test's (tests/cluster/test_drain.py)."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner

from fusuma.cluster import ClusterError, command, drain, hostctl
from fusuma.cluster.kube import HOST, LEASE, VM, find_kubeconfig
from fusuma.cluster.placement import HostView
from fusuma.cluster.reconcile import VmReconciler
from fusuma.errors import NotFoundError

Obj = dict[str, Any]
NOW = "2026-01-01T00:00:00Z"


def host(name: str, drain_: bool = False, avail: int = 4000, mem: int = 1024,
         ready: bool = True, generation: int = 1, status: Obj | None = None) -> Obj:
    return {"metadata": {"name": name, "generation": generation},
            "spec": {"drain": True, "unschedulable": True} if drain_ else {},
            "status": {"availableMiB": avail, "accelerator": "tcg",
                       "partitions": [{"name": p, "cpus": [i], "memoryMiB": mem}
                                      for i, p in enumerate(("p0", "p1"))],
                       "conditions": [{"type": "Ready",
                                       "status": "True" if ready else "False"}],
                       **(status or {})}}


def vm(name: str, on: str | None = "h0", mem: int = 128, ns: str = "default",
       spec: Obj | None = None, **status: Any) -> Obj:
    st: Obj = {"host": on, "partition": "p0", "state": "Running",
               "placement": {"host": on, "partition": "p0"}} if on else {}
    st.update(status)
    return {"metadata": {"name": name, "namespace": ns, "uid": f"uid-{name}",
                         "generation": 1},
            "spec": {"memoryMiB": mem, **(spec or {})}, "status": st}


def sent(p: drain.Plan) -> dict[str, str]:
    return {s.name: f"{s.host}/{s.partition}" for s in p.sends}


def test_a_drain_sends_a_few_at_a_time_where_there_is_room_and_says_why_not() -> None:
    hosts = [host("h0", drain_=True), host("h1"), host("h2")]
    vms = [vm("a"), vm("b"), vm("c"), vm("pinned", spec={"host": "h0"}),
           vm("elsewhere", on="h1")]
    p = drain.plan("h0", hosts, vms, set(), NOW)
    # Two at a time (MAX_MOVING), each where most room is left: a beside the VM h1
    # runs (its other partition), b where a did not go.
    assert sent(p) == {"a": "h1/p1", "b": "h2/p0"}
    st = p.status
    assert st is not None
    assert (st["state"], st["remaining"], st["waiting"]) == ("Draining", 4, 1)
    assert st["moving"] == [{"vm": "default/a", "to": "h1/p1"},
                            {"vm": "default/b", "to": "h2/p0"}]
    assert st["refused"] == [{"vm": "default/pinned", "message": "pinned to h0 by "
                              "spec.host; clear it or name another host."}]
    assert st["message"] == "4 VM(s) left on host h0: 2 moving, 1 waiting, 1 that " \
        "cannot leave."
    assert (st["startedAt"], st["observedGeneration"]) == (NOW, 1)


def test_each_pass_counts_what_moved_and_sends_the_next() -> None:
    hosts = [host("h0", drain_=True), host("h1"), host("h2")]
    first = drain.plan("h0", hosts, [vm("a"), vm("b"), vm("c")], set(), NOW)
    hosts[0]["status"]["drain"] = first.status
    # a ran its move (now on h1), b still moves (placed on h2, defined on h0).
    vms = [vm("a", on="h1", lastMove={"result": "ok", "downtimeMs": 41.5}),
           vm("b", placement={"host": "h2", "partition": "p0"}), vm("c")]
    p = drain.plan("h0", hosts, vms, set(), "2026-01-01T00:01:00Z")
    # h1 runs a in p0, h2 is to take b in p0: c goes to the first partition left.
    assert sent(p) == {"c": "h1/p1"}
    st = p.status
    assert st is not None
    assert st["moved"] == [{"vm": "default/a", "to": "h1/p0", "downtimeMs": 41.5}]
    assert [m["vm"] for m in st["moving"]] == ["default/b", "default/c"]
    assert (st["remaining"], st["waiting"], st["startedAt"]) == (2, 0, NOW)
    assert drain.describe(st) == ["moved default/a to h1/p0 (41.5 ms downtime)",
                                  "moving default/b to h2/p0", "moving default/c to h1/p1"]
    # b runs on h2 now, but h0 has not yet ended its side of the move (the record is
    # still there): still moving, the drain not done.
    hosts[0]["status"]["drain"] = st
    vms = [vm("a", on="h1"), vm("c", on="h1"),
           vm("b", on="h2", move={"fromHost": "h0", "toHost": "h2", "to": "h2/p0",
                                  "phase": "Switched"})]
    st = drain.plan("h0", hosts, vms, set(), NOW).status
    assert st is not None and st["state"] == "Draining" and st["remaining"] == 1
    assert st["moving"] == [{"vm": "default/b", "to": "h2/p0"}]
    assert [m["vm"] for m in st["moved"]] == ["default/a", "default/c"]
    # Then both are gone from h0: drained, every move listed.
    hosts[0]["status"]["drain"] = st
    done = drain.plan("h0", hosts, [vm("a", on="h1"), vm("b", on="h2"),
                                    vm("c", on="h1")], set(), NOW).status
    assert done is not None and done["state"] == "Drained" and done["remaining"] == 0
    # In the order they finished.
    assert [m["vm"] for m in done["moved"]] == ["default/a", "default/c", "default/b"]
    assert done["message"] == "no VM is left on host h0 (3 moved); `fusuma host " \
        "uncordon h0` lets VMs be placed here again."


def test_room_is_counted_so_what_does_not_fit_is_refused_with_the_sums() -> None:
    """h1 is the only destination (h2 lost, h3 cordoned, h4 not ready): one VM fits in
    each of its partitions, the third does not, and says so with the sums; the lost,
    cordoned and unready hosts are named for what they are."""
    hosts = [host("h0", drain_=True), host("h1", mem=400), host("h2"),
             {**host("h3"), "spec": {"unschedulable": True}}, host("h4", ready=False)]
    vms = [vm(n, spec={"sharedRam": False}) for n in ("a", "b", "c")]
    p = drain.plan("h0", hosts, vms, {"h2"}, NOW, limit=5)
    assert sent(p) == {"a": "h1/p0", "b": "h1/p1"}
    st = p.status
    assert st is not None
    [ref] = st["refused"]
    assert ref["vm"] == "default/c"
    msg = ref["message"]
    assert msg.startswith("no host has room for 'c' (1 vCPU, 128 MiB): h1/p0: 64 + a 256 "
                          "+ c 256 = 576 > 400 MiB; h1/p1: ")
    assert "h2: lost" in msg
    assert "h3: not ready, or unschedulable" in msg and "h4: not ready" in msg
    assert msg.endswith("add a host or partition, or ask for less.")


def test_the_only_host_has_nowhere_to_send_its_vms() -> None:
    p = drain.plan("h0", [host("h0", drain_=True)], [vm("a")], set(), NOW)
    assert p.sends == ()
    st = p.status
    assert st is not None and st["state"] == "Blocked"
    assert st["refused"][0]["message"].startswith("no other host can take it: h0 is the "
                                                  "cluster's only host")
    assert st["message"] == "1 VM(s) cannot leave host h0 (status.drain.refused says " \
        "why for each); fix them, or `fusuma host uncordon h0`."


def test_a_failed_move_is_said_and_does_not_hold_a_slot() -> None:
    hosts = [host("h0", drain_=True), host("h1")]
    failed = vm("a", placement={"host": "h1", "partition": "p0"}, lastMove={
        "result": "failed", "to": "h1/p0",
        "message": "move to h1 failed (the stream broke); the VM stays on h0."})
    p = drain.plan("h0", hosts, [failed, vm("b"), vm("c")], set(), NOW)
    # No other host: a's move is retried by hostmove, to the room it holds (h1/p0).
    assert sent(p) == {"b": "h1/p1", "c": "h1/p0"}
    st = p.status
    assert st is not None
    assert st["refused"] == [{"vm": "default/a", "message": "move to h1 failed (the "
                              "stream broke); the VM stays on h0; no other place can take "
                              "it (no host has room for 'a' (1 vCPU, 128 MiB): h1: where "
                              "its move just failed; add a host or partition, or ask for "
                              "less), so it is tried there again within a minute."}]
    assert st["failed"] == [{"vm": "default/a", "avoid": "h1", "at": NOW, "message":
                             "move to h1 failed (the stream broke); the VM stays on h0."}]


def test_a_vm_named_like_one_on_a_host_goes_elsewhere() -> None:
    hosts = [host("h0", drain_=True), host("h1", avail=9000), host("h2")]
    vms = [vm("web", ns="a"), vm("web", ns="b", on="h1")]
    assert sent(drain.plan("h0", hosts, vms, set(), NOW)) == {"web": "h2/p0"}


def test_no_drain_no_status_and_a_draining_host_takes_no_new_vm() -> None:
    h0 = host("h0", status={"drain": {"state": "Drained"}})
    assert drain.plan("h0", [h0, host("h1")], [vm("a")], set(), NOW) == \
        drain.Plan((), None)
    assert drain.wanted(h0) and not drain.wanted(host("h1"))
    assert drain.wanted(host("h0", drain_=True))
    only_drain = {**host("h0"), "spec": {"drain": True}}
    assert not HostView.from_obj(only_drain, ready=True).schedulable
    assert HostView.from_obj(host("h1"), ready=True).schedulable


class FakeKube:
    """FusumaHosts, FusumaVMs and Leases in memory; merge patches as the API server
    applies them (without pruning: the test of an old CRD prunes by hand); a Lease is
    replaced only at its current resourceVersion, as the API server does."""

    def __init__(self, hosts: list[Obj], vms: list[Obj]) -> None:
        self.hosts = {h["metadata"]["name"]: h for h in hosts}
        self.vms = {(v["metadata"]["namespace"], v["metadata"]["name"]): v for v in vms}
        self.leases: dict[str, Obj] = {}
        self.version = 0
        self.prune: set[str] = set()
        self.on_get: Any = lambda: None
        self.on_replace: Any = lambda: None
        self.calls: list[tuple[str, str, str | None]] = []

    def _stamp(self, obj: Obj) -> Obj:
        self.version += 1
        obj["metadata"]["resourceVersion"] = str(self.version)
        return copy.deepcopy(obj)

    def create(self, kind: Any, obj: Obj, ns: str | None = None) -> Obj:
        from fusuma.cluster import ConflictApiError

        assert kind is LEASE
        self.calls.append(("create", kind.plural, None))
        if obj["metadata"]["name"] in self.leases:
            raise ConflictApiError(409, "AlreadyExists", "exists", "POST", "")
        self.leases[obj["metadata"]["name"]] = copy.deepcopy(obj)
        return self._stamp(self.leases[obj["metadata"]["name"]])

    def replace(self, kind: Any, obj: Obj, sub: str | None = None) -> Obj:
        from fusuma.cluster import ConflictApiError

        assert kind is LEASE
        self.calls.append(("update", kind.plural, sub))
        self.on_replace()
        cur = self.leases[obj["metadata"]["name"]]
        if cur["metadata"]["resourceVersion"] != obj["metadata"].get("resourceVersion"):
            raise ConflictApiError(409, "Conflict", "the object has been modified", "PUT",
                                   "")
        self.leases[obj["metadata"]["name"]] = copy.deepcopy(obj)
        return self._stamp(self.leases[obj["metadata"]["name"]])

    def _merge(self, into: Obj, patch: Obj) -> None:
        for k, val in patch.items():
            if val is None:
                into.pop(k, None)
            elif isinstance(val, dict) and isinstance(into.get(k), dict):
                self._merge(into[k], val)
            else:
                into[k] = copy.deepcopy(val)

    def find(self, kind: Any, name: str, ns: str | None = None) -> Obj | None:
        self.calls.append(("get", kind.plural, None))
        if kind is LEASE:
            got = self.leases.get(name)
            return copy.deepcopy(got) if got else None
        assert kind is HOST
        h = self.hosts.get(name)
        return copy.deepcopy(h) if h else None

    def get(self, kind: Any, name: str, ns: str | None = None) -> Obj:
        self.on_get()
        got = self.find(kind, name)
        assert got is not None
        return got

    def list(self, kind: Any, namespace: str | None = None) -> tuple[list[Obj], str]:
        self.calls.append(("list", kind.plural, None))
        objs = self.hosts.values() if kind is HOST else self.vms.values()
        return [copy.deepcopy(o) for o in objs], "1"

    def patch(self, kind: Any, name: str, patch: Obj, ns: str | None = None,
              sub: str | None = None) -> Obj:
        self.calls.append(("patch", kind.plural, sub))
        obj = self.hosts[name] if kind is HOST else self.vms[(str(ns), name)]
        spec = {k: v for k, v in (patch.get("spec") or {}).items() if k not in self.prune}
        if "spec" in patch:
            self._merge(obj.setdefault("spec", {}), spec)
            obj["metadata"]["generation"] += 1
        self._merge(obj.setdefault("status", {}), patch.get("status") or {})
        return copy.deepcopy(obj)

    def patch_status(self, kind: Any, name: str, status: Obj, ns: str | None = None) -> Obj:
        return self.patch(kind, name, {"status": status}, ns, sub="status")


class Informer:
    def __init__(self, kube: FakeKube, kind: Any) -> None:
        self.kube, self.kind = kube, kind

    def items(self) -> list[Obj]:
        return self.kube.list(self.kind)[0]

    def get(self, ns: str, name: str) -> Obj | None:
        if self.kind is HOST:
            return self.kube.find(HOST, name)
        o = self.kube.vms.get((ns, name))
        return copy.deepcopy(o) if o else None

    def put(self, obj: Obj) -> None:
        pass


class Agent:
    """What drain.run uses of an agent (fusuma.cluster.context.AgentContext)."""

    def __init__(self, me: str, kube: FakeKube) -> None:
        self.host = me
        self.kube = kube
        self.hosts_informer = Informer(kube, HOST)
        self.vms_informer = Informer(kube, VM)
        self.events = self
        self.emitted: list[tuple[str, str, str]] = []

    def emit(self, obj: Obj, reason: str, message: str, type_: str = "Normal") -> None:
        self.emitted.append((obj["metadata"]["name"], reason, message))

    def host_lost(self, name: str) -> bool:
        return False


def test_the_agents_pass_places_the_vms_elsewhere_and_the_reconciler_moves_them(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The drained host's agent writes each VM's placement (which the admission policy
    lets a host do to the VMs placed on it) and its own status.drain; its VM reconciler
    then begins the live move, as for a change of spec.host; uncordoned, the status
    goes."""
    from fusuma.cluster import hostmove
    from tests.unit.test_hostmove import UID, FakeAgent, FakeHost, Rec
    from tests.unit.test_hostmove import FakeKube as OneVm

    kube = FakeKube([host("h0", drain_=True), host("h1")], [vm("vm0")])
    a = Agent("h0", kube)
    drain.run(a)     # type: ignore[arg-type]
    obj = kube.vms[("default", "vm0")]
    assert obj["status"]["placement"]["host"] == "h1"
    assert obj["status"]["placement"]["reason"] == "Drained"
    assert obj["status"]["state"] == "Running"        # it still runs on h0
    placed = [c for c in obj["status"]["conditions"] if c["type"] == "Placed"]
    assert placed[0]["reason"] == "Drained"
    assert a.emitted == [("vm0", "Drained", "host h0 is drained: moving live to h1/p0")]
    st = kube.hosts["h0"]["status"]["drain"]
    assert (st["state"], st["moving"]) == ("Draining", [{"vm": "default/vm0",
                                                         "to": "h1/p0"}])
    # h0's VM reconciler takes the placement as a move between hosts.
    from fusuma.state import VmState

    here = FakeHost()
    here.db.vms["vm0"] = Rec("vm0", "p0", VmState.RUNNING)
    mine = copy.deepcopy(obj)
    mine["metadata"]["uid"] = UID          # the VM the fake host's owners file names
    agent = FakeAgent("h0", OneVm(mine), here)
    begun: list[str] = []
    monkeypatch.setattr(hostmove, "begin",
                        lambda ag, r, v, local: begun.append(f"{v.name}->{v.want_host}"))
    VmReconciler(agent).reconcile(agent.kube.get(None, "vm0"))    # type: ignore[arg-type]
    assert begun == ["vm0->h1"]
    # A second pass sends nothing again and writes nothing new.
    before = copy.deepcopy(kube.vms)
    drain.run(a)     # type: ignore[arg-type]
    assert kube.vms == before and len(a.emitted) == 1
    # Uncordoned: no drain, its status removed.
    hostctl.uncordon(kube, "h0")    # type: ignore[arg-type]
    drain.run(a)     # type: ignore[arg-type]
    assert "drain" not in kube.hosts["h0"]["status"]
    assert kube.hosts["h0"]["spec"] == {"unschedulable": False}


def test_a_host_that_is_down_is_read_from_its_vms() -> None:
    """The controller restarted the restartable VM elsewhere and said why the others
    cannot be: `host drain --wait` shows each."""
    down = host("h0", drain_=True, status={"conditions": [
        {"type": "Ready", "status": "False", "reason": "LeaseExpired",
         "lastTransitionTime": NOW}]})
    lost = {"lostFrom": "h0", "lostAt": NOW}
    vms = [vm("keeper", on="h1", **lost),
           vm("fragile", state="Lost", message="host h0's Lease expired: "
              "the VM is lost; it is not restartable: set spec.restartable to start it "
              "elsewhere from its image, or bring the host back.", **lost),
           vm("starting", on=None, state="Placed",
              placement={"host": "h2", "partition": "p1"}, **lost),
           vm("other", on="h1"),
           # Restarted after an earlier loss of h0: not this one's.
           vm("before", on="h2", lostFrom="h0", lostAt="2025-12-31T00:00:00Z")]
    st = drain.progress(down, vms)
    assert st is not None and st["down"] and st["state"] == "Draining"
    assert st["moved"] == [{"vm": "default/keeper", "to": "h1/p0", "restarted": True}]
    assert st["moving"] == [{"vm": "default/starting", "to": "h2/p1"}]
    assert [r["vm"] for r in st["refused"]] == ["default/fragile"]
    assert drain.describe(st)[0] == "moved default/keeper to h1/p0 (restarted from its " \
        "image)"
    assert "cannot move default/fragile: host h0's Lease expired" in drain.describe(st)[2]
    # Once the last restartable runs: blocked by the one that cannot be.
    vms[2] = vm("starting", on="h2", **lost)
    st = drain.progress(down, vms)
    assert st is not None and st["state"] == "Blocked"
    err = hostctl.blocked("h0", st)
    assert err is not None and str(err).startswith("host h0 is not drained: 1 VM(s) "
                                                   "cannot leave it")


def test_progress_waits_for_the_agent_to_answer_the_current_spec() -> None:
    h = host("h0", drain_=True, generation=3,
             status={"drain": {"state": "Drained", "observedGeneration": 2}})
    assert drain.progress(h, []) is None
    h["status"]["drain"]["observedGeneration"] = 3
    assert drain.progress(h, []) == {"state": "Drained", "observedGeneration": 3,
                                     "down": False}


# -- the CLI --------------------------------------------------------------------------------
def cli(kube: FakeKube, monkeypatch: pytest.MonkeyPatch, *args: str) -> Any:
    monkeypatch.setattr(command, "_kube", lambda kubeconfig: kube)
    monkeypatch.setattr(hostctl, "FOLLOW_EVERY_S", 0.0)
    return CliRunner().invoke(command.host, list(args))


def test_an_unknown_host_is_one_sentence_with_the_hosts_there_are(
        monkeypatch: pytest.MonkeyPatch) -> None:
    kube = FakeKube([host("h0"), host("h1")], [])
    for verb in ("drain", "cordon", "uncordon"):
        r = cli(kube, monkeypatch, verb, "h9")
        assert isinstance(r.exception, NotFoundError), r.output
        assert str(r.exception) == "no host named 'h9' in the cluster (it has: h0, h1); " \
            "`fusuma host list` shows them."
    assert all(h["spec"] == {} for h in kube.hosts.values())


def test_no_cluster_configured(tmp_path: Path) -> None:
    with pytest.raises(ClusterError, match=r"^no cluster configured: pass --kubeconfig "):
        find_kubeconfig(None, {"HOME": str(tmp_path), "KUBECONFIG": "/nonexistent/k"})
    (tmp_path / "k").write_text("x")
    (tmp_path / ".kube").mkdir()
    (tmp_path / ".kube" / "config").write_text("x")
    assert find_kubeconfig(None, {"HOME": str(tmp_path), "KUBECONFIG":
                                  f"/nonexistent/k:{tmp_path / 'k'}"}) == tmp_path / "k"
    assert find_kubeconfig(None, {"HOME": str(tmp_path)}) == tmp_path / ".kube" / "config"


def test_a_cluster_whose_crd_has_no_drain_is_told_to_install(
        monkeypatch: pytest.MonkeyPatch) -> None:
    kube = FakeKube([host("h0")], [])
    kube.prune = {"drain"}
    r = cli(kube, monkeypatch, "drain", "h0")
    assert isinstance(r.exception, ClusterError)
    assert "run `fusuma cluster install --apply` first" in str(r.exception)


def test_drain_wait_prints_each_vm_and_fails_saying_which_cannot_leave(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The agent (drain.run, on each read) does its part; the CLI follows it."""
    kube = FakeKube([host("h0"), host("h1", mem=400)],
                    [vm("a", spec={"sharedRam": False}),
                     vm("b", spec={"sharedRam": False}),
                     vm("pinned", spec={"host": "h0"})])
    a = Agent("h0", kube)

    def agent_and_moves() -> None:
        drain.run(a)     # type: ignore[arg-type]
        for v in kube.vms.values():           # a move finishes each time
            pl = v["status"]["placement"]
            if v["status"]["host"] == "h0" and pl["host"] != "h0":
                v["status"].update(host=pl["host"], partition=pl["partition"],
                                   lastMove={"result": "ok", "downtimeMs": 7})

    kube.on_get = agent_and_moves
    r = cli(kube, monkeypatch, "drain", "h0", "--wait", "--timeout", "5")
    assert isinstance(r.exception, ClusterError), r.output
    assert str(r.exception).startswith("host h0 is not drained: 1 VM(s) cannot leave it")
    lines = r.output.splitlines()
    assert "... moving default/a to h1/p0" in lines
    assert "... moved default/a to h1/p0 (7 ms downtime)" in lines
    assert "... moved default/b to h1/p1 (7 ms downtime)" in lines
    assert "... cannot move default/pinned: pinned to h0 by spec.host; clear it or " \
        "name another host." in lines
    assert kube.hosts["h0"]["spec"] == {"unschedulable": True, "drain": True}


def test_drain_wait_gives_up_when_no_agent_answers(
        monkeypatch: pytest.MonkeyPatch) -> None:
    kube = FakeKube([host("h0"), host("h1")], [vm("a")])
    r = cli(kube, monkeypatch, "drain", "h0", "--wait", "--timeout", "1")
    assert isinstance(r.exception, ClusterError)
    assert str(r.exception).startswith("host h0's agent did not take up the drain in 1 s")


def test_list_and_cordon(monkeypatch: pytest.MonkeyPatch) -> None:
    kube = FakeKube([host("h0", status={"vms": 2, "freeMiB": 100}), host("h1")], [])
    r = cli(kube, monkeypatch, "cordon", "h0")
    assert r.exit_code == 0, r.output
    assert kube.hosts["h0"]["spec"] == {"unschedulable": True}
    assert "host h0 takes no new VM; its 2 VM(s) keep running there" in r.output
    r = cli(kube, monkeypatch, "list")
    lines = r.output.splitlines()
    assert lines[0].split() == ["HOST", "READY", "SCHEDULABLE", "VMS", "FREE_MIB", "DRAIN",
                                "ADDRESS"]
    assert lines[1].split()[:6] == ["h0", "yes", "cordoned", "2", "100", "-"]
    assert lines[2].split()[:3] == ["h1", "yes", "yes"]
