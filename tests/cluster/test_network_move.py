"""A network that spans the lab's hosts (FusumaNetwork: a managed network on each host,
a VXLAN between their bridges, only between the hosts' namespaces) and a VM on it that
moves live from h0 to h1 keeping its MAC, its address (allocated cluster-wide: a
FusumaAddress, handed to h1 with it) and an open TCP connection to a client on h2's
bridge (the network's MTU, the veths' 1500 less the VXLAN's 50, on every
bridge, VXLAN port and tap and told to the guest by DHCP, and a bulk TCP transfer of
full-size segments from the guest to that client first); a stopped VM on h1 gets
another address, a static one that is held is refused,
a host cannot free another's, deleting a VM frees its address. One test (the lab and a
guest cost minutes); see conftest.py."""

from __future__ import annotations

import itertools
import json
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from tests.cluster.conftest import Cluster, wait_for

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


def test_a_vm_moves_between_hosts_keeping_its_nic_and_tcp_connection(
        clean: Cluster, tmp_path: Path) -> None:
    c = clean
    lab = c.lab
    for lh, h in zip(lab.hosts, c.hosts, strict=True):
        h.wrap = ["nsenter", f"--net=/run/netns/{lh.netns}", "--"]
    c.apply(yaml.safe_dump({
        "apiVersion": "fusuma.io/v1alpha1", "kind": "FusumaNetwork",
        "metadata": {"name": "lan"},
        "spec": {"subnet": f"{SUBNET}.0/24", "vni": 124, "nat": False}}))
    wait_for(lambda: len([h for h in (lab.get("fusumanetwork", "lan", None).get("status")
                                      or {}).get("hosts") or [] if h.get("ready")]) == 3,
             60, "network lan on the three hosts")
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
    # A client on h2's bridge (a veth into a namespace of its own).
    client = f"fz{lab.tag}-cl"
    subprocess.run(["ip", "netns", "add", client], check=True)
    lab.namespaces.append(client)           # removed (and checked) with the lab
    h2 = lab.hosts[2].netns
    for cmd in (["-n", h2, "link", "add", "cl0", "type", "veth", "peer", "name", "eth0",
                 "netns", client],
                ["-n", h2, "link", "set", "cl0", "master", "fzb-lan", "up"],
                ["-n", client, "addr", "add", f"{CLIENT_IP}/24", "dev", "eth0"],
                ["-n", client, "link", "set", "eth0", "up"],
                ["-n", client, "link", "set", "lo", "up"]):
        subprocess.run(["ip", *cmd], check=True)

    c.apply(yaml.safe_dump({
        "apiVersion": "fusuma.io/v1alpha1", "kind": "FusumaVM",
        "metadata": {"name": "roamer", "namespace": "default"},
        "spec": {"memoryMiB": 192, "vcpus": 1, "host": "h0", "partition": "p0",
                 "nics": [{"network": "lan"}]}}))
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
