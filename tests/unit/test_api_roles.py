"""Roles without QEMU: every route of the app's own OpenAPI document (and every route
kept out of it) refuses each role below the one it declares with 403, and a route
without a declared role cannot be made. Tokens keep their role in the state file; a
state file from before roles is taken over. A real SQLite file in tmp_path."""

from __future__ import annotations

import re
import sqlite3
import urllib.parse
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner
from fastapi import APIRouter, FastAPI
from fastapi.routing import iter_route_contexts
from fastapi.testclient import TestClient

from fusuma.api.app import Limits, create_app
from fusuma.api.roles import (
    OPENAPI_KEY,
    PUBLIC_ROLE,
    VIEWER,
    Identity,
    RoleRoute,
    check_roles,
    declared,
)
from fusuma.api.server import LocalAuth, TokenAuth, with_identity
from fusuma.api.sessions import COOKIE
from fusuma.ops import tokens
from fusuma.ops.context import Ctx
from fusuma.paths import Paths
from fusuma.state import Database, PartitionRecord
from fusuma.state.roles import ROLES, Role
from tests.unit import test_api

# A route answered as its own role must get past the gate; these requests make the
# route answer at once (the event stream otherwise never ends).
ALLOWED_PARAMS = {("GET", "/1.0/events"): {"type": "no-such-type"}}


paths = test_api.paths          # the same fixture: a state file and dirs in tmp_path


@pytest.fixture
def app(paths: Paths) -> FastAPI:
    return create_app(paths)


class As:
    """The app as a request holding ``role`` reaches it (what TokenAuth does for a
    token of that role)."""

    def __init__(self, app: Any, role: Role) -> None:
        self.app = app
        self.who = Identity(f"token 'as-{role}'", role, f"as-{role}")

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] == "http":
            scope = with_identity(scope, self.who)
        await self.app(scope, receive, send)


def client_as(app: FastAPI, role: Role) -> TestClient:
    return TestClient(As(Limits(app), role), raise_server_exceptions=False,
                      follow_redirects=False)


def routes(app: FastAPI) -> list[tuple[str, str, str]]:
    """(method, path, declared role) of every operation: the OpenAPI document as the
    app serves it, then the routes kept out of it (the dashboard's)."""
    with client_as(app, Role.ADMIN) as c:
        spec = c.get("/openapi.json").json()
    out = []
    for path, ops in spec["paths"].items():
        for method, op in ops.items():
            assert OPENAPI_KEY in op, f"{method.upper()} {path} declares no role"
            out.append((method.upper(), path, op[OPENAPI_KEY]))
    hidden = [ctx for ctx in iter_route_contexts(app.routes)
              if not ctx.original_route.include_in_schema]      # type: ignore[attr-defined]
    for ctx in hidden:
        need = declared(ctx.original_route)
        for method in sorted(ctx.methods or ()):
            if method != "HEAD":
                out.append((method, str(ctx.path), need.label))
    # Every route of the app is in one of the two lists, once.
    every = {(m, str(ctx.path)) for ctx in iter_route_contexts(app.routes)
             for m in ctx.methods or () if m != "HEAD"}
    assert sorted(every) == sorted((m, p) for m, p, _ in out)
    return out


def filled(path: str) -> str:
    return re.sub(r"\{[^}]+\}", "x", path)


def test_every_route_refuses_every_role_below_its_own(app: FastAPI) -> None:
    table = routes(app)
    assert len(table) >= 50, len(table)
    seen = {role for _, _, role in table}
    assert seen == {PUBLIC_ROLE, *ROLES}, seen        # every role guards something
    clients = {role: client_as(app, role) for role in ROLES}
    for method, path, label in table:
        url = filled(path)
        if label == PUBLIC_ROLE:
            continue
        needed = Role(label)
        for role in ROLES:
            c = clients[role]
            if role.includes(needed):
                r = c.request(method, url, params=ALLOWED_PARAMS.get((method, path)))
                assert r.status_code not in (401, 403), (method, path, role, r.text)
                continue
            r = c.request(method, url)
            assert r.status_code == 403, (method, path, role, r.status_code, r.text)
            body = r.json()
            assert body == {"type": "error", "error_code": 403, "error":
                            f"{method} {url} needs the {needed} role; token 'as-{role}' "
                            f"has the {role} role."}, body


def test_the_declared_roles_follow_the_policy(app: FastAPI) -> None:
    """What the issue asks of each role, checked against the declarations: a read is a
    viewer's (/metrics the metrics role's), a write at least an operator's, and the
    writes that name host paths or binaries, or shape partitions, disks, segments,
    images or KSM are admin's alone."""
    table = routes(app)
    for method, path, role in table:
        if role == PUBLIC_ROLE:
            continue
        if method == "GET":
            assert role == ("metrics" if path == "/metrics" else "viewer"), (method, path)
        else:
            assert Role(role).includes(Role.OPERATOR), (method, path, role)
    admin = sorted((m, p) for m, p, role in table if role == "admin")
    assert admin == [
        ("DELETE", "/1.0/disks/{name}"), ("DELETE", "/1.0/images/{name}"),
        ("DELETE", "/1.0/networks/{name}"), ("DELETE", "/1.0/partitions/{name}"),
        ("DELETE", "/1.0/segments/{name}"), ("PATCH", "/1.0/disks/{name}"),
        ("PATCH", "/1.0/partitions/{name}"), ("POST", "/1.0/disks"),
        ("POST", "/1.0/images"), ("POST", "/1.0/images/import"), ("POST", "/1.0/networks"),
        ("POST", "/1.0/networks/{name}/restart"), ("POST", "/1.0/partitions"),
        ("POST", "/1.0/segments"), ("PUT", "/1.0/share/ksm")]
    operator = {p for m, p, role in table if role == "operator"}
    for door in ("/1.0/vms", "/1.0/vms/{name}/state", "/1.0/vms/{name}/move",
                 "/1.0/vms/{name}/exec", "/1.0/partitions/{name}/maintain"):
        assert door in operator, door


def test_public_routes_are_only_the_login_and_its_files(app: FastAPI) -> None:
    public = sorted((m, p) for m, p, role in routes(app) if role == PUBLIC_ROLE)
    assert public == [("GET", "/login"), ("GET", "/static/{name}"), ("POST", "/login"),
                      ("POST", "/logout")]
    # The token middleware lets exactly these through without a token.
    assert all(p in ("/login", "/logout") or p.startswith("/static/") for _, p in public)


def test_a_request_without_an_identity_is_refused(app: FastAPI) -> None:
    c = TestClient(Limits(app), raise_server_exceptions=False, follow_redirects=False)
    for method, path in (("GET", "/metrics"), ("GET", "/1.0"), ("POST", "/1.0/vms")):
        r = c.request(method, path)
        assert r.status_code == 401 and "no identity" in r.json()["error"], r.text
    assert c.get("/login").status_code == 200


def test_a_route_without_a_role_cannot_be_made() -> None:
    r = APIRouter(route_class=RoleRoute)
    with pytest.raises(RuntimeError, match=r"GET /undeclared declares 0 roles"):
        @r.get("/undeclared")
        def undeclared() -> None: ...
    with pytest.raises(RuntimeError, match=r"declares 2 roles"):
        @r.get("/twice", dependencies=[VIEWER, VIEWER])
        def twice() -> None: ...

    @r.get("/fine", dependencies=[VIEWER])
    def fine() -> None: ...
    bare = {"openapi_url": None, "docs_url": None, "redoc_url": None}
    ok = FastAPI(**bare)
    ok.include_router(r)
    check_roles(ok)            # passes: every route declares one
    # FastAPI's own pages, or a route made another way, stop the app.
    with pytest.raises(RuntimeError, match=r"'/openapi\.json' was not made by a router"):
        check_roles(FastAPI())
    bad = FastAPI(**bare)
    bad.include_router(r)

    @bad.get("/plain")
    def plain() -> None: ...
    with pytest.raises(RuntimeError, match="'/plain' was not made by a router"):
        check_roles(bad)


def test_refused_writes_change_nothing(app: FastAPI, paths: Paths,
                                       tmp_path: Path) -> None:
    """A real body past the gate's check: the disk is registered only by admin."""
    # Inside the default storage directory: the one place a disk may be registered.
    img = paths.home / "disks" / "d.img"
    img.parent.mkdir(parents=True, exist_ok=True)
    img.write_bytes(b"\0" * 4096)
    db = Database(paths.db)
    db.add_partition(PartitionRecord("p0", [0], 1024))
    disk = {"name": "d0", "path": str(img), "partition": "p0"}
    for role in (Role.METRICS, Role.VIEWER, Role.OPERATOR):
        r = client_as(app, role).post("/1.0/disks", json=disk)
        assert r.status_code == 403 and "needs the admin role" in r.json()["error"], r.text
        assert db.disks() == []
    r = client_as(app, Role.ADMIN).post("/1.0/disks", json=disk)
    assert r.status_code == 201, r.text
    assert [x.name for x in db.disks()] == ["d0"]


def test_operator_cannot_name_a_qemu_binary(app: FastAPI, paths: Paths,
                                            tmp_path: Path) -> None:
    """maintain is an operator's, but a QEMU named by path is root running a binary."""
    marker = tmp_path / "ran"
    fake = tmp_path / "qemu"
    fake.write_text(f"#!/bin/sh\ntouch {marker}\necho 'QEMU emulator version 10.0.2'\n")
    fake.chmod(0o755)
    db = Database(paths.db)
    db.add_partition(PartitionRecord("p0", [0], 1024))
    db.add_partition(PartitionRecord("p1", [1], 1024))
    body = {"via": "p1", "qemu": str(fake)}
    r = client_as(app, Role.OPERATOR).post("/1.0/partitions/p0/maintain", json=body)
    assert r.status_code == 403, r.text
    assert r.json()["error"] == ("naming a QEMU binary by path (not a version from "
                                 "`fusuma qemu list`) needs the admin role; token "
                                 "'as-operator' has the operator role.")
    assert not marker.exists()
    # A version name is the operator's to give (refused here only because it is not
    # installed), and admin gets past the role check with the path.
    r = client_as(app, Role.OPERATOR).post("/1.0/partitions/p0/maintain",
                                           json={"via": "p1", "qemu": "99.9"})
    assert r.status_code == 404 and "99.9 is not installed" in r.json()["error"], r.text
    r = client_as(app, Role.ADMIN).post("/1.0/partitions/p0/maintain", json=body)
    assert r.status_code != 403, r.text


def test_outside_or_privileged_host_ports_are_admins(app: FastAPI, paths: Paths) -> None:
    """A forward from 127.0.0.1 above 1023 is an operator's; one on another address or
    below 1024 takes a host port that is not a guest's to take."""
    db = Database(paths.db)
    db.add_partition(PartitionRecord("p0", [0], 1024))
    for port in ("0.0.0.0:8080:80", "127.0.0.1:22:22", "443:443"):
        r = client_as(app, Role.OPERATOR).post(
            "/1.0/vms", json={"name": "w", "partition": "p0", "memory_mib": 128,
                              "ports": [port]})
        assert r.status_code == 403, r.text
        assert r.json()["error"].startswith("forwarding host port "), r.text
        assert r.json()["error"].endswith("needs the admin role; token 'as-operator' "
                                          "has the operator role."), r.text
        assert db.vms() == []
    r = client_as(app, Role.OPERATOR).post(
        "/1.0/vms", json={"name": "w", "partition": "p0", "memory_mib": 128,
                          "ports": ["8080:80"]})
    # Past the role check (refused further on only because no image is built here).
    assert r.status_code != 403 and "role" not in r.text, r.text


def test_a_host_process_is_analyzed_by_admin_only(app: FastAPI) -> None:
    import os

    r = client_as(app, Role.OPERATOR).get("/1.0/share/analyze", params={"pid": os.getpid()})
    assert r.status_code == 403 and r.json()["error"] == (
        "analyzing a host process by pid (not ?vm=) needs the admin role; token "
        "'as-operator' has the operator role."), r.text
    r = client_as(app, Role.ADMIN).get("/1.0/share/analyze", params={"pid": os.getpid()})
    assert r.status_code == 200 and r.json()["pid"] == os.getpid(), r.text


def test_host_info_names_the_identity(app: FastAPI) -> None:
    got = client_as(app, Role.VIEWER).get("/1.0").json()
    assert (got["auth_user_name"], got["auth_role"]) == ("token 'as-viewer'", "viewer")
    local = TestClient(LocalAuth(Limits(app), "fusuma")).get("/1.0").json()
    assert (local["auth_user_name"], local["auth_role"]) == (
        "the UNIX socket (group fusuma)", "admin")


# -- the dashboard's session ----------------------------------------------------------------
def test_a_session_holds_its_tokens_role(app: FastAPI, paths: Paths) -> None:
    from fusuma.api.roles import token_identity

    db = Database(paths.db)
    made = {}
    for role in (Role.METRICS, Role.VIEWER, Role.OPERATOR):
        made[role] = tokens.new_token()
        db.add_token(f"t-{role}", tokens.digest(made[role]), role)

    def lookup(h: str) -> Identity | None:
        rec = Database(paths.db).token_by_hash(h)
        return None if rec is None else token_identity(rec)
    sessions = app.state.daemon.sessions        # the ones /login makes
    c = TestClient(TokenAuth(Limits(app), lambda t: lookup(tokens.digest(t)), sessions,
                             lookup), follow_redirects=False)

    def login(role: Role) -> tuple[str, str]:
        r = c.post("/login", content=urllib.parse.urlencode({"token": made[role]}),
                   headers={"content-type": "application/x-www-form-urlencoded"})
        assert r.status_code == 303, r.text
        return r.headers["location"], r.cookies.get(COOKIE) or ""

    # A metrics token reads /metrics only: no dashboard session is made for it.
    where, sid = login(Role.METRICS)
    assert not sid and where.startswith("/login?error=")
    assert "has the metrics role" in urllib.parse.unquote_plus(where)

    for role, write in ((Role.VIEWER, 403), (Role.OPERATOR, 404)):
        where, sid = login(role)
        assert where == "/" and sid
        c.cookies.set(COOKIE, sid)
        page = c.get("/")
        assert page.status_code == 200 and f'data-role="{role}"' in page.text
        csrf = re.search(r'name="csrf-token" content="([^"]+)"', page.text)
        assert csrf
        assert c.get("/1.0/vms").json() == []
        r = c.put("/1.0/vms/x/state", json={"action": "start"},
                  headers={"X-CSRF-Token": csrf.group(1)})
        assert r.status_code == write, r.text     # operator: past the role, no such VM
        if write == 403:
            assert r.json()["error"] == ("PUT /1.0/vms/x/state needs the operator role; "
                                         f"token 't-{role}' has the {role} role.")
        c.cookies.clear()


# -- tokens in the state file --------------------------------------------------------------
def test_tokens_keep_their_role(tmp_path: Path) -> None:
    db = Database(tmp_path / "state.db")
    for role in ROLES:
        db.add_token(f"t-{role}", tokens.digest(f"tok-{role}"), role)
    assert [(t.name, t.role, t.before_roles) for t in db.tokens()] == [
        ("t-admin", Role.ADMIN, False), ("t-metrics", Role.METRICS, False),
        ("t-operator", Role.OPERATOR, False), ("t-viewer", Role.VIEWER, False)]
    rec = db.token_by_hash(tokens.digest("tok-viewer"))
    assert rec is not None and rec.role is Role.VIEWER


def test_roles_are_ordered() -> None:
    assert [r.value for r in ROLES] == ["metrics", "viewer", "operator", "admin"]
    assert Role.ADMIN.includes(Role.METRICS) and Role.OPERATOR.includes(Role.OPERATOR)
    assert not Role.VIEWER.includes(Role.OPERATOR)
    assert not Role.METRICS.includes(Role.VIEWER)


def old_state_file(path: Path) -> None:
    """The tokens table as a fusuma from before roles made it, with one token."""
    old = sqlite3.connect(path)
    old.executescript(f"""
        CREATE TABLE tokens (name TEXT PRIMARY KEY, hash TEXT NOT NULL UNIQUE,
            created_at REAL NOT NULL, last_used_at REAL);
        INSERT INTO tokens VALUES ('prometheus', '{tokens.digest("old")}', 1.0, NULL);
    """)
    old.close()


def test_a_state_file_from_before_roles_is_taken_over(tmp_path: Path) -> None:
    path = tmp_path / "state.db"
    old_state_file(path)
    db = Database(path)
    rec = db.token_by_hash(tokens.digest("old"))
    assert rec is not None
    assert (rec.name, rec.role, rec.before_roles) == ("prometheus", Role.ADMIN, True)
    db.add_token("scrape", tokens.digest("new"), Role.METRICS)
    assert [(t.name, t.role, t.before_roles) for t in db.tokens()] == [
        ("prometheus", Role.ADMIN, True), ("scrape", Role.METRICS, False)]
    # The old token goes the usual way.
    db.remove_token("prometheus")
    assert db.token_by_hash(tokens.digest("old")) is None


def test_token_list_shows_roles_and_names_tokens_from_before_roles(paths: Paths) -> None:
    from fusuma.cli.token import token

    paths.home.mkdir(parents=True)
    old_state_file(paths.db)
    ctx = Ctx(paths)
    runner = CliRunner()
    made = runner.invoke(token, ["create", "ci", "--role", "operator", "--json"], obj=ctx)
    assert made.exit_code == 0, made.output
    listed = runner.invoke(token, ["list"], obj=ctx)
    assert listed.exit_code == 0, listed.output
    rows = [line.split() for line in listed.stdout.splitlines()]
    assert [r[:2] for r in rows] == [["NAME", "ROLE"], ["ci", "operator"],
                                     ["prometheus", "admin*"]], listed.stdout
    assert "'prometheus' were made before tokens had roles and keep the admin role" \
        in listed.stderr
    as_json = runner.invoke(token, ["list", "--json"], obj=ctx)
    import json

    got = [(t["name"], t["role"], t["before_roles"]) for t in json.loads(as_json.stdout)]
    assert got == [("ci", "operator", False), ("prometheus", "admin", True)]


def test_token_create_needs_a_role(paths: Paths) -> None:
    from fusuma.cli.token import token
    from fusuma.errors import SpecError

    ctx = Ctx(paths)
    res = CliRunner().invoke(token, ["create", "ci"], obj=ctx)
    assert isinstance(res.exception, SpecError)
    assert str(res.exception) == ("say what token 'ci' may do: --role "
                                  "metrics|viewer|operator|admin (no default; `fusuma "
                                  "token create --help` lists what each may do).")
    assert ctx.db.tokens() == []           # nothing made
    res = CliRunner().invoke(token, ["create", "ci", "--role", "root"], obj=ctx)
    assert res.exit_code == 2 and "'root' is not one of" in res.output
    assert ctx.db.tokens() == []
