"""Browser sessions of the TCP listener (the dashboard's login), kept in the daemon's
memory: a restart logs everyone out; the token stays valid."""

from __future__ import annotations

import secrets
import threading
import time
from dataclasses import dataclass

SESSION_S = 12 * 3600
COOKIE = "fusuma_session"


@dataclass
class Session:
    token_name: str
    token_hash: str
    csrf: str
    expires: float


class Sessions:
    """Browser sessions of the TCP listener, in the daemon's memory (a restart logs
    everyone out; the token stays valid)."""

    def __init__(self) -> None:
        self._s: dict[str, Session] = {}
        self._lock = threading.Lock()

    def create(self, token_name: str, token_hash: str) -> tuple[str, Session]:
        sid = secrets.token_urlsafe(32)
        s = Session(token_name, token_hash, secrets.token_urlsafe(24),
                    time.time() + SESSION_S)
        with self._lock:
            now = time.time()
            for k in [k for k, v in self._s.items() if v.expires < now]:
                del self._s[k]
            self._s[sid] = s
        return sid, s

    def get(self, sid: str | None) -> Session | None:
        if not sid:
            return None
        with self._lock:
            s = self._s.get(sid)
        if s is None or s.expires < time.time():
            return None
        return s

    def drop(self, sid: str | None) -> None:
        with self._lock:
            self._s.pop(sid or "", None)


def cookie(headers: list[tuple[bytes, bytes]], name: str = COOKIE) -> str | None:
    for k, v in headers:
        if k == b"cookie":
            for part in v.decode("latin-1").split(";"):
                key, _, value = part.strip().partition("=")
                if key == name:
                    return value
    return None
