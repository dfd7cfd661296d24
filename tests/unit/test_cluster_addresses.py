"""Addresses allocated cluster-wide (fusuma.cluster.addresses) against a fake API server
that keeps objects by name the way the real one does (a create of a name that exists is
409): two agents racing for one address, a full subnet, static against allocated
addresses, freeing and handing on; and the policy's rules for FusumaAddresses."""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import pytest

from fusuma.cluster import ConflictApiError
from fusuma.cluster import addresses as A
from fusuma.cluster.kube import ADDRESS, NETWORK, VM, Kind
from fusuma.cluster.policy import ADDRESS_POLICY, admission_policy
from fusuma.cluster.resources import VmView
from fusuma.errors import ConflictError, SpecError

Obj = dict[str, Any]


class FakeApi:
    """Objects by (plural, namespace, name); label selectors of ``k=v,k=v``."""

    def __init__(self) -> None:
        self.objs: dict[tuple[str, str, str], Obj] = {}
        self.creates = 0
        self.conflicts = 0
        # Called before each create: another agent acting first.
        self.before_create: Callable[[Obj], None] = lambda obj: None

    def put(self, kind: Kind, obj: Obj) -> None:
        md = obj["metadata"]
        self.objs[(kind.plural, md.get("namespace") or "", md["name"])] = copy.deepcopy(obj)

    def list(self, kind: Kind, namespace: str | None = None,
             label_selector: str | None = None) -> tuple[list[Obj], str]:
        want = dict(p.split("=") for p in (label_selector or "").split(",") if p)
        out = [copy.deepcopy(o) for (k, _, _), o in sorted(self.objs.items())
               if k == kind.plural and all(
                   (o["metadata"].get("labels") or {}).get(a) == b for a, b in want.items())]
        return out, "1"

    def find(self, kind: Kind, name: str, namespace: str | None = None) -> Obj | None:
        o = self.objs.get((kind.plural, namespace or "", name))
        return copy.deepcopy(o) if o is not None else None

    def create(self, kind: Kind, obj: Obj, namespace: str | None = None) -> Obj:
        self.before_create(obj)
        self.creates += 1
        k = (kind.plural, namespace or "", obj["metadata"]["name"])
        if k in self.objs:
            self.conflicts += 1
            raise ConflictApiError(409, "AlreadyExists", "exists", "POST", kind.plural)
        self.objs[k] = copy.deepcopy(obj)
        return obj

    def replace(self, kind: Kind, obj: Obj, sub: str | None = None) -> Obj:
        self.put(kind, obj)
        return obj

    def delete(self, kind: Kind, name: str, namespace: str | None = None) -> None:
        self.objs.pop((kind.plural, namespace or "", name), None)

    def held(self) -> dict[str, tuple[str, int, str]]:
        """address name -> (VM, NIC, holder host)."""
        return {n: (o["spec"]["vm"]["name"], o["spec"]["nic"], o["spec"]["host"])
                for (k, _, n), o in self.objs.items() if k == ADDRESS.plural}


def vm(name: str, *nics: Obj, uid: str | None = None, host: str | None = None,
       move: Obj | None = None) -> Obj:
    status: Obj = {"host": host} if host else {}
    if move:
        status["move"] = move
    return {"metadata": {"name": name, "namespace": "default", "uid": uid or f"uid-{name}"},
            "spec": {"nics": list(nics)}, "status": status}


@pytest.fixture
def api() -> FakeApi:
    api = FakeApi()
    api.put(NETWORK, {"metadata": {"name": "lan"}, "spec": {"subnet": "10.9.0.0/29"}})
    return api


def test_each_vm_gets_the_first_free_address_and_keeps_it(api: FakeApi) -> None:
    a = VmView(vm("a", {"network": "lan"}, {"network": "lan"}))
    assert A.allocate(api, "h0", a) == {0: "10.9.0.2", 1: "10.9.0.3"}
    b = VmView(vm("b", {"network": "lan"}))
    # The host's own records (a VM the CLI made) are never handed out.
    assert A.allocate(api, "h1", b, {"lan": ["10.9.0.4"]}) == {0: "10.9.0.5"}
    # Idempotent: a second pass (or another host, after a move) finds what it holds.
    assert A.allocate(api, "h2", a) == {0: "10.9.0.2", 1: "10.9.0.3"}
    assert api.held() == {"lan.10.9.0.2": ("a", 0, "h0"), "lan.10.9.0.3": ("a", 1, "h0"),
                          "lan.10.9.0.5": ("b", 0, "h1")}
    assert A.status_nics({0: "10.9.0.5"}, b) == [
        {"index": 0, "network": "lan", "ip": "10.9.0.5"}]
    o = api.find(ADDRESS, "lan.10.9.0.5")
    assert o is not None and o["metadata"]["labels"] == {
        A.NETWORK_LABEL: "lan", A.HOST_LABEL: "h1", A.VM_UID_LABEL: "uid-b"}
    # A network that is no FusumaNetwork is the host's own: not allocated here.
    assert A.allocate(api, "h0", VmView(vm("c", {"network": "local"}))) == {}


def test_a_race_for_one_address_retries_on_409_and_never_shares_it(api: FakeApi) -> None:
    a, b = VmView(vm("a", {"network": "lan"})), VmView(vm("b", {"network": "lan"}))
    raced: list[str] = []

    def other_agent_first(obj: Obj) -> None:
        # Host h1's agent read the same holders and creates the same name first.
        if not raced and obj["spec"]["vm"]["name"] == "a":
            raced.append(obj["metadata"]["name"])
            api.put(ADDRESS, A.address_object("lan", obj["spec"]["address"], b, 0, "h1",
                                              False))

    api.before_create = other_agent_first
    assert A.allocate(api, "h0", a) == {0: "10.9.0.3"}
    assert raced == ["lan.10.9.0.2"] and api.conflicts == 1
    assert A.allocate(api, "h1", b) == {0: "10.9.0.2"}     # what it holds
    assert api.held() == {"lan.10.9.0.2": ("b", 0, "h1"), "lan.10.9.0.3": ("a", 0, "h0")}


def test_a_full_subnet_is_refused_in_one_sentence_and_nothing_more_is_held(
        api: FakeApi) -> None:
    # 10.9.0.0/29: .2 to .6 (.1 is the gateway).
    for i in range(5):
        A.allocate(api, "h0", VmView(vm(f"v{i}", {"network": "lan"})))
    before = api.held()
    with pytest.raises(ConflictError, match=r"^subnet 10.9.0.0/29 has no free address "
                                            r"left; delete a VM or make a larger network"):
        A.allocate(api, "h1", VmView(vm("late", {"network": "lan"})))
    assert api.held() == before


def test_an_endless_race_gives_up_after_bounded_tries(api: FakeApi) -> None:
    api.put(NETWORK, {"metadata": {"name": "big"}, "spec": {"subnet": "10.8.0.0/16"}})
    other = VmView(vm("other", {"network": "big"}))
    api.before_create = lambda obj: api.put(ADDRESS, A.address_object(
        "big", obj["spec"]["address"], other, 0, "h1", False))
    with pytest.raises(ConflictError, match="in 32 tries"):
        A.allocate(api, "h0", VmView(vm("a", {"network": "big"})))
    assert api.creates == A.MAX_TRIES


def test_a_static_address_is_honoured_or_refused_in_one_sentence(api: FakeApi) -> None:
    s = VmView(vm("s", {"network": "lan", "ip": "10.9.0.4"}))
    assert A.allocate(api, "h0", s) == {0: "10.9.0.4"}
    assert A.allocate(api, "h0", s) == {0: "10.9.0.4"}        # its own: again fine
    assert api.find(ADDRESS, "lan.10.9.0.4")["spec"]["static"] is True  # type: ignore[index]
    # Allocation skips it.
    d = VmView(vm("d", {"network": "lan"}, {"network": "lan"}, {"network": "lan"}))
    assert A.allocate(api, "h1", d) == {0: "10.9.0.2", 1: "10.9.0.3", 2: "10.9.0.5"}
    with pytest.raises(ConflictError) as exc:
        A.allocate(api, "h1", VmView(vm("t", {"network": "lan", "ip": "10.9.0.4"})))
    assert str(exc.value) == ("spec.nics[0].ip: address 10.9.0.4 of network lan is held by "
                              "FusumaVM default/s (its NIC 0); pick another or leave it "
                              "out to have one allocated.")
    with pytest.raises(SpecError) as exc2:
        A.allocate(api, "h1", VmView(vm("u", {"network": "lan", "ip": "10.7.0.4"})))
    assert str(exc2.value) == ("spec.nics[0].ip: address 10.7.0.4 is outside network lan's "
                               "subnet 10.9.0.0/29; pick one inside it or leave it out to "
                               "have one allocated.")
    with pytest.raises(SpecError, match="gateway"):
        A.allocate(api, "h1", VmView(vm("g", {"network": "lan", "ip": "10.9.0.1"})))
    # A VM made again under the same name is another VM: it does not inherit.
    with pytest.raises(ConflictError, match="held by FusumaVM default/s"):
        A.allocate(api, "h0", VmView(vm("s", {"network": "lan", "ip": "10.9.0.4"},
                                        uid="uid-s2")))


def test_free_takes_only_what_the_host_holds_and_sweep_frees_or_hands_on(
        api: FakeApi) -> None:
    a = vm("a", {"network": "lan"})
    A.allocate(api, "h0", VmView(a))
    A.allocate(api, "h1", VmView(vm("b", {"network": "lan"})))
    assert A.free(api, "h1", "uid-a") == []                  # h0's, not h1's
    assert "lan.10.9.0.2" in api.held()
    vms = {("default", "a"): vm("a", host="h1", move={"toHost": "h1"})}

    def vm_of(ns: str, name: str) -> Obj | None:
        return vms.get((ns, name))

    # During a move nothing changes hands; after it, the holder follows the VM.
    assert A.sweep(api, "h0", vm_of) == []
    vms[("default", "a")] = vm("a", host="h1")
    assert A.sweep(api, "h0", vm_of) == ["handed lan.10.9.0.2 to host h1"]
    assert api.held()["lan.10.9.0.2"] == ("a", 0, "h1")
    assert A.sweep(api, "h0", vm_of) == []
    # A VM deleted while its holder was away: freed at the holder's sweep, once the API
    # server agrees it is gone; one made again under its name is not it.
    vms[("default", "a")] = vm("a", uid="uid-a2")
    assert A.sweep(api, "h1", vm_of, namespace="other") == []
    assert A.sweep(api, "h1", vm_of) == ["freed lan.10.9.0.2 (FusumaVM default/a is "
                                         "gone)", "freed lan.10.9.0.3 (FusumaVM default/b "
                                         "is gone)"]
    api.put(VM, vm("c"))
    A.allocate(api, "h1", VmView(vm("c", {"network": "lan"})))
    assert A.sweep(api, "h1", lambda ns, name: None) == []  # the API server has it
    assert A.free(api, "h1", "uid-c") == ["lan.10.9.0.2"]
    assert api.held() == {}


def test_the_address_policy_lets_a_host_hold_hand_on_and_free_only_its_own() -> None:
    docs = admission_policy()
    assert [d["metadata"]["name"] for d in docs[-2:]] == [ADDRESS_POLICY] * 2
    spec = docs[-2]["spec"]
    assert spec["matchConstraints"]["resourceRules"][0]["operations"] == [
        "CREATE", "UPDATE", "DELETE"]
    rules = " ".join(v["expression"] for v in spec["validations"])
    for needle in ("oldObject.spec.host == variables.me", "object.spec.host == variables.me",
                   "object.metadata.name == object.spec.network + '.' + object.spec.address",
                   f"labels[?'{A.VM_UID_LABEL}']"):
        assert needle in rules, needle


def test_the_host_defines_the_vm_with_the_addresses_it_holds() -> None:
    o = vm("a", {"network": "lan"},
           {"network": "lan", "ip": "10.9.0.6", "mac": "52:54:00:00:00:01"})
    v = VmView(o)
    assert v.vm_spec_fields("p0", {0: "10.9.0.2", 1: "10.9.0.6"})["nics"] == [
        {"network": "lan", "ip": "10.9.0.2"},
        {"network": "lan", "mac": "52:54:00:00:00:01", "ip": "10.9.0.6"}]
    # Later passes (a stopped VM redefined, another host after a handover) read
    # status.nics.
    o["status"]["nics"] = [{"index": 0, "network": "lan", "ip": "10.9.0.3"}]
    assert VmView(o).vm_spec_fields("p0")["nics"][0] == {"network": "lan", "ip": "10.9.0.3"}
    assert VmView(vm("b")).vm_spec_fields("p0").get("nics") is None
