"""Nothing lost, nothing wedged: the four cases reported against 316d991 as
regressions, commands issued in the middle of a move, racing CLIs, and a host crash.
Real processes, real QEMU, real kills."""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import time
from pathlib import Path

import pytest

from tests.conftest import FUSUMA, Host
from tests.fault.movekit import (
    PHASES,
    check_truth,
    hold_move,
    intact,
    job,
    next_move_works,
    qemu_pids,
    ready,
    two_partitions,
    wait_resolved,
)
from tests.fault.test_bad_input import assert_one_sentence

pytestmark = [pytest.mark.fault, pytest.mark.timeout(300)]


def test_failed_up_keeps_a_disk_image_it_did_not_create(host: Host, tmp_path: Path) -> None:
    keep = tmp_path / "disks" / "keep.img"
    keep.parent.mkdir()
    keep.write_bytes(b"precious" * 2048)
    busy = socket.socket()
    busy.bind(("127.0.0.1", 0))
    busy.listen()
    port = busy.getsockname()[1]
    spec = tmp_path / "host.toml"
    spec.write_text(f"""
[[storage]]
path = "{keep.parent}"

[[partition]]
name = "p0"
cpus = "{host.core(0)}"
memory_mib = 768

[[disk]]
name = "keep"
path = "{keep}"
partition = "p0"
size_mib = 16

[[vm]]
name = "web"
partition = "p0"
disks = ["keep"]
ports = ["{port}:80"]
""")
    try:
        err = host.fail("up", str(spec), "--no-wait").err
    finally:
        busy.close()
    assert "fusuma: error:" in err
    assert keep.read_bytes() == b"precious" * 2048, "up's rollback touched the user's disk"
    ps = host.ps()
    assert ps["partitions"] == [] and ps["vms"] == []


def test_stop_during_a_move_is_refused_and_the_move_completes(host: Host) -> None:
    two_partitions(host)
    ram = host.shm / "vm0.ram"
    held = hold_move(host, "streamed")
    res = host.fail("vm", "stop", "vm0")
    assert_one_sentence(res.err)
    assert "VM 'vm0' is busy: moving to p1 (phase: streamed) since " in res.err, res.err
    assert f"by pid {held.proc.pid}" in res.err
    shown = host.vm("vm0")
    assert shown["state"] == "migrating" and shown["job"]["phase"] == "streamed"
    assert shown["job"]["owner_pid"] == held.proc.pid and shown["job"]["owner_alive"]
    assert "moving to p1 (streamed" in host.run("ps").out
    _out, err = held.proc.communicate(timeout=60)
    assert held.proc.returncode == 0, err
    v = host.vm("vm0")
    assert (v["partition"], v["state"]) == ("p1", "running")
    assert ram.exists(), "the RAM file of a running guest was unlinked"
    assert intact(host, "vm0")
    next_move_works(host)     # zero-copy again, on the same RAM file
    assert ram.exists()


def test_cli_killed_after_the_stream_recovers_without_an_operator(host: Host) -> None:
    two_partitions(host)
    held = hold_move(host, "resumed")      # the stream is done, the source not released
    t0 = time.monotonic()
    os.kill(held.proc.pid, signal.SIGKILL)
    held.proc.wait()
    while job(host, "vm0") is not None:
        assert time.monotonic() - t0 < 5, "no recovery within 5 s of the owner's death"
        time.sleep(0.05)
    v = host.vm("vm0")
    assert (v["partition"], v["state"]) == ("p1", "running"), v
    assert qemu_pids(host, "vm0") == [v["pid"]], "an orphan QEMU maps the guest's RAM"
    assert not list((host.runtime / "vms" / "vm0").glob("in-*"))
    assert intact(host, "vm0")
    host.run("vm", "stop", "vm0")
    host.run("vm", "start", "vm0")
    next_move_works(host)


@pytest.mark.parametrize("phase", list(PHASES))
def test_every_command_during_a_move_is_refused_or_queued(shared_logs: Host,
                                                          phase: str) -> None:
    # The phases share one host and guest: what a case's commands changed (a move, a
    # restarted supervisor, a resize) the next case's start puts back.
    host = shared_logs
    ready(host)
    held = hold_move(host, phase)
    commands = [["vm", "stop", "vm0"], ["vm", "kill", "vm0"],
                ["vm", "exec", "vm0", "--", "/bin/true"],
                ["partition", "resize", "p1", "--memory", "1100"],
                ["vm", "delete", "vm0"], ["partition", "restart", "p0"],
                ["maintain", "p1", "--via", "p0"]]
    procs = [subprocess.Popen([*FUSUMA, *c], env=host.env, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for c in commands]
    # Each answer, and whether the move was over before the command ended: on a loaded
    # host a command may reach its supervisor only after the held move has ended (it
    # is held HOLD_S seconds), and then it may succeed. The move counts as over for a
    # command only if it was over before the last poll that saw the command running.
    answers: dict[int, tuple[list[str], int, str, str, bool]] = {}
    over_before = False
    deadline = time.monotonic() + 120
    while len(answers) < len(procs):
        assert time.monotonic() < deadline, [c for i, c in enumerate(commands)
                                             if i not in answers]
        over_now = held.proc.poll() is not None and job(host, "vm0") is None
        for i, p in enumerate(procs):
            if i not in answers and p.poll() is not None:
                out, err = p.communicate()
                answers[i] = (commands[i], p.returncode, out, err, over_before)
        over_before = over_now
        time.sleep(0.01)
    held.proc.communicate(timeout=60)
    wait_resolved(host, held)
    for cmd, code, _out, err, after_the_move in (answers[i] for i in range(len(procs))):
        if code != 0:
            assert_one_sentence(err)
            assert "Traceback" not in err
            # Refused because of the move, or because of what the move left: never
            # because the command mistook the state.
            assert any(s in err for s in ("is busy", "is running", "stop it first",
                                          "is being recovered", "is migrating",
                                          "has no running VM", "already")), (cmd, err)
        elif (cmd[:2] == ["vm", "stop"] or cmd[:2] == ["vm", "kill"]) \
                and not after_the_move:
            pytest.fail(f"{cmd} succeeded in the middle of a move: {err}")
    check_truth(host)


def test_eight_racing_clis_one_answer_each(host: Host) -> None:
    two_partitions(host)
    commands = [["migrate", "vm0", "--to", "p1"]] * 4 + [
        ["vm", "stop", "vm0"], ["partition", "resize", "p0", "--memory", "1100"],
        ["vm", "delete", "vm0"], ["vm", "create", "vm0", "-p", "p1"]]
    procs = [subprocess.Popen([*FUSUMA, *c], env=host.env, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for c in commands]
    answers = [(c, *p.communicate(timeout=180), p.returncode) for c, p in
               zip(commands, procs, strict=True)]
    for cmd, _out, err, code in answers:
        if code != 0:
            assert_one_sentence(err)
            assert "Traceback" not in err, (cmd, err)
    ok = {tuple(c) for c, _o, _e, code in answers if code == 0}
    assert [v["name"] for v in host.ps()["vms"]].count("vm0") <= 1
    pids = qemu_pids(host, "vm0")
    assert len(pids) <= 1
    moved = sum(1 for c, *_r, code in answers if c[0] == "migrate" and code == 0)
    assert moved <= 1, "the same VM moved to p1 twice"
    if ("vm", "delete", "vm0") in ok:
        # One order runs them one after another: the stop first (a delete needs a
        # stopped VM), then the delete; the name was then free for the create.
        assert ("vm", "stop", "vm0") in ok, "a running VM was deleted"
        if ("vm", "create", "vm0", "-p", "p1") in ok:
            v = host.vm("vm0")
            assert (v["partition"], v["state"], pids) == ("p1", "stopped", [])
        else:
            assert "vm0" not in [v["name"] for v in host.ps()["vms"]] and pids == []
        assert host.part("p0")["memory_mib"] in (1024, 1100)
        return
    assert ("vm", "create", "vm0", "-p", "p1") not in ok, "a second VM of the same name"
    v = host.vm("vm0")
    if ("vm", "stop", "vm0") in ok:
        assert v["state"] == "stopped" and pids == []
    else:
        assert v["state"] == "running" and pids == [v["pid"]]
        assert v["partition"] == ("p1" if moved else "p0")
    assert host.part("p0")["memory_mib"] in (1024, 1100)


def test_host_crash_then_ps_and_up_tell_and_repair(host: Host) -> None:
    host.run("up")
    before = {v["name"]: v["pid"] for v in host.ps()["vms"]}
    assert all(before.values())
    victims = host.our_pids()
    for pid in victims:
        os.kill(pid, signal.SIGKILL)
    deadline = time.monotonic() + 10
    while any(Path(f"/proc/{p}").exists() and "Z" not in
              Path(f"/proc/{p}/stat").read_text().rsplit(")", 1)[1].split()[0]
              for p in victims if Path(f"/proc/{p}/stat").exists()):
        assert time.monotonic() < deadline
        time.sleep(0.05)
    ps = host.ps()
    assert {v["name"]: v["state"] for v in ps["vms"]} == {n: "crashed" for n in before}
    assert all(p["state"] == "supervisor-down" for p in ps["partitions"])
    host.run("up")
    ps = host.ps()
    assert all(v["state"] == "running" for v in ps["vms"]), ps["vms"]
    assert all(p["state"] == "running" for p in ps["partitions"])
    for name in before:
        assert len(qemu_pids(host, name)) == 1
        assert host.run("vm", "exec", name, "--", "/bin/true").code == 0
    # One RAM file per guest: none left from the QEMUs that died.
    assert sorted(p.name for p in host.shm.iterdir()) == sorted(f"{n}.ram" for n in before)


def test_runtime_dir_others_cannot_pass_is_refused_up_front(host: Host,
                                                            tmp_path: Path) -> None:
    own = host.runtime
    closed = tmp_path / "closed"
    closed.mkdir(mode=0o700)
    host.runtime = closed / "run"
    host.env["FUSUMA_RUNTIME_DIR"] = str(host.runtime)
    err = host.fail("partition", "create", "p0", "--cpus", host.core(0), "--memory", "512").err
    assert_one_sentence(err)
    assert f"below {closed}, which other users cannot pass" in err, err
    assert f"chmod o+x {closed}" in err
    assert host.ps()["partitions"] == []
    # Missing parents fusuma makes itself are passable (0711), so this works:
    host.runtime = Path(f"/tmp/fz-{host.tag}") / "nested" / "run"
    host.env["FUSUMA_RUNTIME_DIR"] = str(host.runtime)
    try:
        host.run("partition", "create", "p0", "--cpus", host.core(0), "--memory", "512")
        host.run("vm", "create", "v", "-p", "p0", "--memory", "128", "--start")
        assert host.run("vm", "exec", "v", "--", "/bin/true").code == 0
        assert (host.runtime.parent.stat().st_mode & 0o777) == 0o711
    finally:
        host.run("down", check=False)
        shutil.rmtree(f"/tmp/fz-{host.tag}", ignore_errors=True)
        # The fixture's own teardown (and its leftover check) uses the usual runtime
        # dir again: with the nested one it would make /tmp/fz-TAG/nested anew.
        host.runtime = own
        host.env["FUSUMA_RUNTIME_DIR"] = str(own)
