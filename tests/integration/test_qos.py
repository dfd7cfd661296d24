"""QoS classes and the governor end to end: the real cgroup values on each VM's leaf,
admission, `governor status`, `top`, and the governor acting on a real wait."""

from __future__ import annotations

import math
import time
from pathlib import Path

import pytest

from fusuma.host.cgroups import CONTROL_HEADROOM
from fusuma.host.cgroups.v1 import shares_for_weight
from tests.conftest import Host

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]

BUSY = ("setsid sh -c 'echo $$ >/tmp/busy.pid; while :; do :; done' </dev/null >/dev/null "
        "2>&1 &")


def cpu_files(host: Host, partition: str, vm: str) -> dict[str, str]:
    """The CPU policy files of a VM's leaf, v1 names (v2 values translated)."""
    v1 = Path(f"/sys/fs/cgroup/cpu/{host.prefix}/{partition}/vm.{vm}")
    if v1.is_dir():
        return {n: (v1 / n).read_text().strip()
                for n in ("cpu.shares", "cpu.cfs_quota_us", "cpu.idle") if (v1 / n).exists()}
    v2 = Path(f"/sys/fs/cgroup/{host.prefix}/{partition}/vm.{vm}")
    quota = (v2 / "cpu.max").read_text().split()[0]
    out = {"cpu.weight": (v2 / "cpu.weight").read_text().strip(),
           "cpu.cfs_quota_us": "-1" if quota == "max" else quota}
    if (v2 / "cpu.idle").exists():
        out["cpu.idle"] = (v2 / "cpu.idle").read_text().strip()
    return out


def weight(files: dict[str, str]) -> int:
    """cpu.shares, or cpu.weight on the v1 scale (a v2 VM leaf holds its weight divided
    by CONTROL_HEADROOM, rounded: back to the tens the classes' weights are made of)."""
    if "cpu.shares" in files:
        return int(files["cpu.shares"])
    return shares_for_weight(max(1, int(round(int(files["cpu.weight"]) * CONTROL_HEADROOM, -1))))


def wait_for(cond, timeout: float = 30.0, what: str = "condition") -> None:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if cond():
            return
        time.sleep(0.25)
    raise AssertionError(f"timed out waiting for {what}")


def three_classes(host: Host) -> None:
    host.run("partition", "create", "p0", "--cpus", "0-1", "--memory", "1280")
    for name, qos in (("g", "guaranteed"), ("b", "burstable"), ("e", "best-effort")):
        host.run("vm", "create", name, "-p", "p0", "--memory", "128", "--qos", qos)
        host.run("vm", "start", name, "--wait")


def test_classes_are_set_on_the_leaves_and_survive_a_supervisor_restart(host: Host) -> None:
    three_classes(host)
    assert {v["name"]: v["qos"] for v in host.ps()["vms"]} == {
        "g": "guaranteed", "b": "burstable", "e": "best-effort"}

    def check() -> None:
        g, b, e = (cpu_files(host, "p0", n) for n in ("g", "b", "e"))
        # Guaranteed: 10x a burstable VM (100x while the governor has raised it).
        assert weight(g) in (10240, 102400) and g["cpu.cfs_quota_us"] == "-1", g
        assert weight(b) == 1024 and b["cpu.cfs_quota_us"] == "-1", b
        if "cpu.idle" in e:
            assert e["cpu.idle"] == "1", e
        else:
            assert weight(e) <= 10, e
        assert e["cpu.cfs_quota_us"] == "-1"

    check()
    host.run("partition", "restart", "p0")
    check()
    st = host.run("governor", "status", "p0", "--json").json()["partitions"][0]
    assert st["partition"] == "p0" and st["cores"] == [0, 1]


def test_admission_refuses_guaranteed_vcpus_beyond_the_cores(host: Host) -> None:
    host.run("partition", "create", "p0", "--cpus", host.core(0), "--memory", "1024")
    host.run("vm", "create", "g1", "-p", "p0", "--memory", "128", "--qos", "guaranteed")
    res = host.fail("vm", "create", "g2", "-p", "p0", "--memory", "128", "--qos", "guaranteed")
    assert res.code == 5
    assert ("partition 'p0' has 1 core(s) and its guaranteed VMs already reserve 1 vCPU(s), "
            "so guaranteed VM 'g2' with 1 vCPU(s) does not fit") in res.err
    assert len(res.err.strip().splitlines()) == 1
    assert [v["name"] for v in host.ps()["vms"]] == ["g1"]
    # Burstable and best-effort VMs are not counted.
    host.run("vm", "create", "b1", "-p", "p0", "--memory", "128", "--qos", "burstable")
    # A partition cannot shrink below its guaranteed vCPUs.
    host.run("partition", "create", "p1", "--cpus", host.core(1), "--memory", "512")
    host.run("vm", "create", "g3", "-p", "p1", "--memory", "128", "--qos", "guaranteed")
    err = host.fail("vm", "create", "g4", "-p", "p1", "--vcpus", "2", "--qos",
                    "guaranteed").err
    assert "does not fit" in err


def test_governor_status_and_top_shapes(host: Host) -> None:
    three_classes(host)
    time.sleep(2.5)   # two governor ticks: loads are known
    st = host.run("governor", "status", "--json").json()
    assert [p["partition"] for p in st["partitions"]] == ["p0"]
    p = st["partitions"][0]
    for key in ("interval_s", "thresholds", "cores", "ticks", "errors", "vms", "decisions"):
        assert key in p, key
    assert p["ticks"] >= 2 and p["errors"] == 0, p
    assert p["thresholds"]["wait_high_pct"] > 0
    vms = {v["name"]: v for v in p["vms"]}
    assert sorted(vms) == ["b", "e", "g"]
    assert vms["g"]["qos"] == "guaranteed" and vms["e"]["qos"] == "best-effort"
    for v in vms.values():
        assert {"weight", "cap_cpus", "dedicated_cores", "short", "load"} <= set(v)
        assert v["load"] is not None and v["load"]["cpu_pct"] >= 0
    for d in p["decisions"]:
        assert {"at", "vm", "action", "reason", "numbers"} <= set(d)
    text = host.run("governor", "status").out
    assert "partition p0" in text and "guaranteed" in text

    top = host.run("top", "--once", "--json").json()
    rows = {v["name"]: v for v in top["vms"]}
    assert sorted(rows) == ["b", "e", "g"]
    for v in rows.values():
        assert v["partition"] == "p0" and v["pid"] > 0
        for key in ("cpu_pct", "vcpu_pct", "wait_pct", "run_delay_ms"):
            assert math.isfinite(v[key]) and v[key] >= 0, (key, v)
        assert v["vcpus"] == 1
        assert v["governor"] is not None and v["governor"]["qos"] == v["qos"]
    assert "WAIT%" in host.run("top", "--once").out


def test_governor_raises_a_waiting_guaranteed_vm(host: Host) -> None:
    """One core, a guaranteed VM and two burstable VMs all busy: at weight 10:1:1 the
    guaranteed vCPU still waits (~17%), so the governor raises its weight; with no
    spare core it may also cap the burstable ones. When the load ends, caps go."""
    host.run("partition", "create", "p0", "--cpus", host.core(0), "--memory", "1280")
    for name, qos in (("g", "guaranteed"), ("b1", "burstable"), ("b2", "burstable")):
        host.run("vm", "create", name, "-p", "p0", "--memory", "128", "--qos", qos)
        host.run("vm", "start", name, "--wait")
    def decided(action: str, since: float) -> bool:
        st = host.run("governor", "status", "p0", "--json", "--limit", "256").json()
        return any(d["vm"] == "g" and d["action"] == action and d["at"] >= since
                   for d in st["partitions"][0]["decisions"])

    def g_weight() -> int:
        st = host.run("governor", "status", "p0", "--json").json()["partitions"][0]
        return int(next(v for v in st["vms"] if v["name"] == "g")["weight"])

    # Booting may itself have made the governor act: let it settle, count what follows.
    wait_for(lambda: g_weight() == 1000, 90, "the governor to settle after boot")
    busy_since = time.time()
    # The burstable VMs first: once g is busy and favoured, their agents answer slowly.
    for name in ("b1", "b2", "g"):
        host.run("vm", "exec", name, "--", "/bin/sh", "-c", BUSY)

    wait_for(lambda: decided("raise-weight", busy_since), 60,
             "the governor to raise g's weight")
    assert weight(cpu_files(host, "p0", "g")) == 102400
    st = host.run("governor", "status", "p0", "--json", "--limit", "256").json()
    d = next(d for d in st["partitions"][0]["decisions"]
             if d["action"] == "raise-weight" and d["at"] >= busy_since)
    assert d["numbers"]["wait_pct"] > st["partitions"][0]["thresholds"]["wait_high_pct"]
    # Never below the floor: a capped burstable VM keeps >= 0.1 CPU (10 ms per 100 ms).
    for name in ("b1", "b2"):
        quota = int(cpu_files(host, "p0", name)["cpu.cfs_quota_us"])
        assert quota == -1 or quota >= 10000, (name, quota)
    # g's load gone: it turns calm, then idle; caps go and its weight comes back.
    idle_since = time.time()
    host.run("vm", "exec", "g", "--", "/bin/sh", "-c", "kill $(cat /tmp/busy.pid)")
    wait_for(lambda: decided("restore", idle_since), 120, "the governor to restore g's weight")
    assert weight(cpu_files(host, "p0", "g")) == 10240
    st = host.run("governor", "status", "p0", "--json", "--limit", "256").json()["partitions"][0]
    throttled = {d["vm"] for d in st["decisions"] if d["action"] == "throttle"}
    unthrottled = {d["vm"] for d in st["decisions"] if d["action"] == "unthrottle"}
    assert throttled <= unthrottled, (throttled, unthrottled)
    for name in ("b1", "b2"):
        assert cpu_files(host, "p0", name)["cpu.cfs_quota_us"] == "-1"
        v = next(v for v in st["vms"] if v["name"] == name)
        assert v["cap_cpus"] is None
