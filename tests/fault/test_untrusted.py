"""Root trusts nothing it is told: real guests, real local users, a real daemon.

- A guest whose agent answers garbage (or nothing): its agent is replaced, through
  `vm exec`, by a shell script in the guest that speaks on the very virtio-serial port
  qemu-ga used. That is the path a compromised guest has (guest port -> QEMU's chardev
  -> the supervisor), with no fake on the host side. `vm exec` gets one sentence,
  `vm stop` finishes within its timeout, and `ps` says the VM stopped and why.
- A guest that floods its serial console: the log stays within FUSUMA_CONSOLE_LOG_MAX
  at every moment, one rotated file is kept, and the console still works.
- A local user (``nobody``) who makes the shm or runtime directory first: refused with
  one sentence, nothing made there, the directory left as it was.
- A local user's process that maps a file whose path ends like a guest's RAM file and
  says ``debug-threads=on``: the RAM file is still removed when the VM stops.
- `exec` through the API: neither the command nor the guest's output lands in the
  event log (replayed by ``/1.0/events?since=0``) or in any log of the daemon, the
  supervisor or the VM.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import sqlite3
import subprocess
import time
from pathlib import Path

import httpx
import pytest

from tests.apikit import Api
from tests.conftest import FUSUMA, Host
from tests.fault.movekit import qemu_pids
from tests.fault.test_bad_input import assert_one_sentence

pytestmark = [pytest.mark.fault, pytest.mark.timeout(300)]

AS_NOBODY = ["setpriv", "--reuid=nobody", "--regid=nogroup", "--clear-groups"]
PORT = "/dev/virtio-ports/org.qemu.guest_agent.0"
# The guest's stand-in for qemu-ga: it answers the host's sync as qemu-ga does (so the
# channel looks alive) and every other command with ANSWER. When the host side hangs
# up, the port reads end; it opens the port again.
BAD_AGENT = r"""
sleep 2                                   # let qemu-ga answer the exec that started this
kill $(pidof qemu-ga)
while pidof qemu-ga >/dev/null; do sleep 0.1; done
while :; do
    # (`command`: a port that cannot be opened is not the end of this shell)
    if command exec 3<>PORT 2>/dev/null; then
        while IFS= read -r line <&3; do
            case "$line" in
                *guest-sync-delimited*)
                    id=${line##*'"id": '}; id=${id%%[!0-9]*}
                    printf '\377{"return": %s}\n' "$id" >&3 ;;
                *) ANSWER ;;
            esac
        done
        exec 3>&-
    fi
    sleep 0.2
done
""".replace("PORT", PORT)
ANSWERS = {
    # What passes for JSON but breaks the types: the old client raised ValueError.
    "wrong types": (r"""printf '{"return": {"pid": "seven"}}\n' >&3""",
                    'the guest agent answered guest-exec with a string as "pid"'),
    # Not JSON at all, with control bytes.
    "junk": (r"""printf '}{ \001\002 not json\n' >&3""",
             "the guest agent answered guest-exec with 14 bytes that are not JSON"),
    # Nothing: the channel is synchronised, then silent.
    "silence": (":", "guest agent command guest-exec got no answer in 3 s"),
}


def boot(host: Host, vm: str = "v") -> None:
    host.run("partition", "create", "p0", "--cpus", host.core(0), "--memory", "768")
    host.run("vm", "create", vm, "-p", "p0", "--memory", "128", "--start")
    assert host.run("vm", "exec", vm, "--", "/bin/true").code == 0   # the agent is up


def cli_error(err: str) -> str:
    return next(ln for ln in err.splitlines() if ln.startswith("fusuma: error: "))


@pytest.mark.parametrize("mode", sorted(ANSWERS))
def test_stop_finishes_when_the_agent_answers_garbage(host: Host, mode: str) -> None:
    boot(host)
    answer, said = ANSWERS[mode]
    script = BAD_AGENT.replace("ANSWER", answer)
    host.run("vm", "exec", "v", "--stdin", "--", "/bin/sh", "-c",
             "cat > /tmp/bad-agent.sh && "
             "(setsid sh /tmp/bad-agent.sh </dev/null >/dev/null 2>&1 &)", input=script)
    time.sleep(4)                         # qemu-ga is gone, the script holds the port
    res = host.fail("vm", "exec", "v", "--timeout", "3", "--", "/bin/true")
    assert_one_sentence(res.err)
    assert said in res.err, res.err
    assert "internal" not in res.err and "Error(" not in res.err
    pids = qemu_pids(host, "v")
    assert len(pids) == 1

    t0 = time.monotonic()
    out = host.run("vm", "stop", "v", "--timeout", "5").out
    took = time.monotonic() - t0
    assert out.startswith("vm v: stopped (stopped without flushing the guest's "), out
    # The flush gets at most the timeout, QEMU's quit is immediate (and killed after 5 s).
    assert took < 5 + 5 + 10, took
    v = host.vm("v")
    assert v["state"] == "stopped" and v["pid"] is None, v
    assert v["error"].startswith("stopped without flushing the guest's filesystems: "), v
    assert not qemu_pids(host, "v") and not any(Path(f"/proc/{p}").exists() for p in pids)
    # The reason is fusuma's own words: nothing the guest sent is quoted.
    assert "seven" not in v["error"] and "not json" not in v["error"]
    # And the VM is usable again: a new boot gets a sound agent.
    host.run("vm", "start", "v")
    assert host.run("vm", "exec", "v", "--", "/bin/echo", "ok").out == "ok\n"
    assert host.vm("v")["error"] is None


CAP = 256 * 1024
FLOOD_S = 12          # ~90 KB/s under TCG here: about four files of 256K


def test_a_console_flood_stays_within_the_cap(host: Host) -> None:
    host.env["FUSUMA_CONSOLE_LOG_MAX"] = "256K"
    boot(host)
    log = host.home / "vms" / "v" / "console.log"
    old = log.with_name("console.log.1")
    assert b"fusuma-guest: ready" in log.read_bytes()
    flood = subprocess.Popen(
        [*FUSUMA, "vm", "exec", "v", "--timeout", str(FLOOD_S + 30), "--",
         "/bin/sh", "-c", f"timeout {FLOOD_S} yes fusuma-flood > /dev/ttyS0; true"],
        env=host.env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    sizes = []
    deadline = time.monotonic() + FLOOD_S + 40
    while flood.poll() is None and time.monotonic() < deadline:
        for f in (log, old):
            if f.exists():
                sizes.append(f.stat().st_size)
        time.sleep(0.05)
    assert flood.wait(5) == 0, flood.stderr.read() if flood.stderr else ""
    assert sizes and max(sizes) <= CAP, max(sizes)
    assert old.exists() and log.stat().st_size <= CAP and old.stat().st_size <= CAP
    # More than two files' worth went by: the boot banner has been rotated out of both.
    both = old.read_bytes() + log.read_bytes()
    # (the tty turns each line's end into CR LF: 14 bytes a line)
    assert b"fusuma-guest: ready" not in both and both.count(b"fusuma-flood\r\n") > CAP // 28
    assert sorted(p.name for p in log.parent.glob("console.log*")) == \
        ["console.log", "console.log.1"]

    # The console still works: the log, ...
    def logged(mark: str) -> bool:
        end = time.monotonic() + 20
        while time.monotonic() < end:
            if mark in host.run("vm", "console", "v", "--log").out:
                return True
            time.sleep(0.2)
        return False
    host.run("vm", "exec", "v", "--", "/bin/sh", "-c", "echo mark-$((6*7)) > /dev/ttyS0")
    assert logged("mark-42")
    # ... attaching to it (QEMU's console socket, as `vm console` does), ...
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.connect(str(host.runtime / "vms" / "v" / "console.sock"))
    sock.settimeout(1)
    got = b""
    end = time.monotonic() + 30
    sock.sendall(b"\recho attached-$((6*7))\r")
    while b"attached-42" not in got and time.monotonic() < end:
        try:
            got += sock.recv(65536)
        except TimeoutError:
            sock.sendall(b"\recho attached-$((6*7))\r")
    sock.close()
    assert b"attached-42" in got, got[-500:]
    # ... and a new supervisor, while the guest writes: QEMU's writes fail while no
    # supervisor reads (QEMU ignores SIGPIPE), the new one adopts it and reopens its
    # console FIFO.
    pid = host.vm("v")["pid"]
    host.run("vm", "exec", "v", "--", "/bin/sh", "-c",
             "(i=0; while [ $i -lt 100 ]; do echo tick-$i > /dev/ttyS0; i=$((i+1)); "
             "sleep 0.1; done) </dev/null >/dev/null 2>&1 &")
    host.run("partition", "restart", "p0")
    time.sleep(2)
    assert host.vm("v")["pid"] == pid and host.vm("v")["state"] == "running"
    host.run("vm", "exec", "v", "--", "/bin/sh", "-c", "echo again-$((6*7)) > /dev/ttyS0")
    assert logged("again-42")
    host.run("vm", "stop", "v")
    assert not (host.runtime / "vms" / "v" / "console.fifo").exists()


def made_by_nobody(path: Path, mode: str) -> None:
    subprocess.run([*AS_NOBODY, "mkdir", "-m", mode, str(path)], check=True, cwd="/")
    assert path.stat().st_uid == 65534


@pytest.mark.parametrize(("which", "env", "what"), [
    ("shm", "FUSUMA_SHM_DIR", "shared-memory directory"),
    ("runtime", "FUSUMA_RUNTIME_DIR", "runtime directory")])
@pytest.mark.parametrize("mode", ["0755", "0777"])
def test_a_directory_another_user_made_first_is_refused(host: Host, which: str, env: str,
                                                        what: str, mode: str) -> None:
    evil: Path = getattr(host, which)
    made_by_nobody(evil, mode)
    (evil / "planted").write_text("")            # something of theirs inside
    os.chown(evil / "planted", 65534, 65534)
    before = (evil.stat().st_uid, evil.stat().st_mode, sorted(os.listdir(evil)))
    for cmd in (["partition", "create", "p0", "--cpus", "0", "--memory", "512"],
                ["ps"], ["vm", "list"]):
        err = host.fail(*cmd).err
        assert_one_sentence(err)
        assert f"the {what} {evil} belongs to nobody (uid 65534) with mode {mode}, " \
               "not to root" in err, err
        assert env in err and f"rm -r {evil}" in err
        assert (evil.stat().st_uid, evil.stat().st_mode, sorted(os.listdir(evil))) \
            == before
    assert not host.our_pids() and not host.our_cgroups()
    assert not (host.home / "state.db").exists()
    # The fix the sentence names works (the shm dir is made at a VM's first start).
    shutil.rmtree(evil)
    host.run("partition", "create", "p0", "--cpus", host.core(0), "--memory", "512")
    assert which == "shm" or evil.stat().st_uid == 0


def test_a_shm_dir_taken_while_fusuma_was_down_is_refused_at_start(host: Host) -> None:
    """/dev/shm is emptied at boot: a user who makes fusuma's directory before the
    first VM starts owns it. Here it is emptied by hand."""
    boot(host)
    host.run("vm", "stop", "v")
    assert not list(host.shm.iterdir())
    host.shm.rmdir()
    made_by_nobody(host.shm, "0777")
    err = host.fail("vm", "start", "v").err
    assert_one_sentence(err)
    assert f"{host.shm} belongs to nobody" in err
    assert host.shm.stat().st_uid == 65534 and not list(host.shm.iterdir())
    assert not qemu_pids(host, "v")
    shutil.rmtree(host.shm)
    assert host.vm("v")["state"] == "stopped"


IMPOSTOR = """
import mmap, os, sys, time
path = sys.argv[1]
os.makedirs(os.path.dirname(path), exist_ok=True)
with open(path, "wb+") as f:
    f.truncate(4096)
    m = mmap.mmap(f.fileno(), 4096, mmap.MAP_SHARED)
print("mapped", flush=True)
time.sleep(120)
"""


def test_a_lookalike_mapping_cannot_keep_a_ram_file(host: Host, tmp_path: Path) -> None:
    boot(host)
    ram = host.shm / "v.ram"
    assert ram.exists()
    lair = Path(f"/tmp/fz-lookalike-{host.tag}")
    lair.mkdir(mode=0o777)
    lair.chmod(0o777)
    try:
        # A local user's process: its argv says debug-threads=on and names the VM, and
        # it maps a file whose path ends with the RAM file's path.
        # Its argv is a whole QEMU's, run dir included: only its uid gives it away.
        imp = subprocess.Popen([*AS_NOBODY, "/usr/bin/python3", "-I", "-c", IMPOSTOR,
                                f"{lair}{ram}", "-name", "guest=v,debug-threads=on",
                                "-chardev", f"socket,id=qmp0,path={host.runtime}/vms/v/"
                                "qmp.sock,server=on,wait=off"],
                               stdout=subprocess.PIPE, text=True, cwd="/")
        try:
            assert imp.stdout is not None and imp.stdout.readline() == "mapped\n"
            maps = Path(f"/proc/{imp.pid}/maps").read_text()
            assert maps.count(f"{lair}{ram}") == 1
            log = host.home / "partitions" / "p0" / "supervisor.log"
            seen = len(log.read_text())
            host.run("vm", "stop", "v")
            assert not ram.exists(), "the RAM file was kept for a process not fusuma's"
            assert "kept RAM file" not in log.read_text()[seen:]
        finally:
            imp.kill()
            imp.wait()
    finally:
        shutil.rmtree(lair, ignore_errors=True)


MARK = "fz-secret-payload"


def test_exec_payload_stays_out_of_events_and_logs(host: Host) -> None:
    api = Api(host)
    try:
        c = api.unix()
        Api.ok(c, c.post("/1.0/partitions", json={"name": "p0", "cpus": "0",
                                                  "memory_mib": 768}))
        Api.ok(c, c.post("/1.0/vms", json={"name": "v", "partition": "p0", "vcpus": 1,
                                           "memory_mib": 128, "start": True}))
        # The command names the marker and the guest prints it (as its own output).
        cmd = ["/bin/sh", "-c", f"echo {MARK}-out; echo {MARK}-err >&2; exit 3"]
        done = Api.wait(c, c.post("/1.0/vms/v/exec", json={"command": cmd}))
        assert done["status"] == "Success", done
        res = done["result"]
        assert (res["exit_code"], res["stdout"], res["stderr"]) == (
            3, f"{MARK}-out\n", f"{MARK}-err\n")
        op = done["id"]
        # A command that cannot run: the agent's error quotes it.
        failed = Api.wait(c, c.post("/1.0/vms/v/exec", json={"command": [f"/{MARK}-cmd"]}))
        assert failed["status"] == "Failure" and MARK in failed["err"], failed

        text = replay(c)
        assert f"/1.0/operations/{op}" in text
        assert MARK not in text, [ln for ln in text.splitlines() if MARK in ln]
        events = [json.loads(ln[6:]) for ln in text.splitlines() if ln.startswith("data: ")]
        told = [e["metadata"]["context"] for e in events
                if e["metadata"]["source"] == f"/1.0/operations/{op}"]
        assert told[-1]["status"] == "Success", told
        assert told[-1]["description"] == "exec in VM v"
        # That it ran, its exit code and the sizes of its output: nothing more.
        assert told[-1]["result"] == {"exit_code": 3, "signal": None,
                                      "stdout_bytes": len(MARK) + 5,
                                      "stderr_bytes": len(MARK) + 5}, told[-1]
    finally:
        api.stop()
    logs = [api.log, *host.home.rglob("*.log")]
    assert host.home / "partitions" / "p0" / "supervisor.log" in logs
    assert host.home / "vms" / "v" / "qmp.log" in logs
    for f in logs:
        text = f.read_text(errors="replace")
        if f.name == "console.log":
            continue                   # the guest's own console: its business
        assert MARK not in text, (f, [ln for ln in text.splitlines() if MARK in ln])
    con = sqlite3.connect(str(host.home / "state.db"))
    try:
        rows = con.execute("SELECT action, source, context FROM events").fetchall()
    finally:
        con.close()
    assert rows and not [r for r in rows if MARK in "".join(r)]


def replay(c: httpx.Client) -> str:
    """The event stream from the start (``since=0``), read until it goes quiet."""
    out: list[str] = []
    end = time.monotonic() + 5
    try:
        with c.stream("GET", "/1.0/events", params={"since": 0}, timeout=2) as r:
            for line in r.iter_lines():
                out.append(line)
                if time.monotonic() > end:
                    break
    except httpx.ReadTimeout:
        pass
    return "\n".join(out)
