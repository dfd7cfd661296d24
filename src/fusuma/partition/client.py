"""The CLI's side of a partition supervisor's socket."""

from __future__ import annotations

import json
import socket
import time
from typing import Any

from fusuma.errors import SupervisorError
from fusuma.partition.protocol import encode, raise_reply
from fusuma.paths import Paths


class SupervisorClient:
    """Synchronous request/response calls to one partition's supervisor."""

    def __init__(self, paths: Paths, partition: str) -> None:
        self.paths = paths
        self.partition = partition
        self.path = paths.supervisor_socket(partition)

    def call(self, op: str, rpc_timeout: float = 60.0, *, wait_up: float = 3.0,
             **args: Any) -> Any:
        """One request and its reply. A supervisor that is restarting (no socket yet)
        is waited for up to ``wait_up`` seconds, so a command issued during
        `partition restart` is queued rather than refused."""
        deadline = time.monotonic() + wait_up
        while True:
            try:
                return self._call(op, rpc_timeout, **args)
            except SupervisorError as exc:
                if not isinstance(exc.__cause__, (FileNotFoundError, ConnectionRefusedError)) \
                        or time.monotonic() >= deadline:
                    raise
            time.sleep(0.05)

    def _call(self, op: str, rpc_timeout: float, **args: Any) -> Any:
        try:
            with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
                s.settimeout(rpc_timeout)
                s.connect(str(self.path))
                s.sendall(encode({"op": op, "args": args}))
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
                                  f"answer {op!r} within {rpc_timeout:.0f} s.") from exc
        except OSError as exc:
            raise SupervisorError(f"cannot talk to the supervisor of partition "
                                  f"{self.partition!r}: {exc}.") from exc
        if not buf:
            raise SupervisorError(f"the supervisor of partition {self.partition!r} closed the "
                                  f"connection during {op!r}; see its log in "
                                  f"{self.paths.partition_dir(self.partition)}/supervisor.log.")
        try:
            reply = json.loads(buf)
        except ValueError as exc:
            raise SupervisorError(f"the supervisor of partition {self.partition!r} sent a "
                                  f"garbled answer to {op!r}; see its log.") from exc
        return raise_reply(reply)

    def alive(self) -> bool:
        try:
            self.call("ping", rpc_timeout=2.0, wait_up=0.0)
        except SupervisorError:
            return False
        return True
