"""Faults of an in-place move (`fusuma maintain P --in-place`, QEMU's cpr-transfer).

The matrix: kill -9 the CLI, the partition's supervisor, the old QEMU or the new QEMU
at three phases of the move (the new QEMU waiting on its cpr channel; holding the
guest's RAM descriptors while the guest still runs on the old one; holding the whole
device state, nothing decided). After each: at most one QEMU runs the guest; if it runs,
data written before the move is intact; `ps` is true; the next in-place move works.
A new QEMU that dies always leaves the guest running on the old one. The cases share one
host and guest (``module_host``), booted again only after a case lost it. Each case's
outcome goes to test-output/cpr-matrix.jsonl.

And: an in-place move asked of QEMU 7.2 is refused with one sentence naming --via,
nothing changed."""

from __future__ import annotations

import json
import subprocess
import time
from pathlib import Path

import pytest

from tests.conftest import FUSUMA, REPO, Host
from tests.fault.movekit import (
    WRITE,
    Held,
    check_truth,
    intact,
    job,
    kill,
    qemu_pids,
    wait_resolved,
)
from tests.fault.test_bad_input import assert_one_sentence
from tests.integration.test_cpr import need_qemu_10

pytestmark = [pytest.mark.fault, pytest.mark.timeout(240)]

# Seconds the move is held at a phase: seen there within tens of ms and killed.
HOLD_S = "2"
# Phase -> (the environment that holds the in-place move there, the job phase then).
PHASES: dict[str, tuple[dict[str, str], str]] = {
    # The new QEMU listens on its cpr channel; it has nothing of the guest yet.
    "waiting": ({"FUSUMA_FAULT_SLEEP_BEFORE_STREAM": HOLD_S}, "prepared"),
    # The old QEMU handed over the RAM descriptors; the new one is built on them and
    # has not asked for the device state; the guest still runs on the old one.
    "handed": ({"FUSUMA_FAULT_SLEEP_BEFORE_INCOMING": HOLD_S}, "streaming"),
    # The device state arrived; the new QEMU is paused, nothing is decided.
    "streamed": ({"FUSUMA_FAULT_SLEEP_BEFORE_DECIDE": HOLD_S}, "streamed"),
}
TARGETS = ("cli", "supervisor", "old-qemu", "new-qemu")


def one_partition(host: Host, vm: str = "vm0") -> None:
    need_qemu_10(host)
    host.run("partition", "create", "p0", "--cpus", host.core(0), "--memory", "1024",
             "--qemu", "10.0")
    host.run("vm", "create", vm, "-p", "p0", "--start")
    host.run("vm", "exec", vm, "--", "/bin/sh", "-c", WRITE)


def ready(host: Host, vm: str = "vm0") -> None:
    """A case's start on the module's shared host: p0 on QEMU 10.0 running ``vm`` with
    its data; a host in any other state is taken down and built anew."""
    ps = host.ps()
    parts = [(p["name"], p["state"], p["qemu"]) for p in ps["partitions"]]
    vms = [(v["name"], v["state"]) for v in ps["vms"]]
    if parts != [("p0", "running", "10.0")] or vms != [(vm, "running")] \
            or len(qemu_pids(host, vm)) != 1:
        host.run("down", check=False, timeout=120)
        one_partition(host, vm)
    elif not intact(host, vm):
        host.run("vm", "exec", vm, "--", "/bin/sh", "-c", WRITE)


def hold_in_place(host: Host, phase: str, vm: str = "vm0") -> Held:
    env_extra, job_phase = PHASES[phase]
    sup = host.part("p0")["supervisor_pid"]
    proc = subprocess.Popen([*FUSUMA, "maintain", "p0", "--in-place"],
                            env={**host.env, **env_extra}, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        j = job(host, vm)
        if j is not None and j["phase"] == job_phase and (
                phase != "handed" or Path(str(j["detail"].get("dest_run")),
                                          "qmp.sock").exists()):
            break
        if proc.poll() is not None:
            raise AssertionError(f"the move ended before phase {phase}: "
                                 f"{proc.communicate()}")
        time.sleep(0.01)
    else:
        raise AssertionError(f"the move never reached phase {phase}")
    detail = j["detail"]
    return Held(proc, "cpr-transfer", {
        "cli": proc.pid, "supervisor": sup, "old-qemu": detail.get("source_pid"),
        "new-qemu": detail.get("dest_pid")})


def next_in_place_works(host: Host, vm: str = "vm0") -> None:
    if host.vm(vm)["state"] == "crashed":
        host.run("vm", "start", vm)
        host.run("vm", "exec", vm, "--", "/bin/true")
    before = host.vm(vm)["pid"]
    res = host.run("maintain", "p0", "--in-place", "--json").json()
    assert [m["qemu_mode"] for m in res["moves"]] == ["cpr-transfer"]
    after = host.vm(vm)
    assert after["pid"] != before and qemu_pids(host, vm) == [after["pid"]]
    assert host.run("vm", "exec", vm, "--", "/bin/true").code == 0


@pytest.mark.parametrize("target", TARGETS)
@pytest.mark.parametrize("phase", list(PHASES))
def test_kill_during_in_place_move(shared_logs: Host, phase: str, target: str) -> None:
    host = shared_logs
    ready(host)
    old_pid = host.vm("vm0")["pid"]
    held = hold_in_place(host, phase)
    assert held.pids["new-qemu"] in qemu_pids(host, "vm0")
    t0 = time.monotonic()
    killed = kill(held.pids[target])
    recover_s = wait_resolved(host, held)
    _out, err = held.proc.communicate()
    if target != "cli" and held.proc.returncode != 0:
        assert_one_sentence(err)
        assert "partition" in err, err
    truth = check_truth(host)
    v = host.vm("vm0")
    if target == "new-qemu":
        # The new QEMU died: the guest runs on, on the old one.
        assert (v["state"], v["pid"]) == ("running", old_pid), v
    if target == "old-qemu" and phase == "streamed":
        # The new QEMU holds everything: the guest goes on there.
        assert (v["state"], v["pid"]) == ("running", held.pids["new-qemu"]), v
    if target in ("cli", "supervisor"):
        assert v["state"] == "running", v
    next_in_place_works(host)
    row = {"phase": phase, "killed": target if killed else f"{target} (already gone)",
           "cli_exit": held.proc.returncode, **truth,
           "on": "old QEMU" if v["pid"] == old_pid else "new QEMU" if v["pid"] else None,
           "recovered_s": round(recover_s, 2), "total_s": round(time.monotonic() - t0, 2)}
    (REPO / "test-output").mkdir(exist_ok=True)
    with open(REPO / "test-output" / "cpr-matrix.jsonl", "a") as f:
        f.write(json.dumps(row) + "\n")


def test_in_place_on_qemu_7_2_is_refused_naming_via(host: Host) -> None:
    host.run("partition", "create", "p0", "--cpus", host.core(0), "--memory", "1024")
    host.run("vm", "create", "vm0", "-p", "p0", "--start")
    before = host.vm("vm0")
    qemu_before = host.part("p0")["qemu"]
    res = host.fail("maintain", "p0", "--in-place")
    assert_one_sentence(res.err)
    assert "lacks cpr-transfer" in res.err and "--via" in res.err, res.err
    assert "7.2" in res.err
    # Nothing changed: same QEMU, no job left, no second QEMU, partition as it was.
    after = host.vm("vm0")
    assert (after["pid"], after["state"]) == (before["pid"], "running")
    assert job(host, "vm0") is None and qemu_pids(host, "vm0") == [before["pid"]]
    assert host.part("p0")["qemu"] == qemu_before
    # A 10.0 QEMU asked for VMs started on 7.2 is refused the same way.
    listed = host.run("qemu", "list", "--json").json()
    if any(q["series"] == "10.0" for q in listed):
        res = host.fail("maintain", "p0", "--in-place", "--qemu", "10.0")
        assert_one_sentence(res.err)
        assert "VM 'vm0' runs on QEMU 7.2" in res.err and "--via" in res.err, res.err
        assert host.part("p0")["qemu"] == qemu_before, "the partition was switched anyway"
        assert host.vm("vm0")["pid"] == before["pid"]


def test_cli_killed_while_one_move_is_released_and_the_next_prepared(host: Host) -> None:
    """maintain --pipeline holds two moves at once: vm0's guest already runs on its new
    QEMU and its old one is being released, while vm1's new QEMU starts (its move
    begun, not streamed). The CLI killed -9 there: each move is recovered on its own
    (vm0 forward on its new QEMU, vm1 back on its old one), one QEMU per guest, data
    intact, ps true, and the next maintain moves both."""
    one_partition(host, "vm0")
    host.run("vm", "create", "vm1", "-p", "p0", "--start")
    host.run("vm", "exec", "vm1", "--", "/bin/sh", "-c", WRITE)
    old = {vm: host.vm(vm)["pid"] for vm in ("vm0", "vm1")}
    proc = subprocess.Popen([*FUSUMA, "maintain", "p0", "--in-place", "--pipeline"],
                            env={**host.env, "FUSUMA_FAULT_SLEEP_AFTER_RELEASE": "5"},
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        j0, j1 = job(host, "vm0"), job(host, "vm1")
        if j0 is not None and j0["phase"] == "released" and j1 is not None \
                and len(qemu_pids(host, "vm1")) == 2:
            break
        if proc.poll() is not None:
            raise AssertionError(f"maintain ended first: {proc.communicate()}")
        time.sleep(0.01)
    else:
        raise AssertionError("maintain never held vm0 released and vm1's QEMU started")
    assert j1["phase"] in ("prepare", "prepared"), j1
    new0 = host.vm("vm0")["pid"]
    assert kill(proc.pid)
    proc.communicate()
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and (job(host, "vm0") or job(host, "vm1")):
        time.sleep(0.1)
    assert job(host, "vm0") is None and job(host, "vm1") is None, "a job was left"
    truth = {vm: check_truth(host, vm) for vm in ("vm0", "vm1")}
    assert truth["vm0"]["checksum"] == truth["vm1"]["checksum"] == "intact", truth
    v0, v1 = host.vm("vm0"), host.vm("vm1")
    assert (v0["state"], v0["pid"]) == ("running", new0) and new0 != old["vm0"], v0
    assert (v1["state"], v1["pid"]) == ("running", old["vm1"]), v1
    res = host.run("maintain", "p0", "--in-place", "--json").json()
    assert sorted(m["vm"] for m in res["moves"]) == ["vm0", "vm1"]
    for vm in ("vm0", "vm1"):
        assert qemu_pids(host, vm) == [host.vm(vm)["pid"]]
        assert intact(host, vm)
