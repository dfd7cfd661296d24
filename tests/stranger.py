"""Someone else on the network: a connection made from inside a network namespace the
test made (from a thread that enters it: setns(2) changes only the calling thread's),
to a port that waits for a move's stream, before the real source connects."""

from __future__ import annotations

import ctypes
import os
import socket
import ssl
import tempfile
import threading

CLONE_NEWNET = 0x40000000
# The start of a QEMU migration stream: its file magic and version.
QEVM = b"QEVM\x00\x00\x00\x03"


def enter_netns(netns: str) -> None:
    fd = os.open(f"/run/netns/{netns}", os.O_RDONLY | os.O_CLOEXEC)
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        if libc.setns(fd, CLONE_NEWNET) != 0:
            raise OSError(ctypes.get_errno(), f"setns into {netns}")
    finally:
        os.close(fd)


def connect_first(netns: str, addr: str, port: int, pem: bytes | None = None,
                  timeout: float = 10.0) -> str:
    """Connect from ``netns`` to ``addr:port`` and send the start of a migration stream:
    raw (``pem`` None) or inside TLS with the certificate and key ``pem``. Returns what
    came back: "refused: ..." or "answered b'...'"."""
    out: list[str] = []

    def attempt() -> None:
        enter_netns(netns)
        try:
            s = socket.create_connection((addr, port), timeout=timeout)
        except OSError as exc:
            out.append(f"refused: {exc!r}")
            return
        try:
            if pem is None:
                s.sendall(QEVM + b"\0" * 64)
                out.append(f"answered {s.recv(64)!r}")
                return
            ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
            ctx.check_hostname = False
            ctx.verify_mode = ssl.CERT_NONE
            with tempfile.NamedTemporaryFile(suffix=".pem") as f:
                f.write(pem)
                f.flush()
                ctx.load_cert_chain(f.name)
            with ctx.wrap_socket(s, server_hostname="peer") as t:
                t.sendall(QEVM)
                out.append(f"answered {t.recv(64)!r}")
        except (OSError, ssl.SSLError) as exc:
            out.append(f"refused: {exc!r}")
        finally:
            s.close()

    t = threading.Thread(target=attempt, name=f"stranger-{netns}")
    t.start()
    t.join(timeout * 3)
    if not out:
        raise AssertionError(f"the connection to {addr}:{port} did not end")
    return out[0]


def refused(answer: str) -> bool:
    """The listener closed, reset or failed the handshake: it took nothing."""
    return answer.startswith("refused") or answer == "answered b''"
