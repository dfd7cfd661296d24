"""The API's pieces without QEMU: request checks, errors, operations, events, tokens,
and the JSON shapes it shares with the CLI (a real SQLite state file in tmp_path)."""

from __future__ import annotations

import asyncio
import threading
import time
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient

from fusuma.api import auth
from fusuma.api.app import Limits, create_app
from fusuma.api.events import EventHub, api_event
from fusuma.api.models import PartitionInfo, VmInfo
from fusuma.api.operations import CANCELLED, FAILURE, SUCCESS, Operation, Operations
from fusuma.api.roles import Identity
from fusuma.api.server import LocalAuth, TokenAuth, parse_listen
from fusuma.errors import NotFoundError, SpecError, StateError
from fusuma.ops import tokens
from fusuma.paths import Paths
from fusuma.state import Database, PartitionRecord, VmRecord, VmState
from fusuma.state.lock import host_lock
from fusuma.state.roles import Role


@pytest.fixture
def paths(tmp_path: Path) -> Paths:
    return Paths(home=tmp_path / "home", runtime=tmp_path / "run", shm=tmp_path / "shm",
                 cache=tmp_path / "cache", cgroup_prefix="fusuma-unit-api")


@pytest.fixture
def client(paths: Paths) -> TestClient:
    return TestClient(LocalAuth(Limits(create_app(paths)), "fusuma"),
                      raise_server_exceptions=False)


def _error(r: Any, code: int) -> str:
    assert r.status_code == code, r.text
    body = r.json()
    assert body["type"] == "error" and body["error_code"] == code
    return str(body["error"])


# -- bad input ----------------------------------------------------------------------------
def test_malformed_json_is_400_saying_json(client: TestClient) -> None:
    msg = _error(client.post("/1.0/vms", content=b'{"name": "x", '), 400)
    assert "not valid JSON" in msg


def test_unknown_field_is_named(client: TestClient) -> None:
    msg = _error(client.post("/1.0/vms", json={"name": "x", "partition": "p0",
                                               "bogus": 1}), 400)
    assert "'bogus'" in msg and "unknown field" in msg


def test_missing_field_is_named(client: TestClient) -> None:
    msg = _error(client.post("/1.0/partitions", json={"name": "p9", "cpus": "0"}), 400)
    assert "'memory_mib'" in msg and "required" in msg


@pytest.mark.parametrize("name", ["a/b", "..", "../etc", "x y"])
def test_bad_names_in_body_are_400(client: TestClient, name: str) -> None:
    msg = _error(client.post("/1.0/vms", json={"name": name, "partition": "p0"}), 400)
    assert "'name'" in msg and "not allowed" in msg


def test_bad_name_in_path_is_400_and_unknown_is_404(client: TestClient) -> None:
    assert "not allowed" in _error(client.get("/1.0/vms/%2e%2e"), 400)
    assert "no VM named 'nope'" in _error(client.get("/1.0/vms/nope"), 404)
    assert "no such API path" in _error(client.get("/1.0/nothing"), 404)
    assert "not allowed on" in _error(client.put("/1.0/vms"), 405)


def test_body_over_the_limit_is_413(client: TestClient) -> None:
    msg = _error(client.post("/1.0/vms", content=b"x" * (2 << 20)), 413)
    assert "at most" in msg


def test_body_without_content_type_is_json(client: TestClient) -> None:
    # `curl -d '{...}'` sends form data's content type; the body is JSON all the same.
    r = client.post("/1.0/vms", content=b'{"name": "x", "partition": "nope"}',
                    headers={"content-type": "application/x-www-form-urlencoded"})
    assert "no partition named 'nope'" in _error(r, 404)


def _through_limits(app: Any, receive: Any, timeout: float) -> list[dict[str, Any]]:
    """What the Limits middleware in front of ``app`` sends, the body coming from
    ``receive``."""
    sent: list[dict[str, Any]] = []

    async def send(msg: dict[str, Any]) -> None:
        sent.append(msg)

    scope = {"type": "http", "method": "POST", "path": "/1.0/vms", "headers": []}
    asyncio.run(Limits(app, timeout=timeout)(scope, receive, send))
    return sent


def test_slow_body_is_408(paths: Paths) -> None:
    """A body that never arrives is answered (408), not waited for forever."""
    async def app(scope: Any, receive: Any, send: Any) -> None:
        await receive()
        raise AssertionError("the body should not have arrived")

    async def receive() -> dict[str, Any]:
        await asyncio.sleep(10)
        return {"type": "http.request", "body": b"", "more_body": False}

    sent = _through_limits(app, receive, 0.1)
    assert sent[0]["status"] == 408
    assert b"did not arrive" in sent[1]["body"]


def test_a_body_sent_a_byte_at_a_time_gets_408_at_the_deadline() -> None:
    """Each byte comes well inside the timeout; the whole body does not."""
    async def app(scope: Any, receive: Any, send: Any) -> None:
        for _ in range(1000):
            if not (await receive()).get("more_body"):
                break
        raise AssertionError("the body should not have been read to its end")

    async def receive() -> dict[str, Any]:
        await asyncio.sleep(0.05)
        return {"type": "http.request", "body": b"x", "more_body": True}

    t0 = time.monotonic()
    sent = _through_limits(app, receive, 0.3)
    assert 0.25 < time.monotonic() - t0 < 1.5
    assert sent[0]["status"] == 408 and b"did not arrive within 0.3 s" in sent[1]["body"]


def test_listen_address_parsing() -> None:
    assert parse_listen("127.0.0.1:8443") == ("127.0.0.1", 8443)
    assert parse_listen("[::1]:0") == ("::1", 0)
    for bad in ("8443", "host:", ":80", "h:99999"):
        with pytest.raises(SpecError, match="HOST:PORT"):
            parse_listen(bad)


# -- the same shapes as the CLI ------------------------------------------------------------
def test_cli_json_validates_against_the_api_models(paths: Paths) -> None:
    from fusuma.ops.context import Ctx
    from fusuma.views.host import ps_data

    c = Ctx(paths)
    c.db.add_partition(PartitionRecord("p0", [0], 1024))
    c.db.add_vm(VmRecord("vm0", "p0", vcpus=1, memory_mib=256))
    data = ps_data(c)
    assert [PartitionInfo.model_validate(p).name for p in data["partitions"]] == ["p0"]
    vm = VmInfo.model_validate(data["vms"][0])
    assert (vm.name, vm.state, vm.job) == ("vm0", "stopped", None)
    # Both ways: a key the CLI adds that the model does not know fails validation.
    with pytest.raises(ValueError, match="extra"):
        VmInfo.model_validate({**data["vms"][0], "surprise": 1})


def test_api_lists_what_the_cli_lists(paths: Paths, client: TestClient) -> None:
    from fusuma.ops.context import Ctx
    from fusuma.views.host import ps_data

    c = Ctx(paths)
    c.db.add_partition(PartitionRecord("p0", [0], 1024))
    c.db.add_vm(VmRecord("vm0", "p0", vcpus=1, memory_mib=256))
    assert client.get("/1.0/vms").json() == ps_data(c, vms_only=True)["vms"]
    assert client.get("/1.0/vms", params={"recursion": 0}).json() == ["/1.0/vms/vm0"]
    assert client.get("/1.0/partitions/p0").json() == ps_data(c)["partitions"][0]


# -- operations ---------------------------------------------------------------------------
def _ops() -> tuple[Operations, list[tuple[str, str]]]:
    seen: list[tuple[str, str]] = []
    return Operations(lambda op, action: seen.append((action, op.status)), workers=1), seen


def test_operation_success_and_failure_codes() -> None:
    ops, seen = _ops()
    ok = ops.submit("t", "ok", {}, lambda op: {"answer": 42})
    assert ok.done.wait(5) and ok.status_code == SUCCESS and ok.result == {"answer": 42}

    def busy(op: Operation) -> Any:
        raise StateError("VM 'x' is busy")
    bad = ops.submit("t", "bad", {}, busy)
    assert bad.done.wait(5)
    assert (bad.status_code, bad.err, bad.error_code) == (FAILURE, "VM 'x' is busy", 409)
    gone = ops.submit("t", "gone", {}, lambda op: (_ for _ in ()).throw(NotFoundError("no")))
    assert gone.done.wait(5) and gone.error_code == 404
    assert ("operation-created", "Pending") in seen
    assert ("operation-updated", "Success") in seen
    with pytest.raises(NotFoundError):
        ops.get("no-such-id")
    ops.shutdown()


def test_cancel_pending_running_and_done() -> None:
    ops, _ = _ops()
    gate = threading.Event()
    first = ops.submit("t", "blocks the only worker", {}, lambda op: gate.wait(5))
    queued = ops.submit("t", "waits", {}, lambda op: "ran")
    assert ops.cancel(queued.id).status_code == CANCELLED
    with pytest.raises(StateError, match="cannot be cancelled"):
        ops.cancel(first.id)
    gate.set()
    assert first.done.wait(5) and queued.done.is_set()
    assert queued.result is None
    with pytest.raises(StateError, match="already ended"):
        ops.cancel(first.id)

    started = threading.Event()

    def movelike(op: Operation) -> Any:
        started.set()
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline:
            op.check_cancel()       # a safe point
            time.sleep(0.01)
        return "not cancelled"
    mv = ops.submit("t", "move", {}, movelike, cancellable=True)
    assert started.wait(5)
    assert ops.cancel(mv.id).cancel_requested
    assert mv.done.wait(5) and mv.status_code == CANCELLED and mv.error_code == 499
    ops.shutdown()


# -- events ---------------------------------------------------------------------------------
def test_transitions_partitions_and_vms_write_lifecycle_events(tmp_path: Path) -> None:
    db = Database(tmp_path / "state.db")
    start = db.last_event_id()
    db.add_partition(PartitionRecord("p0", [0], 1024))
    db.add_vm(VmRecord("vm0", "p0", vcpus=1, memory_mib=256))
    db.transition("vm0", VmState.STARTING)
    db.transition("vm0", VmState.RUNNING, pid=4242)
    db.transition("vm0", VmState.CRASHED, pid=None, error="QEMU exited")
    db.transition("vm0", VmState.STOPPED)
    db.remove_vm("vm0")
    evs = db.events_since(start)
    assert [e["action"] for e in evs] == ["partition-created", "vm-created", "vm-started",
                                         "vm-crashed", "vm-stopped", "vm-deleted"]
    started = evs[2]
    assert started["source"] == "/1.0/vms/vm0" and started["context"]["pid"] == 4242
    assert evs[3]["context"]["error"] == "QEMU exited"
    shown = api_event(started)
    assert shown["metadata"]["action"] == "vm-started" and shown["timestamp"].endswith("Z")


def test_event_hub_streams_live_and_replays(tmp_path: Path) -> None:
    dbfile = tmp_path / "state.db"
    local = threading.local()

    def db() -> Database:
        if not hasattr(local, "db"):
            local.db = Database(dbfile)
        d: Database = local.db
        return d
    writer = Database(dbfile)
    first = writer.emit("lifecycle", "vm-started", "/1.0/vms/a")
    observed: list[str] = []

    async def scenario() -> list[bytes]:
        hub = EventHub(db, lambda e: observed.append(e["action"]))
        await hub.start()
        chunks: list[bytes] = []

        async def read() -> None:
            async for chunk in hub.stream(frozenset({"lifecycle"}), since=first - 1):
                chunks.append(chunk)
                if b"vm-stopped" in chunk:
                    return
        reader = asyncio.create_task(read())
        await asyncio.sleep(0.2)
        writer.emit("governor", "cap", "/1.0/partitions/p0", partition="p0")
        writer.emit("lifecycle", "vm-stopped", "/1.0/vms/a")
        await asyncio.wait_for(reader, 5)
        await hub.stop()
        return chunks
    chunks = asyncio.run(scenario())
    text = b"".join(chunks).decode()
    assert "vm-started" in text            # replayed from the log (since)
    assert "vm-stopped" in text            # live
    assert "event: governor" not in text   # filtered out by type
    assert observed == ["cap", "vm-stopped"]   # the metrics see every new event


# -- tokens -------------------------------------------------------------------------------
def test_tokens_store_only_a_hash(tmp_path: Path) -> None:
    db = Database(tmp_path / "state.db")
    tok = tokens.new_token()
    db.add_token("ci", tokens.digest(tok), Role.OPERATOR)
    got = db.token_by_hash(tokens.digest(tok))
    assert got is not None and (got.name, got.role, got.before_roles) == (
        "ci", Role.OPERATOR, False)
    assert db.token_by_hash(tokens.digest(tok + "x")) is None
    assert tok.encode() not in (tmp_path / "state.db").read_bytes()
    db.remove_token("ci")
    assert db.token_by_hash(tokens.digest(tok)) is None
    with pytest.raises(NotFoundError):
        db.remove_token("ci")
    assert auth.bearer("Bearer abc") == "abc" and auth.bearer("Basic abc") is None


def test_token_middleware(paths: Paths) -> None:
    from fusuma.api.sessions import COOKIE, Sessions

    good = tokens.new_token()
    sessions = Sessions()
    valid = {tokens.digest(good)}
    ci = Identity("token 'ci'", Role.ADMIN, "ci")
    app = TokenAuth(Limits(create_app(paths)), lambda t: ci if t == good else None,
                    sessions, lambda h: ci if h in valid else None)
    c = TestClient(app, follow_redirects=False)
    r = c.get("/1.0/vms")
    assert r.status_code == 401 and r.headers["www-authenticate"].startswith("Bearer")
    assert "needs a token" in r.json()["error"]
    r = c.get("/1.0/vms", headers={"Authorization": "Bearer wrong"})
    assert r.status_code == 401 and "not valid" in r.json()["error"]
    assert c.get("/1.0/vms", headers={"Authorization": f"Bearer {good}"}).json() == []
    # A browser without a session is sent to the login page, and gets no data.
    r = c.get("/")
    assert r.status_code == 303 and r.headers["location"] == "/login"
    # A session: reads pass; writes need its CSRF token; a revoked token ends it.
    sid, sess = sessions.create("ci", tokens.digest(good))
    c.cookies.set(COOKIE, sid)
    assert c.get("/1.0/vms").status_code == 200
    r = c.put("/1.0/vms/x/state", json={"action": "start"})
    assert r.status_code == 403 and "CSRF" in r.json()["error"]
    r = c.put("/1.0/vms/x/state", json={"action": "start"},
              headers={"X-CSRF-Token": sess.csrf})
    assert r.status_code == 404        # past auth: the VM does not exist
    valid.clear()
    assert c.get("/1.0/vms").status_code == 401


# -- the host lock across threads ---------------------------------------------------------
def test_host_lock_excludes_threads_of_one_process(tmp_path: Path) -> None:
    inside = 0
    most = 0
    guard = threading.Lock()

    def work() -> None:
        nonlocal inside, most
        for _ in range(20):
            with host_lock(tmp_path), host_lock(tmp_path):   # re-entrant per thread
                with guard:
                    inside += 1
                    most = max(most, inside)
                time.sleep(0.001)
                with guard:
                    inside -= 1
    pool = [threading.Thread(target=work) for _ in range(4)]
    for t in pool:
        t.start()
    for t in pool:
        t.join()
    assert most == 1


def test_docs_page_needs_no_cdn(client: TestClient) -> None:
    page = client.get("/docs")
    assert page.status_code == 200
    assert "/static/swagger-ui-bundle.js" in page.text and "cdn." not in page.text
    assert client.get("/static/swagger-ui-bundle.js").status_code == 200
    assert client.get("/static/swagger-ui.css").status_code == 200
    spec = client.get("/openapi.json").json()
    assert "/1.0/vms/{name}/move" in spec["paths"]
    assert client.get("/redoc").status_code == 404     # it would need a CDN


@pytest.mark.parametrize("backup", ["/etc/x", "../x", "a/b"])
def test_a_backup_is_a_name_never_a_path(client: TestClient, backup: str) -> None:
    msg = _error(client.post("/1.0/vms/v/backups", json={"backup": backup}), 400)
    assert "'backup'" in msg and "not allowed" in msg
    msg = _error(client.post("/1.0/backups/x/restore", json={"vm": backup}), 400)
    assert "'vm'" in msg


def test_backup_of_an_unknown_vm_and_restore_of_no_backup(client: TestClient) -> None:
    assert "no VM named 'nope'" in _error(
        client.post("/1.0/vms/nope/backups", json={"backup": "b"}), 404)
