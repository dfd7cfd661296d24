"""`fusuma serve` against real guests: the REST API over its UNIX socket and HTTPS,
operations, events from the CLI, metrics, auth, bad input, and a daemon restart."""

from __future__ import annotations

import errno
import grp
import json
import socket
import stat
import subprocess
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.apikit import Api
from tests.conftest import Host

pytestmark = [pytest.mark.integration, pytest.mark.timeout(180)]

# What `vm list --json` and `GET /1.0/vms` must agree on (host_memory is sampled anew
# on every read, so it is compared by its keys only).
STABLE = ("name", "partition", "state", "pid", "accel", "vcpus", "memory_mib",
          "shared_ram", "qos", "mergeable", "segments", "ports", "disks", "error", "job")
VM = {"vcpus": 1, "memory_mib": 128}
# Run as another user, so only the system's python and the standard library.
PROBE = r"""
import socket, sys
s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
try:
    s.connect(sys.argv[1])
except OSError as exc:
    print("errno", exc.errno)
    raise SystemExit(0)
s.sendall(b"GET /1.0 HTTP/1.1\r\nHost: fusuma\r\nConnection: close\r\n\r\n")
buf = b""
while chunk := s.recv(65536):
    buf += chunk
print("status", buf.split(b" ", 2)[1].decode())
"""


@pytest.fixture
def daemons(host: Host) -> Iterator[Callable[..., Api]]:
    """Start `fusuma serve` in the test's namespace; every daemon is stopped at the end
    (before the host fixture's teardown proves nothing is left)."""
    started: list[Api] = []

    def start(**kw: Any) -> Api:
        api = Api(host, **kw)
        started.append(api)
        return api
    yield start
    for api in reversed(started):     # a later daemon may own the socket path
        api.stop()


# -- helpers ----------------------------------------------------------------------------
def alive(pid: int | None) -> bool:
    return pid is not None and Path(f"/proc/{pid}").exists()


def cli_error(res: Any) -> str:
    """The sentence the CLI printed after `fusuma: error: `."""
    line = next(x for x in res.err.splitlines() if x.startswith("fusuma: error: "))
    return str(line.removeprefix("fusuma: error: "))


def api_partitions(c: httpx.Client) -> None:
    for name, core in (("p0", "0"), ("p1", "1")):
        got = Api.ok(c, c.post("/1.0/partitions",
                               json={"name": name, "cpus": core, "memory_mib": 1024}))
        assert (got["name"], got["cpus"], got["memory_mib"]) == (name, [int(core)], 1024)
        assert alive(got["supervisor_pid"]), got


def cli_setup(host: Host, vm: str = "v0") -> None:
    """Partitions p0 (core 0) and p1 (core 1), and VM ``vm`` running in p0, by the CLI."""
    host.run("partition", "create", "p0", "--cpus", host.core(0), "--memory", "1024")
    host.run("partition", "create", "p1", "--cpus", host.core(1), "--memory", "1024")
    host.run("vm", "create", vm, "-p", "p0", "--memory", "128", "--start")


def raw(path: Path, data: bytes, timeout: float = 20.0) -> tuple[int, dict[str, str], bytes]:
    """One request sent byte for byte over the UNIX socket; status, headers, body."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.settimeout(timeout)
        s.connect(str(path))
        s.sendall(data)
        return read_response(s)


def read_response(s: socket.socket) -> tuple[int, dict[str, str], bytes]:
    buf = b""
    while b"\r\n\r\n" not in buf:
        chunk = s.recv(65536)
        if not chunk:
            raise AssertionError(f"connection closed before a response: {buf!r}")
        buf += chunk
    head, _, body = buf.partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    headers = {k.strip().lower(): v.strip()
               for k, _, v in (x.partition(":") for x in lines[1:])}
    want = int(headers.get("content-length", "0"))
    while len(body) < want:
        chunk = s.recv(65536)
        if not chunk:
            break
        body += chunk
    return int(lines[0].split()[1]), headers, body


def error_of(status: int, body: bytes) -> str:
    data = json.loads(body)
    assert data["type"] == "error" and data["error_code"] == status, data
    return str(data["error"])


def timed_get(c: httpx.Client, path: str = "/1.0") -> float:
    t0 = time.monotonic()
    r = c.get(path)
    assert r.status_code == 200, r.text
    return time.monotonic() - t0


def metric(text: str, sample: str, **labels: str) -> float:
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            if s.name == sample and all(s.labels.get(k) == v for k, v in labels.items()):
                return float(s.value)
    raise AssertionError(f"no sample {sample}{labels} in /metrics")


def wait_event(events: list[dict[str, Any]], action: str, vm: str,
               timeout: float = 5.0) -> dict[str, Any]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for ev in events:
            md = ev["metadata"]
            if md["action"] == action and md["source"] == f"/1.0/vms/{vm}":
                return ev
        time.sleep(0.02)
    raise AssertionError(f"no {action} event of {vm} within {timeout} s: "
                         f"{[e['metadata']['action'] for e in events]}")


# -- 1 ----------------------------------------------------------------------------------
def test_lifecycle_over_unix_socket(host: Host, daemons: Callable[..., Api]) -> None:
    api = daemons()
    with api.unix() as c:
        api_partitions(c)
        parts = c.get("/1.0/partitions").json()
        assert parts == host.run("partition", "list", "--json").json()

        vm = Api.ok(c, c.post("/1.0/vms", json={"name": "v0", "partition": "p0",
                                                **VM, "start": True}))
        assert (vm["state"], vm["partition"]) == ("running", "p0") and alive(vm["pid"])
        got = c.get("/1.0/vms/v0").json()
        assert got["state"] == "running" and got["pid"] == vm["pid"] and alive(got["pid"])

        # The API and the CLI show a VM in the same shape.
        api_vms = c.get("/1.0/vms").json()
        cli_vms = host.run("vm", "list", "--json").json()
        assert [v["name"] for v in api_vms] == [v["name"] for v in cli_vms] == ["v0"]
        assert set(api_vms[0]) == set(cli_vms[0])
        assert {k: api_vms[0][k] for k in STABLE} == {k: cli_vms[0][k] for k in STABLE}
        assert set(api_vms[0]["host_memory"]) == set(cli_vms[0]["host_memory"])

        moved = Api.ok(c, c.post("/1.0/vms/v0/move", json={"partition": "p1"}))
        assert (moved["vm"], moved["from"], moved["to"], moved["mode"]) == (
            "v0", "p0", "p1", "zero-copy")
        assert moved["downtime_ms"] > 0 and moved["bytes_sent"] > 0, moved
        ps = host.vm("v0")
        assert (ps["partition"], ps["state"]) == ("p1", "running") and ps["job"] is None
        assert ps["pid"] != vm["pid"] and alive(ps["pid"]) and not alive(vm["pid"])
        assert [v["name"] for v in c.get("/1.0/vms", params={"partition": "p1"}).json()] \
            == ["v0"]
        assert c.get("/1.0/vms", params={"partition": "p0"}).json() == []

        ran = Api.ok(c, c.post("/1.0/vms/v0/exec", json={"command": ["cat", "/proc/uptime"]}))
        assert ran["exit_code"] == 0 and float(ran["stdout"].split()[0]) > 0, ran
        # Page reporting is on by default here (cgroup v1): a trim hands memory back.
        trimmed = Api.ok(c, c.post("/1.0/vms/v0/trim"))
        assert 0 < trimmed["resident_after_mib"] <= trimmed["resident_before_mib"], trimmed
        assert host.vm("v0")["ram"]["page_reporting"] is True

        stopped = Api.ok(c, c.put("/1.0/vms/v0/state", json={"action": "stop"}))
        assert (stopped["state"], stopped["pid"]) == ("stopped", None)
        assert host.vm("v0")["state"] == "stopped" and not alive(ps["pid"])

        assert Api.ok(c, c.delete("/1.0/vms/v0")) == {"deleted": "/1.0/vms/v0"}
        r = c.get("/1.0/vms/v0")
        assert r.status_code == 404 and "v0" in r.json()["error"]
        assert host.run("vm", "list", "--json").json() == []


# -- 2 ----------------------------------------------------------------------------------
def test_cli_changes_stream_as_events_and_metrics(host: Host,
                                                  daemons: Callable[..., Api]) -> None:
    cli_setup(host)
    api = daemons()
    with api.events("lifecycle") as events:
        res = host.run("migrate", "v0", "--to", "p1", "--json").json()
        returned = time.time()
        ev = wait_event(events, "vm-moved", "v0")
        assert ev["_received"] - returned < 1.0, ev["_received"] - returned
        ctx = ev["metadata"]["context"]
        assert (ctx["vm"], ctx["from"], ctx["to"], ctx["result"]) == ("v0", "p0", "p1", "ok")
        assert ctx["downtime_ms"] == res["downtime_ms"] > 0

        host.run("vm", "stop", "v0")
        returned = time.time()
        ev = wait_event(events, "vm-stopped", "v0")
        assert ev["_received"] - returned < 1.0, ev["_received"] - returned
    # One more event, so that the stream's reader (which checks its stop flag on each
    # line) ends before the daemon does, rather than on a cut stream.
    host.run("vm", "delete", "v0")
    time.sleep(0.3)
    with api.unix() as c:
        text = c.get("/metrics").text
    assert metric(text, "fusuma_vm_moves_total", mode="zero-copy", result="ok") >= 1
    assert metric(text, "fusuma_vm_move_downtime_seconds_count", mode="zero-copy") >= 1
    assert metric(text, "fusuma_vm_move_downtime_seconds_sum", mode="zero-copy") == \
        pytest.approx(res["downtime_ms"] / 1000, rel=0.01)


# -- 3 ----------------------------------------------------------------------------------
def test_https_tokens(host: Host, daemons: Callable[..., Api]) -> None:
    from fusuma.ops.tokens import digest

    api = daemons(listen=True)
    assert api.url and api.url.startswith("https://127.0.0.1:")
    tok = host.run("token", "create", "t1", "--role", "viewer", "--json").json()
    token = tok["token"]
    assert (tok["name"], tok["role"]) == ("t1", "viewer") and token.startswith("fsm_")

    def state_bytes() -> bytes:
        return b"".join(p.read_bytes() for p in sorted(host.home.parent.rglob("*"))
                        if p.is_file())
    # Only the hash is kept (the search covers the file that holds it).
    assert digest(token).encode() in state_bytes()
    assert token.encode() not in state_bytes()

    with api.tcp(token) as c:
        r = c.get("/1.0")
        assert r.status_code == 200 and r.json()["api_version"] == "1.0"
    with api.tcp(None) as c:
        r = c.get("/1.0")
        assert r.status_code == 401 and "token" in r.json()["error"]
        assert r.headers["www-authenticate"].startswith("Bearer")
    with api.tcp(token[:-2] + "xx") as c:
        r = c.get("/1.0/vms")
        assert r.status_code == 401 and "not valid" in r.json()["error"]
    with api.tcp(None) as c:
        r = c.get("/1.0", headers={"Authorization": f"Basic {token}"})
        assert r.status_code == 401
    assert host.run("token", "list", "--json").json()[0]["last_used_at"] is not None

    host.run("token", "revoke", "t1")
    with api.tcp(token) as c:
        r = c.get("/1.0")
        assert r.status_code == 401, r.text
    assert "t1" not in [t["name"] for t in host.run("token", "list", "--json").json()]

    log = api.log_text()
    assert "GET /1.0" in log          # requests are logged, the token is not
    assert token not in log
    assert token.encode() not in state_bytes()


# -- 4 ----------------------------------------------------------------------------------
def test_socket_permissions_with_real_users(host: Host,
                                            daemons: Callable[..., Api]) -> None:
    api = daemons()
    gid = grp.getgrnam("fusuma").gr_gid
    sock, d = api.socket, api.socket.parent
    st, dst = sock.stat(), d.stat()
    assert stat.S_ISSOCK(st.st_mode) and stat.S_IMODE(st.st_mode) == 0o660
    assert (st.st_uid, st.st_gid) == (0, gid)
    assert stat.S_IMODE(dst.st_mode) == 0o750 and (dst.st_uid, dst.st_gid) == (0, gid)
    assert stat.S_IMODE(host.runtime.stat().st_mode) == 0o711

    def probe(*prefix: str) -> str:
        p = subprocess.run([*prefix, "/usr/bin/python3", "-I", "-c", PROBE, str(sock)],
                           capture_output=True, text=True, timeout=30, cwd="/")
        assert p.returncode == 0, p.stderr
        return p.stdout.strip()

    assert probe("setpriv", "--reuid=nobody", "--regid=nogroup", "--clear-groups") == \
        f"errno {errno.EACCES}"
    assert probe("setpriv", "--reuid=nobody", "--regid=nogroup",
                 f"--groups={gid}") == "status 200"
    user = f"fzt-{host.tag}"
    subprocess.run(["useradd", "--system", "--no-create-home", "--shell",
                    "/usr/sbin/nologin", "-G", "fusuma", user], check=True,
                   capture_output=True)
    try:
        assert probe("runuser", "-u", user, "--") == "status 200"
    finally:
        subprocess.run(["userdel", user], check=True, capture_output=True)
    assert "errno" not in probe("runuser", "-u", "root", "--")


# -- 5 ----------------------------------------------------------------------------------
def test_bad_input(host: Host, daemons: Callable[..., Api]) -> None:
    cli_setup(host)
    api = daemons()
    with api.unix(timeout=30) as c:
        r = c.post("/1.0/vms", content=b'{"name": "x", "partition": ',
                   headers={"Content-Type": "application/json"})
        assert r.status_code == 400 and "JSON" in error_of(400, r.content), r.text
        r = c.post("/1.0/vms", json={"name": "x", "partition": "p0", "bogus": 1})
        assert r.status_code == 400 and "bogus" in error_of(400, r.content), r.text
        for bad in ("a/b", "..", "../x"):
            r = c.post("/1.0/vms", json={"name": bad, "partition": "p0"})
            assert r.status_code == 400 and "name" in error_of(400, r.content), r.text
        r = c.post("/1.0/vms/v0/move", json={"partition": "../p1"})
        assert r.status_code == 400, r.text
        assert [v["name"] for v in host.run("vm", "list", "--json").json()] == ["v0"]

        # Paths that would escape (sent raw: a client library may normalise them).
        for path in ("/1.0/vms/%2e%2e", "/1.0/vms/..%2fp0", "/1.0/vms/v0%2f..%2f..",
                     "/1.0/partitions/%2e%2e%2fetc"):
            code, headers, body = raw(api.socket, f"GET {path} HTTP/1.1\r\nHost: f\r\n"
                                      "Connection: close\r\n\r\n".encode())
            assert 400 <= code < 500, (path, code, body)
            assert headers["content-type"] == "application/json" and error_of(code, body)

        # 10 MB: refused from its Content-Length, and from its size when streamed.
        big = b"[" + b"1," * (5 * 2**20) + b"1]"
        r = c.post("/1.0/vms", content=big, headers={"Content-Type": "application/json"})
        assert r.status_code == 413 and "bytes" in error_of(413, r.content), r.text
        code, _, body = raw(api.socket, b"POST /1.0/vms HTTP/1.1\r\nHost: f\r\n"
                            b"Content-Length: 10485760\r\n\r\n")
        assert code == 413, body
        code, _, body = raw(api.socket, b"POST /1.0/vms HTTP/1.1\r\nHost: f\r\n"
                            b"Transfer-Encoding: chunked\r\n\r\n"
                            + b"".join(b"%x\r\n" % len(x) + x + b"\r\n"
                                       for x in [b"x" * 2**16] * 20) + b"0\r\n\r\n")
        assert code == 413, body
        assert timed_get(c) < 1.0

        # A body that never arrives: 408 after BODY_TIMEOUT_S; half the request headers,
        # then nothing: 408 after HEADER_TIMEOUT_S, then the connection is closed. Both
        # stall at once (the waits overlap); others are served meanwhile.
        from fusuma.api.guard import CLIENT_TIMEOUT_S as HEADER_TIMEOUT_S
        from fusuma.api.http import BODY_TIMEOUT_S

        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as slow, \
                socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as half:
            slow.settimeout(BODY_TIMEOUT_S + 10)
            half.settimeout(HEADER_TIMEOUT_S + 10)
            slow.connect(str(api.socket))
            half.connect(str(api.socket))
            t0 = time.monotonic()
            slow.sendall(b"POST /1.0/vms HTTP/1.1\r\nHost: f\r\nContent-Type: "
                         b"application/json\r\nContent-Length: 100\r\n\r\n{\"name\": ")
            half.sendall(b"GET /1.0 HTTP/1.1\r\nHost: f\r\n")
            time.sleep(1)
            assert max(timed_get(c) for _ in range(5)) < 1.0
            code, _, body = read_response(slow)
            took = time.monotonic() - t0
            hcode, _, hbody = read_response(half)
            htook = time.monotonic() - t0
            assert half.recv(1) == b""           # and closed
        assert code == 408 and "did not arrive" in error_of(408, body), body
        assert BODY_TIMEOUT_S - 1 < took < BODY_TIMEOUT_S + 2, took
        assert hcode == 408 and "headers did not arrive" in error_of(408, hbody), hbody
        assert HEADER_TIMEOUT_S - 1 < htook < HEADER_TIMEOUT_S + 2, htook
        assert timed_get(c) < 1.0

        # Unknown names: 404 with the CLI's sentence.
        r = c.get("/1.0/vms/nosuch")
        assert r.status_code == 404
        assert error_of(404, r.content) == cli_error(host.fail("vm", "start", "nosuch"))
        r = c.put("/1.0/vms/nosuch/state", json={"action": "stop"})
        assert r.status_code == 404 and error_of(404, r.content) == \
            cli_error(host.fail("vm", "stop", "nosuch"))
        # A conflict: 409 with the CLI's sentence.
        r = c.put("/1.0/vms/v0/state", json={"action": "start"})
        assert r.status_code == 409, r.text
        assert error_of(409, r.content) == cli_error(host.fail("vm", "start", "v0"))
        assert host.vm("v0")["state"] == "running"


# -- 6 ----------------------------------------------------------------------------------
def test_operations_list_and_cancel_a_move(host: Host, daemons: Callable[..., Api]) -> None:
    cli_setup(host)
    before = host.vm("v0")
    api = daemons(env={"FUSUMA_FAULT_SLEEP_BEFORE_STREAM": "3"})
    with api.unix() as c:
        r = c.post("/1.0/vms/v0/move", json={"partition": "p1"})
        assert r.status_code == 202, r.text
        op = r.json()
        assert op["may_cancel"] and op["kind"] == "vm-move"
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:          # until it sleeps before its stream
            cur = c.get(f"/1.0/operations/{op['id']}").json()
            if cur["status"] == "Running" and cur["metadata"].get("progress", "") \
                    .startswith("preparing"):
                break
            time.sleep(0.05)
        else:
            raise AssertionError(f"the move did not reach its preparation: {cur}")
        assert host.vm("v0")["job"] is not None
        r = c.delete(f"/1.0/operations/{op['id']}")
        assert r.status_code == 200, r.text
        done = c.get(f"/1.0/operations/{op['id']}/wait", params={"timeout": 60}).json()
        assert done["status"] == "Cancelled" and done["error_code"] == 499, done
        assert "cancelled" in done["err"]
        vm = host.vm("v0")
        assert (vm["partition"], vm["state"], vm["pid"], vm["job"]) == (
            "p0", "running", before["pid"], None)
        assert host.ps()["partitions"][1]["job"] is None

        # The VM still moves afterwards, and the ended operations are listed.
        moved = Api.ok(c, c.post("/1.0/vms/v0/move", json={"partition": "p1"}))
        assert moved["to"] == "p1" and host.vm("v0")["partition"] == "p1"
        ops = {o["id"]: o for o in c.get("/1.0/operations").json()}
        assert ops[op["id"]]["status"] == "Cancelled"
        assert [o["status"] for o in ops.values() if o["kind"] == "vm-move"] == [
            "Cancelled", "Success"]
        assert [o["id"] for o in c.get("/1.0/operations",
                                       params={"status": "Success"}).json()] == [
            o["id"] for o in ops.values() if o["status"] == "Success"]
        for o in ops.values():
            r = c.delete(f"/1.0/operations/{o['id']}")
            assert r.status_code == 409 and "already ended" in r.json()["error"], r.text
        r = c.get("/1.0/operations/00000000-0000-0000-0000-000000000000")
        assert r.status_code == 404


# -- 7 ----------------------------------------------------------------------------------
def test_daemon_restart_keeps_vms(host: Host, daemons: Callable[..., Api]) -> None:
    api = daemons()
    with api.unix() as c:
        api_partitions(c)
        vm = Api.ok(c, c.post("/1.0/vms", json={"name": "v0", "partition": "p0", **VM,
                                                "start": True}))
    second = host.run("serve", check=False, timeout=60)
    assert second.code != 0 and "already answers" in second.err, second
    api.stop()
    assert api.proc.returncode == 0, api.log_text()
    assert alive(vm["pid"]) and host.vm("v0")["state"] == "running"

    again = daemons()
    with again.unix() as c:
        got = c.get("/1.0/vms").json()
        assert [(v["name"], v["state"], v["pid"]) for v in got] == [
            ("v0", "running", vm["pid"])]
        ran = Api.ok(c, c.post("/1.0/vms/v0/exec", json={"command": ["true"]}))
        assert ran["exit_code"] == 0
        assert Api.ok(c, c.put("/1.0/vms/v0/state", json={"action": "kill"}))["state"] \
            in ("stopped", "crashed")
    assert not alive(vm["pid"])


# -- templates ----------------------------------------------------------------------------
def test_templates_over_the_api(host: Host, daemons: Callable[..., Api]) -> None:
    api = daemons()
    host.run("partition", "create", "p10", "--cpus", host.core(0), "--memory", "1024",
             "--qemu", "10.0")
    host.run("vm", "create", "src", "-p", "p10", "--start")
    with api.unix() as c:
        made = Api.ok(c, c.post("/1.0/templates", json={"name": "t", "from_vm": "src"}))
        assert made["name"] == "t" and made["intact"] is True, made
        assert [t["name"] for t in c.get("/1.0/templates").json()] == ["t"]
        assert host.vm("src")["state"] == "stopped"
        clone = Api.ok(c, c.post("/1.0/vms", json={"name": "c1", "partition": "p10",
                                                   "template": "t", "start": True}))
        assert clone["state"] == "running" and clone["template"] == "t", clone
        got = c.get("/1.0/templates/t").json()
        assert got["clones"] == ["c1"], got
        r = c.delete("/1.0/templates/t")
        assert r.status_code == 409 and "c1" in r.json()["error"], r.text
        r = c.post("/1.0/templates", json={"name": "t2", "from_vm": "nope"})
        assert r.status_code == 404 and "nope" in r.json()["error"], r.text
        r = c.post("/1.0/templates", json={"name": "t", "from_vm": "c1"})
        assert r.status_code == 409 and "already exists" in r.json()["error"], r.text
        Api.ok(c, c.delete("/1.0/vms/c1?force=true"))
        assert c.delete("/1.0/templates/t").json() == {"deleted": "/1.0/templates/t"}
        assert c.get("/1.0/templates/t").status_code == 404
