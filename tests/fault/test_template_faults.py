"""Templates under faults: a save that fails half way, a template whose files are
missing or damaged, a clone's QEMU killed while it starts, clones where they cannot
run. Each gets one sentence and leaves nothing half made; the template is never
changed."""

from __future__ import annotations

import os
import signal
import sqlite3
import subprocess
import time
from pathlib import Path

import pytest

from tests.conftest import FUSUMA, Host, Result
from tests.fault.movekit import qemu_pids
from tests.fault.test_bad_input import assert_one_sentence
from tests.integration.test_templates import sha256

pytestmark = [pytest.mark.fault, pytest.mark.timeout(400)]


def run_env(host: Host, env: dict[str, str], *args: str) -> Result:
    """Run the CLI with extra environment (fault injection)."""
    p = subprocess.run([*FUSUMA, *args], env={**host.env, **env}, capture_output=True,
                       text=True, timeout=300)
    return Result(p.returncode, p.stdout, p.stderr)


def job_phase(host: Host, obj: str) -> str | None:
    with sqlite3.connect(host.home / "state.db") as conn:
        row = conn.execute("SELECT phase FROM jobs WHERE obj=?", (obj,)).fetchone()
    return None if row is None else str(row[0])


def shm_files(host: Host) -> list[str]:
    return sorted(p.name for p in host.shm.iterdir()) if host.shm.exists() else []


def test_template_faults(host: Host) -> None:
    host.run("partition", "create", "p10", "--cpus", host.core(0), "--memory", "1400",
             "--qemu", "10.0")
    host.run("partition", "create", "p72", "--cpus", host.core(1), "--memory", "512")
    host.run("vm", "create", "src", "-p", "p10", "--start")

    # Refused before anything changes: a VM that is not running, an unknown VM.
    host.run("vm", "create", "idle", "-p", "p10")
    res = host.fail("template", "create", "t", "--from", "idle")
    assert_one_sentence(res.err)
    assert "is stopped; a template is made from a running VM" in res.err
    assert_one_sentence(host.fail("template", "create", "t", "--from", "nope").err)

    # A save that fails after the state was written (fault injected): the VM runs on,
    # its guest answers, no record and no file of the template are left.
    before = shm_files(host)
    for phase in ("stop", "save"):
        res = run_env(host, {"FUSUMA_FAULT_TEMPLATE": phase},
                      "template", "create", "t", "--from", "src")
        assert res.code != 0
        assert_one_sentence(res.err)
        assert "fault injected" in res.err
        assert host.vm("src")["state"] == "running"
        assert host.run("vm", "exec", "src", "--", "hostname").out.strip() == "src"
        assert host.run("template", "list", "--json").json() == []
        assert shm_files(host) == before and not (host.home / "templates" / "t").exists()

    # The supervisor killed while it prepares the guest: the next command that touches
    # the VM has a new supervisor undo the save; the VM runs on, nothing is left.
    p = subprocess.Popen([*FUSUMA, "template", "create", "t", "--from", "src"],
                         env=host.env, text=True, stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE)
    deadline = time.monotonic() + 30
    while job_phase(host, "vm:src") != "guest" and time.monotonic() < deadline:
        time.sleep(0.05)
    assert job_phase(host, "vm:src") == "guest"
    os.kill(int(host.part("p10")["supervisor_pid"]), signal.SIGKILL)
    _, err = p.communicate(timeout=60)
    assert p.returncode != 0
    assert_one_sentence(err)
    assert host.run("vm", "exec", "src", "--", "hostname").out.strip() == "src"
    assert job_phase(host, "vm:src") is None and host.vm("src")["state"] == "running"
    assert host.run("template", "list", "--json").json() == []
    assert shm_files(host) == before and not (host.home / "templates" / "t").exists()

    t = host.run("template", "create", "t", "--from", "src", "--json").json()
    ram, state = Path(t["ram_path"]), Path(t["state_path"])
    good = sha256(ram)
    size = ram.stat().st_size
    res = host.fail("template", "create", "t", "--from", "idle")
    assert_one_sentence(res.err)
    assert "already exists" in res.err

    # Clones where they cannot run: a QEMU older than 8.2, different RAM.
    res = host.fail("vm", "create", "old", "-p", "p72", "--template", "t")
    assert_one_sentence(res.err)
    assert "QEMU 7.2" in res.err and "10.0" in res.err
    res = host.fail("vm", "create", "big", "-p", "p10", "--template", "t", "--memory", "512")
    assert_one_sentence(res.err)
    names = {v["name"] for v in host.ps()["vms"]}
    assert names == {"src", "idle"}

    # Damaged or missing files: refused at create and at start, nothing made or run.
    host.run("vm", "create", "c1", "-p", "p10", "--template", "t")
    saved = state.read_bytes()
    state.write_bytes(saved[:-1] + bytes([saved[-1] ^ 1]))
    for args in (("vm", "create", "c2", "-p", "p10", "--template", "t", "--start"),
                 ("vm", "start", "c1")):
        res = host.fail(*args)
        assert_one_sentence(res.err)
        assert "template 't' is damaged" in res.err and "sha256" in res.err
    state.write_bytes(saved)
    os.truncate(ram, size + 4096)
    res = host.fail("vm", "start", "c1")
    assert_one_sentence(res.err)
    assert "bytes, not" in res.err
    os.truncate(ram, size)
    aside = ram.with_name("aside")
    ram.rename(aside)
    res = host.fail("vm", "start", "c1")
    assert "is missing" in res.err
    aside.rename(ram)
    assert host.run("template", "show", "t", "--json").json()["intact"]
    assert {v["name"]: v["state"] for v in host.ps()["vms"]} == {
        "src": "stopped", "idle": "stopped", "c1": "stopped"}
    assert qemu_pids(host, "c1") == [] and qemu_pids(host, "c2") == []

    # A clone's QEMU killed while it loads the template (the supervisor holds it
    # there): the start fails with one sentence, no QEMU of it is left, its state says
    # so, and the next start works.
    host.run("partition", "delete", "p72")
    assert run_env(host, {"FUSUMA_FAULT_CLONE_RESTORE_DELAY": "3"}, "partition", "create",
                   "slow", "--cpus", host.core(1), "--memory", "700", "--qemu", "10.0").code == 0
    host.run("vm", "create", "k1", "-p", "slow", "--template", "t")
    p = subprocess.Popen([*FUSUMA, "vm", "start", "k1"], env=host.env, text=True,
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    deadline = time.monotonic() + 20
    while not qemu_pids(host, "k1") and time.monotonic() < deadline:
        time.sleep(0.05)
    pids = qemu_pids(host, "k1")
    assert len(pids) == 1
    time.sleep(0.5)
    os.kill(pids[0], signal.SIGKILL)
    out, err = p.communicate(timeout=60)
    assert p.returncode != 0, out
    assert_one_sentence(err)
    assert "k1" in err
    assert qemu_pids(host, "k1") == []
    k1 = host.vm("k1")
    assert k1["state"] in ("stopped", "crashed") and k1["pid"] is None and k1["error"]
    assert sha256(ram) == good
    host.run("vm", "start", "k1")
    assert len(qemu_pids(host, "k1")) == 1
    assert host.run("vm", "exec", "k1", "--", "hostname").out.strip() == "k1"
    assert sha256(ram) == good

    # In use, then free: deletion refused naming the clones, then allowed.
    res = host.fail("template", "delete", "t")
    assert_one_sentence(res.err)
    assert "c1, k1" in res.err
    host.run("vm", "delete", "k1", "--force")

    # The supervisor killed between a clone's `cont` and its identity step: the next
    # supervisor finds the step's job and gives the clone its own identity (before,
    # it kept its template's hostname).
    assert run_env(host, {"FUSUMA_FAULT_CLONE_IDENTITY_DELAY": "30"}, "partition",
                   "restart", "slow").code == 0
    host.run("vm", "create", "k2", "-p", "slow", "--template", "t", "--start")
    assert job_phase(host, "identity:k2") == "identity"
    sup = next(p["supervisor_pid"] for p in host.ps()["partitions"] if p["name"] == "slow")
    os.kill(sup, signal.SIGKILL)
    host.run("partition", "restart", "slow")
    assert host.run("vm", "exec", "k2", "--", "hostname").out.strip() == "k2"
    assert job_phase(host, "identity:k2") is None
    assert len(qemu_pids(host, "k2")) == 1
    host.run("vm", "delete", "k2", "--force")
    host.run("vm", "delete", "c1")
    host.run("template", "delete", "t")
    assert not ram.exists() and not state.exists()
