"""`fusuma serve`: the sockets, the uvicorn servers and the daemon's life.

One process, one event loop, one app: uvicorn serves it on the UNIX socket (no TLS, no
token: the kernel's word on who connected decides, ``fusuma.api.peers``) and, with
``--listen``, on TCP (TLS, and a bearer token on every request). Both servers share the
daemon's operations, event hub and metrics; SIGTERM/SIGINT stop both (running
operations are left to finish their current step: their jobs make any half-done one
recoverable). Each server has its own gate (``fusuma.api.guard``: how many connections,
how long a client may take); token checks run on the daemon's ``auth_pool``, threads
nothing else uses.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import socket
import stat
from collections.abc import Callable, Generator
from concurrent.futures import Executor, ThreadPoolExecutor
from dataclasses import field
from pathlib import Path
from typing import Any

from fusuma.api.guard import ClientLimits
from fusuma.errors import ConflictError, HostError, SpecError, StateError
from fusuma.frozen import frozen
from fusuma.paths import Paths
from fusuma.state.roles import Role

LOG = logging.getLogger(__name__)


@frozen
class ServeOptions:
    listen: tuple[str, int] | None = None
    cert: Path | None = None
    key: Path | None = None
    group: str = "fusuma"
    access_log: bool = True
    limits: ClientLimits = field(default_factory=ClientLimits)
    # Other local groups that may use the UNIX socket, each with its role.
    group_roles: tuple[tuple[str, Role], ...] = ()


def parse_listen(value: str) -> tuple[str, int]:
    """``HOST:PORT`` or ``[V6]:PORT``; a clear SpecError otherwise."""
    host, sep, port = value.rpartition(":")
    if not sep or not port.isdigit() or not 0 <= int(port) < 65536 or not host:
        raise SpecError(f"--listen {value!r}: give HOST:PORT, e.g. 127.0.0.1:8443 (port 0: "
                        "any free port, printed at start).")
    return host.strip("[]"), int(port)


def api_dir(paths: Paths) -> Path:
    return paths.runtime / "api"


def api_socket(paths: Paths) -> Path:
    return api_dir(paths) / "fusuma.sock"


def _in_use(path: Path) -> bool:
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        s.connect(str(path))
        return True
    except OSError:
        return False
    finally:
        s.close()


def unix_socket(paths: Paths, group: str, open_to_all: bool = False) -> socket.socket:
    """Bind ``RUNTIME/api/fusuma.sock``: directory 0750 and socket 0660, both of group
    ``group`` (created when missing), so that only root and that group can connect;
    with ``open_to_all`` (other groups have roles: ``serve --group-role``) directory
    0711 and socket 0666, and the peer's credentials decide. Refuses when another
    daemon answers there."""
    from fusuma.api.auth import ensure_group

    gid = ensure_group(group)
    dir_mode, sock_mode = (0o711, 0o666) if open_to_all else (0o750, 0o660)
    paths.ensure_runtime()
    d = api_dir(paths)
    d.mkdir(mode=dir_mode, exist_ok=True)
    st = d.lstat()
    if not stat.S_ISDIR(st.st_mode) or (st.st_uid != 0 and os.geteuid() == 0):
        raise HostError(f"{d} is not a directory owned by root; remove it and try again.")
    os.chown(d, 0 if os.geteuid() == 0 else -1, gid)
    os.chmod(d, dir_mode)
    path = api_socket(paths)
    if path.exists() or path.is_symlink():
        if _in_use(path):
            raise ConflictError(f"another `fusuma serve` already answers on {path}; stop "
                                "it first (or use another FUSUMA_RUNTIME_DIR).")
        path.unlink()
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    old = os.umask(0o177)
    try:
        s.bind(str(path))
    finally:
        os.umask(old)
    os.chown(path, 0 if os.geteuid() == 0 else -1, gid)
    os.chmod(path, sock_mode)
    s.listen(1024)
    s.setblocking(False)
    return s


def tcp_socket(host: str, port: int) -> socket.socket:
    """The listening socket of ``--listen``. Made with its protocol named: asyncio sets
    TCP_NODELAY only on connections whose socket says IPPROTO_TCP, and without it a
    response's second write (its body after its head) waits for the client's delayed
    ACK: 40 ms on every request."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    s = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        s.bind((host, port))
    except OSError as exc:
        s.close()
        raise HostError(f"cannot listen on {host}:{port}: {exc.strerror}.") from exc
    s.listen(1024)
    s.setblocking(False)
    return s


def with_identity(scope: Any, who: Any, **more: Any) -> Any:
    """A copy of ``scope`` whose request state names ``who`` (fusuma.api.roles.Identity):
    a copy, so that no server's shared state dict can carry it to another request."""
    return {**scope, "state": {**scope.get("state", {}), "identity": who, **more}}


class LocalAuth:
    """ASGI middleware for the UNIX socket: each request carries the role of the peer
    that connected (``fusuma.api.peers``: root and the socket's group are admin, a
    group of ``--group-role`` its role); a peer with none gets 403 and one sentence."""

    def __init__(self, app: Any, group: str, access: Any = None) -> None:
        from fusuma.api.peers import LocalAccess

        self.app = app
        self.access = access if access is not None else LocalAccess(group)

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] in ("http", "websocket"):
            from fusuma.api.peers import PEER

            who = self.access.identity(scope.get("state", {}).get(PEER))
            if isinstance(who, str):
                if scope["type"] == "http":
                    from fusuma.api.http import error_response

                    await error_response(403, who)(scope, receive, send)
                return
            scope = with_identity(scope, who)
        await self.app(scope, receive, send)


class TokenAuth:
    """ASGI middleware for the TCP server: a request needs a valid bearer token, or the
    dashboard's session cookie (made by /login from a token) and, for a write, that
    session's CSRF token in ``X-CSRF-Token``. Either way the request carries the token's
    role (``check`` and ``lookup`` give the Identity of a token, and of a token's hash,
    read anew on every request: a revoked token ends its sessions). The login page and
    its static files are open; a browser asking for the page without a session is sent
    to /login. Tokens are read on ``pool``'s threads, which nothing else uses (the
    daemon's ``auth_pool``), so that no flood of other requests can starve them."""

    def __init__(self, app: Any, check: Callable[[str], Any],
                 sessions: Any = None, lookup: Callable[[str], Any] | None = None,
                 pool: Executor | None = None) -> None:
        self.app = app
        self.check = check
        self.sessions = sessions
        self.lookup = lookup
        self.pool = pool or ThreadPoolExecutor(2, thread_name_prefix="auth")

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] not in ("http", "websocket"):
            await self.app(scope, receive, send)
            return
        from fusuma.api.auth import bearer
        from fusuma.api.http import error_response

        path = scope.get("path", "")
        if path == "/login" or path.startswith("/static/"):
            await self.app(scope, receive, send)
            return
        headers = scope.get("headers", [])
        header = next((v.decode("latin-1") for k, v in headers if k == b"authorization"),
                      None)
        token = bearer(header)
        if token:
            who = await asyncio.get_running_loop().run_in_executor(
                self.pool, self.check, token)
            if who is not None:
                await self.app(with_identity(scope, who), receive, send)
                return
            resp = error_response(401, "the token is not valid (unknown or revoked).")
            resp.headers["WWW-Authenticate"] = 'Bearer realm="fusuma"'
            await resp(scope, receive, send)
            return
        if self.sessions is not None and self.lookup is not None:
            from fusuma.api.sessions import cookie

            sess = self.sessions.get(cookie(headers))
            who = None if sess is None else \
                await asyncio.get_running_loop().run_in_executor(
                    self.pool, self.lookup, sess.token_hash)
            if sess is not None and who is not None:
                if scope.get("method") not in ("GET", "HEAD", "OPTIONS"):
                    sent = next((v.decode("latin-1") for k, v in headers
                                 if k == b"x-csrf-token"), "")
                    import hmac

                    if not hmac.compare_digest(sent, sess.csrf):
                        await error_response(403, "this write needs the page's CSRF token in "
                                             "X-CSRF-Token; reload the page.")(scope, receive, send)
                        return
                await self.app(with_identity(scope, who, session=sess), receive, send)
                return
        if scope.get("method") == "GET" and (path == "/" or path.startswith("/ui/")):
            from starlette.responses import RedirectResponse

            await RedirectResponse("/login", status_code=303)(scope, receive, send)
            return
        resp = error_response(401, "this API needs a token: send `Authorization: Bearer "
                                   "TOKEN` (make one with `fusuma token create NAME "
                                   "--role ROLE`).")
        resp.headers["WWW-Authenticate"] = 'Bearer realm="fusuma"'
        await resp(scope, receive, send)


def peer_h11(base: type) -> type:
    """``base`` (the UNIX socket's guarded protocol) reading each connection's peer
    credentials (``fusuma.api.peers.credentials``) once, into the state every request
    of that connection carries."""
    from fusuma.api.peers import PEER, credentials

    class PeerH11(base):  # type: ignore[misc]
        app_state: dict[str, Any]

        def connection_made(self, transport: Any) -> None:
            super().connection_made(transport)
            peer = credentials(transport.get_extra_info("socket"))
            self.app_state = {**self.app_state, PEER: peer}

    return PeerH11


def _quiet_server(config: Any) -> Any:
    import uvicorn

    class Server(uvicorn.Server):
        """Signals are the daemon's, not each server's (two servers share them)."""

        @contextlib.contextmanager
        def capture_signals(self) -> Generator[None, None, None]:
            yield

    return Server(config)


async def serve(paths: Paths, opts: ServeOptions,
                ready: Callable[[dict[str, Any]], None] = lambda info: None) -> None:
    import uvicorn

    from fusuma.api import app as api_app
    from fusuma.api.auth import ensure_certificate
    from fusuma.api.daemon import Daemon
    from fusuma.api.guard import KEEP_ALIVE_S, Gate, guarded_h11, raise_open_files, tls_deadlines
    from fusuma.api.roles import Identity, token_identity
    from fusuma.ops.tokens import digest

    if opts.access_log:
        # The CLI's default level is WARNING, which would hide uvicorn's INFO lines.
        logging.getLogger("uvicorn.access").setLevel(logging.INFO)
    lim = opts.limits
    short = raise_open_files(lim.open_files(1 if opts.listen is None else 2))
    if short:
        LOG.warning("%s", short)
    from fusuma.api.auth import ensure_group
    from fusuma.api.peers import LocalAccess

    # A mapping that names no group is refused before anything is made.
    access = LocalAccess.build(opts.group, ensure_group(opts.group), opts.group_roles)
    daemon = Daemon(paths)
    app = api_app.create_app(paths, daemon)
    paths.ensure_parents()
    uds = unix_socket(paths, opts.group, access.open_to_all)
    servers = []
    # No WebSocket routes: an upgrade would leave the guard's protocol (ws="none").
    common: dict[str, Any] = {"lifespan": "off", "log_config": None, "ws": "none",
                              "access_log": opts.access_log,
                              "timeout_keep_alive": KEEP_ALIVE_S,
                              "timeout_graceful_shutdown": 3, "server_header": False}

    def guarded(key: str, gate: Gate) -> type:
        daemon.gates[key] = gate
        return guarded_h11(gate, lim.timeout_s)
    unix_gate = Gate("UNIX socket", lim.max_connections, None)
    servers.append((_quiet_server(uvicorn.Config(
        LocalAuth(api_app.wrap(app, lim.timeout_s), opts.group, access),
        http=peer_h11(guarded("unix", unix_gate)), **common)), uds))
    info: dict[str, Any] = {"socket": str(api_socket(paths)), "pid": os.getpid(),
                            "group_roles": access.describe()}
    try:
        older = [t.name for t in daemon.db().tokens() if t.before_roles]
    except StateError as exc:       # a token of an unknown role: refused when used
        LOG.warning("%s", exc)
        older = []
    if older:
        info["tokens_before_roles"] = older
    if opts.listen is not None:
        cert = opts.cert or paths.home / "api" / "server.crt"
        key = opts.key or paths.home / "api" / "server.key"
        if (opts.cert is None) != (opts.key is None):
            raise SpecError("give both --cert and --key, or neither (a self-signed pair "
                            "is made in FUSUMA_HOME/api).")
        if opts.cert is None and ensure_certificate(cert, key):
            info["certificate_made"] = str(cert)
        for f in (cert, key):
            if not f.is_file():
                raise SpecError(f"{f} does not exist.")

        def lookup(token_hash: str) -> Identity | None:
            try:
                rec = daemon.db().token_by_hash(token_hash)
            except StateError:      # a role this fusuma does not know: no access
                return None
            return None if rec is None else token_identity(rec)

        def check(token: str) -> Identity | None:
            who = lookup(digest(token))
            if who is not None and who.token is not None:
                daemon.db().token_used(who.token)
            return who
        tcp = tcp_socket(*opts.listen)
        where = f"{opts.listen[0]}:{tcp.getsockname()[1]}"
        tcp_gate = Gate(f"TCP listener {where}", lim.max_connections, lim.max_per_client)
        tls = uvicorn.Config(TokenAuth(api_app.wrap(app, lim.timeout_s), check,
                                       daemon.sessions, lookup, daemon.auth_pool),
                             ssl_certfile=str(cert), ssl_keyfile=str(key),
                             http=guarded("tcp", tcp_gate), **common)
        servers.append((_quiet_server(tls), tcp))
        info["listen"] = f"https://{where}"
        info["certificate"] = str(cert)
    await daemon.hub.start()
    await daemon.sampler.start()
    loop = asyncio.get_running_loop()

    ending: set[asyncio.Task[None]] = set()

    def stop() -> None:
        for srv, _ in servers:
            srv.should_exit = True
        # End the event streams now: uvicorn waits for open responses (up to its
        # graceful timeout) and then cuts them mid-chunk.
        task = loop.create_task(daemon.hub.stop())
        ending.add(task)
        task.add_done_callback(ending.discard)
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop)
    info["limits"] = {"max_connections": lim.max_connections,
                      "max_connections_per_client": lim.max_per_client,
                      "client_timeout_s": lim.timeout_s}
    try:
        with tls_deadlines(loop, lim.timeout_s):
            tasks = [asyncio.create_task(srv.serve(sockets=[sock])) for srv, sock in servers]
            ready(info)
            await asyncio.gather(*tasks)
    finally:
        await daemon.hub.stop()
        await daemon.sampler.stop()
        daemon.ops.shutdown()
        daemon.auth_pool.shutdown(wait=False, cancel_futures=True)
        with contextlib.suppress(FileNotFoundError):
            api_socket(paths).unlink()
        for _, sock in servers:
            sock.close()
