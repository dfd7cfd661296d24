"""A packet capture for the tests, with no tool but Python: an AF_PACKET socket on one
interface of a network namespace the test made, frames written to a pcap file (which
tcpdump and Wireshark read), and a reader that puts one TCP connection's bytes back in
order.

Run inside the namespace (``Capture.start``: ``nsenter --net=... python capture.py``),
bounded in time and in bytes, ended by SIGTERM by pid. The reader reports gaps in a
connection's sequence space, so a test can prove it saw the whole stream before it
claims that something is not in it.
"""

from __future__ import annotations

import contextlib
import json
import os
import select
import signal
import socket
import struct
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

ETH_P_ALL = 0x0003
PACKET_OUTGOING = 4
SOL_PACKET = 263
PACKET_STATISTICS = 6
SO_RCVBUFFORCE = 33
LINKTYPE_ETHERNET = 1
SNAPLEN = 262144


def _capture(out: Path, iface: str, seconds: float, max_bytes: int) -> None:
    """Write every frame on ``iface`` to ``out`` (pcap) until SIGTERM, ``seconds`` or
    ``max_bytes``; then ``out``.json says how many the kernel dropped."""
    stop = False

    def _stop(*_: object) -> None:
        nonlocal stop
        stop = True

    signal.signal(signal.SIGTERM, _stop)
    s = socket.socket(socket.AF_PACKET, socket.SOCK_RAW, socket.htons(ETH_P_ALL))
    s.setsockopt(socket.SOL_SOCKET, SO_RCVBUFFORCE, 64 * 2**20)
    s.bind((iface, 0))
    # On lo every frame is seen twice (sent, received): keep the received copy.
    loopback = iface == "lo"
    deadline = time.monotonic() + seconds
    written = truncated = 0
    buf = bytearray(SNAPLEN)
    with open(out, "wb") as f:
        f.write(struct.pack("<IHHiIII", 0xA1B2C3D4, 2, 4, 0, 0, SNAPLEN, LINKTYPE_ETHERNET))
        f.flush()
        Path(f"{out}.ready").touch()
        while not stop and time.monotonic() < deadline and written < max_bytes:
            ready, _, _ = select.select([s], [], [], 0.1)
            if not ready:
                continue
            # MSG_TRUNC: the frame's real length, so a cut frame is counted, not hidden.
            n, addr = s.recvfrom_into(buf, SNAPLEN, socket.MSG_TRUNC)
            if loopback and addr[2] == PACKET_OUTGOING:
                continue
            kept = min(n, SNAPLEN)
            truncated += n > SNAPLEN
            now = time.time()
            f.write(struct.pack("<IIII", int(now), int(now % 1 * 1e6), kept, n))
            f.write(buf[:kept])
            written += kept
    _, drops = struct.unpack("II", s.getsockopt(SOL_PACKET, PACKET_STATISTICS, 8))
    Path(f"{out}.json").write_text(json.dumps({"drops": drops + truncated,
                                               "truncated": truncated, "bytes": written}))
    s.close()


@dataclass
class Capture:
    """One capture process in namespace ``netns`` (started by the test, ended by pid)."""

    netns: str
    out: Path
    iface: str = "eth0"
    seconds: float = 300.0
    max_bytes: int = 2 * 2**30
    proc: subprocess.Popen[bytes] | None = None

    def start(self) -> Capture:
        self.proc = subprocess.Popen(
            ["nsenter", f"--net=/run/netns/{self.netns}", "--", sys.executable, __file__,
             str(self.out), self.iface, str(self.seconds), str(self.max_bytes)],
            stdin=subprocess.DEVNULL)
        deadline = time.monotonic() + 10
        while not Path(f"{self.out}.ready").exists():
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"the capture in {self.netns} did not start")
            time.sleep(0.02)
        return self

    def stop(self) -> int:
        """End it; the frames the kernel dropped or that were cut short."""
        if self.proc is not None:
            if self.proc.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)
        stats = Path(f"{self.out}.json")
        return int(json.loads(stats.read_text())["drops"]) if stats.exists() else -1

    def __enter__(self) -> Capture:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


# -- reading ------------------------------------------------------------------------------
@dataclass
class Flow:
    """One direction of one TCP connection: its bytes in sequence order."""

    src: tuple[str, int]
    dst: tuple[str, int]
    syn: int | None = None
    segments: dict[int, bytes] = field(default_factory=dict)

    def data(self) -> tuple[bytes, int]:
        """The bytes in order, and how many bytes of the sequence space are missing."""
        if not self.segments:
            return b"", 0
        base = self.syn + 1 if self.syn is not None else min(self.segments)
        out = bytearray()
        missing = 0
        for seq in sorted(self.segments, key=lambda q: (q - base) % 2**32):
            rel = (seq - base) % 2**32
            chunk = self.segments[seq]
            if rel > len(out):
                missing += rel - len(out)
                out.extend(b"\0" * (rel - len(out)))
            out[rel:rel + len(chunk)] = chunk
        return bytes(out), missing


def frames(path: Path) -> list[bytes]:
    raw = path.read_bytes()
    magic, = struct.unpack_from("<I", raw, 0)
    if magic != 0xA1B2C3D4:
        raise ValueError(f"{path} is not a pcap file of this module")
    at, out = 24, []
    while at + 16 <= len(raw):
        _, _, incl, _ = struct.unpack_from("<IIII", raw, at)
        out.append(raw[at + 16:at + 16 + incl])
        at += 16 + incl
    return out


def tcp_flows(path: Path, port: int) -> dict[tuple[tuple[str, int], tuple[str, int]], Flow]:
    """The directions of every TCP connection to or from ``port`` (IPv4)."""
    flows: dict[tuple[tuple[str, int], tuple[str, int]], Flow] = {}
    for fr in frames(path):
        if len(fr) < 34 or fr[12:14] != b"\x08\x00":
            continue
        ip = fr[14:]
        ihl = (ip[0] & 0x0F) * 4
        total = struct.unpack_from("!H", ip, 2)[0] or len(ip)     # 0: a GSO frame
        if ip[9] != 6:
            continue
        src = (socket.inet_ntoa(ip[12:16]), 0)
        dst = (socket.inet_ntoa(ip[16:20]), 0)
        tcp = ip[ihl:total]
        sport, dport, seq = struct.unpack_from("!HHI", tcp, 0)
        if port not in (sport, dport):
            continue
        off = (tcp[12] >> 4) * 4
        flags = tcp[13]
        key = ((src[0], sport), (dst[0], dport))
        flow = flows.setdefault(key, Flow(*key))
        if flags & 0x02:
            flow.syn = seq
        payload = bytes(tcp[off:])
        if payload:
            flow.segments.setdefault(seq, payload)
    return flows


if __name__ == "__main__":
    _capture(Path(sys.argv[1]), sys.argv[2], float(sys.argv[3]), int(sys.argv[4]))
