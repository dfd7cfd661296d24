"""What a move costs a guest's network, seen from a client: a TCP stream (a line every
5 ms, echoed back by the guest, each checked in order) and an ICMP echo every
millisecond (a raw socket, so no ``ping`` binary is needed; root), both run in a
network namespace while a move runs. Shared by ``fusuma bench network`` and
``tests/integration/test_network_moves.py``.

Both probes are bounded: the stream ends after SPAN seconds (a 10 s socket timeout
inside), the echo sends SPAN x 1000 requests and waits one second more for replies.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
import time
from collections.abc import Callable
from typing import Any, Generic, TypeVar

from fusuma.frozen import frozen

T = TypeVar("T")

# The move starts this long after both probes, so each has a baseline before it.
LEAD_S = 0.8
ECHO_INTERVAL_MS = 1.0

# argv: HOST PORT SECONDS. The guest echoes each line (busybox `nc -ll -e /bin/cat`).
STREAM = textwrap.dedent("""
    import json, socket, sys, time
    host, port, secs = sys.argv[1], int(sys.argv[2]), float(sys.argv[3])
    sent = got = 0
    gap = 0.0
    err = None
    local = None
    end = time.monotonic() + secs
    try:
        s = socket.create_connection((host, port), timeout=10)
        s.settimeout(10)
        local = s.getsockname()[1]
        f = s.makefile("rwb")
        while time.monotonic() < end:
            t = time.monotonic()
            f.write(b"%d\\n" % sent); f.flush(); sent += 1
            line = f.readline()
            if int(line) != got:
                err = f"line {got} came back as {line!r}"; break
            got += 1
            gap = max(gap, time.monotonic() - t)
            time.sleep(0.005)
    except (OSError, ValueError) as exc:
        err = repr(exc)
    print(json.dumps({"sent": sent, "echoed": got, "max_gap_ms": round(gap * 1000, 1),
                      "local": local, "error": err}))
""")

# The head of a probe that sends ICMP echoes: a raw socket ``s``, the echoes' ``ident``
# and the checksum ``csum``.
ICMP_HEAD = textwrap.dedent("""
    import json, os, select, socket, struct, sys, time
    s = socket.socket(socket.AF_INET, socket.SOCK_RAW, socket.IPPROTO_ICMP)
    ident = os.getpid() & 0xFFFF
    def csum(b):
        b += b"\\0" * (len(b) % 2)
        t = sum(struct.unpack("!%dH" % (len(b) // 2), b))
        t = (t >> 16) + (t & 0xFFFF); t += t >> 16
        return ~t & 0xFFFF
""")

# argv: HOST COUNT. One ICMP echo a millisecond, replies counted by sequence. Prints the
# count lost and the longest run of lost ones (in echoes: ms). An echo whose moment the
# prober itself missed by more than 5 ms (it got no CPU: a loaded host) is skipped, not
# sent late in a burst, and counted apart: a stall of the prober is not the guest's
# outage, and a burst of hundreds of echoes loses replies of its own.
ECHO = ICMP_HEAD + textwrap.dedent("""
    host, count = sys.argv[1], int(sys.argv[2])
    got, skipped = set(), set()
    t0 = time.monotonic()
    seq = 0
    end = None
    while True:
        now = time.monotonic()
        while seq < count and now > t0 + seq * 0.001 + 0.005:
            skipped.add(seq)
            seq += 1
        if seq < count and now >= t0 + seq * 0.001:
            body = struct.pack("!BBHHH", 8, 0, 0, ident, seq & 0xFFFF) + b"fusuma"
            body = body[:2] + struct.pack("!H", csum(body)) + body[4:]
            s.sendto(body, (host, 0))
            seq += 1
            continue
        if seq >= count and end is None:
            end = now + 1.0
        if end is not None and now >= end:
            break
        wait = (t0 + seq * 0.001 - now) if seq < count else end - now
        r, _, _ = select.select([s], [], [], max(0.0, wait))
        while r:
            pkt = s.recv(2048)
            ihl = (pkt[0] & 15) * 4
            typ, _, _, pid, n = struct.unpack("!BBHHH", pkt[ihl:ihl + 8])
            if typ == 0 and pid == ident:
                got.add(n)
            r, _, _ = select.select([s], [], [], 0)
    run = worst = 0
    for i in range(count):
        if i in skipped:
            continue
        run = 0 if (i & 0xFFFF) in got else run + 1
        worst = max(worst, run)
    sent = count - len(skipped)
    print(json.dumps({"sent": sent, "skipped": len(skipped),
                      "received": min(len(got), sent),
                      "lost": sent - min(len(got), sent), "longest_lost_run": worst}))
""")


@frozen
class Seen(Generic[T]):
    """What the probes saw around one move, and the move's own answer."""

    moved: T
    echo: dict[str, Any]       # sent, received, lost, longest_lost_run
    stream: dict[str, Any]     # sent, echoed, max_gap_ms, local, error

    @property
    def outage_ms(self) -> float:
        """The longest run of echoes lost in a row, in ms."""
        return float(self.echo["longest_lost_run"]) * ECHO_INTERVAL_MS

    @property
    def stream_whole(self) -> bool:
        """The stream kept its connection and every line came back once, in order."""
        s = self.stream
        return s["error"] is None and s["echoed"] == s["sent"] > 0


def around(nsenter: list[str], host: str, port: int, span_s: float,
           move: Callable[[], T], python: str = sys.executable) -> Seen[T]:
    """Start the stream and the echo from the namespace ``nsenter`` enters (an argv
    prefix), run ``move`` LEAD_S later, and collect both once they end (``span_s``
    seconds after they started). Neither is left running, whatever ``move`` raises."""
    stream = subprocess.Popen([*nsenter, python, "-c", STREAM, host, str(port),
                               str(span_s)], stdout=subprocess.PIPE, text=True)
    echo = subprocess.Popen([*nsenter, python, "-c", ECHO, host,
                             str(int(span_s * 1000 / ECHO_INTERVAL_MS))],
                            stdout=subprocess.PIPE, text=True)
    try:
        time.sleep(LEAD_S)
        moved = move()
        echoed, _ = echo.communicate(timeout=span_s + 30)
        streamed, _ = stream.communicate(timeout=span_s + 30)
    finally:
        for p in (echo, stream):
            if p.poll() is None:
                p.kill()
                p.wait()
    return Seen(moved, _json(echoed, "echo"), _json(streamed, "stream"))


def _json(text: str, what: str) -> dict[str, Any]:
    try:
        data: dict[str, Any] = json.loads(text)
    except ValueError as exc:
        raise ValueError(f"the {what} probe printed no result: {text[-200:]!r}") from exc
    return data
