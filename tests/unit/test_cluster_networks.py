"""FusumaNetwork on one host without a cluster or a kernel: the reconciler makes the
network and spans it to the registered hosts, keeps its own status entry, refuses a
network the CLI made, and removes only what the cluster made (segments share the same
machinery, checked here too)."""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from fusuma.cluster.networks import NetworkReconciler, peers
from fusuma.cluster.owners import Owners
from fusuma.errors import NetworkError
from fusuma.paths import Paths
from fusuma.state import Database


class FakeKube:
    def __init__(self, obj: dict[str, Any]) -> None:
        self.obj = obj
        self.writes = 0

    def get(self, kind: Any, name: str, namespace: str | None = None) -> dict[str, Any]:
        return copy.deepcopy(self.obj)

    def replace(self, kind: Any, obj: dict[str, Any], sub: str | None = None) -> Any:
        assert sub == "status"
        self.obj = copy.deepcopy(obj)
        self.writes += 1
        return obj


class FakeInformer:
    def __init__(self, items: list[dict[str, Any]]) -> None:
        self._items = items

    def items(self) -> list[dict[str, Any]]:
        return self._items


@dataclass
class FakeCtx:
    paths: Paths
    db: Database


@dataclass
class FakeEvents:
    said: list[str] = field(default_factory=list)

    def emit(self, obj: Any, reason: str, message: str, *a: Any) -> None:
        self.said.append(f"{reason}: {message}")


class FakeAgent:
    host = "h0"
    address = "10.251.0.10"

    def __init__(self, tmp: Path, obj: dict[str, Any]) -> None:
        self._ctx = FakeCtx(Paths(home=tmp / "home", runtime=tmp / "run", shm=tmp / "shm",
                                  cache=tmp / "c", cgroup_prefix="fusuma-t"),
                            Database(tmp / "state.db"))
        self.kube = FakeKube(obj)
        self.owners = Owners(tmp / "home")
        self.events = FakeEvents()
        self.finalized: list[bool] = []
        self.hosts_informer = FakeInformer([
            {"status": {"address": a}} for a in ("10.251.0.10", "10.251.0.11", "")])

    def ctx(self) -> FakeCtx:
        return self._ctx

    def add_finalizer(self, kind: Any, obj: Any) -> None:
        self.finalized.append(True)

    def remove_finalizer(self, kind: Any, obj: Any) -> None:
        self.finalized.append(False)


NET = {"metadata": {"name": "lan", "uid": "u-1"},
       "spec": {"subnet": "10.124.0.0/24", "vni": 124, "nat": False}}


@pytest.fixture
def kernel(monkeypatch: pytest.MonkeyPatch) -> list[tuple[Any, ...]]:
    """What the reconciler asked of the kernel: networks made, spans, deletions."""
    from fusuma.network import span
    from fusuma.network.manager import NetworkManager, NetworkStatus

    calls: list[tuple[Any, ...]] = []

    def create(mgr: NetworkManager, name: str, type_: str = "managed", **kw: Any) -> Any:
        from fusuma.state import NetworkRecord

        calls.append(("create", name, kw["subnet"], kw["nat"], kw["mtu"]))
        mgr.db.add_network(NetworkRecord(name, "managed", f"fzb-{name}", kw["subnet"],
                                         mtu=kw["mtu"]))
        return mgr.db.network(name)

    def status(mgr: NetworkManager, name: str) -> NetworkStatus:
        return NetworkStatus(mgr.db.network(name), True, 1, 2, [])

    def delete(mgr: NetworkManager, name: str) -> None:
        calls.append(("delete", name))
        mgr.db.remove_network(name)

    monkeypatch.setattr(NetworkManager, "create", create)
    monkeypatch.setattr(NetworkManager, "status", status)
    monkeypatch.setattr(NetworkManager, "delete", delete)
    monkeypatch.setattr(NetworkManager, "set_mtu",
                        lambda mgr, name, mtu: mgr.db.network(name).mtu != mtu and (
                            calls.append(("mtu", name, mtu)) or True))
    monkeypatch.setattr(span, "attach", lambda *a: calls.append(("attach", *a)) or [])
    # The host's cluster address is on a 1500-byte uplink.
    monkeypatch.setattr(span, "uplink", lambda local: ("eth0", 1500))
    return calls


def test_a_network_is_made_spanned_and_reported(tmp_path: Path,
                                                kernel: list[tuple[Any, ...]]) -> None:
    a = FakeAgent(tmp_path, copy.deepcopy(NET))
    assert peers(a) == ["10.251.0.10", "10.251.0.11"]       # type: ignore[arg-type]
    rec = NetworkReconciler(a)                                # type: ignore[arg-type]
    rec.reconcile(a.kube.obj)
    # The network's MTU: the uplink's 1500 less the VXLAN's 50.
    assert kernel == [("create", "lan", "10.124.0.0/24", False, 1450),
                      ("attach", "lan", "fzb-lan", "fusuma-t-lan-span", 124, "10.251.0.10",
                       ["10.251.0.10", "10.251.0.11"], 1450)]
    assert a.owners.get("networks", "lan") is not None and a.finalized == [True]
    st = a.kube.obj["status"]
    assert st["hosts"] == [{"host": "h0", "ready": True}]
    assert st["conditions"][0]["reason"] == "Spanned"
    rec.reconcile(a.kube.obj)            # a second pass: nothing made again, no write
    assert [c[0] for c in kernel] == ["create", "attach", "attach"] and a.kube.writes == 1
    # Deleted: removed here, its entry and finalizer gone.
    a.kube.obj["metadata"]["deletionTimestamp"] = "2026-01-01T00:00:00Z"
    rec.reconcile(a.kube.obj)
    assert kernel[-1] == ("delete", "lan") and a.kube.obj["status"]["hosts"] == []
    assert a.owners.get("networks", "lan") is None and a.finalized == [True, False]


def test_a_network_the_cli_made_is_not_taken_or_removed(
        tmp_path: Path, kernel: list[tuple[Any, ...]]) -> None:
    from fusuma.state import NetworkRecord

    a = FakeAgent(tmp_path, copy.deepcopy(NET))
    a.ctx().db.add_network(NetworkRecord("lan", "managed", "fzb-lan", "10.9.0.0/24"))
    rec = NetworkReconciler(a)                                # type: ignore[arg-type]
    rec.reconcile(a.kube.obj)
    assert kernel == []
    entry = a.kube.obj["status"]["hosts"][0]
    assert not entry["ready"] and "already has a network 'lan' the cluster did not " \
        "make" in entry["message"]
    a.kube.obj["metadata"]["deletionTimestamp"] = "2026-01-01T00:00:00Z"
    rec.reconcile(a.kube.obj)
    assert kernel == [] and a.ctx().db.find_network("lan") is not None


def test_a_failed_span_is_reported_not_raised(tmp_path: Path, kernel: list[tuple[Any, ...]],
                                              monkeypatch: pytest.MonkeyPatch) -> None:
    from fusuma.network import span

    def refuse(*a: Any) -> list[str]:
        raise NetworkError("interface fzv-lan exists with VXLAN id 9 from 10.0.0.1.")

    monkeypatch.setattr(span, "attach", refuse)
    a = FakeAgent(tmp_path, copy.deepcopy(NET))
    NetworkReconciler(a).reconcile(a.kube.obj)                # type: ignore[arg-type]
    entry = a.kube.obj["status"]["hosts"][0]
    assert entry == {"host": "h0", "ready": False,
                     "message": "interface fzv-lan exists with VXLAN id 9 from 10.0.0.1."}
    assert a.kube.obj["status"]["conditions"][0]["reason"] == "NotSpanned"


def test_a_segment_goes_through_the_same_steps(tmp_path: Path,
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    from fusuma.cluster.reconcile import SegmentReconciler
    from fusuma.ops import segments

    made: list[str] = []

    @dataclass
    class Seg:
        size_bytes: int = 8 * 2**20

    have: dict[str, Seg] = {}

    class Mgr:
        def create(self, name: str, from_image: str) -> Seg:
            made.append(f"create {name} {from_image}")
            have[name] = Seg()
            return have[name]

        def delete(self, name: str) -> None:
            made.append(f"delete {name}")
            del have[name]

    monkeypatch.setattr(segments, "segment_manager", lambda c: Mgr())
    obj = {"metadata": {"name": "tools", "uid": "u-2"},
           "spec": {"fromImage": "minimal", "hosts": ["h0"]}}
    a = FakeAgent(tmp_path, obj)
    monkeypatch.setattr(Database, "find_segment", lambda db, n: have.get(n))
    monkeypatch.setattr(Database, "segment", lambda db, n: have[n])
    rec = SegmentReconciler(a)                                # type: ignore[arg-type]
    rec.reconcile(a.kube.obj)
    assert made == ["create tools minimal"] and a.events.said[0].startswith("Built:")
    rec.reconcile(a.kube.obj)
    assert made == ["create tools minimal"]
    assert a.kube.obj["status"]["hosts"] == [{"host": "h0", "ready": True, "sizeMiB": 8}]
    a.kube.obj["spec"]["hosts"] = ["h1"]           # no longer this host's
    rec.reconcile(a.kube.obj)
    assert made[-1] == "delete tools" and a.kube.obj["status"]["hosts"] == []


def test_a_network_s_mtu_is_the_spec_s_if_the_uplink_carries_it(
        tmp_path: Path, kernel: list[tuple[Any, ...]]) -> None:
    net = copy.deepcopy(NET)
    net["spec"]["mtu"] = 1400
    a = FakeAgent(tmp_path, net)
    rec = NetworkReconciler(a)                                # type: ignore[arg-type]
    rec.reconcile(a.kube.obj)
    assert kernel[0] == ("create", "lan", "10.124.0.0/24", False, 1400)
    assert kernel[1][-1] == 1400 and a.kube.obj["status"]["hosts"][0]["ready"]
    # Changed in the spec: the record, bridge and taps follow, then the VXLAN.
    a.kube.obj["spec"]["mtu"] = 1300
    rec.reconcile(a.kube.obj)
    assert kernel[2:] == [("mtu", "lan", 1300),
                          ("attach", "lan", "fzb-lan", "fusuma-t-lan-span", 124,
                           "10.251.0.10", ["10.251.0.10", "10.251.0.11"], 1300)]
    # More than the uplink carries after the VXLAN's headers: refused, in one sentence.
    a.kube.obj["spec"]["mtu"] = 1500
    rec.reconcile(a.kube.obj)
    entry = a.kube.obj["status"]["hosts"][0]
    assert entry == {"host": "h0", "ready": False, "message": (
        "MTU 1500 is more than uplink eth0 (MTU 1500) carries after the VXLAN's 50 bytes "
        "of headers; give at most 1450 or raise eth0's MTU.")}
    assert kernel[-1][0] == "attach" and kernel[-1][-1] == 1300      # nothing new


def test_a_network_is_not_made_on_an_uplink_too_small_for_the_vxlan(
        tmp_path: Path, kernel: list[tuple[Any, ...]],
        monkeypatch: pytest.MonkeyPatch) -> None:
    from fusuma.network import span

    monkeypatch.setattr(span, "uplink", lambda local: ("eth0", 1300))
    a = FakeAgent(tmp_path, copy.deepcopy(NET))
    NetworkReconciler(a).reconcile(a.kube.obj)                # type: ignore[arg-type]
    assert kernel == [] and a.ctx().db.find_network("lan") is None
    assert a.kube.obj["status"]["hosts"][0]["message"] == (
        "uplink eth0's MTU 1300 leaves 1250 after the VXLAN's 50 bytes of headers, below "
        "1280; raise its MTU.")
