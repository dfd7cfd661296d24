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

from fusuma.network.keeper import FAULT_DNSMASQ_DELAY
from tests import netns
from tests.apikit import Api
from tests.conftest import FUSUMA, Host, _tear_down, core

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
            netns.add(ns)
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
            netns.delete(ns)

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
    h.wrap = netns.wrap(net.ns)
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
    h.run("partition", "create", "p0", "--cpus", h.core(0), "--memory", "1024")
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


def spec_text(more: str = "") -> str:
    """A spec naming lan0, lan1 (and ``more``), p0 and c on lan1."""
    return f"""
[[network]]
name = "lan0"
subnet = "{LAN0}.0/24"

[[network]]
name = "lan1"
subnet = "{LAN1}.0/24"
{more}
[[partition]]
name = "p0"
cpus = "{core(0)}"
memory_mib = 1024

[[vm]]
name = "c"
partition = "p0"
memory_mib = 128
nics = [{{ network = "lan1" }}]
"""


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
    spec.write_text(spec_text('''
[[network]]
name = "lan2"
subnet = "10.123.3.0/24"
isolated = true
'''))
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


# -- template clones (before the reboot and down below: they need lan0 as made) ----------
def test_template_clones_get_nics_of_their_own(booted: tuple[Host, Net]) -> None:
    """A template made from a VM on lan0; two clones of it, each with a MAC, an address
    and a tap of its own, which they ping each other through (and the gateway)."""
    h, net = booted
    h.run("partition", "create", "p10", "--cpus", h.core(1), "--memory", "1024", "--qemu", "10.0")
    h.run("vm", "create", "t0", "-p", "p10", "--memory", "192", "--nic", "lan0", "--start")
    t0 = {n["vm"]: n for n in h.run("network", "show", "lan0", "--json").json()["nics"]}["t0"]
    wait_address(h, "t0", t0["ip"])
    shown = h.run("template", "create", "tn", "--from", "t0", "--json").json()
    assert shown["networks"] == ["lan0"] and shown["network"]
    try:
        for c in ("k1", "k2"):
            h.run("vm", "create", c, "-p", "p10", "--template", "tn", "--start")
        nics = {n["vm"]: n for n in h.run("network", "show", "lan0", "--json").json()["nics"]}
        k1, k2 = nics["k1"], nics["k2"]
        assert len({t0["mac"], k1["mac"], k2["mac"]}) == 3
        assert len({t0["ip"], k1["ip"], k2["ip"]}) == 3
        for c, n in (("k1", k1), ("k2", k2)):
            # The guest has its record's MAC and address (the identity step, done
            # before the first exec), its hostname, and dnsmasq leased it that address.
            got = guest(h, c, "hostname; cat /sys/class/net/eth0/address; "
                              "ip -4 -o addr show eth0").split()
            assert got[:2] == [c, n["mac"]] and f"{n['ip']}/24" in got, got
        leases = (h.home / "networks" / "lan0" / "leases").read_text()
        for n in (k1, k2):
            assert f"{n['mac']} {n['ip']} " in leases, leases
        # Each its own tap (the kernel's view), a port of lan0's bridge.
        taps = {link["ifname"]: link for link in net.links()
                if link["ifname"].startswith("fzt-")}
        for c in ("k1", "k2"):
            pid = h.vm(c)["pid"]
            held = _taps_of(pid)
            assert len(held) == 1 and taps[held.pop()]["master"] == "fzb-lan0"
        guest(h, "k1", f"ping -c 2 -W 3 {k2['ip']} && ping -c 1 -W 3 {LAN0}.1")
        guest(h, "k2", f"ping -c 2 -W 3 {k1['ip']}")
        res = h.fail("network", "delete", "lan0")
        assert "used by VM(s)" in res.err
    finally:
        for c in ("k1", "k2"):
            h.run("vm", "delete", c, "--force", check=False)
        h.run("template", "delete", "tn", check=False)
        h.run("vm", "delete", "t0", "--force", check=False)
        h.run("partition", "delete", "p10", check=False)


# -- shown everywhere ----------------------------------------------------------------
def _kernel_taps(net: Net) -> set[str]:
    return {link["ifname"] for link in net.links() if link["ifname"].startswith("fzt-")}


def test_ps_vm_show_and_network_list_show_each_nic(booted: tuple[Host, Net]) -> None:
    h, net = booted
    taps = _kernel_taps(net)
    ps = h.ps()
    nics = {v["name"]: v["nics"] for v in ps["vms"]}
    assert [(n["network"], n["ip"]) for n in nics["b"]] == [("lan0", f"{LAN0}.50")]
    assert [n["network"] for n in nics["c"]] == ["lan1"]
    for vm in ("a", "b", "c"):
        (nic,) = nics[vm]
        # The tap ps names is the one the kernel has, and it says so.
        assert nic["tap"] in taps and nic["tap_present"], (vm, nic, taps)
        assert nic["mac"].startswith("52:54:00:")
    assert {n["name"]: n["vms"] for n in ps["networks"]} == {"lan0": ["a", "b"],
                                                            "lan1": ["c"]}
    assert {n["bridge"] for n in ps["networks"]} == {"fzb-lan0", "fzb-lan1"}
    shown = h.run("vm", "show", "b", "--json").json()
    assert shown["nics"] == nics["b"] and shown["state"] == "running"
    text = h.run("vm", "show", "b").out
    assert f"{LAN0}.50" in text and nics["b"][0]["tap"] in text
    text = h.run("ps").out
    assert "fzb-lan0" in text and nics["a"][0]["mac"] in text
    lst = {n["name"]: n for n in h.run("network", "list", "--json").json()}
    assert [(n["vm"], n["tap"]) for n in lst["lan1"]["nics"]] == [("c", nics["c"][0]["tap"])]
    # The API's models carry them (each response is checked against its model) and the
    # dashboard's state has them.
    api = Api(h)
    try:
        with api.unix() as c:
            assert c.get("/1.0/vms/b").json()["nics"] == nics["b"]
            got = c.get("/1.0/ps").json()
            assert {v["name"]: v["nics"] for v in got["vms"]} == nics
            assert {n["name"]: n["vms"] for n in got["networks"]} == {"lan0": ["a", "b"],
                                                                     "lan1": ["c"]}
            assert c.get("/1.0/networks/lan1").json()["nics"] == lst["lan1"]["nics"]
            ui = c.get("/1.0/ui/state").json()
            assert [n["name"] for n in ui["networks"]] == ["lan0", "lan1"]
            assert {v["name"]: v["nics"] for v in ui["vms"]} == nics
    finally:
        api.stop()


def test_dashboard_shows_nics_and_networks(booted: tuple[Host, Net], tmp_path: Path) -> None:
    from playwright.sync_api import expect, sync_playwright

    from tests.integration.test_dashboard import (
        ARGS,
        CHROMIUM,
        PHONE,
        WIDE,
        Console,
        login,
        no_overflow,
    )

    h, net = booted
    token = h.run("token", "create", "nics", "--role", "viewer", "--json").json()["token"]
    # The browser joins the daemon in the test's network namespace (Playwright drives
    # it through pipes, which the namespace does not touch).
    browser_in_ns = tmp_path / "chromium"
    browser_in_ns.write_text(f'#!/bin/sh\nexec nsenter --net=/run/netns/{net.ns} -- '
                             f'{CHROMIUM} "$@"\n')
    browser_in_ns.chmod(0o755)
    mac_b = h.vm("b")["nics"][0]["mac"]
    api = Api(h, listen=True)
    try:
        assert api.url
        with sync_playwright() as p:
            browser = p.chromium.launch(executable_path=str(browser_in_ns), headless=True,
                                        args=ARGS)
            try:
                page = browser.new_context(ignore_https_errors=True, viewport=WIDE).new_page()
                console = Console(page)
                login(page, api.url, token)
                lan0 = page.locator('#networks tr[data-network="lan0"]')
                expect(lan0).to_contain_text("fzb-lan0")
                expect(lan0).to_contain_text(f"{LAN0}.0/24")
                expect(lan0.locator('[data-nic="b/0"]')).to_contain_text(f"{LAN0}.50")
                expect(page.locator('#networks tr[data-network="lan1"]')).to_contain_text("c")
                nic = page.locator('#vms tr[data-vm="b"] [data-nic="lan0/0"]')
                expect(nic).to_contain_text(f"{LAN0}.50")
                expect(nic).to_contain_text(mac_b)
                for size in (WIDE, PHONE):
                    page.set_viewport_size(size)
                    page.wait_for_timeout(200)
                    no_overflow(page)
                assert console.errors == [], console.errors
            finally:
                browser.close()
    finally:
        api.stop()
        h.run("token", "revoke", "nics", check=False)


# -- bad input: one sentence, nothing made -----------------------------------------------
def _state(h: Host, net: Net) -> tuple[Any, ...]:
    return (sorted(link["ifname"] for link in net.links()),
            sorted(t["name"] for t in net.tables()),
            [n["name"] for n in h.run("network", "list", "--json").json()],
            [v["name"] for v in h.run("vm", "list", "--json").json()])


def test_bad_input_is_one_sentence_and_makes_nothing(booted: tuple[Host, Net],
                                                      tmp_path: Path) -> None:
    h, net = booted
    before = _state(h, net)
    # The uplink's own route (172.31.250.0/30 on uplink0).
    res = h.fail("network", "create", "lan5", "--subnet", "172.31.250.0/24")
    assert "host's route to 172.31.250.0/30 (dev uplink0)" in res.err, res.err
    mac = h.vm("a")["nics"][0]["mac"]
    res = h.fail("vm", "create", "d", "-p", "p0", "--nic", f"lan1,mac={mac}")
    assert f"MAC {mac} is already VM a's NIC" in res.err, res.err
    res = h.fail("vm", "create", "d", "-p", "p0", "--nic", "lan0,ip=10.99.0.5")
    assert f"address 10.99.0.5 is outside the network's subnet {LAN0}.0/24" in res.err
    # nft missing: a PATH without /usr/sbin.
    env = {**h.env, "PATH": "/usr/local/bin:/usr/bin:/bin"}
    p = subprocess.run([*h.wrap, *FUSUMA, "network", "create", "lan5"], env=env,
                       capture_output=True, text=True, timeout=60)
    assert p.returncode != 0 and "nftables is missing (the `nft` command)" in p.stderr, p
    # dnsmasq missing: an empty, non-executable file over it, in a mount namespace of
    # this one command's own.
    empty = tmp_path / "empty"
    empty.write_text("")
    p = subprocess.run(["unshare", "-m", "--propagation", "private", "sh", "-c",
                        f"mount --bind {empty} /usr/sbin/dnsmasq && exec \"$@\"", "sh",
                        *h.wrap, *FUSUMA, "network", "create", "lan5"], env=h.env,
                       capture_output=True, text=True, timeout=60)
    assert p.returncode != 0 and "dnsmasq is missing; install it" in p.stderr, p
    res = h.fail("vm", "create", "d", "-p", "p0", "--nic", "lan0,mac=01:00:5e:00:00:01")
    assert "is a multicast address" in res.err
    assert _state(h, net) == before


# -- kills ------------------------------------------------------------------------------
def _cmdline(pid: int) -> bytes:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return b""


def _held_taps(h: Host) -> dict[str, int]:
    """Each tap a QEMU of this namespace holds a descriptor of (its fdinfo's ``iff:``),
    and that QEMU's pid."""
    held: dict[str, int] = {}
    for pid in h.our_pids():
        try:
            if b"qemu-system" not in _cmdline(pid):
                continue
            fds = os.listdir(f"/proc/{pid}/fd")
        except OSError:
            continue
        for tap in _taps_of(pid, fds):
            held[tap] = pid
    return held


def _taps_of(pid: int, fds: list[str] | None = None) -> set[str]:
    """The taps QEMU ``pid`` holds a queue of (its descriptors' ``iff:`` lines)."""
    out = set()
    for fd in os.listdir(f"/proc/{pid}/fd") if fds is None else fds:
        with contextlib.suppress(OSError):
            for line in Path(f"/proc/{pid}/fdinfo/{fd}").read_text().splitlines():
                if line.startswith("iff:\tfzt-"):
                    out.add(line.split("\t", 1)[1].strip())
    return out


def _settled(h: Host, vm: str, timeout: float = 30) -> dict[str, Any] | None:
    """VM ``vm`` as ps shows it once no start is under way (None: not defined)."""
    deadline = time.monotonic() + timeout
    while True:
        v = next((x for x in h.ps()["vms"] if x["name"] == vm), None)
        if v is None or (v["state"] != "starting" and not v["job"]) or \
                time.monotonic() > deadline:
            return v
        time.sleep(0.2)


def _truthful(h: Host, net: Net, vm: str) -> None:
    """ps says of ``vm`` what the kernel and /proc say, and every tap in the namespace
    is held by a live QEMU of this namespace (no tap leftover)."""
    v = _settled(h, vm)
    held = _held_taps(h)
    assert _kernel_taps(net) == set(held), (_kernel_taps(net), held)
    if v is None:
        return
    (nic,) = v["nics"]
    if v["state"] == "running":
        assert v["pid"] and held.get(nic["tap"]) == v["pid"] and nic["tap_present"], v
    else:
        assert v["pid"] is None and nic["tap"] not in held and not nic["tap_present"], v


def test_kill9_during_create_and_start_of_a_nic_vm(booted: tuple[Host, Net]) -> None:
    h, net = booted
    argv = [*h.wrap, *FUSUMA, "vm", "create", "d", "-p", "p0", "--memory", "128",
            "--nic", "lan0", "--start"]
    for delay in (0.4, 1.0, 2.0):
        p = subprocess.Popen(argv, env=h.env, stdout=subprocess.DEVNULL,
                             stderr=subprocess.DEVNULL)
        time.sleep(delay)
        p.kill()
        p.wait()
        _truthful(h, net, "d")
        h.run("vm", "delete", "d", "--force", check=False)
        _truthful(h, net, "d")
    # The supervisor killed once it made d's tap (before or while QEMU takes it).
    h.run("vm", "create", "d", "-p", "p0", "--memory", "128", "--nic", "lan0")
    tap = h.run("vm", "show", "d", "--json").json()["nics"][0]["tap"]
    sup = h.part("p0")["supervisor_pid"]
    p = subprocess.Popen([*h.wrap, *FUSUMA, "vm", "start", "d"], env=h.env,
                         stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 30
    while tap not in _kernel_taps(net) and time.monotonic() < deadline:
        time.sleep(0.01)
    os.kill(sup, signal.SIGKILL)
    p.wait(60)
    h.run("partition", "restart", "p0")
    _truthful(h, net, "d")
    # The guests that ran before still run, with their taps.
    for vm in ("a", "b", "c"):
        assert h.vm(vm)["state"] == "running" and h.vm(vm)["nics"][0]["tap_present"]
    h.run("vm", "delete", "d", "--force")
    _truthful(h, net, "d")
    assert "fzb-lan0" in {link["ifname"] for link in net.links()}


def test_keeper_and_cli_killed_between_bridge_and_dnsmasq(booted: tuple[Host, Net],
                                                          tmp_path: Path) -> None:
    h, net = booted
    # The keeper waits before it starts dnsmasq (a fault hook): the kills below land
    # between the bridge and dnsmasq however quickly the keeper starts.
    p = subprocess.Popen([*h.wrap, *FUSUMA, "network", "create", "lan3", "--subnet",
                          "10.123.4.0/24"], env={**h.env, FAULT_DNSMASQ_DELAY: "60"},
                         stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 30
    keeper = None
    while keeper is None and time.monotonic() < deadline:
        keeper = next((pid for pid in h.our_pids() if b"keeper\0lan3" in _cmdline(pid)),
                      None)
        time.sleep(0.005)
    # Both die before dnsmasq runs: what a crash of the host's fusuma leaves.
    p.kill()
    assert keeper is not None
    os.kill(keeper, signal.SIGKILL)
    p.wait()
    time.sleep(0.3)
    assert not any(b"lan3/dnsmasq.conf" in _cmdline(pid) for pid in h.our_pids())
    shown = {n["name"]: n for n in h.run("network", "list", "--json").json()}
    assert shown["lan3"]["state"] in ("no-dhcp", "down"), shown["lan3"]
    # The next `up` completes it.
    spec = tmp_path / "spec.toml"
    spec.write_text('[[network]]\nname = "lan3"\nsubnet = "10.123.4.0/24"\n')
    out = h.run("up", str(spec)).out
    st = h.run("network", "show", "lan3", "--json").json()
    assert st["state"] == "up" and st["dnsmasq_pid"], (out, st)
    assert ("bridge", f"{h.prefix}-lan3") in {(t["family"], t["name"]) for t in net.tables()}
    h.run("network", "delete", "lan3")
    assert "fzb-lan3" not in {link["ifname"] for link in net.links()}


# -- a reboot, then down ------------------------------------------------------------------
def test_up_after_a_reboot_makes_what_the_spec_names(booted: tuple[Host, Net],
                                                     tmp_path: Path) -> None:
    h, net = booted
    # What a reboot leaves of fusuma in the kernel: nothing. No QEMU, supervisor, keeper
    # or dnsmasq (their taps go with the QEMUs), no bridge, no nftables table.
    for pid in h.our_pids():
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    deadline = time.monotonic() + 10
    while h.our_pids() and time.monotonic() < deadline:
        time.sleep(0.1)
    for br in ("fzb-lan0", "fzb-lan1"):
        subprocess.run(["ip", "-n", net.ns, "link", "del", br], check=True)
    for t in net.tables():
        if t["name"].startswith(h.prefix):
            ns_run(net.ns, "nft", "delete", "table", t["family"], t["name"])
    assert not _kernel_taps(net)
    ps = h.ps()
    assert {v["name"]: v["state"] for v in ps["vms"]} == {"a": "crashed", "b": "crashed",
                                                          "c": "crashed"}
    assert not any(n["tap_present"] for v in ps["vms"] for n in v["nics"])
    assert {n["name"]: n["state"] for n in ps["networks"]} == {"lan0": "down",
                                                              "lan1": "down"}
    spec = tmp_path / "spec.toml"
    spec.write_text(spec_text())
    out = h.run("up", str(spec)).out
    shown = {n["name"]: n for n in h.run("network", "list", "--json").json()}
    assert [shown[n]["state"] for n in ("lan0", "lan1")] == ["up", "up"], (out, shown)
    names = {(t["family"], t["name"]) for t in net.tables()}
    for n in ("lan0", "lan1"):
        assert {("inet", f"{h.prefix}-{n}"), ("bridge", f"{h.prefix}-{n}")} <= names
    wait_address(h, "c", f"{LAN1}.2", timeout=60)
    guest(h, "c", f"ping -c 1 -W 3 {LAN1}.1")
    for vm in ("a", "b", "c"):
        _truthful(h, net, vm)
    assert h.vm("c")["state"] == "running" and h.vm("a")["state"] == "crashed"


def test_down_removes_what_it_made_and_nothing_else(booted: tuple[Host, Net],
                                                    tmp_path: Path) -> None:
    h, net = booted
    # Another's objects in the same namespace: a bridge, a bridge of another fusuma's
    # name, tables of another prefix, and a dnsmasq of someone else's.
    for br in ("br-keep", "fzb-other"):
        subprocess.run(["ip", "-n", net.ns, "link", "add", br, "type", "bridge"],
                       check=True)
    ns_run(net.ns, "nft", "add", "table", "inet", "fusuma-other-lan0")
    ns_run(net.ns, "nft", "add", "table", "bridge", f"{h.prefix}x-lan0")
    other = subprocess.Popen([*h.wrap, "dnsmasq", "-k", "--conf-file=/dev/null", "-p", "0",
                              f"--pid-file={tmp_path / 'other.pid'}"],
                             stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        mine = h.run("network", "list", "--json").json()
        dnsmasqs = [n["dnsmasq_pid"] for n in mine]
        assert all(dnsmasqs)
        h.run("down")
        links = {link["ifname"] for link in net.links()}
        assert not {n for n in links if n.startswith("fzt-")}
        assert not {"fzb-lan0", "fzb-lan1"} & links
        assert {"br-keep", "fzb-other"} <= links
        tables = {(t["family"], t["name"]) for t in net.tables()}
        assert not {t for t in tables if t[1].startswith(f"{h.prefix}-")}, tables
        assert {("inet", "fusuma-other-lan0"), ("bridge", f"{h.prefix}x-lan0")} <= tables
        assert not h.our_pids()
        assert not any(Path(f"/proc/{pid}").exists() for pid in dnsmasqs)
        assert other.poll() is None, "down ended a dnsmasq that is not fusuma's"
    finally:
        other.kill()
        other.wait()
        for br in ("br-keep", "fzb-other"):
            subprocess.run(["ip", "-n", net.ns, "link", "del", br], check=False)
        ns_run(net.ns, "nft", "delete", "table", "inet", "fusuma-other-lan0", check=False)
        ns_run(net.ns, "nft", "delete", "table", "bridge", f"{h.prefix}x-lan0", check=False)
