"""Roles against a real `fusuma serve --listen` and a real guest: a token of each role
tries real doors (create a partition, with a QEMU that is a script; exec in the guest;
register a host file as a disk; build a segment from /root; read /metrics and the
events), and each refusal is a 403 naming the roles, after which nothing changed: the
state, the guest, the host's cgroups, the script never run. The dashboard's session
holds its token's role, and a state file from before roles is taken over."""

from __future__ import annotations

import json
import sqlite3
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import pytest

from fusuma.ops.tokens import digest
from fusuma.state.roles import ROLES, Role
from tests.apikit import Api
from tests.conftest import Host
from tests.integration import test_api

pytestmark = [pytest.mark.integration, pytest.mark.timeout(240)]

daemons = test_api.daemons          # the same fixture: every daemon stopped at the end


def make_tokens(host: Host) -> dict[Role, str]:
    out = {}
    for role in ROLES:
        made = host.run("token", "create", f"t-{role}", "--role", role, "--json").json()
        assert made["role"] == role
        out[role] = made["token"]
    return out


def refused(r: httpx.Response, needed: Role, held: Role, what: str) -> None:
    assert r.status_code == 403, (what, r.status_code, r.text)
    assert r.json() == {"type": "error", "error_code": 403,
                        "error": f"{what} needs the {needed} role; token 't-{held}' has "
                                 f"the {held} role."}, r.text


def qemu_script(tmp: Path) -> tuple[Path, Path]:
    """A 'QEMU' that is a shell script: it leaves a marker when root runs it."""
    marker = tmp / "script-ran"
    script = tmp / "qemu-script"
    script.write_text(f"#!/bin/sh\ntouch {marker}\necho 'QEMU emulator version 10.0.2'\n")
    script.chmod(0o755)
    return script, marker


def snapshot(host: Host) -> dict[str, Any]:
    """What a refused write must leave as it was: partitions, disks, segments, and
    every cgroup directory of this namespace."""
    parts = host.run("partition", "list", "--json").json()
    return {"partitions": [(p["name"], p["cpus"], p["memory_mib"], p["supervisor_pid"])
                           for p in parts],
            "disks": host.run("disk", "list", "--json").json(),
            "segments": host.run("segment", "list", "--json").json(),
            "cgroups": sorted(str(d) for base in host.our_cgroups()
                              for d in [base, *base.rglob("*")] if d.is_dir())}


def exec_ops(c: httpx.Client) -> int:
    return sum(1 for o in c.get("/1.0/operations").json() if o["kind"] == "vm-exec")


def test_each_role_at_real_doors(host: Host, daemons: Callable[..., Any],
                                 tmp_path: Path) -> None:
    host.run("partition", "create", "p0", "--cpus", host.core(0), "--memory", "1024")
    host.run("vm", "create", "v0", "-p", "p0", "--memory", "128", "--start")
    tok = make_tokens(host)
    api = daemons(listen=True)
    script, marker = qemu_script(tmp_path)
    secret = tmp_path / "host-secret.img"
    secret.write_bytes(b"\0" * 4096)
    before = snapshot(host)
    assert any(c.endswith("/p0") for c in before["cgroups"]), before
    v0 = host.vm("v0")

    # -- below admin: no partition (even with a script as its QEMU), no host file as a
    # disk, no segment from a host directory.
    p1 = {"name": "p1", "cpus": host.core(1), "memory_mib": 1024, "qemu": str(script)}
    for role in (Role.METRICS, Role.VIEWER, Role.OPERATOR):
        with api.tcp(tok[role]) as c:
            refused(c.post("/1.0/partitions", json=p1), Role.ADMIN, role,
                    "POST /1.0/partitions")
            refused(c.post("/1.0/disks", json={"name": "d0", "path": str(secret),
                                               "partition": "p0"}),
                    Role.ADMIN, role, "POST /1.0/disks")
            refused(c.post("/1.0/segments", json={"name": "s0", "from_dir": "/root"}),
                    Role.ADMIN, role, "POST /1.0/segments")
            refused(c.patch("/1.0/partitions/p0", json={"memory_mib": 2048}),
                    Role.ADMIN, role, "PATCH /1.0/partitions/p0")
            refused(c.delete("/1.0/partitions/p0", params={"force": "true"}),
                    Role.ADMIN, role, "DELETE /1.0/partitions/p0")
    time.sleep(0.5)               # an operation, had one been made, would have begun
    assert not marker.exists(), "root ran the script named as QEMU"
    assert snapshot(host) == before
    assert host.vm("v0")["pid"] == v0["pid"] and host.vm("v0")["state"] == "running"

    # -- below operator: no exec in the guest, no stop.
    with api.tcp(tok[Role.OPERATOR]) as ops:
        execs = exec_ops(ops)
    for role in (Role.METRICS, Role.VIEWER):
        with api.tcp(tok[role]) as c:
            refused(c.post("/1.0/vms/v0/exec",
                           json={"command": ["touch", f"/tmp/{role}-was-here"]}),
                    Role.OPERATOR, role, "POST /1.0/vms/v0/exec")
            refused(c.put("/1.0/vms/v0/state", json={"action": "kill"}),
                    Role.OPERATOR, role, "PUT /1.0/vms/v0/state")
    with api.tcp(tok[Role.OPERATOR]) as ops:
        assert exec_ops(ops) == execs             # no operation was even made
        first = Api.ok(ops, ops.post("/1.0/vms/v0/exec", json={"command": ["ls", "/tmp"]}))
        assert first["exit_code"] == 0 and "was-here" not in first["stdout"], first
        Api.ok(ops, ops.post("/1.0/vms/v0/exec",
                             json={"command": ["touch", "/tmp/operator-was-here"]}))
        then = Api.ok(ops, ops.post("/1.0/vms/v0/exec", json={"command": ["ls", "/tmp"]}))
        # The same look finds what an exec did leave.
        assert set(then["stdout"].split()) - set(first["stdout"].split()) == {
            "operator-was-here"}, then
    assert host.vm("v0")["pid"] == v0["pid"] and host.vm("v0")["state"] == "running"

    # -- admin makes the partition (without the script), an operator moves into it but
    # may not name a QEMU binary for its maintenance.
    with api.tcp(tok[Role.ADMIN]) as adm:
        got = Api.ok(adm, adm.post("/1.0/partitions", json={**p1, "qemu": None}))
        assert (got["name"], got["cpus"]) == ("p1", [int(host.core(1))])
    with api.tcp(tok[Role.OPERATOR]) as ops:
        moved = Api.ok(ops, ops.post("/1.0/vms/v0/move", json={"partition": "p1"}))
        assert (moved["from"], moved["to"]) == ("p0", "p1")
        r = ops.post("/1.0/partitions/p1/maintain", json={"via": "p0", "qemu": str(script)})
        refused(r, Role.ADMIN, Role.OPERATOR, "naming a QEMU binary by path (not a "
                "version from `fusuma qemu list`)")
    assert not marker.exists()
    assert (host.vm("v0")["partition"], host.vm("v0")["state"]) == ("p1", "running")

    # -- reads: metrics reads /metrics only; a viewer reads everything.
    with api.tcp(tok[Role.METRICS]) as c:
        text = c.get("/metrics").text
        assert 'fusuma_vm_state{' in text and 'vm="v0"' in text
        for path in ("/1.0", "/1.0/vms", "/1.0/events", "/openapi.json"):
            refused(c.get(path), Role.VIEWER, Role.METRICS, f"GET {path}")
    with api.tcp(tok[Role.VIEWER]) as c:
        assert c.get("/metrics").status_code == 200
        assert [v["name"] for v in c.get("/1.0/vms").json()] == ["v0"]
        me = c.get("/1.0").json()
        assert (me["auth_user_name"], me["auth_role"]) == ("token 't-viewer'", "viewer")
        with c.stream("GET", "/1.0/events", params={"since": 0}) as r:
            assert r.status_code == 200
            assert any("partition-created" in line for line in r.iter_lines())
    # The UNIX socket is admin.
    with api.unix() as c:
        me = c.get("/1.0").json()
        assert (me["auth_user_name"], me["auth_role"]) == (
            "the UNIX socket (group fusuma)", "admin")


def test_a_dashboard_session_holds_its_tokens_role(host: Host,
                                                   daemons: Callable[..., Any]) -> None:
    host.run("partition", "create", "p0", "--cpus", host.core(0), "--memory", "1024")
    host.run("vm", "create", "v0", "-p", "p0", "--memory", "128", "--start")
    tok = make_tokens(host)
    api = daemons(listen=True)
    pid = host.vm("v0")["pid"]

    def session(role: Role) -> tuple[httpx.Client, str]:
        c = api.tcp(None)
        r = c.post("/login", content=f"token={tok[role]}",
                   headers={"content-type": "application/x-www-form-urlencoded"})
        assert r.status_code == 303, r.text
        page = c.get("/")
        assert page.status_code == 200 and f'data-role="{role}"' in page.text, page.text
        csrf = page.text.split('name="csrf-token" content="', 1)[1].split('"', 1)[0]
        return c, csrf

    c, csrf = session(Role.VIEWER)
    try:
        assert [v["name"] for v in c.get("/1.0/ui/state").json()["vms"]] == ["v0"]
        r = c.put("/1.0/vms/v0/state", json={"action": "stop"},
                  headers={"X-CSRF-Token": csrf})
        refused(r, Role.OPERATOR, Role.VIEWER, "PUT /1.0/vms/v0/state")
    finally:
        c.close()
    assert (host.vm("v0")["state"], host.vm("v0")["pid"]) == ("running", pid)

    # A metrics token gets no session.
    with api.tcp(None) as c:
        r = c.post("/login", content=f"token={tok[Role.METRICS]}",
                   headers={"content-type": "application/x-www-form-urlencoded"})
        assert r.status_code == 303 and "/login?error=" in r.headers["location"]
        assert "fusuma_session" not in c.cookies
        assert c.get("/1.0/ui/state").status_code == 401

    c, csrf = session(Role.OPERATOR)
    try:
        got = Api.ok(c, c.put("/1.0/vms/v0/state", json={"action": "stop"},
                              headers={"X-CSRF-Token": csrf}))
        assert got["state"] == "stopped"
        refused(c.post("/1.0/partitions", json={"name": "p1", "cpus": "1",
                                                 "memory_mib": 512},
                       headers={"X-CSRF-Token": csrf}),
                Role.ADMIN, Role.OPERATOR, "POST /1.0/partitions")
    finally:
        c.close()
    assert [p["name"] for p in host.run("partition", "list", "--json").json()] == ["p0"]


def test_a_state_file_from_before_roles_is_taken_over(host: Host,
                                                      daemons: Callable[..., Any]) -> None:
    """The tokens table as an older fusuma wrote it: its token keeps working, as admin,
    and both `serve` and `token list` name it once."""
    host.home.mkdir(parents=True, exist_ok=True)
    old = sqlite3.connect(host.home / "state.db")
    old.executescript(f"""
        CREATE TABLE tokens (name TEXT PRIMARY KEY, hash TEXT NOT NULL UNIQUE,
            created_at REAL NOT NULL, last_used_at REAL);
        INSERT INTO tokens VALUES ('ci', '{digest("fsm_made-before-roles")}', 1.0, NULL);
    """)
    old.close()
    api = daemons(listen=True)
    notice = ("token(s) 'ci' were made before tokens had roles and keep the admin role "
              "they had")
    assert notice in api.log_text()
    with api.tcp("fsm_made-before-roles") as c:
        me = c.get("/1.0").json()
        assert (me["auth_user_name"], me["auth_role"]) == ("token 'ci'", "admin")
    listed = host.run("token", "list", "--json")
    assert notice in listed.err
    rows = json.loads(listed.out)
    assert [(t["name"], t["role"], t["before_roles"]) for t in rows] == [
        ("ci", "admin", True)]
    assert rows[0]["last_used_at"] is not None
    host.run("token", "revoke", "ci")
    with api.tcp("fsm_made-before-roles") as c:
        assert c.get("/1.0").status_code == 401
