"""`fusuma host drain` on a real cluster (issue 27, "Drain and evacuate"): the drained
host's agent moves its VMs live to the other hosts, the CLI follows, `uncordon`
reverses it; `drain --partition` moves a partition's VMs into the host's other one.
See conftest.py for the lab; the decisions themselves are
tests/unit/test_cluster_drain.py's and test_cluster_drain_places.py's."""

from __future__ import annotations

import json
import time

import pytest

from tests.cluster.conftest import Cluster, wait_for
from tests.cluster.test_cluster import WRITE, guest_md5, vm_yaml

pytestmark = [pytest.mark.cluster, pytest.mark.timeout(300)]


def uptime(c: Cluster, host: str, vm: str) -> float:
    return float(c.host(host).run("vm", "exec", vm, "--", "/bin/cat",
                                  "/proc/uptime").out.split()[0])


def test_drain_moves_every_vm_off_live_and_uncordon_reverses_it(clean: Cluster) -> None:
    c, lab = clean, clean.lab

    def host_cmd(*args: str) -> tuple[int, str, str]:
        p = lab.fusuma(lab.ctl, ["host", *args, "--kubeconfig",
                                 str(lab.admin_kubeconfig)], timeout=200)
        return p.returncode, p.stdout, p.stderr

    # Both VMs land on h0: the other hosts are cordoned while they are placed (not
    # pinned by spec.host: a pinned VM is not drained).
    for h in ("h1", "h2"):
        assert host_cmd("cordon", h)[0] == 0
    names = ("d0", "d1")
    c.apply("---\n".join(vm_yaml(n) for n in names))
    for n in names:
        o = wait_for(lambda n=n: c.running(n), 180, f"{n} running")
        assert o["status"]["host"] == "h0"
    for h in ("h1", "h2"):
        assert host_cmd("uncordon", h)[0] == 0
    data = {n: guest_md5(c, "h0", n, WRITE) for n in names}
    up0 = {n: uptime(c, "h0", n) for n in names}

    t0 = time.monotonic()
    rc, out, err = host_cmd("drain", "h0", "--wait", "--timeout", "150")
    drain_s = time.monotonic() - t0
    assert rc == 0, (out, err)
    assert out.strip().startswith("no VM is left on host h0 (2 moved)"), out
    # A line per VM as it moved (a "moving" line only if a read fell inside its move).
    for n in names:
        assert f"moved default/{n} to " in err, err

    host = lab.get("fusumahost", "h0", None)
    assert (host["spec"]["unschedulable"], host["spec"]["drain"]) == (True, True)
    st = host["status"]["drain"]
    assert (st["state"], st["remaining"], st["refused"]) == ("Drained", 0, [])
    assert sorted(m["vm"] for m in st["moved"]) == [f"default/{n}" for n in names]
    for n in names:
        o = c.vm(n)
        where = o["status"]["host"]
        assert where in ("h1", "h2") and c.running(n), o["status"]
        assert o["status"]["placement"]["reason"] == "Drained"
        move = o["status"]["lastMove"]
        assert (move["kind"], move["from"].split("/")[0], move["result"]) == (
            "between-hosts", "h0", "ok")
        assert list(c.local_vms(n)) == [where]
        assert guest_md5(c, where, n) == data[n]
        assert uptime(c, where, n) > up0[n], f"{n} rebooted"
        reasons = [e["reason"] for e in c.events(n)]
        assert "Drained" in reasons and "Moved" in reasons, reasons
    assert not c.host("h0").ps()["vms"]

    # A new VM is not placed on the drained host.
    c.apply(vm_yaml("late"))
    assert wait_for(lambda: c.running("late"), 180, "late running")["status"]["host"] != "h0"

    rc, out, err = host_cmd("uncordon", "h0")
    assert rc == 0, err
    host = wait_for(lambda: (h := lab.get("fusumahost", "h0", None))
                    and "drain" not in (h.get("status") or {}) and h, 30,
                    "h0's drain status to go")
    # (The CRD's defaults show false for a field that is unset.)
    assert (host["spec"]["unschedulable"], host["spec"].get("drain", False)) == (False,
                                                                                 False)
    rows = json.loads(host_cmd("list", "--json")[1])
    assert [(r["name"], r["schedulable"], r["drainState"]) for r in rows] == [
        ("h0", True, None), ("h1", True, None), ("h2", True, None)]

    # Only a partition's QEMU to upgrade: its VMs go to the host's other partition,
    # zero-copy, and stay on the host (spec.drainPartitions).
    late = c.vm("late")["status"]
    on, part = late["host"], late["partition"]
    other = "p1" if part == "p0" else "p0"
    up = uptime(c, on, "late")
    t0 = time.monotonic()
    rc, out, err = host_cmd("drain", on, "--partition", part, "--wait", "--timeout", "60")
    part_s = time.monotonic() - t0
    assert rc == 0, (out, err)
    assert out.strip().startswith(f"no VM is left on partition(s) {part} of host {on} ("), out
    assert f"moved default/late to {on}/{other}" in err, err
    o = c.vm("late")["status"]
    assert (o["host"], o["partition"], o["placement"]["reason"]) == (on, other, "Drained")
    assert (o["lastMove"]["kind"], o["lastMove"]["result"]) == ("in-host", "ok")
    assert uptime(c, on, "late") > up, "late rebooted"
    # Each placement reserved its room first in the ledger, written by the hosts'
    # own identities (the admission policy and their roles let them).
    ledger = lab.get("lease", "fusuma-room", "fusuma-system")
    holds = json.loads(ledger["metadata"]["annotations"]["fusuma.io/holds"])
    assert {"vm": "default/late", "host": on, "partition": other}.items() <= \
        holds[-1].items(), holds
    assert ledger["spec"]["holderIdentity"] == on
    assert host_cmd("uncordon", on, "--partition", part)[0] == 0
    assert not lab.get("fusumahost", on, None)["spec"].get("drainPartitions")
    print(f"drain of 2 VMs: {drain_s:.1f} s; downtimes "
          f"{[m.get('downtimeMs') for m in st['moved']]} ms; drain of a partition: "
          f"{part_s:.1f} s, {o['lastMove'].get('downtimeMs')} ms downtime")
