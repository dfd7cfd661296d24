"""The daemon stays up (issue 24), piece by piece without a daemon: waits that hold no
thread, token checks on threads of their own, each listener's gate and deadlines (a
real uvicorn on a UNIX socket or a loopback port in this process, with a tiny app)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import resource
import socket
import threading
import time
from collections.abc import AsyncIterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
import uvicorn
from fastapi.testclient import TestClient
from starlette.requests import Request

from fusuma.api import app as app_module
from fusuma.api.app import Limits, create_app
from fusuma.api.guard import REFUSED_MAX, Gate, guarded_h11, raise_open_files
from fusuma.api.http import unless_gone
from fusuma.api.operations import SUCCESS, Operations
from fusuma.api.roles import Identity
from fusuma.api.server import LocalAuth, TokenAuth, tcp_socket
from fusuma.paths import Paths
from fusuma.state.roles import Role


def _ops() -> Operations:
    return Operations(lambda op, action: None, workers=2)


# -- waits ----------------------------------------------------------------------------
def test_two_hundred_waits_hold_no_thread_and_all_wake() -> None:
    ops = _ops()
    release = threading.Event()
    op = ops.submit("t", "long", {}, lambda op: release.wait(10))

    async def main() -> tuple[int, int, int, list[bool]]:
        await asyncio.sleep(0.1)
        before = threading.active_count()
        waits = [asyncio.ensure_future(ops.wait(op, 10)) for _ in range(200)]
        await asyncio.sleep(0.2)
        during, watching = threading.active_count(), len(op.watchers)
        release.set()
        ended = await asyncio.wait_for(asyncio.gather(*waits), 5)
        return before, during, watching, ended
    before, during, watching, ended = asyncio.run(main())
    assert during == before, "a waiter took a thread"
    assert watching == 200 and all(ended) and op.watchers == []
    assert op.status_code == SUCCESS
    ops.shutdown()


def test_a_wait_that_times_out_says_so_and_forgets_itself() -> None:
    ops = _ops()
    release = threading.Event()
    op = ops.submit("t", "long", {}, lambda op: release.wait(10))
    t0 = time.monotonic()
    assert asyncio.run(ops.wait(op, 0.2)) is False
    assert 0.15 < time.monotonic() - t0 < 2 and op.watchers == []
    release.set()
    assert op.done.wait(5)
    assert asyncio.run(ops.wait(op, 5)) is True        # ended: at once
    ops.shutdown()


def test_cancelling_a_pending_operation_wakes_its_waiters() -> None:
    ops = Operations(lambda op, action: None, workers=1)
    release = threading.Event()
    ops.submit("t", "holds the only worker", {}, lambda op: release.wait(10))
    queued = ops.submit("t", "pending", {}, lambda op: "ran")

    async def main() -> bool:
        waiter = asyncio.ensure_future(ops.wait(queued, 10))
        await asyncio.sleep(0.1)
        ops.cancel(queued.id)
        return await asyncio.wait_for(waiter, 5)
    assert asyncio.run(main()) is True
    release.set()
    ops.shutdown()


def test_wait_route_is_bounded_by_the_server(tmp_path: Path,
                                             monkeypatch: pytest.MonkeyPatch) -> None:
    """timeout=-1 waits WAIT_MAX_S, then answers the operation with timed_out: true."""
    paths = Paths(home=tmp_path / "home", runtime=tmp_path / "run", shm=tmp_path / "shm",
                  cache=tmp_path / "cache", cgroup_prefix="fusuma-unit-guard")
    app = create_app(paths)
    monkeypatch.setattr(app_module, "WAIT_MAX_S", 0.3)
    d = app.state.daemon
    release = threading.Event()
    op = d.ops.submit("t", "long", {}, lambda op: release.wait(10) and {"done": 1})
    c = TestClient(LocalAuth(Limits(app), "fusuma"))
    t0 = time.monotonic()
    r = c.get(f"/1.0/operations/{op.id}/wait")                 # timeout -1
    assert time.monotonic() - t0 < 3
    assert r.status_code == 200 and r.json()["timed_out"] is True, r.text
    assert r.json()["status"] in ("Pending", "Running")
    r = c.get(f"/1.0/operations/{op.id}/wait", params={"timeout": 86400})
    assert r.json()["timed_out"] is True                     # capped too
    release.set()
    r = c.get(f"/1.0/operations/{op.id}/wait", params={"timeout": 5})
    assert r.json()["timed_out"] is False and r.json()["result"] == {"done": 1}
    spec = c.get("/openapi.json").json()
    desc = spec["paths"]["/1.0/operations/{op_id}/wait"]["get"]["description"]
    assert "at most 600 s" in desc and "timed_out" in desc
    d.ops.shutdown()


def test_a_wait_ends_with_its_client() -> None:
    async def main() -> tuple[object, float]:
        sent = [{"type": "http.request", "body": b"", "more_body": False}]

        async def receive() -> dict[str, Any]:
            if sent:
                return sent.pop()
            await asyncio.sleep(0.2)
            return {"type": "http.disconnect"}
        req = Request({"type": "http", "method": "GET", "path": "/", "headers": []},
                      receive)
        t0 = time.monotonic()
        got = await unless_gone(req, asyncio.sleep(30, "ended"))
        return got, time.monotonic() - t0
    got, took = asyncio.run(main())
    assert got is None and took < 2

    async def stays() -> object:
        async def receive() -> dict[str, Any]:
            await asyncio.sleep(30)
            return {"type": "http.disconnect"}
        req = Request({"type": "http", "method": "GET", "path": "/", "headers": []},
                      receive)
        return await unless_gone(req, asyncio.sleep(0.05, "ended"))
    assert asyncio.run(stays()) == "ended"


# -- token checks --------------------------------------------------------------------
def test_token_checks_run_on_their_own_threads_when_the_common_pool_is_full() -> None:
    """asyncio's default executor busy with one stuck job (its only worker): a request
    with a token is still checked and served, on the auth pool's thread."""
    ran_on: list[str] = []
    who = Identity("token 'ci'", Role.VIEWER, "ci")

    def check(token: str) -> Identity | None:
        ran_on.append(threading.current_thread().name)
        return who if token == "good" else None

    async def inner(scope: Any, receive: Any, send: Any) -> None:
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": scope["state"]["identity"].name
                    .encode()})

    auth_pool = ThreadPoolExecutor(1, thread_name_prefix="auth")
    guard = TokenAuth(inner, check, pool=auth_pool)
    stuck = threading.Event()

    async def main() -> list[dict[str, Any]]:
        loop = asyncio.get_running_loop()
        loop.set_default_executor(ThreadPoolExecutor(1))
        blocker = loop.run_in_executor(None, stuck.wait, 10)
        sent: list[dict[str, Any]] = []

        async def receive() -> dict[str, Any]:
            return {"type": "http.request", "body": b""}

        async def send(msg: dict[str, Any]) -> None:
            sent.append(msg)
        scope = {"type": "http", "method": "GET", "path": "/1.0", "state": {},
                 "headers": [(b"authorization", b"Bearer good")]}
        try:
            await asyncio.wait_for(guard(scope, receive, send), 3)
        finally:
            stuck.set()
            await blocker
        return sent
    sent = asyncio.run(main())
    auth_pool.shutdown()
    assert sent[0]["status"] == 200 and sent[1]["body"] == b"token 'ci'"
    assert ran_on and ran_on[0].startswith("auth")


def test_tcp_connections_are_made_without_nagle() -> None:
    """A connection accepted on the --listen socket has TCP_NODELAY (asyncio sets it
    only when the socket names its protocol); else every response's body waits 40 ms
    for the client's delayed ACK."""
    listener = tcp_socket("127.0.0.1", 0)
    port = listener.getsockname()[1]
    seen: list[int] = []

    class Note(asyncio.Protocol):
        def connection_made(self, transport: Any) -> None:
            sock = transport.get_extra_info("socket")
            seen.append(sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY))

    async def main() -> None:
        server = await asyncio.get_running_loop().create_server(Note, sock=listener)
        _, w = await asyncio.open_connection("127.0.0.1", port)
        for _ in range(100):
            if seen:
                break
            await asyncio.sleep(0.01)
        w.close()
        server.close()
        await server.wait_closed()
    asyncio.run(main())
    assert seen and seen[0] != 0


# -- the gate ------------------------------------------------------------------------
def test_gate_counts_places_and_says_why_it_refuses() -> None:
    g = Gate("TCP listener 127.0.0.1:8443", max_connections=3, per_client=2)
    assert g.admit("10.0.0.1") is None and g.admit("10.0.0.1") is None
    r = g.admit("10.0.0.1")
    assert r is not None and r.status == 429
    assert r.sentence == ("10.0.0.1 has 2 connections open to fusuma serve's TCP listener "
                          "127.0.0.1:8443, the most one address may have (serve "
                          "--max-connections-per-client 2); close some and try again.")
    assert g.admit("10.0.0.2") is None
    full = g.admit("10.0.0.3")
    assert full is not None and full.status == 503
    assert full.sentence == ("fusuma serve's TCP listener 127.0.0.1:8443 has 3 connections "
                             "open, the most it takes (serve --max-connections 3); try "
                             "again when some have closed.")
    g.release("10.0.0.1")
    assert g.admit("10.0.0.3") is None and g.open == 3
    for a in ("10.0.0.1", "10.0.0.2", "10.0.0.3"):
        g.release(a)
    assert g.open == 0 and not g.by_client
    unix = Gate("UNIX socket", 2, None)
    assert unix.admit(None) is None and unix.admit(None) is None
    refusal = unix.admit(None)
    assert refusal is not None and refusal.status == 503
    assert all(unix.hold_refused(refusal) for _ in range(REFUSED_MAX))
    assert not unix.hold_refused(refusal)
    assert unix.as_json()["refused"] == {"503": REFUSED_MAX + 1}


def test_open_files_limit() -> None:
    _, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    assert raise_open_files(16) is None
    if hard != resource.RLIM_INFINITY:
        short = raise_open_files(hard + 1)
        assert short is not None and "--max-connections" in short and str(hard + 1) in short


# -- a real server: the gate and the deadlines on the wire ---------------------------
async def _big(scope: Any, receive: Any, send: Any) -> None:
    """/big: 16 MiB; anything else: a small JSON."""
    if scope["type"] != "http":
        return
    if scope["path"] == "/big":
        await send({"type": "http.response.start", "status": 200, "headers": []})
        for _ in range(256):
            await send({"type": "http.response.body", "body": b"x" * 65536,
                        "more_body": True})
        await send({"type": "http.response.body", "body": b""})
        return
    body = b'{"ok": true}'
    await send({"type": "http.response.start", "status": 200,
                "headers": [(b"content-length", str(len(body)).encode())]})
    await send({"type": "http.response.body", "body": body})


class _Server(uvicorn.Server):
    @contextlib.contextmanager
    def capture_signals(self) -> Any:
        yield


@contextlib.asynccontextmanager
async def _served(sock: socket.socket, gate: Gate, timeout: float) -> AsyncIterator[None]:
    srv = _Server(uvicorn.Config(_big, lifespan="off", log_config=None, access_log=False,
                                 http=guarded_h11(gate, timeout), timeout_keep_alive=5))
    task = asyncio.create_task(srv.serve(sockets=[sock]))
    for _ in range(200):
        if srv.started:
            break
        await asyncio.sleep(0.01)
    try:
        yield
    finally:
        srv.should_exit = True
        await asyncio.wait_for(task, 10)
        sock.close()


async def _answer(r: asyncio.StreamReader, limit: float = 5) -> tuple[int, dict[str, Any]]:
    raw = await asyncio.wait_for(r.read(65536), limit)
    head, _, body = raw.partition(b"\r\n\r\n")
    return int(head.split()[1]), json.loads(body) if body.startswith(b"{") else {}


async def _until(gate: Gate, n: int) -> None:
    """Until ``gate`` holds ``n`` connections (at most a second)."""
    for _ in range(100):
        if gate.open == n:
            return
        await asyncio.sleep(0.01)
    raise AssertionError(f"the gate holds {gate.open} connections, not {n}")


def _unix(tmp_path: Path) -> tuple[socket.socket, str]:
    path = str(tmp_path / "g.sock")
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.bind(path)
    s.listen(64)
    s.setblocking(False)
    return s, path


def test_listener_full_is_503_and_a_place_comes_back(tmp_path: Path) -> None:
    sock, path = _unix(tmp_path)
    gate = Gate("UNIX socket", 2, None)

    async def main() -> None:
        async with _served(sock, gate, 5):
            held = [await asyncio.open_unix_connection(path) for _ in range(2)]
            await _until(gate, 2)
            r, w = await asyncio.open_unix_connection(path)
            w.write(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
            code, body = await _answer(r)
            assert code == 503 and body["error_code"] == 503
            assert body["error"].startswith("fusuma serve's UNIX socket has 2 connections")
            assert await asyncio.wait_for(r.read(), 5) == b""           # closed
            w.close()
            held[0][1].close()
            await _until(gate, 1)
            r, w = await asyncio.open_unix_connection(path)
            w.write(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
            assert (await _answer(r))[0] == 200
            w.close()
            held[1][1].close()
    asyncio.run(main())
    assert gate.open == 0 and gate.waiting_refused == 0


def test_per_client_limit_on_tcp_is_429() -> None:
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind(("127.0.0.1", 0))
    sock.listen(64)
    sock.setblocking(False)
    port = sock.getsockname()[1]
    gate = Gate("TCP listener", 10, 1)

    async def main() -> tuple[int, dict[str, Any]]:
        async with _served(sock, gate, 5):
            _, held = await asyncio.open_connection("127.0.0.1", port)
            await _until(gate, 1)
            r, w = await asyncio.open_connection("127.0.0.1", port)
            w.write(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
            got = await _answer(r)
            w.close()
            held.close()
            return got
    code, body = asyncio.run(main())
    assert code == 429 and body["error"].startswith("127.0.0.1 has 1 connections open")


def test_slowloris_and_silent_clients_get_408_and_are_closed(tmp_path: Path) -> None:
    """One client sends nothing, one sends its headers a byte every 50 ms (each gap
    well inside the deadline): both get 408 at the deadline and are closed."""
    sock, path = _unix(tmp_path)
    gate = Gate("UNIX socket", 10, None)

    async def main() -> tuple[list[float], int]:
        loop = asyncio.get_running_loop()
        clients = []
        for _ in range(2):
            c = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            c.setblocking(False)
            clients.append(c)
        silent, drip = clients
        async with _served(sock, gate, 0.5):
            t0 = time.monotonic()
            for c in clients:
                await loop.sock_connect(c, path)
            request = b"GET / HTTP/1.1\r\nHost: x\r\nX-Pad: " + b"a" * 100
            sent = 0
            with contextlib.suppress(BrokenPipeError, ConnectionResetError):
                for byte in request:                 # up to 6 s; cut after 0.5 s
                    await loop.sock_sendall(drip, bytes([byte]))
                    sent += 1
                    await asyncio.sleep(0.05)
            took = []
            for c in (silent, drip):
                raw = b""
                for _ in range(100):                  # to EOF: closed
                    chunk = await asyncio.wait_for(loop.sock_recv(c, 65536), 5)
                    if not chunk:
                        break
                    raw += chunk
                assert raw.startswith(b"HTTP/1.1 408 "), raw
                assert b"headers did not arrive within 0.5 s" in raw
                took.append(time.monotonic() - t0)
                c.close()
            return took, sent
    took, sent = asyncio.run(main())
    assert all(0.4 < t < 3 for t in took), took
    assert 5 <= sent < 60, sent
    assert gate.open == 0


def test_a_response_nobody_reads_is_cut(tmp_path: Path) -> None:
    sock, path = _unix(tmp_path)
    gate = Gate("UNIX socket", 10, None)

    async def main() -> tuple[int, int]:
        async with _served(sock, gate, 0.5):
            c = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            c.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
            c.connect(path)
            c.sendall(b"GET /big HTTP/1.1\r\nHost: x\r\n\r\n")
            opened = 0
            for _ in range(100):
                opened = max(opened, gate.open)
                if opened and gate.open == 0:
                    break
                await asyncio.sleep(0.05)          # the client reads nothing meanwhile
            c.settimeout(5)
            got = 0
            with contextlib.suppress(ConnectionError):
                for _ in range(4096):
                    chunk = c.recv(1 << 16)
                    if not chunk:
                        break
                    got += len(chunk)
            c.close()
            return opened, got
    opened, got = asyncio.run(main())
    assert opened == 1 and gate.open == 0
    assert got < 16 * 2**20, "the whole response was sent to a client that did not read"
