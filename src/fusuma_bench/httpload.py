"""Bounded HTTP to guests through their forwarded loopback ports (QEMU user networking):
a free port for a new forward, waiting for a guest's first answer, a request loop.

Every request has a timeout and every loop a deadline, so a guest that stops answering
costs seconds, never the run. Errors: NotReady (a fusuma.errors.FusumaError) when a
guest does not answer in time; HostError when no free port is found.
"""

from __future__ import annotations

import socket
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor

from fusuma.errors import FusumaError, HostError

REQUEST_TIMEOUT_S = 5.0
POLL_S = 0.05


class NotReady(FusumaError):
    """The guest behind a port did not answer HTTP in time."""


def free_port(taken: set[int]) -> int:
    """A loopback TCP port nothing listens on now and not in ``taken`` (which it joins);
    the VM's QEMU binds it next."""
    for _ in range(100):
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.bind(("127.0.0.1", 0))
            port = int(s.getsockname()[1])
        if port not in taken:
            taken.add(port)
            return port
    raise HostError("no free loopback TCP port for a VM's forwarded HTTP port.")


def get(port: int, timeout: float = REQUEST_TIMEOUT_S) -> bool:
    """One GET of ``/``; whether it answered 200 in time."""
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/", timeout=timeout) as r:
            r.read()
            return bool(r.status == 200)
    except (OSError, urllib.error.URLError):
        return False


def wait_http(port: int, started: float, timeout: float) -> float:
    """Poll until the guest behind ``port`` answers; ms since ``started`` (a
    time.monotonic() reading)."""
    deadline = started + timeout
    while time.monotonic() < deadline:
        left = deadline - time.monotonic()
        if get(port, timeout=min(REQUEST_TIMEOUT_S, max(0.5, left))):
            return round((time.monotonic() - started) * 1000, 1)
        time.sleep(POLL_S)
    raise NotReady(f"the guest behind port {port} did not answer HTTP within "
                   f"{timeout:.0f} s of its start.")


def request_loop(ports: Sequence[int], total: int, concurrency: int,
                 deadline_s: float) -> tuple[float | None, int, int]:
    """``total`` GETs round-robin over ``ports``, ``concurrency`` at a time, until done
    or ``deadline_s`` passed; (requests/s of the answered ones, answered, failed)."""
    lock = threading.Lock()
    state = {"next": 0, "ok": 0, "failed": 0}
    started = time.monotonic()

    def worker() -> None:
        while time.monotonic() - started < deadline_s:
            with lock:
                i = state["next"]
                if i >= total:
                    return
                state["next"] = i + 1
            ok = get(ports[i % len(ports)])
            with lock:
                state["ok" if ok else "failed"] += 1

    with ThreadPoolExecutor(max_workers=concurrency) as pool:
        for _ in range(concurrency):
            pool.submit(worker)
    elapsed = time.monotonic() - started
    rps = round(state["ok"] / elapsed, 1) if state["ok"] and elapsed > 0 else None
    return rps, state["ok"], state["failed"]
