"""`fusuma bench cluster`'s parallel case: every VM re-hosted at once (issue 27: 24 VMs
across 3 hosts in <= 5 s, each move's downtime as the guest sees it <= 100 ms median
and <= 300 ms at p99).

The VMs are on a FusumaNetwork (``NETWORK``: a managed network on each lab host, a VXLAN
between their bridges, only inside the lab's namespaces) and a client namespace of the
bench's own sits on the last host's bridge. From there, while the moves run:

  * an ICMP echo to every VM every ``interval_ms`` (one raw socket, round robin); a
    VM's downtime as the network sees it is its longest run of echoes lost in a row,
    times the interval (so within one interval of the truth; an echo lost for another
    reason in the middle of a run cannot lengthen it, two runs are not added);
  * the guest clock probe, on one VM: the guest writes its own clock (/proc/uptime,
    centiseconds) every 10 ms down a TCP connection to the client; across the move,
    the host's elapsed time less the guest's is the time the guest's clock did not
    see. If that is the pause fusuma recorded, the guest's own clock cannot measure
    its downtime (the claim that under TCG its clock stops while the VM is stopped).

Then one `kubectl apply` re-hosts every VM (each to the next host), and the whole run
is from that command's start to the last VM Running at its new host with its move
recorded (``parallel_whole_run_s``; polled every ``POLL_S``). Each move's downtime as
fusuma records it (status.lastMove.downtimeMs) is reported beside the guest's.

Every load loop is bounded: the echo sends at most ``MAX_SPAN_S`` / interval rounds,
the guest's loop at most ``CLOCK_LINES`` lines, the client's server ends after
``MAX_SPAN_S``.
"""

from __future__ import annotations

import itertools
import json
import math
import statistics
import subprocess
import sys
import textwrap
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import yaml

from fusuma.cluster.lab import Lab
from fusuma.cluster.moveslots import MOVE_QUEUED
from fusuma.errors import FusumaError
from fusuma_bench.clusterwait import ready as _ready
from fusuma_bench.clusterwait import wait as _wait
from fusuma_bench.netprobe import ICMP_HEAD

NETWORK = "benchlan"
SUBNET = "10.125.0"
VNI = 125
CLIENT_IP = f"{SUBNET}.250"
CLOCK_PORT = 5000
PING_INTERVAL_MS = 10.0
MAX_SPAN_S = 180.0
CLOCK_LINES = 20000
POLL_S = 0.2
LEAD_S = 2.0
TAIL_S = 2.0
TARGETS = {"parallel_whole_run_s": 5.0, "parallel_guest_downtime_ms_median": 100.0,
           "parallel_guest_downtime_ms_p99": 300.0}

# argv: STOPFILE INTERVAL_MS MAX_ROUNDS IP... One echo to each IP per round, a round
# every INTERVAL_MS, until STOPFILE exists or MAX_ROUNDS; then one second for replies.
# Prints, per IP, the rounds sent, the replies and the longest run of rounds without one.
ECHO_MANY = ICMP_HEAD + textwrap.dedent("""
    stop, every, rounds = sys.argv[1], float(sys.argv[2]) / 1000, int(sys.argv[3])
    ips = sys.argv[4:]
    got = {ip: set() for ip in ips}
    skipped = set()
    t0 = time.monotonic()
    n = unsent = 0
    end = None
    def drain(wait):
        r, _, _ = select.select([s], [], [], max(0.0, wait))
        while r:
            pkt, addr = s.recvfrom(2048)
            ihl = (pkt[0] & 15) * 4
            typ, _, _, pid, seq = struct.unpack("!BBHHH", pkt[ihl:ihl + 8])
            if typ == 0 and pid == ident and addr[0] in got:
                got[addr[0]].add(seq)
            r, _, _ = select.select([s], [], [], 0)
    while True:
        now = time.monotonic()
        if end is None and (n >= rounds or (n % 50 == 0 and os.path.exists(stop))):
            end = now + 1.0
        if end is not None:
            if now >= end:
                break
            drain(end - now)
            continue
        if now > t0 + n * every + max(0.005, every / 2):
            # A round whose moment the prober missed (no CPU): skipped and counted
            # apart, not sent late in a burst whose replies the kernel drops.
            skipped.add(n)
            n += 1
            continue
        if now >= t0 + n * every:
            for ip in ips:
                body = struct.pack("!BBHHH", 8, 0, 0, ident, n & 0xFFFF) + b"fusuma"
                body = body[:2] + struct.pack("!H", csum(body)) + body[4:]
                try:
                    s.sendto(body, (ip, 0))
                except OSError:
                    unsent += 1     # the kernel's queue for it is full (ARP unresolved)
            n += 1
            continue
        drain(t0 + n * every - now)
    out = {}
    for ip in ips:
        run = worst = 0
        for i in range(n):
            if i in skipped:
                continue
            run = 0 if (i & 0xFFFF) in got[ip] else run + 1
            worst = max(worst, run)
        out[ip] = {"sent": n - len(skipped), "received": len(got[ip]),
                   "longest_lost_run": worst}
    print(json.dumps({"unsent": unsent, "skipped": len(skipped), "ips": out}))
""")

# argv: OUT ADDR PORT SECONDS. One connection; each line (the guest's /proc/uptime)
# written down with its arrival time (host clock, monotonic), until the connection ends,
# OUT.stop appears or SECONDS passed.
CLOCK_SERVER = textwrap.dedent("""
    import os, socket, sys, time
    out = open(sys.argv[1], "w", buffering=1)
    s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    s.bind((sys.argv[2], int(sys.argv[3]))); s.listen(1)
    end = time.monotonic() + float(sys.argv[4])
    s.settimeout(max(1.0, end - time.monotonic()))
    out.write("listening\\n")
    conn, _ = s.accept(); conn.settimeout(0.5)
    buf = b""
    while time.monotonic() < end and not os.path.exists(sys.argv[1] + ".stop"):
        try:
            data = conn.recv(4096)
        except socket.timeout:
            continue
        if not data:
            break
        now = time.monotonic()
        buf += data
        while b"\\n" in buf:
            line, buf = buf.split(b"\\n", 1)
            out.write(f"{now:.6f} {line.decode(errors='replace')}\\n")
    conn.close()
    out.write("end\\n")
""")


def p99(values: list[float]) -> float:
    """The 99th percentile by nearest rank (of 24 values: the largest)."""
    xs = sorted(values)
    return xs[max(0, math.ceil(0.99 * len(xs)) - 1)]


def clock_lost_ms(lines: list[tuple[float, float]], t_a: float, t_b: float
                  ) -> tuple[float, float]:
    """From (host monotonic arrival, guest uptime) pairs: from the last line that
    arrived before ``t_a`` to the first after ``t_b``, the host's elapsed time less the
    guest's (the time the guest's clock did not see), and the longest gap between two
    lines' arrivals."""
    before = [x for x in lines if x[0] <= t_a]
    after = [x for x in lines if x[0] >= t_b]
    if not before or not after:
        raise FusumaError("the guest clock probe has no line before or after the span.")
    a, b = before[-1], after[0]
    span = [x for x in lines if a[0] <= x[0] <= b[0]]
    gap = max((y[0] - x[0] for x, y in itertools.pairwise(span)), default=0.0)
    return round(((b[0] - a[0]) - (b[1] - a[1])) * 1000, 1), round(gap * 1000, 1)


def clock_figures(lines: list[tuple[float, float]], t_from: float, t_to: float
                  ) -> dict[str, Any]:
    """The guest clock probe's figures: its lines, how far the guest's clock went over
    the host's from the first line to the last (``rate``: 1.0 for a clock that keeps
    time and sees pauses), and, across the moves (from a line before the first patch to
    one a second after the last move ended) and over the lead before them, the time
    the guest's clock did not see; a sentence instead where the lines do not reach."""
    out: dict[str, Any] = {"lines": len(lines)}
    if len(lines) >= 2:
        host = lines[-1][0] - lines[0][0]
        out["host_span_s"] = round(host, 2)
        out["guest_span_s"] = round(lines[-1][1] - lines[0][1], 2)
        out["rate"] = round((lines[-1][1] - lines[0][1]) / host, 3) if host > 0 else None
    for what, (a, b) in (("lost_ms", (t_from - 0.1, t_to + 1.0)),
                         ("lost_ms_before_moves", (t_from - LEAD_S + 0.1, t_from - 0.1))):
        try:
            out[what], gap = clock_lost_ms(lines, a, b)
        except FusumaError as exc:
            out[what] = str(exc)
            continue
        if what == "lost_ms":
            out["longest_arrival_gap_ms"] = gap
    return out


def summarize(moves: dict[str, dict[str, Any]], guest_ms: dict[str, float],
              whole_s: float, queued: set[str], most_at_once: dict[str, int],
              clock: dict[str, Any]) -> dict[str, Any]:
    """The parallel case's figures: ``moves`` each VM's lastMove, ``guest_ms`` each
    VM's downtime seen by the echo."""
    ok = {n: lm for n, lm in moves.items() if lm.get("result") == "ok"}
    out: dict[str, Any] = {"parallel_vms": len(moves), "parallel_moves_ok": len(ok),
                           "parallel_whole_run_s": round(whole_s, 2),
                           "parallel_moves_queued": len(queued),
                           "parallel_most_at_once_per_pair": json.dumps(most_at_once,
                                                                        sort_keys=True)}
    for what, field in (("downtime", "downtimeMs"), ("total", "totalMs"),
                        ("wall", "wallMs"), ("prepare", "prepareMs")):
        vals = [float(lm[field]) for lm in ok.values() if lm.get(field) is not None]
        if vals:
            out[f"parallel_{what}_ms_median"] = round(statistics.median(vals), 2)
            out[f"parallel_{what}_ms_p99"] = round(p99(vals), 2)
            out[f"parallel_{what}_ms"] = vals
    g = [guest_ms[n] for n in sorted(guest_ms)]
    if g:
        out["parallel_guest_downtime_ms_median"] = round(statistics.median(g), 1)
        out["parallel_guest_downtime_ms_p99"] = round(p99(g), 1)
        out["parallel_guest_downtime_ms"] = g
    out.update({f"guest_clock_{k}": v for k, v in clock.items()})
    return out


def network(lab: Lab, progress: Callable[[str], None]) -> str:
    """FusumaNetwork ``NETWORK`` on every host and a client namespace of the bench's own
    on the last host's bridge (removed with the lab); the client's name."""
    lab.kubectl("apply", "-f", "-", input=yaml.safe_dump({
        "apiVersion": "fusuma.io/v1alpha1", "kind": "FusumaNetwork",
        "metadata": {"name": NETWORK},
        "spec": {"subnet": f"{SUBNET}.0/24", "vni": VNI, "nat": False}}))
    n = len(lab.hosts)

    def ready() -> bool:
        st = lab.get("fusumanetwork", NETWORK, None).get("status") or {}
        return len([h for h in st.get("hosts") or [] if h.get("ready")]) == n

    _wait(ready, 120, f"network {NETWORK} on the {n} hosts")
    client = f"fz{lab.tag}-pcl"
    lab.namespaces.append(client)        # removed (and checked) with the lab
    last = lab.hosts[-1].netns
    from fusuma.network.ifnames import bridge_name

    for cmd in (["netns", "add", client], ["-n", client, "link", "set", "lo", "up"],
                ["-n", last, "link", "add", "pcl0", "type", "veth", "peer", "name", "eth0",
                 "netns", client],
                ["-n", last, "link", "set", "pcl0", "master", bridge_name(NETWORK), "up"],
                ["-n", client, "addr", "add", f"{CLIENT_IP}/24", "dev", "eth0"],
                ["-n", client, "link", "set", "eth0", "up"]):
        subprocess.run(["ip", *cmd], check=True, capture_output=True)
    progress(f"network {NETWORK} on {n} hosts, client {CLIENT_IP} in namespace {client}")
    return client


def nics() -> list[dict[str, str]]:
    """The NICs of the bench's VMs when the parallel case runs."""
    return [{"network": NETWORK}]


def _in(ns: str) -> list[str]:
    return ["nsenter", f"--net=/run/netns/{ns}", "--"]


def _echo(client: str, ips: list[str], rounds: int, interval_ms: float,
          stop: Path) -> subprocess.Popen[str]:
    return subprocess.Popen([*_in(client), sys.executable, "-c", ECHO_MANY, str(stop),
                             str(interval_ms), str(rounds), *ips],
                            stdout=subprocess.PIPE, text=True)


def _answering(client: str, ips: list[str], work: Path) -> list[str]:
    """Which of ``ips`` answer 10 echoes (0.1 s apart) with at least one."""
    p = _echo(client, ips, 10, 100.0, work / "never")
    out, _ = p.communicate(timeout=30)
    got = json.loads(out)["ips"]
    return [ip for ip in ips if got[ip]["received"] > 0]


def _items(lab: Lab, names: list[str]) -> dict[str, dict[str, Any]]:
    return {o["metadata"]["name"]: o for o in lab.get("fusumavm")["items"]
            if o["metadata"]["name"] in names}


def run(lab: Lab, names: list[str], cli: Callable[..., str], work: Path,
        progress: Callable[[str], None], interval_ms: float = PING_INTERVAL_MS,
        settle: Callable[[], object] = lambda: None) -> dict[str, Any]:
    """Re-host every VM of ``names`` at once (each to the next host) and measure.
    ``cli(host, *args)`` runs fusuma's CLI on a lab host."""
    client = f"fz{lab.tag}-pcl"
    items = _items(lab, names)
    ips = {n: str(((o.get("status") or {}).get("nics") or [{}])[0].get("ip") or "")
           for n, o in items.items()}
    if not all(ips.values()):
        raise FusumaError(f"VMs without an address on {NETWORK}: "
                          f"{[n for n, ip in ips.items() if not ip]}")
    progress(f"waiting for the {len(ips)} guests to answer echoes")
    _wait(lambda: len(_answering(client, list(ips.values()), work)) == len(ips), 180,
          "every guest answering echoes", every=2.0)
    settle()
    hosts = [h.name for h in lab.hosts]
    where = {n: str(o["status"]["host"]) for n, o in items.items()}
    to = {n: hosts[(hosts.index(where[n]) + 1) % len(hosts)] for n in names}
    before = {n: (o["status"].get("lastMove") or {}) for n, o in items.items()}
    # The guest clock probe on the first VM: its guest writes /proc/uptime every 10 ms
    # down one TCP connection to the client.
    probe_vm = names[0]
    log = work / "guest-clock.log"
    server = subprocess.Popen([*_in(client), sys.executable, "-c", CLOCK_SERVER, str(log),
                               CLIENT_IP, str(CLOCK_PORT), str(MAX_SPAN_S)])
    stop = work / "echo.stop"
    echo: subprocess.Popen[str] | None = None
    try:
        _wait(lambda: log.exists() and "listening" in log.read_text(), 30,
              "the clock probe's server", every=0.1)
        host = next(h for h in lab.hosts if h.name == where[probe_vm])
        cli(host, "vm", "exec", probe_vm, "--", "/bin/sh", "-c",
            f"( i=0; while [ $i -lt {CLOCK_LINES} ]; do i=$((i+1)); cat /proc/uptime; "
            f"sleep 0.01; done | nc {CLIENT_IP} {CLOCK_PORT} ) </dev/null >/dev/null "
            "2>&1 &")
        _wait(lambda: log.read_text().count("\n") > 50, 30, "the guest's clock lines",
              every=0.2)
        echo = _echo(client, [ips[n] for n in names], int(MAX_SPAN_S * 1000 / interval_ms),
                     interval_ms, stop)
        time.sleep(LEAD_S)
        progress(f"re-hosting {len(names)} VMs at once, each to the next host")
        docs = [{**o_doc(items[n]), "spec": {**items[n]["spec"], "host": to[n]}}
                for n in names]
        t_from = time.monotonic()
        lab.kubectl("apply", "-f", "-", input=yaml.safe_dump_all(docs))
        queued: set[str] = set()
        most: dict[str, int] = {}
        done: dict[str, dict[str, Any]] = {}
        deadline = t_from + MAX_SPAN_S - 10
        while len(done) < len(names):
            if time.monotonic() > deadline:
                progress(f"{len(names) - len(done)} moves did not end in "
                         f"{MAX_SPAN_S - 10:.0f} s: {sorted(set(names) - set(done))}")
                break
            now = _items(lab, names)
            at_once: dict[str, int] = {}
            for n, o in now.items():
                st = o.get("status") or {}
                m = st.get("move") or {}
                if m:
                    pair = f"{m.get('fromHost')}->{m.get('toHost')}"
                    at_once[pair] = at_once.get(pair, 0) + 1
                if any(cd.get("type") == "Moved" and cd.get("reason") == MOVE_QUEUED
                       for cd in st.get("conditions") or []):
                    queued.add(n)
                last = st.get("lastMove") or {}
                if n not in done and not m and last and last != before[n] \
                        and (last.get("result") != "ok"
                             or (st.get("host") == to[n] and _ready(o))):
                    done[n] = last
            for pair, k in at_once.items():
                most[pair] = max(most.get(pair, 0), k)
            if len(done) < len(names):
                time.sleep(POLL_S)
        t_to = time.monotonic()
        whole = t_to - t_from
        progress(f"{len(done)} of {len(names)} moves ended after {whole:.2f} s")
        time.sleep(TAIL_S)
    finally:
        stop.touch()
        Path(str(log) + ".stop").touch()
        echoed = ""
        if echo is not None:
            try:
                echoed, _ = echo.communicate(timeout=30)
            finally:
                if echo.poll() is None:
                    echo.kill()
                    echo.wait()
        try:
            server.wait(10)
        except subprocess.TimeoutExpired:
            server.kill()
            server.wait()
    try:
        echo_out = json.loads(echoed)
    except ValueError:
        echo_out = {"unsent": None, "ips": {}}
        progress(f"the echo probe printed no result: {echoed[-200:]!r}")
    got = echo_out["ips"]
    guest = {n: float(got[ips[n]]["longest_lost_run"]) * interval_ms for n in names
             if ips[n] in got}
    lines = []
    for line in log.read_text().splitlines():
        parts = line.split()
        if len(parts) >= 2 and parts[0][0].isdigit():
            try:
                lines.append((float(parts[0]), float(parts[1])))
            except ValueError:
                continue
    clock = clock_figures(lines, t_from, t_to)
    clock.update({"vm": probe_vm,
                  "fusuma_downtime_ms": done.get(probe_vm, {}).get("downtimeMs"),
                  "echo_downtime_ms": guest.get(probe_vm)})
    out = summarize(done, guest, whole, queued, most, clock)
    out["parallel_moves_unfinished"] = sorted(set(names) - set(done))
    if out["parallel_moves_unfinished"]:
        out["parallel_whole_run_s"] = None        # not measured: the run did not end
    out["parallel_echo_interval_ms"] = interval_ms
    out["parallel_echoes_lost"] = sum(got[ips[n]]["sent"] - got[ips[n]]["received"]
                                      for n in names if ips[n] in got)
    out["parallel_echoes_unsent"] = echo_out["unsent"]
    return out


def o_doc(o: dict[str, Any]) -> dict[str, Any]:
    """A FusumaVM as `kubectl apply` takes it again (its kind, name and namespace)."""
    md = o["metadata"]
    return {"apiVersion": o["apiVersion"], "kind": o["kind"],
            "metadata": {"name": md["name"], "namespace": md.get("namespace", "default")}}
