"""A fork server for the tests' CLI calls: the real CLI in a real process of its own,
without paying Python's start-up and fusuma's imports at every call.

A test run makes about 3,500 `fusuma` calls; each spent ~0.1 CPU-s (0.2 under load) on
the interpreter's start-up and imports before it did its work: a sixth of the suite's
CPU. Here one server per test process imports ``fusuma.cli.main`` and the CLI's command
modules once, then forks a child per call. The child takes the caller's stdin, stdout
and stderr (passed as file descriptors), environment, working directory and arguments,
runs ``fusuma.cli.main.main()`` exactly as ``python -m fusuma.cli.main`` would, runs the
interpreter's exit steps (non-daemon threads joined, ``atexit``), and exits with the
code the command gave. Its pid is real (a test can kill it), its exit status is the
server's ``waitpid`` of it.

What this does not exercise is the interpreter's start and the first import of each
module: tests that are about a process and its start-up (kill the CLI mid-operation,
the CLI's imports) run ``tests.conftest.FUSUMA`` as a subprocess, and
``FUSUMA_TEST_FORK=0`` runs every call that way. fusuma reads its environment only
when a command runs, never at import (the server's own is the test process's).

Protocol: a SOCK_SEQPACKET connection per call to the server's abstract UNIX socket;
the request is one JSON record (argv, env, cwd) with three descriptors; the server
answers ``{"pid": N}`` when the child runs, then ``{"code": N}`` when it was reaped.
"""

from __future__ import annotations

import array
import contextlib
import json
import locale
import os
import select
import signal
import socket
import subprocess
import sys
import threading
import uuid
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
# Modules of the CLI's commands the server imports ahead (the daemons' own commands,
# `serve` and `agent`, are long-lived: their start-up does not repeat).
PRELOAD = ("fusuma.cli.main", "fusuma.cli.host", "fusuma.cli.vm", "fusuma.cli.partition",
           "fusuma.cli.disk", "fusuma.cli.migrate", "fusuma.cli.network",
           "fusuma.cli.image", "fusuma.cli.template", "fusuma.cli.governor",
           "fusuma.cli.snapshot", "fusuma.cli.backup", "fusuma.cli.storage",
           "fusuma.cli.segment", "fusuma.cli.share", "fusuma.cli.token",
           "fusuma.cli.qemu")
MAX_REQUEST = 1 << 20


def enabled() -> bool:
    return os.environ.get("FUSUMA_TEST_FORK", "1") != "0"


# -- the client (in the test process) -------------------------------------------------
class _Server:
    def __init__(self) -> None:
        # An abstract socket: no file to leave behind.
        self.name = f"fusuma-clifork-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        self.address = "\0" + self.name
        env = {**os.environ, "PYTHONPATH": str(REPO / "src") + os.pathsep + str(REPO)}
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "tests.clifork", self.name], cwd=REPO, env=env,
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        assert self.proc.stdout is not None
        ready = self.proc.stdout.readline()
        if ready.strip() != "ready":
            self.proc.kill()
            raise RuntimeError(f"the CLI fork server did not start (it said {ready!r})")

    def alive(self) -> bool:
        return self.proc.poll() is None


_lock = threading.Lock()
_server: _Server | None = None
_owner = 0


def _get() -> _Server:
    global _server, _owner
    with _lock:
        if _server is None or _owner != os.getpid() or not _server.alive():
            _server, _owner = _Server(), os.getpid()
        return _server


def _memfd(name: str, data: bytes = b"") -> int:
    fd = os.memfd_create(name, os.MFD_CLOEXEC)
    if data:
        os.write(fd, data)
        os.lseek(fd, 0, os.SEEK_SET)
    return fd


def _read_all(fd: int) -> bytes:
    os.lseek(fd, 0, os.SEEK_SET)
    chunks = []
    while chunk := os.read(fd, 1 << 20):
        chunks.append(chunk)
    return b"".join(chunks)


def netns_of(wrap: list[str]) -> str | None:
    """The network namespace file of a ``nsenter --net=FILE --`` wrap, the one wrap the
    server does itself ("" for none); None for any other."""
    if not wrap:
        return ""
    if len(wrap) == 3 and wrap[0] == "nsenter" and wrap[1].startswith("--net=") \
            and wrap[2] == "--":
        return wrap[1].removeprefix("--net=")
    return None


def run(argv: list[str], env: dict[str, str], timeout: float | None = None,
        input: str | None = None, cwd: str | None = None, netns: str = ""
        ) -> subprocess.CompletedProcess[str]:
    """``subprocess.run([*FUSUMA, *argv], env=env, capture_output=True, text=True,
    timeout=timeout, input=input)``, served by a fork of the server; with ``netns``
    (a file such as /run/netns/NAME) the child enters that network namespace first, as
    ``nsenter --net=FILE`` would."""
    server = _get()
    enc = locale.getpreferredencoding(False)
    fds = [_memfd("stdin", (input or "").encode(enc)), _memfd("stdout"), _memfd("stderr")]
    cmd = ["fusuma", *argv]
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET) as s:
            s.connect(server.address)
            req = json.dumps({"argv": argv, "env": env, "cwd": cwd or os.getcwd(),
                              "netns": netns})
            s.sendmsg([req.encode()], [(socket.SOL_SOCKET, socket.SCM_RIGHTS,
                                        array.array("i", fds))])
            os.close(fds[0])
            fds[0] = -1
            s.settimeout(30)
            pid = int(json.loads(s.recv(4096))["pid"])
            s.settimeout(timeout)
            try:
                got = s.recv(4096)
            except TimeoutError:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
                s.settimeout(30)
                s.recv(4096)
                raise subprocess.TimeoutExpired(
                    cmd, timeout or 0, output=_read_all(fds[1]).decode(enc, "replace"),
                    stderr=_read_all(fds[2]).decode(enc, "replace")) from None
            if not got:
                raise RuntimeError(f"the CLI fork server went away during `{cmd}`")
            code = int(json.loads(got)["code"])
        return subprocess.CompletedProcess(cmd, code, _read_all(fds[1]).decode(enc),
                                           _read_all(fds[2]).decode(enc))
    finally:
        for fd in fds:
            if fd >= 0:
                os.close(fd)


# -- the server ---------------------------------------------------------------------
def _child(req: dict[str, Any], fds: list[int], keep_closed: list[int]) -> None:
    """In the forked child: become the caller's ``python -m fusuma.cli.main ARGV``."""
    code = 126                                  # as a shell says of what it cannot run
    try:
        signal.set_wakeup_fd(-1)
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
        for fd in keep_closed:
            with contextlib.suppress(OSError):
                os.close(fd)
        for i, fd in enumerate(fds):
            os.dup2(fd, i)
            os.close(fd)
        if req.get("netns"):
            import ctypes

            ns = os.open(req["netns"], os.O_RDONLY | os.O_CLOEXEC)
            if ctypes.CDLL(None, use_errno=True).setns(ns, 0x40000000) != 0:  # NEWNET
                raise OSError(ctypes.get_errno(), f"setns {req['netns']}")
            os.close(ns)
        os.chdir(req["cwd"])
        os.environ.clear()
        os.environ.update(req["env"])
    except BaseException:
        import traceback

        traceback.print_exc()
        sys.stderr.flush()
        os._exit(code)
    try:
        from fusuma.cli import main as cli_main

        sys.argv = [str(cli_main.__file__), *req["argv"]]
        # What click names the program after (`python -m fusuma.cli.main` in usage).
        sys.modules["__main__"].__package__ = "fusuma.cli"
        try:
            cli_main.main()
            code = 0
        except SystemExit as exc:
            if exc.code is None:
                code = 0
            elif isinstance(exc.code, int):
                code = exc.code
            else:
                print(exc.code, file=sys.stderr)
                code = 1
        except BaseException:
            import traceback

            traceback.print_exc()
            code = 1
        # The interpreter's own exit steps: non-daemon threads, then atexit.
        with contextlib.suppress(BaseException):
            threading._shutdown()  # type: ignore[attr-defined]
        with contextlib.suppress(BaseException):
            import atexit

            atexit._run_exitfuncs()
    finally:
        with contextlib.suppress(BaseException):
            sys.stdout.flush()
        with contextlib.suppress(BaseException):
            sys.stderr.flush()
        os._exit(code & 0xFF)


def serve(address: str) -> None:
    import importlib

    for name in PRELOAD:
        importlib.import_module(name)
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    listener.bind(address)
    listener.listen(64)
    wake_r, wake_w = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
    signal.set_wakeup_fd(wake_w)
    signal.signal(signal.SIGCHLD, lambda *_: None)
    waiting: dict[int, socket.socket] = {}
    sys.stdout.write("ready\n")
    sys.stdout.flush()
    while True:
        readable, _, _ = select.select([listener, wake_r, sys.stdin], [], [])
        if sys.stdin in readable and not sys.stdin.read(1):
            return                                   # the test process is gone
        if listener in readable:
            conn, _ = listener.accept()
            try:
                data, anc, _, _ = conn.recvmsg(MAX_REQUEST, socket.CMSG_SPACE(3 * 4))
                fds = array.array("i")
                for level, kind, raw in anc:
                    if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
                        fds.frombytes(raw[:len(raw) - len(raw) % fds.itemsize])
                req = json.loads(data)
                if len(fds) != 3:
                    raise ValueError(f"{len(fds)} descriptors, not 3")
            except (OSError, ValueError) as exc:
                print(f"clifork: bad request: {exc}", file=sys.stderr)
                conn.close()
                continue
            sys.stdout.flush()
            sys.stderr.flush()
            pid = os.fork()
            if pid == 0:
                _child(req, list(fds), [listener.fileno(), wake_r, wake_w, conn.fileno(),
                                        *(c.fileno() for c in waiting.values())])
            for fd in fds:
                os.close(fd)
            with contextlib.suppress(OSError):
                conn.send(json.dumps({"pid": pid}).encode())
            waiting[pid] = conn
        if wake_r in readable:
            with contextlib.suppress(BlockingIOError):
                while os.read(wake_r, 512):
                    pass
        while waiting:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                break
            if pid == 0:
                break
            conn = waiting.pop(pid, None)
            if conn is not None:
                with contextlib.suppress(OSError):
                    conn.send(json.dumps({"code": os.waitstatus_to_exitcode(status)}).encode())
                conn.close()


if __name__ == "__main__":
    serve("\0" + sys.argv[1])
