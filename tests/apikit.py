"""A real `fusuma serve` in a test's namespace, and clients for it.

``Api(host)`` starts the daemon as the CLI would (a subprocess of ``fusuma serve``),
waits for its ready line, and gives httpx clients over the UNIX socket and, with
``listen=True``, over HTTPS on a loopback port of the kernel's choosing (the daemon's
self-signed certificate is verified). ``stop()`` ends the daemon by its pid and checks
that it removed its socket.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import ssl
import subprocess
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx

from tests.conftest import FUSUMA, Host


class Api:
    def __init__(self, host: Host, *, listen: bool = False, args: tuple[str, ...] = (),
                 env: dict[str, str] | None = None) -> None:
        self.host = host
        self.log = host.home.parent / f"serve-{time.monotonic_ns()}.log"
        host.home.mkdir(parents=True, exist_ok=True)
        # Under the host's wrap (a network namespace of the test's own, say) as its CLI.
        cmd = [*host.wrap, *FUSUMA, "serve",
               *(["--listen", "127.0.0.1:0"] if listen else []), *args]
        self._logf = open(self.log, "wb")  # noqa: SIM115 (closed in stop)
        self.proc = subprocess.Popen(cmd, env={**host.env, **(env or {})},
                                     stdout=self._logf, stderr=subprocess.STDOUT,
                                     stdin=subprocess.DEVNULL)
        self.info = self._wait_ready()
        self.socket = Path(self.info["socket"])
        self.url: str | None = self.info.get("listen")
        self.cert: str | None = self.info.get("certificate")

    def _wait_ready(self, timeout: float = 30.0) -> dict[str, Any]:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for line in self.log.read_text(errors="replace").splitlines():
                if line.startswith('{"ready"'):
                    info: dict[str, Any] = json.loads(line)["ready"]
                    return info
            if self.proc.poll() is not None:
                raise AssertionError(f"fusuma serve exited {self.proc.returncode}:\n"
                                     f"{self.log.read_text(errors='replace')}")
            time.sleep(0.05)
        raise AssertionError(f"fusuma serve not ready in {timeout} s:\n{self.log_text()}")

    def log_text(self) -> str:
        return self.log.read_text(errors="replace")

    # -- clients ------------------------------------------------------------------------
    def unix(self, timeout: float = 60.0) -> httpx.Client:
        return httpx.Client(transport=httpx.HTTPTransport(uds=str(self.socket)),
                            base_url="http://fusuma", timeout=timeout)

    def tcp(self, token: str | None, timeout: float = 60.0) -> httpx.Client:
        assert self.url and self.cert, "started without listen=True"
        headers = {"Authorization": f"Bearer {token}"} if token else {}
        return httpx.Client(base_url=self.url, headers=headers, timeout=timeout,
                            verify=ssl.create_default_context(cafile=self.cert))

    # -- operations -----------------------------------------------------------------------
    @staticmethod
    def wait(client: httpx.Client, resp: httpx.Response, timeout: float = 180) -> dict[str, Any]:
        """The ended operation of a 202 response (fails the test on any other code)."""
        assert resp.status_code == 202, f"{resp.status_code}: {resp.text}"
        op = resp.json()
        assert resp.headers["location"] == f"/1.0/operations/{op['id']}"
        r = client.get(f"/1.0/operations/{op['id']}/wait", params={"timeout": timeout},
                       timeout=timeout + 10)
        assert r.status_code == 200, r.text
        done: dict[str, Any] = r.json()
        assert done["status"] in ("Success", "Failure", "Cancelled"), done
        return done

    @classmethod
    def ok(cls, client: httpx.Client, resp: httpx.Response, timeout: float = 180) -> Any:
        """The result of an operation that must succeed."""
        done = cls.wait(client, resp, timeout)
        assert done["status"] == "Success", done
        return done["result"]

    # -- events -----------------------------------------------------------------------
    @contextlib.contextmanager
    def events(self, types: str | None = None) -> Iterator[list[dict[str, Any]]]:
        """Collect the SSE stream into a list (with the local receive time of each
        event as ``_received``) while the block runs."""
        got: list[dict[str, Any]] = []
        stop = threading.Event()
        ready = threading.Event()

        def reader() -> None:
            params = {"type": types} if types else {}
            # The stream ends when the daemon stops; that is not the test's failure.
            with contextlib.suppress(httpx.HTTPError), \
                    httpx.Client(transport=httpx.HTTPTransport(uds=str(self.socket)),
                                 base_url="http://fusuma", timeout=None) as c, \
                    c.stream("GET", "/1.0/events", params=params) as r:
                ready.set()
                data = ""
                for line in r.iter_lines():
                    if stop.is_set():
                        return
                    if line.startswith("data: "):
                        data = line[6:]
                    elif line == "" and data:
                        ev = json.loads(data)
                        ev["_received"] = time.time()
                        got.append(ev)
                        data = ""
        t = threading.Thread(target=reader, daemon=True)
        t.start()
        assert ready.wait(10), "the event stream did not open"
        time.sleep(0.1)
        try:
            yield got
        finally:
            stop.set()

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                os.kill(self.proc.pid, signal.SIGKILL)
                self.proc.wait(5)
        self._logf.close()
        assert not self.socket.exists(), f"fusuma serve left its socket {self.socket}"
