"""A network that spans the lab's hosts (FusumaNetwork: a managed network on each host,
a VXLAN between their bridges, only between the hosts' namespaces) and a VM on it that
moves live from h0 to h1 keeping its MAC, its address (allocated cluster-wide: a
FusumaAddress, handed to h1 with it) and an open TCP connection to a client on h2's
bridge (the network's MTU, the veths' 1500 less the VXLAN's 50, on every
bridge, VXLAN port and tap and told to the guest by DHCP, and a bulk TCP transfer of
full-size segments from the guest to that client first); a stopped VM on h1 gets
another address, a static one that is held is refused,
a host cannot free another's, deleting a VM frees its address. Then, on the same
guest, ``kill -9`` of a move's processes between hosts (the destination's QEMU while
the stream runs, the destination's agent once it recorded "forward"; the source's agent
while the stream runs, expected to fail for now): one QEMU holds the tap, MAC, address,
data and TCP connection kept. The lab
and the guest are the module's (they cost minutes); see conftest.py."""

from __future__ import annotations

import itertools
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from fusuma.cluster.hostmove import FAULT_DECIDED_DELAY
from fusuma.migration import FAULT_STREAM_BPS
from tests.cluster.conftest import Cluster, wait_for
from tests.fault.movekit import job, qemu_pids
from tests.integration.test_network_moves import holders
from tests.netns import add as add_netns
from tests.netns import wrap as netns_wrap

pytestmark = [pytest.mark.cluster, pytest.mark.timeout(600)]

SUBNET = "10.124.0"
CLIENT_IP = f"{SUBNET}.200"
PORT = 5000
BULK_PORT = 5001
BULK_BYTES = 4 * 2**20
# The client's end of a bulk transfer from the guest: one connection, BULK_BYTES read
# (then closed: the guest's nc ends), written down as "BYTES RCV_MSS SECONDS" (the
# kernel's tcp_info: the largest segment's payload seen), in at most 60 s.
RECEIVER = """
import socket, struct, sys, time
s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
s.bind((sys.argv[2], int(sys.argv[3]))); s.listen(1); s.settimeout(60)
open(sys.argv[1] + ".ready", "w").close()
conn, _ = s.accept(); conn.settimeout(60)
want, got, t0 = int(sys.argv[4]), 0, time.monotonic()
while got < want:
    data = conn.recv(65536)
    if not data:
        break
    got += len(data)
secs = time.monotonic() - t0
rcv_mss = struct.unpack_from("I", conn.getsockopt(socket.IPPROTO_TCP, socket.TCP_INFO, 104), 20)[0]
conn.close()
open(sys.argv[1], "w").write(f"{got} {rcv_mss} {secs:.3f}\\n")
"""
# The client's end of the guest's stream: one connection accepted, each line's arrival
# time written down, until the connection ends or the file ``stop`` appears.
SERVER = """
import socket, sys, time, os
out = open(sys.argv[1], "w", buffering=1)
s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
s.bind((sys.argv[2], int(sys.argv[3]))); s.listen(1); s.settimeout(120)
out.write("listening\\n")
conn, peer = s.accept(); conn.settimeout(1.0)
out.write(f"peer {peer[0]}:{peer[1]}\\n")
buf = b""
while not os.path.exists(sys.argv[1] + ".stop"):
    try:
        data = conn.recv(4096)
    except socket.timeout:
        continue
    if not data:
        out.write("closed\\n"); break
    buf += data
    while b"\\n" in buf:
        line, buf = buf.split(b"\\n", 1)
        out.write(f"{time.time():.3f} {line.decode(errors='replace')}\\n")
conn.close()
"""


def ns(netns: str, *argv: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["ip", "netns", "exec", netns, *argv], capture_output=True,
                          text=True, timeout=60, check=check)


def links(netns: str) -> dict[str, dict[str, object]]:
    out = subprocess.run(["ip", "-n", netns, "-j", "-d", "link", "show"], check=True,
                         capture_output=True, text=True).stdout
    return {str(x["ifname"]): x for x in json.loads(out)}


@pytest.fixture(scope="module")
def lan(cluster: Cluster) -> Iterator[str]:
    """The network ``lan`` on the three hosts, a client namespace on h2's bridge (its
    name is yielded) and the VM ``roamer`` on it, applied on h0 (not waited for: the
    first test checks addresses while it boots). Every FusumaVM is deleted after the
    module's tests (an agent a test killed is started again first)."""
    c = cluster
    lab = c.lab
    for lh, h in zip(lab.hosts, c.hosts, strict=True):
        h.wrap = netns_wrap(lh.netns)
    c.apply(yaml.safe_dump({
        "apiVersion": "fusuma.io/v1alpha1", "kind": "FusumaNetwork",
        "metadata": {"name": "lan"},
        "spec": {"subnet": f"{SUBNET}.0/24", "vni": 124, "nat": False}}))
    wait_for(lambda: len([h for h in (lab.get("fusumanetwork", "lan", None).get("status")
                                      or {}).get("hosts") or [] if h.get("ready")]) == 3,
             60, "network lan on the three hosts")
    # A client on h2's bridge (a veth into a namespace of its own).
    client = f"fz{lab.tag}-cl"
    add_netns(client)                       # its loopback up
    lab.namespaces.append(client)           # removed (and checked) with the lab
    h2 = lab.hosts[2].netns
    for cmd in (["-n", h2, "link", "add", "cl0", "type", "veth", "peer", "name", "eth0",
                 "netns", client],
                ["-n", h2, "link", "set", "cl0", "master", "fzb-lan", "up"],
                ["-n", client, "addr", "add", f"{CLIENT_IP}/24", "dev", "eth0"],
                ["-n", client, "link", "set", "eth0", "up"]):
        subprocess.run(["ip", *cmd], check=True)
    c.apply(yaml.safe_dump({
        "apiVersion": "fusuma.io/v1alpha1", "kind": "FusumaVM",
        "metadata": {"name": "roamer", "namespace": "default"},
        "spec": {"memoryMiB": 192, "vcpus": 1, "host": "h0", "partition": "p0",
                 "nics": [{"network": "lan"}]}}))
    try:
        yield client
    finally:
        for lh in lab.hosts:
            if lh.agent is None or lh.agent.poll() is not None:
                lab.start_agent(lh)
        c.delete_all_vms()


def test_a_vm_moves_between_hosts_keeping_its_nic_and_tcp_connection(
        cluster: Cluster, lan: str, tmp_path: Path) -> None:
    c = cluster
    lab = c.lab
    client = lan
    # The kernel's view: each host's bridge has the same (gateway) MAC and a VXLAN port
    # flooding to the two other hosts.
    macs = set()
    for lh in lab.hosts:
        ls = links(lh.netns)
        assert ls["fzv-lan"]["master"] == "fzb-lan"
        assert ls["fzv-lan"]["linkinfo"]["info_data"]["id"] == 124  # type: ignore[index]
        macs.add(ls["fzb-lan"]["address"])
        fdb = json.loads(subprocess.run(
            ["ip", "netns", "exec", lh.netns, "bridge", "-j", "fdb", "show", "dev",
             "fzv-lan"], capture_output=True, text=True, check=True).stdout)
        assert sorted(e["dst"] for e in fdb if e["mac"] == "00:00:00:00:00:00") == sorted(
            o.address for o in lab.hosts if o is not lh)
    assert len(macs) == 1
    wait_for(lambda: c.running("roamer"), 180, "roamer running on h0")
    h0, h1 = c.host("h0"), c.host("h1")
    VM_IP = c.vm("roamer")["status"]["nics"][0]["ip"]
    t_addr = time.monotonic()
    other_ip = addresses_and_their_holders(c, VM_IP)
    t_addr = time.monotonic() - t_addr
    wait_for(lambda: f"inet {VM_IP}/24" in h0.run(
        "vm", "exec", "roamer", "--", "/bin/sh", "-c", "ip -4 -o addr show eth0",
        check=False).out, 60, "roamer's lease from h0's dnsmasq")
    mac = h0.run("network", "show", "lan", "--json").json()["nics"][0]["mac"]
    # Across the VXLAN, before the move: h2's client to the guest on h0.
    ns(client, "busybox", "ping", "-c", "2", "-W", "3", VM_IP)
    t_mtu = time.monotonic()
    mtu = mtu_across_hosts(c, client, VM_IP, tmp_path)
    t_mtu = time.monotonic() - t_mtu
    print(f"MTU {mtu} across the VXLAN: checks and a {BULK_BYTES >> 20} MiB transfer "
          f"took {t_mtu:.1f} s")

    log = tmp_path / "stream.log"
    server = subprocess.Popen(["ip", "netns", "exec", client, sys.executable, "-c", SERVER,
                               str(log), CLIENT_IP, str(PORT)])
    try:
        wait_for(lambda: log.exists() and "listening" in log.read_text(), 30,
                 "the client's server to listen", every=0.1)
        h0.run("vm", "exec", "roamer", "--", "/bin/sh", "-c",
               f"( (i=0; while :; do i=$((i+1)); echo $i; sleep 0.1; done) | "
               f"nc {CLIENT_IP} {PORT} ) </dev/null >/dev/null 2>&1 &")
        wait_for(lambda: log.exists() and log.read_text().count("\n") > 10, 30,
                 "the guest's stream to reach the client")
        t_move = time.time()
        lab.kubectl("patch", "fusumavm", "roamer", "--type=merge",
                    "-p", json.dumps({"spec": {"host": "h1"}}))
        o = wait_for(lambda: (v := c.vm("roamer"))["status"].get("host") == "h1"
                     and not v["status"].get("move") and c.running("roamer") and v,
                     180, "the move to h1")
        t_done = time.time()
        time.sleep(3)
        (tmp_path / "stream.log.stop").touch()
        server.wait(15)
    finally:
        if server.poll() is None:
            server.kill()
            server.wait()
    move = o["status"]["lastMove"]
    assert (move["kind"], move["from"], move["to"], move["result"]) == (
        "between-hosts", "h0/p0", "h1/p0", "ok"), move
    lines = log.read_text().splitlines()
    assert lines[1].startswith(f"peer {VM_IP}:") and "closed" not in lines, lines[-5:]
    ticks = [(float(t), int(n)) for t, n in (x.split() for x in lines[2:])]
    # One connection, every number once and in order, before and well after the move.
    assert [n for _, n in ticks] == list(range(1, len(ticks) + 1))
    assert any(t < t_move for t, _ in ticks) and sum(t > t_done for t, _ in ticks) >= 10
    gap = max(b - a for (a, _), (b, _) in itertools.pairwise(ticks))
    assert gap < 30, f"the stream stalled {gap:.1f} s"
    # Where the guest runs and what it holds: h1's tap with the same MAC and address.
    nics = c.host("h1").run("network", "show", "lan", "--json").json()["nics"]
    assert [(n["vm"], n["mac"], n["ip"]) for n in nics] == [("roamer", mac, VM_IP)]
    assert h0.run("network", "show", "lan", "--json").json()["nics"] == []
    assert [n for n in links(lab.hosts[1].netns) if n.startswith("fzt-")]
    assert not [n for n in links(lab.hosts[0].netns) if n.startswith("fzt-")]
    assert f"inet {VM_IP}/24" in h1.run("vm", "exec", "roamer", "--", "/bin/sh", "-c",
                                        "ip -4 -o addr show eth0").out
    # Its address went with it: h1 holds it now (h0 handed it on, through the policy).
    t_hand = time.monotonic()
    wait_for(lambda: held(c) == {f"lan.{VM_IP}": ("roamer", "h1")}, 60,
             "roamer's address handed to h1")
    t_addr += time.monotonic() - t_hand
    assert other_ip != VM_IP
    print(f"cluster-wide addresses: {VM_IP} and {other_ip}; their checks took "
          f"{t_addr:.1f} s")
    ns(client, "busybox", "ping", "-c", "2", "-W", "3", VM_IP)
    print(f"between hosts with a NIC: {move['downtimeMs']} ms downtime, "
          f"{move['totalMs']} ms total; the TCP stream's longest gap {gap * 1000:.0f} ms")


def mtu_across_hosts(c: Cluster, client: str, vm_ip: str, tmp: Path) -> int:
    """Every host's bridge, VXLAN port and the guest's tap have the uplink's MTU less the
    VXLAN's 50 bytes (1450 on the lab's veths), the guest was told it by DHCP, and a
    bulk TCP transfer from the guest on h0 to the client on h2 crosses the VXLAN in
    full-size segments (a guest left at 1500 would send frames the VXLAN drops, and
    the transfer would hang). Returns the MTU."""
    lab = c.lab
    for lh in lab.hosts:
        ls = links(lh.netns)
        assert ls["eth0"]["mtu"] == 1500
        assert ls["fzb-lan"]["mtu"] == ls["fzv-lan"]["mtu"] == 1450, lh.name
    taps = [x for n, x in links(lab.hosts[0].netns).items() if n.startswith("fzt-")]
    assert [t["mtu"] for t in taps] == [1450]
    h0 = c.host("h0")
    assert h0.run("network", "show", "lan", "--json").json()["mtu"] == 1450
    assert h0.run("vm", "exec", "roamer", "--", "cat", "/sys/class/net/eth0/mtu"
                  ).out.strip() == "1450"
    out = tmp / "bulk.out"
    recv = subprocess.Popen(["ip", "netns", "exec", client, sys.executable, "-c", RECEIVER,
                             str(out), CLIENT_IP, str(BULK_PORT), str(BULK_BYTES)])
    try:
        wait_for(lambda: Path(f"{out}.ready").exists(), 30, "the bulk receiver", every=0.1)
        h0.run("vm", "exec", "roamer", "--", "/bin/sh", "-c",
               f"head -c {BULK_BYTES} /dev/zero | timeout 60 nc {CLIENT_IP} {BULK_PORT}",
               check=False, timeout=90)
        recv.wait(90)
    finally:
        if recv.poll() is None:
            recv.kill()
            recv.wait()
    assert out.exists(), "the bulk transfer did not complete in 60 s"
    got, rcv_mss, secs = out.read_text().split()
    assert int(got) == BULK_BYTES
    # Full-size segments for a 1450-byte MTU: 1450 - 40 bytes of IPv4 and TCP headers,
    # less 12 of TCP timestamps where the guest uses them.
    assert 1450 - 40 - 12 <= int(rcv_mss) <= 1450 - 40, rcv_mss
    print(f"bulk across hosts: {BULK_BYTES} bytes in {float(secs):.2f} s, segments of "
          f"{rcv_mss} bytes")
    return 1450


def held(c: Cluster) -> dict[str, tuple[str, str]]:
    """FusumaAddress name -> (VM, holder host)."""
    items = json.loads(c.lab.kubectl("get", "fusumaaddresses", "-o", "json").stdout)["items"]
    return {o["metadata"]["name"]: (o["spec"]["vm"]["name"], o["spec"]["host"])
            for o in items}


def addresses_and_their_holders(c: Cluster, vm_ip: str) -> str:
    """Addresses allocated cluster-wide, checked beside the running roamer (h0): a
    stopped VM on h1 gets another, a static address roamer holds is refused on h2, h0's
    identity cannot free h1's address, deleting the VM frees it. Stopped VMs only: no
    guest boots here. Returns the address the second VM had."""
    lab = c.lab
    assert held(c) == {f"lan.{vm_ip}": ("roamer", "h0")}
    assert c.host("h0").run("network", "show", "lan", "--json").json()["nics"][0]["ip"] \
        == vm_ip
    docs = [{"apiVersion": "fusuma.io/v1alpha1", "kind": "FusumaVM",
             "metadata": {"name": name, "namespace": "default"},
             "spec": {"memoryMiB": 128, "host": host, "partition": "p0", "running": False,
                      "nics": [nic]}}
            for name, host, nic in (("sitter", "h1", {"network": "lan"}),
                                    ("thief", "h2", {"network": "lan", "ip": vm_ip}))]
    c.apply(yaml.safe_dump_all(docs))
    o = wait_for(lambda: (v := c.vm("sitter"))["status"].get("state") == "Stopped" and v,
                 60, "sitter defined, stopped, on h1")
    ip = o["status"]["nics"][0]["ip"]
    assert ip != vm_ip and ip.startswith(f"{SUBNET}.")
    assert [(n["vm"], n["ip"]) for n in c.host("h1").run(
        "network", "show", "lan", "--json").json()["nics"]] == [("sitter", ip)]
    t = wait_for(lambda: (v := c.vm("thief"))["status"].get("state") == "Failed" and v,
                 60, "thief refused")
    assert c.cond(t, "Ready")["message"] == (
        f"spec.nics[0].ip: address {vm_ip} of network lan is held by FusumaVM "
        "default/roamer (its NIC 0); pick another or leave it out to have one allocated.")
    assert c.local_vms("thief") == {}
    assert held(c) == {f"lan.{vm_ip}": ("roamer", "h0"), f"lan.{ip}": ("sitter", "h1")}
    # h0's identity may neither free nor take h1's VM's address.
    p = lab.kubectl("delete", "fusumaaddress", f"lan.{ip}",
                    kubeconfig=lab.hosts[0].kubeconfig, check=False)
    assert p.returncode != 0 and "(Forbidden)" in p.stderr, p.stderr
    assert "is held by host h1" in p.stderr, p.stderr
    theirs = lab.get("fusumaaddress", f"lan.{ip}", None)
    theirs["spec"]["host"] = theirs["metadata"]["labels"]["fusuma.io/host"] = "h0"
    p = lab.kubectl("replace", "-f", "-", input=json.dumps(theirs),
                    kubeconfig=lab.hosts[0].kubeconfig, check=False)
    assert p.returncode != 0 and "(Forbidden)" in p.stderr, p.stderr
    assert "may change or free only the addresses it holds" in p.stderr, p.stderr
    lab.kubectl("delete", "fusumavm", "sitter", "thief", "--wait=false")
    wait_for(lambda: held(c) == {f"lan.{vm_ip}": ("roamer", "h0")}, 60,
             "sitter's address freed with it")
    wait_for(lambda: not [v for v in c.vms() if v["metadata"]["name"] != "roamer"], 60,
             "sitter and thief deleted")
    return str(ip)


# -- kill -9 during a move between hosts, with the NIC and its TCP stream --------------
# The stream's rate while a test kills something during it (bytes/s; the guest's
# stream is about 20 MiB: seconds).
SLOW = str(4 * 2**20)
BLOB = ("dd if=/dev/urandom of=/tmp/kept bs=64k count=32 2>/dev/null; "
        "md5sum /tmp/kept | cut -d' ' -f1")


def qemus(c: Cluster, vm: str) -> dict[str, list[int]]:
    """Each lab host's live QEMUs of ``vm`` (found by their command line)."""
    return {lh.name: qemu_pids(h, vm) for lh, h in zip(c.lab.hosts, c.hosts, strict=True)}


def taps(c: Cluster) -> dict[str, list[str]]:
    return {lh.name: [n for n in links(lh.netns) if n.startswith("fzt-")]
            for lh in c.lab.hosts}


def restart_agent(c: Cluster, host: str, env: dict[str, str] | None = None,
                  sig: int = signal.SIGTERM) -> None:
    lh = c.lab_host(host)
    c.lab.stop_agent(lh, sig)
    c.lab.start_agent(lh, env=env)


def move_to(c: Cluster, host: str) -> None:
    c.lab.kubectl("patch", "fusumavm", "roamer", "--type=merge",
                  "-p", json.dumps({"spec": {"host": host}}))


def at_phase(c: Cluster, pred: Callable[[dict[str, Any]], object], what: str
             ) -> dict[str, Any]:
    """The move's record once ``pred(record)`` holds (polled fast: a phase lasts
    seconds)."""
    out: dict[str, Any] = wait_for(
        lambda: (m := c.vm("roamer")["status"].get("move") or {}) and pred(m) and m,
        60, what, every=0.05)
    return out


def ended(c: Cluster, move_id: str) -> dict[str, Any]:
    """The FusumaVM once move ``move_id`` is over (``lastMove``, no ``move``)."""
    out: dict[str, Any] = wait_for(
        lambda: (v := c.vm("roamer"))["status"].get("lastMove", {}).get("id") == move_id
        and not v["status"].get("move") and v, 120, f"the end of move {move_id}")
    return out


class Stream:
    """The guest's counter, one line every 0.1 s over one TCP connection to the client
    namespace, each line's arrival written down by the client."""

    def __init__(self, c: Cluster, client: str, log: Path, host: str) -> None:
        self.log = log
        self.server = subprocess.Popen(["ip", "netns", "exec", client, sys.executable, "-c",
                                        SERVER, str(log), CLIENT_IP, str(PORT)])
        wait_for(lambda: log.exists() and "listening" in log.read_text(), 30,
                 "the client's server to listen", every=0.1)
        c.host(host).run("vm", "exec", "roamer", "--", "/bin/sh", "-c",
                         f"( (i=0; while :; do i=$((i+1)); echo $i; sleep 0.1; done) | "
                         f"nc {CLIENT_IP} {PORT} ) </dev/null >/dev/null 2>&1 &")
        self.flows(5)

    def numbers(self) -> list[int]:
        lines = self.log.read_text().splitlines()
        assert "closed" not in lines, lines[-5:]
        return [int(x.split()[1]) for x in lines[2:] if len(x.split()) == 2]

    def flows(self, more: int = 10) -> None:
        """``more`` new numbers arrive: the connection carries on."""
        have = len(self.numbers())
        wait_for(lambda: len(self.numbers()) >= have + more, 60,
                 "the guest's TCP stream to flow", every=0.2)

    def close(self) -> list[int]:
        Path(f"{self.log}.stop").touch()
        try:
            self.server.wait(15)
        finally:
            if self.server.poll() is None:
                self.server.kill()
                self.server.wait()
        return self.numbers()


def runs_once_on(c: Cluster, host: str, mac: str, ip: str, md5: str,
                 stream: Stream) -> dict[str, Any]:
    """After a move ended: the guest runs in one QEMU, on ``host``, which holds its tap;
    the guest kept its MAC, address and data; its TCP connection carries on; the
    FusumaVM and each host's `ps` say so; the other hosts keep no QEMU, tap, VM or job
    of it. Returns the FusumaVM."""
    others = [lh.name for lh in c.lab.hosts if lh.name != host]
    # What the other hosts undo runs beside the record's end (a destination's abort):
    # bounded wait for it.
    wait_for(lambda: not any(qemus(c, "roamer")[o] for o in others)
             and not any(taps(c)[o] for o in others)
             and not any(job(c.host(o), "roamer") for o in others)
             and job(c.host(host), "roamer") is None, 60,
             f"nothing of roamer left beside {host}")
    found = qemus(c, "roamer")
    assert found[host] and len(found[host]) == 1, found
    pid = found[host][0]
    o = c.running("roamer")
    assert o and (o["status"]["host"], o["status"]["pid"]) == (host, pid), o and o["status"]
    ps = c.local_vms("roamer")
    assert list(ps) == [host] and ps[host]["state"] == "running" \
        and ps[host]["pid"] == pid, ps
    (tap,) = taps(c)[host]
    holding = holders(tap, next(lh.netns for lh in c.lab.hosts if lh.name == host))
    assert list(holding) == [pid] and all(q.attached for q in holding[pid]), holding
    h = c.host(host)
    nics = h.run("network", "show", "lan", "--json").json()["nics"]
    assert [(n["vm"], n["mac"], n["ip"]) for n in nics] == [("roamer", mac, ip)]
    for o_ in others:
        assert c.host(o_).run("network", "show", "lan", "--json").json()["nics"] == []
    shown = h.run("vm", "exec", "roamer", "--", "/bin/sh", "-c",
                  "cat /sys/class/net/eth0/address; ip -4 -o addr show eth0; "
                  "md5sum /tmp/kept | cut -d' ' -f1").out
    assert mac in shown and f"inet {ip}/24" in shown and md5 in shown, shown
    stream.flows()
    return o


def on_the_guest(c: Cluster, lan: str, log: Path
                 ) -> tuple[str, str, str, str, str, Stream]:
    """Where the guest runs now and the other of h0 and h1, its address, MAC and the
    md5 of data written in it, and its TCP stream to the client, started."""
    wait_for(lambda: c.running("roamer"), 180, "roamer running")
    here = c.vm("roamer")["status"]["host"]
    there = "h0" if here == "h1" else "h1"
    ip = c.vm("roamer")["status"]["nics"][0]["ip"]
    h = c.host(here)
    wait_for(lambda: f"inet {ip}/24" in h.run(
        "vm", "exec", "roamer", "--", "/bin/sh", "-c", "ip -4 -o addr show eth0",
        check=False).out, 60, "roamer's address")
    mac = h.run("network", "show", "lan", "--json").json()["nics"][0]["mac"]
    md5 = h.run("vm", "exec", "roamer", "--", "/bin/sh", "-c", BLOB).out.strip()
    return here, there, ip, mac, md5, Stream(c, lan, log, here)


def test_kill_9_during_a_move_between_hosts_with_a_nic(
        cluster: Cluster, lan: str, tmp_path: Path) -> None:
    """kill -9 of a move's processes between hosts, the guest on ``lan`` streaming to
    the client: the destination's QEMU while the stream runs (the move goes back) and
    the destination's agent once it recorded "forward", started again only once its
    Lease expired (forward). After each: one QEMU, holding the tap; MAC, address, data
    and TCP connection kept; status and `ps` true; nothing left on the other host."""
    c = cluster
    here, there, ip, mac, md5, stream = on_the_guest(c, lan, tmp_path / "stream.log")
    slow = {FAULT_STREAM_BPS: SLOW}
    faulty: set[str] = set()
    times: dict[str, float] = {}
    try:
        # 1. The destination's QEMU, mid-stream: back; the guest runs on at the source.
        t0 = time.monotonic()
        restart_agent(c, here, slow)
        faulty.add(here)
        move_to(c, there)
        m = at_phase(c, lambda m: m.get("phase") == "Streaming", "the stream")
        dest_pid = int(m["destPid"])
        assert dest_pid in qemus(c, "roamer")[there], (dest_pid, qemus(c, "roamer"))
        os.kill(dest_pid, signal.SIGKILL)
        o = ended(c, m["id"])
        last = o["status"]["lastMove"]
        assert (last["result"], last["decision"]) == ("failed", "back"), last
        move_to(c, here)          # the spec follows (else the move is tried again)
        runs_once_on(c, here, mac, ip, md5, stream)
        times["destination QEMU"] = time.monotonic() - t0

        # 2. The destination's agent, right after it recorded "forward" (before its
        # QEMU runs the guest, while the source ends its own), started again only once
        # its host's Lease expired (the source no longer waits for it): the move's
        # record still says where the guest is, and the new agent finishes the move.
        t0 = time.monotonic()
        restart_agent(c, there, {FAULT_DECIDED_DELAY: "60"})
        faulty.add(there)
        move_to(c, there)
        m = at_phase(c, lambda m: m.get("decision"), "the decision")
        assert (m["decision"], m["decidedBy"]) == ("forward", there), m
        lh = c.lab_host(there)
        c.lab.stop_agent(lh, signal.SIGKILL)
        wait_for(lambda: c.cond(c.lab.get("fusumahost", there, None), "Ready"
                                ).get("reason") == "LeaseExpired", 60,
                 f"{there}'s Lease to expire")
        kept = c.vm("roamer")["status"]
        c.lab.start_agent(lh)
        faulty.discard(there)
        assert (kept.get("move") or {}).get("id") == m["id"], kept
        o = ended(c, m["id"])
        last = o["status"]["lastMove"]
        assert (last["result"], last["decision"], o["status"]["host"]) == (
            "ok", "forward", there), last
        runs_once_on(c, there, mac, ip, md5, stream)
        times["destination agent"] = time.monotonic() - t0
    finally:
        numbers = stream.close()
        for name in faulty:
            restart_agent(c, name)
    # One connection all along: every number once and in order.
    assert numbers == list(range(1, len(numbers) + 1)), numbers[-20:]
    print("kill -9 between hosts with a NIC: " + ", ".join(
        f"{k} {v:.1f} s" for k, v in times.items()))


def test_the_source_agent_killed_mid_stream_between_hosts(
        cluster: Cluster, lan: str, tmp_path: Path) -> None:
    """kill -9 of the source's agent while the stream runs, started again at once: the
    move ends one way or the other (back if the new agent decides first, forward if
    the stream, which the source's supervisor carries on, completes first), with the
    same checks. Last in the module: a guest it leaves paused harms no other test."""
    c = cluster
    here, there, ip, mac, md5, stream = on_the_guest(c, lan, tmp_path / "stream.log")
    slow = {FAULT_STREAM_BPS: SLOW}
    try:
        restart_agent(c, here, slow)
        move_to(c, there)
        m = at_phase(c, lambda m: m.get("phase") == "Streaming", "the stream")
        restart_agent(c, here, slow, signal.SIGKILL)
        o = ended(c, m["id"])
        last = o["status"]["lastMove"]
        now = o["status"]["host"]
        assert (last["result"], last["decision"], now) in (
            ("ok", "forward", there), ("failed", "back", here)), (last, now)
        move_to(c, now)
        runs_once_on(c, now, mac, ip, md5, stream)
        print(f"source agent killed mid-stream: {last['decision']} "
              f"({last.get('message') or 'moved'})")
    finally:
        numbers = stream.close()
        restart_agent(c, here)
    assert numbers == list(range(1, len(numbers) + 1)), numbers[-20:]
