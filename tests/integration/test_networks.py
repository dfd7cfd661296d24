"""Real networks with real guests: bridges, taps, nftables and dnsmasq, all inside
network namespaces this module makes (fusuma's own, and an "uplink" one behind a veth
pair, with a server), never in the machine's root namespace. Traffic goes only to
addresses inside those namespaces. The CLI runs under ``nsenter --net`` (``ip netns
exec`` would remount /sys and hide the cgroups); the supervisors, keepers and dnsmasq
it starts inherit the namespace.

Three minimal guests are booted once for the whole module (TCG boots are dear): ``a``
and ``b`` on managed network lan0 (``b`` with a static address), ``c`` on lan1.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import Host, _tear_down

pytestmark = [pytest.mark.integration, pytest.mark.timeout(600)]

LAN0, LAN1 = "10.123.1", "10.123.2"
UP_HOST, UP_PEER = "172.31.250.1", "172.31.250.2"   # fusuma's namespace, the uplink's
MARKER = "fusuma-net-marker"


def ns_run(ns: str, *argv: str, check: bool = True, timeout: float = 30
           ) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["ip", "netns", "exec", ns, *argv], capture_output=True,
                          text=True, timeout=timeout, check=check)


class Net:
    """The module's world: fusuma's namespace, the uplink's, the server there."""

    def __init__(self, tmp: Path) -> None:
        tag = uuid.uuid4().hex[:6]
        self.ns, self.up = f"fusuma-t-{tag}", f"fusuma-t-{tag}-up"
        self.www = tmp / "www"
        self.server: subprocess.Popen[str] | None = None
        self.server_log = tmp / "server.log"

    def make(self) -> None:
        for ns in (self.ns, self.up):
            subprocess.run(["ip", "netns", "add", ns], check=True)
            subprocess.run(["ip", "-n", ns, "link", "set", "lo", "up"], check=True)
        subprocess.run(["ip", "-n", self.ns, "link", "add", "uplink0", "type", "veth",
                        "peer", "name", "down0", "netns", self.up], check=True)
        for ns, dev, ip in ((self.ns, "uplink0", UP_HOST), (self.up, "down0", UP_PEER)):
            subprocess.run(["ip", "-n", ns, "addr", "add", f"{ip}/30", "dev", dev],
                           check=True)
            subprocess.run(["ip", "-n", ns, "link", "set", dev, "up"], check=True)
        # fusuma's uplink; the uplink namespace routes nowhere else.
        subprocess.run(["ip", "-n", self.ns, "route", "add", "default", "via", UP_PEER],
                       check=True)
        self.www.mkdir()
        (self.www / "marker").write_text(MARKER)
        log = open(self.server_log, "w")   # noqa: SIM115 - the server's, closed with it
        self.server = subprocess.Popen(
            ["ip", "netns", "exec", self.up, "python3", "-m", "http.server", "8000",
             "--bind", UP_PEER, "--directory", str(self.www)],
            stdout=log, stderr=log, text=True)

    def remove(self) -> None:
        if self.server is not None:
            self.server.send_signal(signal.SIGTERM)
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.server.wait(5)
            if self.server.poll() is None:
                self.server.kill()
                self.server.wait()
        for ns in (self.ns, self.up):
            subprocess.run(["ip", "netns", "del", ns], check=False)

    def links(self) -> list[dict[str, Any]]:
        out = subprocess.run(["ip", "-n", self.ns, "-j", "-d", "link", "show"],
                             capture_output=True, text=True, check=True).stdout
        return list(json.loads(out))

    def tables(self) -> list[dict[str, Any]]:
        out = ns_run(self.ns, "nft", "-j", "list", "tables").stdout
        return [t["table"] for t in json.loads(out)["nftables"] if "table" in t]

    def drops(self, table: str) -> int:
        """Packets the bridge table's from_vm chain dropped (its counters)."""
        out = ns_run(self.ns, "nft", "-j", "list", "chain", "bridge", table, "from_vm").stdout
        return sum(int(e["counter"]["packets"]) for item in json.loads(out)["nftables"]
                   if "rule" in item for e in item["rule"]["expr"] if "counter" in e)


@pytest.fixture(scope="module")
def world(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Host, Net]]:
    tmp = tmp_path_factory.mktemp("net")
    net = Net(tmp)
    h = Host(tmp)
    h.wrap = ["nsenter", f"--net=/run/netns/{net.ns}", "--"]
    try:
        net.make()
        yield h, net
    finally:
        try:
            _tear_down(h)
            # The kernel's view: nothing fusuma made is left in its namespace.
            left = [link["ifname"] for link in net.links()
                    if link["ifname"].startswith(("fzb-", "fzt-"))]
            left += [t["name"] for t in net.tables() if t["name"].startswith(h.prefix)]
            assert not left, f"left behind after down: {left}"
        finally:
            net.remove()
    assert not any(p.name in (net.ns, net.up) for p in Path("/run/netns").iterdir())


def guest(h: Host, vm: str, script: str, check: bool = True) -> str:
    res = h.run("vm", "exec", vm, "--", "/bin/sh", "-c", script, check=check)
    return res.out


def wait_address(h: Host, vm: str, ip: str, timeout: float = 90) -> None:
    deadline = time.monotonic() + timeout
    out = ""
    while time.monotonic() < deadline:
        res = h.run("vm", "exec", vm, "--", "/bin/sh", "-c", "ip -4 -o addr show eth0",
                    check=False)
        out = res.out
        if f"inet {ip}/24" in out:
            return
        time.sleep(1)
    raise AssertionError(f"{vm} has no lease for {ip} after {timeout} s: {out!r}")


@pytest.fixture(scope="module")
def booted(world: tuple[Host, Net]) -> tuple[Host, Net]:
    h, net = world
    h.run("partition", "create", "p0", "--cpus", "0", "--memory", "1024")
    h.run("network", "create", "lan0", "--subnet", f"{LAN0}.0/24")
    h.run("network", "create", "lan1", "--subnet", f"{LAN1}.0/24")
    h.run("vm", "create", "a", "-p", "p0", "--memory", "128", "--nic", "lan0",
          "--port", "0.0.0.0:8080:80", "--start")
    h.run("vm", "create", "b", "-p", "p0", "--memory", "128", "--nic",
          f"lan0,ip={LAN0}.50", "--start")
    h.run("vm", "create", "c", "-p", "p0", "--memory", "128", "--nic", "lan1", "--start")
    for vm, ip in (("a", f"{LAN0}.2"), ("b", f"{LAN0}.50"), ("c", f"{LAN1}.2")):
        wait_address(h, vm, ip)
    return h, net


def test_kernel_view_bridges_taps_tables_dnsmasq(booted: tuple[Host, Net]) -> None:
    h, net = booted
    links = {link["ifname"]: link for link in net.links()}
    for br in ("fzb-lan0", "fzb-lan1"):
        assert links[br]["linkinfo"]["info_kind"] == "bridge"
    taps = {n: link for n, link in links.items() if n.startswith("fzt-")}
    assert sorted(link["master"] for link in taps.values()) == [
        "fzb-lan0", "fzb-lan0", "fzb-lan1"]
    assert all(link["linkinfo"]["info_kind"] == "tun" for link in taps.values())
    names = {(t["family"], t["name"]) for t in net.tables()}
    for n in ("lan0", "lan1"):
        assert {("inet", f"{h.prefix}-{n}"), ("bridge", f"{h.prefix}-{n}")} <= names
    shown = h.run("network", "show", "lan0", "--json").json()
    assert shown["state"] == "up" and shown["dnsmasq_pid"]
    assert [(n["vm"], n["ip"]) for n in shown["nics"]] == [("a", f"{LAN0}.2"),
                                                            ("b", f"{LAN0}.50")]
    # QEMU got the tap as a descriptor: its argv names no tun device, and it runs
    # under the VM's uid without capabilities.
    pid = h.vm("a")["pid"]
    argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    assert any(a.startswith(b"tap,id=nic0,fd=") for a in argv), argv
    status = Path(f"/proc/{pid}/status").read_text()
    assert "CapEff:\t0000000000000000" in status
    # It holds the tap (the kernel names the device in the descriptor's fdinfo).
    taps_held = [Path(f"/proc/{pid}/fdinfo/{fd}").read_text()
                 for fd in os.listdir(f"/proc/{pid}/fd")]
    assert any("iff:\tfzt-" in info for info in taps_held)


def test_same_network_pings_gateway_and_nat(booted: tuple[Host, Net]) -> None:
    h, net = booted
    guest(h, "a", f"ping -c 2 -W 3 {LAN0}.50 && ping -c 1 -W 3 {LAN0}.1")
    guest(h, "b", f"ping -c 2 -W 3 {LAN0}.2")
    # busybox nc (its static wget crashes resolving even a literal address).
    got = guest(h, "a", "printf 'GET /marker HTTP/1.0\\r\\n\\r\\n' | "
                        f"nc -w 5 {UP_PEER} 8000")
    assert got.startswith("HTTP/1.0 200") and got.rstrip().endswith(MARKER), got
    # The server saw the host's uplink address: NAT, not the guest's own.
    assert f"{UP_HOST} - -" in net.server_log.read_text()
    assert f"{LAN0}.2" not in net.server_log.read_text()


def test_other_network_cannot_reach(booted: tuple[Host, Net]) -> None:
    h, _ = booted
    guest(h, "c", f"ping -c 1 -W 3 {LAN1}.1")           # its own gateway: yes
    res = h.run("vm", "exec", "c", "--", "/bin/sh", "-c",
                f"ping -c 2 -W 2 {LAN0}.2", check=False)
    assert res.code != 0, res.out
    res = h.run("vm", "exec", "a", "--", "/bin/sh", "-c",
                f"ping -c 2 -W 2 {LAN1}.2", check=False)
    assert res.code != 0, res.out


def test_spoofed_ip_and_mac_are_dropped(booted: tuple[Host, Net]) -> None:
    h, net = booted
    table = f"{h.prefix}-lan0"
    before = net.drops(table)
    res = h.run("vm", "exec", "a", "--", "/bin/sh", "-c",
                f"ip addr add {LAN0}.77/24 dev eth0 && "
                f"ping -c 2 -W 2 -I {LAN0}.77 {LAN0}.50; rc=$?; "
                f"ip addr del {LAN0}.77/24 dev eth0; exit $rc", check=False)
    assert res.code != 0, res.out
    after_ip = net.drops(table)
    assert after_ip > before
    mac = h.run("network", "show", "lan0", "--json").json()["nics"][0]["mac"]
    res = h.run("vm", "exec", "a", "--", "/bin/sh", "-c",
                "ip link set eth0 down; ip link set eth0 address 52:54:00:de:ad:01; "
                f"ip link set eth0 up; ping -c 2 -W 2 {LAN0}.50; rc=$?; "
                f"ip link set eth0 down; ip link set eth0 address {mac}; "
                f"ip link set eth0 up; ip route replace default via {LAN0}.1; exit $rc",
                check=False)
    assert res.code != 0, res.out
    assert net.drops(table) > after_ip
    # Its own MAC and address pass again: the drops were the spoofing's.
    guest(h, "a", f"ping -c 2 -W 3 {LAN0}.50")


def test_port_forward_from_uplink_and_loopback(booted: tuple[Host, Net]) -> None:
    h, net = booted
    guest(h, "a", f"mkdir -p /tmp/www && echo {MARKER}-a > /tmp/www/index.html && "
                  "httpd -p 80 -h /tmp/www")
    got = ns_run(net.up, "curl", "-s", "--max-time", "5",
                 f"http://{UP_HOST}:8080/").stdout
    assert got.strip() == f"{MARKER}-a"
    got = subprocess.run([*h.wrap, "curl", "-s", "--max-time", "5",
                          "http://127.0.0.1:8080/"], capture_output=True, text=True,
                         timeout=30).stdout
    assert got.strip() == f"{MARKER}-a"


def test_killed_dnsmasq_comes_back_with_its_leases(booted: tuple[Host, Net]) -> None:
    h, _ = booted
    before = h.run("network", "show", "lan0", "--json").json()
    leases = h.home / "networks" / "lan0" / "leases"
    assert f"{LAN0}.50" in leases.read_text()
    os.kill(before["dnsmasq_pid"], signal.SIGKILL)
    deadline = time.monotonic() + 15
    now = before
    while time.monotonic() < deadline:
        now = h.run("network", "show", "lan0", "--json").json()
        if now["dnsmasq_pid"] and now["dnsmasq_pid"] != before["dnsmasq_pid"]:
            break
        time.sleep(0.2)
    assert now["dnsmasq_pid"] not in (None, before["dnsmasq_pid"]), now
    assert now["keeper_pid"] == before["keeper_pid"] and now["state"] == "up"
    text = leases.read_text()
    assert f"{LAN0}.50" in text and f"{LAN0}.2 " in text
    # The new one answers: b renews its lease (udhcpc's SIGUSR1) and keeps its address.
    guest(h, "b", "kill -USR1 $(pidof udhcpc) && sleep 2 && ip -4 -o addr show eth0")
    wait_address(h, "b", f"{LAN0}.50", timeout=20)


def test_refusals_name_what_is_wrong(booted: tuple[Host, Net]) -> None:
    h, _ = booted
    res = h.fail("network", "delete", "lan0")
    assert "used by VM(s) a, b" in res.err
    res = h.fail("vm", "create", "d", "-p", "p0", "--nic", f"lan0,ip={LAN0}.50")
    assert f"{LAN0}.50 is already VM b's" in res.err
    res = h.fail("migrate", "a", "--to", "p0")
    assert "already in partition 'p0'" in res.err
    res = h.fail("network", "create", "lan2", "--subnet", f"{LAN0}.128/25")
    assert "overlaps network lan0's" in res.err
    res = h.fail("network", "create", "ext", "--type", "bridged", "--parent", "br9")
    assert "parent bridge 'br9' does not exist" in res.err
    assert h.run("vm", "list", "--json").json().__len__() == 3
    assert [n["name"] for n in h.run("network", "list", "--json").json()] == ["lan0", "lan1"]


def test_up_brings_back_and_makes_what_the_spec_names(booted: tuple[Host, Net],
                                                     tmp_path: Path) -> None:
    h, net = booted
    lan1 = h.run("network", "show", "lan1", "--json").json()
    # What a reboot leaves of lan1: no keeper, no dnsmasq, no tables.
    os.kill(lan1["keeper_pid"], signal.SIGKILL)
    os.kill(lan1["dnsmasq_pid"], signal.SIGKILL)
    for family in ("inet", "bridge"):
        ns_run(net.ns, "nft", "delete", "table", family, f"{h.prefix}-lan1")
    deadline = time.monotonic() + 10
    while h.run("network", "show", "lan1", "--json").json()["state"] != "no-dhcp":
        assert time.monotonic() < deadline
        time.sleep(0.2)
    spec = tmp_path / "spec.toml"
    spec.write_text(f"""
[[network]]
name = "lan0"
subnet = "{LAN0}.0/24"

[[network]]
name = "lan1"
subnet = "{LAN1}.0/24"

[[network]]
name = "lan2"
subnet = "10.123.3.0/24"
isolated = true

[[partition]]
name = "p0"
cpus = "0"
memory_mib = 1024

[[vm]]
name = "c"
partition = "p0"
memory_mib = 128
nics = [{{ network = "lan1" }}]
""")
    out = h.run("up", str(spec)).out + h.run("up", str(spec)).out
    shown = {n["name"]: n for n in h.run("network", "list", "--json").json()}
    assert [shown[n]["state"] for n in ("lan0", "lan1", "lan2")] == ["up"] * 3, (out, shown)
    assert shown["lan2"]["isolated"] and shown["lan1"]["dnsmasq_pid"] != lan1["dnsmasq_pid"]
    names = {(t["family"], t["name"]) for t in net.tables()}
    assert ("bridge", f"{h.prefix}-lan1") in names and ("inet", f"{h.prefix}-lan2") in names
    # c's lease is still served: it renews and keeps its address.
    guest(h, "c", "kill -USR1 $(pidof udhcpc)")
    wait_address(h, "c", f"{LAN1}.2", timeout=20)
    guest(h, "c", f"ping -c 1 -W 3 {LAN1}.1")
    h.run("network", "delete", "lan2")
