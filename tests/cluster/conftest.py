"""A real cluster for the cluster tests: etcd + kube-apiserver in a network namespace,
three fusuma hosts (each a ``tests.conftest.Host``: its own home, runtime, shm dir,
cgroup prefix and uid range) in network namespaces of their own, an agent on each.

Module-scoped (bringing it up takes seconds, the guests are the slow part); every test
deletes its FusumaVMs afterwards and waits until the agents removed them. At the end
each host is taken down and checked for leftovers like any integration test's host,
and the lab proves its processes and namespaces are gone.
"""

from __future__ import annotations

import json
import shutil
import time
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

import pytest

from fusuma.cluster.lab import Lab, LabHost, missing_parts
from tests.conftest import REPO, Host, core

T = TypeVar("T")


def _qemu_10() -> str | None:
    """QEMU 10.0 (`fusuma qemu install 10.0`) when installed: live copy moves between
    hosts under TCG need QEMU >= 9.0; with the system's 7.2 they pause the guest."""
    from fusuma.paths import Paths
    from fusuma.qemu import versions

    try:
        return "10.0" if versions.resolve_unpacked(Paths.from_env(), "10.0") else None
    except Exception:
        return None


QEMU = _qemu_10()
PARTITIONS = """
apiVersion: fusuma.io/v1alpha1
kind: FusumaPartition
metadata: {{name: {h}-p0}}
spec: {{host: {h}, name: p0, cpus: [{c0}], memoryMiB: 1024{q}}}
---
apiVersion: fusuma.io/v1alpha1
kind: FusumaPartition
metadata: {{name: {h}-p1}}
spec: {{host: {h}, name: p1, cpus: [{c1}], memoryMiB: 1024{q}}}
"""


def wait_for(fn: Callable[[], T | None], timeout: float, what: str,
             every: float = 0.5) -> T:
    deadline = time.monotonic() + timeout
    last: Any = None
    while time.monotonic() < deadline:
        try:
            last = fn()
        except AssertionError as exc:
            last = exc
        else:
            if last:
                return last
        time.sleep(every)
    raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what} "
                         f"(last: {last!r:.2000})")


class Cluster:
    def __init__(self, lab: Lab, hosts: list[Host]) -> None:
        self.lab = lab
        self.hosts = hosts            # tests.conftest.Host of each lab host, same order

    def host(self, name: str) -> Host:
        return self.hosts[int(name.removeprefix("h"))]

    def lab_host(self, name: str) -> LabHost:
        return self.lab.hosts[int(name.removeprefix("h"))]

    def apply(self, yaml_text: str) -> None:
        self.lab.kubectl("apply", "-f", "-", input=yaml_text)

    def vm(self, name: str, ns: str = "default") -> dict[str, Any]:
        out: dict[str, Any] = self.lab.get("fusumavm", name, ns)
        return out

    def vms(self, ns: str | None = None) -> list[dict[str, Any]]:
        args = ["get", "fusumavm", "-o", "json"]
        args += ["-n", ns] if ns else ["-A"]
        items: list[dict[str, Any]] = json.loads(self.lab.kubectl(*args).stdout)["items"]
        return items

    def cond(self, obj: dict[str, Any], ctype: str) -> dict[str, Any]:
        for c in (obj.get("status") or {}).get("conditions") or []:
            if c["type"] == ctype:
                return dict(c)
        return {}

    def running(self, name: str, ns: str = "default") -> dict[str, Any] | None:
        o = self.vm(name, ns)
        st = o.get("status") or {}
        ok = st.get("state") == "Running" and self.cond(o, "Ready").get("status") == "True"
        return o if ok else None

    def events(self, name: str, ns: str = "default") -> list[dict[str, Any]]:
        out = json.loads(self.lab.kubectl(
            "get", "events", "-n", ns, "-o", "json",
            f"--field-selector=involvedObject.name={name}").stdout)["items"]
        return sorted(out, key=lambda e: e.get("firstTimestamp") or "")

    def local_vms(self, name: str) -> dict[str, dict[str, Any]]:
        """Each host's `fusuma ps` view of VM ``name`` (hosts that have it)."""
        out = {}
        for lh, h in zip(self.lab.hosts, self.hosts, strict=True):
            for v in h.ps()["vms"]:
                if v["name"] == name:
                    out[lh.name] = v
        return out

    def delete_all_vms(self, timeout: float = 120) -> None:
        self.lab.kubectl("delete", "fusumavm", "--all", "-A", "--wait=false")
        wait_for(lambda: not self.vms(), timeout, "every FusumaVM to be deleted", every=1)
        for h in self.hosts:
            wait_for(lambda h=h: not h.ps()["vms"], 60, "the hosts' VMs to be removed")


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory,
            request: pytest.FixtureRequest) -> Iterator[Cluster]:
    why = missing_parts()
    if why:
        pytest.fail(why)
    base = tmp_path_factory.mktemp("cluster")
    hosts = [Host(base / f"host{i}") for i in range(3)]
    lab = Lab(base / "lab", [h.env for h in hosts], lease_seconds=6)
    lab.start()
    try:
        for lh in lab.hosts:
            lab.start_agent(lh)
        c = Cluster(lab, hosts)
        q = f", qemu: '{QEMU}'" if QEMU else ""
        c.apply("---".join(PARTITIONS.format(h=lh.name, q=q, c0=core(0), c1=core(1))
                           for lh in lab.hosts))
        wait_for(lambda: all(
            (p.get("status") or {}).get("state") == "Ready"
            for p in lab.get("fusumapartition", namespace=None)["items"]) and len(
            lab.get("fusumapartition", namespace=None)["items"]) == 6, 60,
            "the partitions")
        wait_for(lambda: all(len((h.get("status") or {}).get("partitions") or []) == 2
                             for h in lab.get("fusumahost", namespace=None)["items"]),
                 30, "the hosts to report their partitions")
        yield c
    finally:
        out = REPO / "test-output" / f"cluster-{request.module.__name__.rsplit('.', 1)[-1]}"
        out.mkdir(parents=True, exist_ok=True)
        for f in lab.workdir.glob("*.log"):
            shutil.copy(f, out / f.name)
        for lh, h in zip(lab.hosts, hosts, strict=True):
            lab.stop_agent(lh)
            h.run("down", check=False, timeout=120)
        lab.close()
        left = lab.leftovers()
        for h in hosts:
            left += h.leftovers()
            h.force_clean()
        assert not left, f"left behind by the cluster tests: {left}"


@pytest.fixture
def clean(cluster: Cluster) -> Iterator[Cluster]:
    """The cluster, with every FusumaVM deleted after the test."""
    yield cluster
    for lh in cluster.lab.hosts:
        if lh.agent is None or lh.agent.poll() is not None:
            cluster.lab.start_agent(lh)
    cluster.delete_all_vms()


@pytest.fixture(autouse=True)
def _save_logs_of_a_failed_test(request: pytest.FixtureRequest) -> Iterator[None]:
    """A failed test of a cluster module leaves its hosts' logs (each supervisor's and
    VM's, before the module's hosts are taken down) in test-output/<test>/<host>/."""
    yield
    rep = getattr(request.node, "rep_call", None)
    c = request.node.funcargs.get("cluster")
    if rep is not None and rep.failed and isinstance(c, Cluster):
        for lh, h in zip(c.lab.hosts, c.hosts, strict=True):
            h.save_logs(REPO / "test-output" / request.node.name / lh.name)
