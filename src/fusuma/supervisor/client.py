"""The callers' side of a partition supervisor's socket (typed: ``fusuma.supervisor.rpc``)."""

from __future__ import annotations

import socket
import time
from typing import TypeVar

from fusuma.errors import SupervisorError
from fusuma.paths import Paths
from fusuma.supervisor import rpc

R = TypeVar("R")


class SupervisorClient:
    """Synchronous request/reply calls to one partition's supervisor."""

    def __init__(self, paths: Paths, partition: str) -> None:
        self.paths = paths
        self.partition = partition
        self.path = paths.supervisor_socket(partition)

    def send(self, req: rpc.Request[R], timeout: float = 60.0, *,
             wait_up: float = 3.0) -> R:
        """One request and its reply. A supervisor that is restarting (no socket yet)
        is waited for up to ``wait_up`` seconds, so a command issued during
        `partition restart` is queued rather than refused."""
        deadline = time.monotonic() + wait_up
        while True:
            try:
                return self._send(req, timeout)
            except SupervisorError as exc:
                if not isinstance(exc.__cause__, (FileNotFoundError, ConnectionRefusedError)) \
                        or time.monotonic() >= deadline:
                    raise
            time.sleep(0.05)

    def _send(self, req: rpc.Request[R], timeout: float) -> R:
        try:
            with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
                s.settimeout(timeout)
                s.connect(str(self.path))
                s.sendall(rpc.encode_request(req))
                buf = b""
                while not buf.endswith(b"\n"):
                    chunk = s.recv(65536)
                    if not chunk:
                        break
                    buf += chunk
        except (FileNotFoundError, ConnectionRefusedError) as exc:
            raise SupervisorError(
                f"the supervisor of partition {self.partition!r} is not running; start it "
                f"with `fusuma partition restart {self.partition}`.") from exc
        except TimeoutError as exc:
            raise SupervisorError(f"the supervisor of partition {self.partition!r} did not "
                                  f"answer {req.OP!r} within {timeout:.0f} s.") from exc
        except OSError as exc:
            raise SupervisorError(f"cannot talk to the supervisor of partition "
                                  f"{self.partition!r}: {exc}.") from exc
        if not buf:
            raise SupervisorError(f"the supervisor of partition {self.partition!r} closed the "
                                  f"connection during {req.OP!r}; see its log in "
                                  f"{self.paths.partition_dir(self.partition)}/supervisor.log.")
        return rpc.decode_reply(req, buf, self.partition)

    def alive(self) -> bool:
        try:
            self.send(rpc.Ping(), timeout=2.0, wait_up=0.0)
        except SupervisorError:
            return False
        return True
