"""Boot the minimal guest image under TCG and run a command through qemu-ga.

Builds (or reuses) the image in $FUSUMA_CACHE (default /var/cache/fusuma). Talks to
QEMU and the agent over raw sockets so it depends on nothing but the image builder.
"""

from __future__ import annotations

import base64
import json
import logging
import os
import shutil
import signal
import socket
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from fusuma.images import GuestImage, build_image

pytestmark = [pytest.mark.integration, pytest.mark.timeout(180)]

LOG = logging.getLogger(__name__)
QEMU = "qemu-system-x86_64"


@pytest.fixture(scope="module")
def image() -> GuestImage:
    if shutil.which(QEMU) is None:
        pytest.skip(f"{QEMU} is not installed")
    cache = Path(os.environ.get("FUSUMA_CACHE", "/var/cache/fusuma"))
    return build_image(cache, progress=LOG.info)


class Channel:
    """A line-oriented JSON connection to a UNIX socket QEMU listens on."""

    def __init__(self, path: Path, timeout: float) -> None:
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.settimeout(timeout)
        self.sock.connect(str(path))
        self.buf = b""

    def send(self, msg: dict[str, Any]) -> None:
        self.sock.sendall(json.dumps(msg).encode() + b"\n")

    def recv(self) -> dict[str, Any]:
        while b"\n" not in self.buf:
            chunk = self.sock.recv(65536)
            if not chunk:
                raise ConnectionError("socket closed")
            self.buf += chunk
        line, _, self.buf = self.buf.partition(b"\n")
        reply: dict[str, Any] = json.loads(line.lstrip(b"\xff"))
        return reply

    def close(self) -> None:
        self.sock.close()


def _wait_for(path: Path, proc: subprocess.Popen[bytes], deadline: float) -> None:
    """Wait until QEMU has created the socket ``path``; fail early if QEMU exited."""
    while not path.exists():
        if proc.poll() is not None:
            out = proc.stdout.read().decode(errors="replace") if proc.stdout else ""
            raise RuntimeError(f"QEMU exited with status {proc.returncode}: {out}")
        if time.monotonic() > deadline:
            raise TimeoutError(f"{path} did not appear")
        time.sleep(0.02)


def agent_sync(qga: Channel, deadline: float) -> None:
    """guest-sync-delimited until the agent echoes our id (it drops input until ready)."""
    ident = 0
    while True:
        ident += 1
        qga.send({"execute": "guest-sync-delimited", "arguments": {"id": ident}})
        try:
            while True:
                reply = qga.recv()
                if reply.get("return") == ident:
                    return
        except TimeoutError:
            if time.monotonic() > deadline:
                raise
        qga.buf = b""


def guest_exec(qga: Channel, argv: list[str], deadline: float) -> tuple[int, bytes]:
    qga.send({"execute": "guest-exec", "arguments": {
        "path": argv[0], "arg": argv[1:], "capture-output": True}})
    pid = qga.recv()["return"]["pid"]
    while True:
        qga.send({"execute": "guest-exec-status", "arguments": {"pid": pid}})
        status = qga.recv()["return"]
        if status["exited"]:
            out = base64.b64decode(status.get("out-data", ""))
            return int(status["exitcode"]), out
        if time.monotonic() > deadline:
            raise TimeoutError(f"guest command {argv} did not finish")
        time.sleep(0.05)


@dataclass
class Booted:
    proc: subprocess.Popen[bytes]
    workdir: Path
    started: float

    @property
    def qmp(self) -> Path:
        return self.workdir / "qmp.sock"

    @property
    def qga(self) -> Path:
        return self.workdir / "qga.sock"

    @property
    def console(self) -> Path:
        return self.workdir / "console.log"


@pytest.fixture()
def vm(image: GuestImage, tmp_path: Path) -> Iterator[Booted]:
    argv = [
        QEMU, "-accel", "tcg", "-machine", "q35", "-m", "256", "-smp", "1",
        "-nodefaults", "-nographic", "-no-reboot",
        "-kernel", str(image.kernel), "-initrd", str(image.initrd),
        "-append", f"{image.append} fusuma.name=imgtest",
        "-serial", f"file:{tmp_path / 'console.log'}",
        "-chardev", f"socket,id=qga0,path={tmp_path / 'qga.sock'},server=on,wait=off",
        "-device", "virtio-serial-pci",
        "-device", "virtserialport,chardev=qga0,name=org.qemu.guest_agent.0",
        "-qmp", f"unix:{tmp_path / 'qmp.sock'},server=on,wait=off",
    ]
    started = time.monotonic()
    proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT)
    booted = Booted(proc, tmp_path, started)
    try:
        yield booted
        _quit(booted)
    finally:
        if proc.poll() is None:
            os.kill(proc.pid, signal.SIGKILL)
        proc.wait(timeout=10)
        if proc.stdout is not None:
            proc.stdout.close()
        print(booted.console.read_text(errors="replace") if booted.console.exists() else "")
    assert proc.returncode is not None
    assert not booted.qmp.exists() and not booted.qga.exists(), "QEMU left sockets"


def _quit(booted: Booted) -> None:
    qmp = Channel(booted.qmp, timeout=10)
    try:
        assert "QMP" in qmp.recv()
        qmp.send({"execute": "qmp_capabilities"})
        assert "return" in qmp.recv()
        qmp.send({"execute": "quit"})
        booted.proc.wait(timeout=10)
    finally:
        qmp.close()


def test_guest_exec_echo(vm: Booted) -> None:
    deadline = time.monotonic() + 120
    _wait_for(vm.qga, vm.proc, deadline)
    qga = Channel(vm.qga, timeout=1)
    try:
        agent_sync(qga, deadline)
        answered = time.monotonic() - vm.started
        qga.sock.settimeout(30)
        code, out = guest_exec(qga, ["/bin/echo", "hello"], deadline)
        _, host = guest_exec(qga, ["/bin/hostname"], deadline)
    finally:
        qga.close()
    print(f"guest agent answered {answered:.2f} s after QEMU started")
    assert (code, out) == (0, b"hello\n")
    assert host == b"imgtest\n"
    assert "fusuma-guest: ready" in vm.console.read_text(errors="replace")
