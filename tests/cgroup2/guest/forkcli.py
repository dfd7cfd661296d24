"""A fork server for the in-guest CLI calls: the guest's Python (under TCG) takes ~3-5 s
to start and import the CLI, each call. One server process imports ``fusuma.cli.main``
(and what the calls imported so far) once; each call is a child forked from it that
takes the caller's stdin/stdout/stderr, environment, working directory and argv, runs
the CLI's ``main()`` and exits with its code. The code under test still runs in a
process of its own, from the same files; only the interpreter's start-up is shared.

``python forkcli.py SOCKET`` serves on a UNIX socket (one call at a time); it prints
"ready" when it listens. Per call the client sends a JSON header and its three
standard fds (SCM_RIGHTS); the server answers ``{"pid": N}`` once the child is forked,
then ``{"code": C, "cpu_s": S}`` when it has ended (C is -SIGNAL if a signal ended it,
as subprocess says). The child tells the server which modules it imported that the
server has not, and the server imports them before the next call.

Module-level state that the fork would freeze: fusuma reads its environment when a
command runs (``Paths.from_env()`` in the CLI's group), never at import (none of its
modules reads ``os.environ`` at module level), so a child's own environment holds.
"""

from __future__ import annotations

import atexit
import contextlib
import importlib
import json
import os
import signal
import socket
import struct
import subprocess
import sys
import threading
import time
import traceback
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
# Imported before the first call: the CLI and the commands the tests use.
PRELOAD = ["fusuma.cli.main", "fusuma.cli.common", "fusuma.cli.host", "fusuma.cli.partition",
           "fusuma.cli.vm", "fusuma.cli.network"]


# -- the wire: a 4-byte length, then JSON -------------------------------------------------
def _send(sock: socket.socket, obj: Any, fds: list[int] | None = None) -> None:
    data = json.dumps(obj).encode()
    msg = struct.pack("!I", len(data)) + data
    if fds:
        socket.send_fds(sock, [msg], fds)
    else:
        sock.sendall(msg)


def _recv_exact(sock: socket.socket, n: int) -> bytes:
    buf = b""
    while len(buf) < n:
        got = sock.recv(n - len(buf))
        if not got:
            raise EOFError("fork server closed the connection")
        buf += got
    return buf


def _recv(sock: socket.socket) -> Any:
    (n,) = struct.unpack("!I", _recv_exact(sock, 4))
    return json.loads(_recv_exact(sock, n))


# -- the server --------------------------------------------------------------------------
def _child(conn: socket.socket, listener: socket.socket, report: int,
           req: dict[str, Any], fds: list[int]) -> None:
    """In the forked child: become the call, run the CLI, never return."""
    code = 1
    try:
        conn.close()
        listener.close()
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
        for i, fd in enumerate(fds):
            os.dup2(fd, i)
            os.close(fd)
        os.chdir(req["cwd"])
        os.environ.clear()
        os.environ.update(req["env"])
        sys.argv = list(req["argv"])
        before = set(sys.modules)
        if req.get("sample"):
            sys.path.insert(0, str(HERE))
            import sampler
            sampler.start(req["sample"])
        from fusuma.cli.main import main
        try:
            main()
            code = 0
        except SystemExit as exc:
            if exc.code is None:
                code = 0
            elif isinstance(exc.code, int):
                code = exc.code
            else:
                print(exc.code, file=sys.stderr)
                code = 1
        # What a process's exit does: non-daemon threads joined, then atexit handlers
        # (logging's flush, the sampler).
        threading._shutdown()  # type: ignore[attr-defined]
        atexit._run_exitfuncs()
        sys.stdout.flush()
        sys.stderr.flush()
        with_new = sorted(m for m in set(sys.modules) - before if m.startswith("fusuma"))
        os.write(report, json.dumps(with_new).encode())
    except BaseException:
        traceback.print_exc()
        sys.stderr.flush()
    finally:
        os._exit(code & 0xFF)


def serve(path: str) -> None:
    for name in PRELOAD:
        importlib.import_module(name)
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    Path(path).unlink(missing_ok=True)
    listener.bind(path)
    listener.listen(4)
    print("ready", flush=True)
    while True:
        conn, _ = listener.accept()
        with conn:
            msg, fds, _, _ = socket.recv_fds(conn, 1 << 20, 3)
            (n,) = struct.unpack("!I", msg[:4])
            body = msg[4:]
            while len(body) < n:
                body += _recv_exact(conn, n - len(body))
            req = json.loads(body)
            if req.get("stop"):
                for fd in fds:
                    os.close(fd)
                return
            sys.stdout.flush()
            sys.stderr.flush()
            report, report_w = os.pipe()
            pid = os.fork()
            if pid == 0:
                os.close(report)
                _child(conn, listener, report_w, req, fds)
            os.close(report_w)
            for fd in fds:
                os.close(fd)
            _send(conn, {"pid": pid})
            # The child's modules, written as it ends (EOF when it has), then its status.
            with os.fdopen(report, "rb") as fh:
                said = fh.read()
            _, status, usage = os.wait4(pid, 0)
            with contextlib.suppress(OSError):     # a client that gave up (timeout)
                _send(conn, {"code": os.waitstatus_to_exitcode(status),
                             "cpu_s": usage.ru_utime + usage.ru_stime})
            try:
                imported: list[str] = json.loads(said) if said else []
            except ValueError:
                imported = []
        for name in imported:
            with contextlib.suppress(Exception):
                importlib.import_module(name)
        if threading.active_count() > 1:
            raise SystemExit("fork server: an import started a thread; forking is unsafe")


# -- the client --------------------------------------------------------------------------
class ForkServer:
    """One server (started under ``wrap``, e.g. ``nsenter --net=...``: its children
    are in that namespace), and the calls made through it."""

    def __init__(self, wrap: list[str], sock: Path) -> None:
        self.sock = sock
        sock.parent.mkdir(parents=True, exist_ok=True)
        self.proc = subprocess.Popen([*wrap, sys.executable, str(HERE / "forkcli.py"),
                                      str(sock)], stdin=subprocess.DEVNULL,
                                     stdout=subprocess.PIPE, text=True)
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline().strip()
        if line != "ready":
            self.proc.kill()
            self.proc.wait()
            raise RuntimeError(f"fork server {sock} did not start (said {line!r})")

    def run(self, argv: list[str], env: dict[str, str], timeout: float,
            sample: str | None = None) -> tuple[int, str, str, float]:
        """Run the CLI with ``argv`` (sys.argv); returns (code, stdout, stderr, CPU s)."""
        import tempfile

        if self.proc.poll() is not None:
            raise RuntimeError(f"the fork server {self.sock} exited with status "
                               f"{self.proc.returncode} (see the guest pytest's stderr)")
        with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err, \
                socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as conn:
            conn.connect(str(self.sock))
            conn.settimeout(timeout)
            _send(conn, {"argv": argv, "env": env, "cwd": os.getcwd(), "sample": sample},
                  [0, out.fileno(), err.fileno()])
            pid = _recv(conn)["pid"]
            deadline = time.monotonic() + timeout
            try:
                while True:
                    conn.settimeout(max(0.1, deadline - time.monotonic()))
                    reply = _recv(conn)
                    if "code" in reply:
                        break
            except TimeoutError:
                os.kill(pid, signal.SIGKILL)
                raise subprocess.TimeoutExpired(argv, timeout) from None
            out.seek(0)
            err.seek(0)
            return (reply["code"], out.read().decode(errors="replace"),
                    err.read().decode(errors="replace"), reply["cpu_s"])

    def close(self) -> None:
        try:
            with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as conn:
                conn.connect(str(self.sock))
                _send(conn, {"stop": True}, [0, 1, 2])
        except OSError:
            self.proc.kill()
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self.sock.unlink(missing_ok=True)


if __name__ == "__main__":
    serve(sys.argv[1])
