"""The guard of each listener of `fusuma serve`: how many connections it takes, and how
long a client may take over what it owes.

Each listener (the UNIX socket; the TCP port with ``--listen``) has a :class:`Gate`:

- it holds at most ``max_connections`` open connections and, on TCP, at most
  ``max_per_client`` from one address. A connection over either limit is answered at
  its first request with ``503`` (the listener is full) or ``429`` (that address has
  its share), one sentence and ``Retry-After``, then closed. While it waits for that
  request it holds no place; at most ``REFUSED_MAX`` such connections wait at once,
  and one more is closed unanswered.
- a client has ``timeout_s`` for each thing it owes: its TLS handshake, its request's
  headers (a connection that sends none, or sends them byte by byte, gets ``408`` and
  is closed), its body (``fusuma.api.http.Limits``) and taking what it is sent (a
  response that cannot be written for that long, its reader reading nothing: the
  connection is cut). An idle keep-alive connection is closed after ``KEEP_ALIVE_S``.

uvicorn's own ``limit_concurrency`` is not used: it counts every open connection,
idle ones and the one asking included, checks only when a request has arrived (a
connection that says nothing holds a place meanwhile), and answers a plain-text
``Service Unavailable`` that names no cause.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import resource
from collections import Counter
from collections.abc import Iterator
from typing import Any

from fusuma.frozen import frozen

LOG = logging.getLogger(__name__)

MAX_CONNECTIONS = 1024        # per listener
MAX_PER_CLIENT = 256          # per client address, on TCP
CLIENT_TIMEOUT_S = 10.0       # handshake, headers, body, a stalled response
KEEP_ALIVE_S = 5.0            # an idle keep-alive connection
REFUSED_MAX = 64              # refused connections waiting for their answer, per listener


@frozen
class ClientLimits:
    """What `fusuma serve` takes from its clients (``--max-connections``,
    ``--max-connections-per-client``, ``--client-timeout``)."""

    max_connections: int = MAX_CONNECTIONS
    max_per_client: int = MAX_PER_CLIENT
    timeout_s: float = CLIENT_TIMEOUT_S

    def open_files(self, listeners: int) -> int:
        """File descriptors the daemon needs with every listener full (and its own)."""
        return listeners * (self.max_connections + REFUSED_MAX) + 256


@frozen
class Refusal:
    """Why a connection is not served: its HTTP status and one sentence."""

    status: int
    sentence: str


class Gate:
    """The connections of one listener: counted on arrival, released when closed.
    ``per_client`` is None on the UNIX socket (its clients have no address)."""

    def __init__(self, name: str, max_connections: int, per_client: int | None) -> None:
        self.name = name
        self.max_connections = max_connections
        self.per_client = per_client
        self.open = 0
        self.by_client: Counter[str] = Counter()
        self.waiting_refused = 0
        self.refused: Counter[int] = Counter()     # by status, since the start

    def admit(self, client: str | None) -> Refusal | None:
        """None, and the connection is counted (``release`` it when it closes); or the
        refusal it gets."""
        if self.open >= self.max_connections:
            return Refusal(503, f"fusuma serve's {self.name} has {self.open} connections "
                                "open, the most it takes (serve --max-connections "
                                f"{self.max_connections}); try again when some have "
                                "closed.")
        if self.per_client is not None and client is not None \
                and self.by_client[client] >= self.per_client:
            return Refusal(429, f"{client} has {self.by_client[client]} connections open "
                                f"to fusuma serve's {self.name}, the most one address "
                                "may have (serve --max-connections-per-client "
                                f"{self.per_client}); close some and try again.")
        self.open += 1
        if client is not None:
            self.by_client[client] += 1
        return None

    def release(self, client: str | None) -> None:
        self.open -= 1
        if client is not None:
            self.by_client[client] -= 1
            if self.by_client[client] <= 0:
                del self.by_client[client]

    def hold_refused(self, refusal: Refusal) -> bool:
        """Whether a refused connection may wait for its request to be answered (else
        it is closed at once: too many refused ones wait already)."""
        self.refused[refusal.status] += 1
        if self.waiting_refused >= REFUSED_MAX:
            return False
        self.waiting_refused += 1
        return True

    def as_json(self) -> dict[str, Any]:
        return {"open": self.open, "max": self.max_connections,
                "max_per_client": self.per_client,
                "refused": {str(k): v for k, v in sorted(self.refused.items())}}


def _canned(status: int, reason: str, sentence: str) -> bytes:
    """A whole HTTP/1.1 error response that closes the connection."""
    body = json.dumps({"type": "error", "error": sentence, "error_code": status}).encode()
    return (f"HTTP/1.1 {status} {reason}\r\ncontent-type: application/json\r\n"
            f"connection: close\r\ncontent-length: {len(body)}\r\n\r\n").encode() + body


def refusal_app(refusal: Refusal) -> Any:
    """An ASGI app that answers every request with ``refusal`` and closes."""
    body = json.dumps({"type": "error", "error": refusal.sentence,
                       "error_code": refusal.status}).encode()
    headers = [(b"content-type", b"application/json"),
               (b"content-length", str(len(body)).encode()),
               (b"retry-after", b"1"), (b"connection", b"close")]

    async def app(scope: Any, receive: Any, send: Any) -> None:
        await send({"type": "http.response.start", "status": refusal.status,
                    "headers": headers})
        await send({"type": "http.response.body", "body": body})
    return app


def guarded_h11(gate: Gate, timeout_s: float = CLIENT_TIMEOUT_S) -> type:
    """uvicorn's HTTP/1.1 protocol behind ``gate``, with deadlines for a request's
    headers and for a response its client does not read (uvicorn times out an idle
    keep-alive connection, not one that sends half its headers and stalls, nor one that
    stops reading)."""
    import h11
    from uvicorn.protocols.http.h11_impl import H11Protocol

    late = _canned(408, "Request Timeout",
                   f"the request headers did not arrive within {timeout_s:g} s.")

    class GuardedH11(H11Protocol):
        _header_timer: asyncio.TimerHandle | None = None
        _write_timer: asyncio.TimerHandle | None = None
        _counted = False           # holds a place in the gate
        _refused = False           # waits for the request its refusal answers

        def connection_made(self, transport: Any) -> None:
            super().connection_made(transport)
            refusal = gate.admit(self._address())
            if refusal is None:
                self._counted = True
            elif gate.hold_refused(refusal):
                self._refused = True
                self.app = refusal_app(refusal)
            else:
                transport.abort()
                return
            self._arm()

        def connection_lost(self, exc: Exception | None) -> None:
            self._disarm()
            if self._write_timer is not None:
                self._write_timer.cancel()
                self._write_timer = None
            if self._counted:
                self._counted = False
                gate.release(self._address())
            if self._refused:
                self._refused = False
                gate.waiting_refused -= 1
            super().connection_lost(exc)

        def _address(self) -> str | None:
            return self.client[0] if self.client else None    # None: the UNIX socket

        # -- the headers' deadline --------------------------------------------------------
        def data_received(self, data: bytes) -> None:
            super().data_received(data)
            if self.conn.their_state is h11.IDLE:
                self._arm()        # a request begun, its headers not complete yet
            else:
                self._disarm()

        def on_response_complete(self) -> None:
            self._disarm()
            super().on_response_complete()

        def _arm(self) -> None:
            if self._header_timer is None:
                self._header_timer = self.loop.call_later(timeout_s, self._expired)

        def _disarm(self) -> None:
            if self._header_timer is not None:
                self._header_timer.cancel()
                self._header_timer = None

        def _expired(self) -> None:
            self._header_timer = None
            if self.conn.their_state is h11.IDLE and not self.transport.is_closing():
                self.transport.write(late)
                self.transport.close()

        # -- a response nobody reads ------------------------------------------------------
        def pause_writing(self) -> None:
            super().pause_writing()
            if self._write_timer is None:
                self._write_timer = self.loop.call_later(timeout_s, self._stalled)

        def resume_writing(self) -> None:
            super().resume_writing()
            if self._write_timer is not None:
                self._write_timer.cancel()
                self._write_timer = None

        def _stalled(self) -> None:
            self._write_timer = None
            LOG.info("%s: closed a connection from %s that read nothing of its response "
                     "for %g s", gate.name, self._address() or "the socket", timeout_s)
            self.transport.abort()

    return GuardedH11


@contextlib.contextmanager
def tls_deadlines(loop: asyncio.AbstractEventLoop, seconds: float) -> Iterator[None]:
    """TLS servers made on ``loop`` meanwhile end a handshake, and the closing exchange
    of a connection, that take longer than ``seconds`` (asyncio's defaults are 60 s and
    30 s; uvicorn passes neither): the guard's protocol sees a TLS connection only once
    its handshake is done, and releases its place only once it is closed."""
    real = loop.create_server

    def create_server(*args: Any, **kwargs: Any) -> Any:
        if kwargs.get("ssl") is not None:
            kwargs.setdefault("ssl_handshake_timeout", seconds)
            kwargs.setdefault("ssl_shutdown_timeout", seconds)
        return real(*args, **kwargs)
    loop.create_server = create_server  # type: ignore[method-assign]
    try:
        yield
    finally:
        del loop.create_server


def raise_open_files(need: int) -> str | None:
    """Raise this process's soft limit of open files towards ``need`` (up to the hard
    limit, as Go programs do at start); a sentence when the hard limit is lower."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != resource.RLIM_INFINITY and soft < need:
        new = need if hard == resource.RLIM_INFINITY else min(need, hard)
        with contextlib.suppress(ValueError, OSError):
            resource.setrlimit(resource.RLIMIT_NOFILE, (new, hard))
            soft = new
    if soft != resource.RLIM_INFINITY and soft < need:
        return (f"this process may open {soft} files, fewer than the {need} its "
                "connection limits need; lower --max-connections or raise the limit "
                "(ulimit -n, or LimitNOFILE= in a systemd unit).")
    return None
