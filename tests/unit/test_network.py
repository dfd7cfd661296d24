"""fusuma.network's pure parts, tested as data without a kernel: names, addresses,
MACs, the nftables tables, dnsmasq's configuration, the NIC argv, the records."""

from __future__ import annotations

import random
import sqlite3
from pathlib import Path

import pytest

from fusuma.errors import ConflictError, NotFoundError, SpecError, StateError
from fusuma.network import addr, dnsmasq, ifnames, nft
from fusuma.network.manager import NetworkManager, NicRequest, parse_nic
from fusuma.paths import Paths
from fusuma.qemu.cmdline import NicConfig, build_argv, device_set
from fusuma.spec import dump_spec, parse_spec
from fusuma.state import Database, NetworkRecord, NicRecord, PartitionRecord, VmRecord
from tests.unit.test_cmdline import cfg, opt

# -- names ---------------------------------------------------------------------------


def test_bridge_and_tap_names_fit_and_differ() -> None:
    assert ifnames.bridge_name("lan0") == "fzb-lan0"
    long_a = ifnames.bridge_name("production-frontend")
    long_b = ifnames.bridge_name("production-frontdoor")
    assert len(long_a) <= 15 and len(long_b) <= 15 and long_a != long_b
    assert long_a.startswith("fzb-produc")
    assert ifnames.tap_name(3, 0) == "fzt-3-0"
    assert len(ifnames.tap_name(9_999_999 - 1, 99)) <= 15
    with pytest.raises(ValueError):
        ifnames.tap_name(0, 0)
    assert ifnames.table_name("fusuma", "lan0") == "fusuma-lan0"


# -- addresses -----------------------------------------------------------------------


def test_subnet_parsing_and_gateway() -> None:
    s = addr.parse_subnet("10.0.5.0/24")
    assert (str(s.gateway), s.gateway_cidr()) == ("10.0.5.1", "10.0.5.1/24")
    for bad, why in (("10.0.5.1/24", "not an IPv4 network"), ("nope", "not an IPv4"),
                     ("10.0.0.0/8", "prefix /8"), ("8.8.8.0/24", "not a private"),
                     ("10.0.5.0/30", "prefix /30")):
        with pytest.raises(SpecError, match=why):
            addr.parse_subnet(bad)


def test_overlap_with_routes_and_other_networks() -> None:
    s = addr.parse_subnet("10.0.5.0/24")
    routes = [addr.Route(addr.ipaddress.IPv4Network("192.168.1.0/24"), "eth0")]
    addr.check_overlap(s, routes, [("other", "10.0.6.0/24")])
    with pytest.raises(ConflictError, match=r"host's route to 10.0.0.0/16 \(dev eth1\)"):
        addr.check_overlap(s, [addr.Route(addr.ipaddress.IPv4Network("10.0.0.0/16"),
                                          "eth1")])
    with pytest.raises(ConflictError, match=r"overlaps network lan0's 10\.0\.5\.128/25"):
        addr.check_overlap(s, [], [("lan0", "10.0.5.128/25")])


def test_macs_generated_once_unique_and_checked() -> None:
    rng = random.Random(7)
    first = addr.new_mac([], rng)
    assert first.startswith("52:54:00:") and addr.MAC_RE.match(first)
    again = addr.new_mac([first], random.Random(7))
    assert again != first
    assert addr.check_mac("52-54-00-AA-bb-01") == "52:54:00:aa:bb:01"
    for bad, why in (("01:00:5e:00:00:01", "multicast"), ("zz", "not an Ethernet"),
                     ("52:54:00:12:34:56", "reserved")):
        with pytest.raises(SpecError, match=why):
            addr.check_mac(bad)


def test_addresses_inside_the_subnet_and_free() -> None:
    s = addr.parse_subnet("10.0.5.0/29")
    assert addr.allocate_ip(s, []) == "10.0.5.2"
    assert addr.allocate_ip(s, ["10.0.5.2", "10.0.5.3"]) == "10.0.5.4"
    assert addr.check_ip(s, "10.0.5.6", {"10.0.5.2": "a"}) == "10.0.5.6"
    with pytest.raises(SpecError, match=r"outside the network's subnet 10\.0\.5\.0/29"):
        addr.check_ip(s, "10.0.6.2", {})
    with pytest.raises(SpecError, match="gateway"):
        addr.check_ip(s, "10.0.5.1", {})
    with pytest.raises(ConflictError, match="already VM a's"):
        addr.check_ip(s, "10.0.5.2", {"10.0.5.2": "a"})
    with pytest.raises(ConflictError, match="no free address"):
        addr.allocate_ip(s, [f"10.0.5.{i}" for i in range(2, 7)])


def test_port_forwards() -> None:
    assert addr.parse_forward("8080:80") == addr.PortForward("127.0.0.1", 8080, 80)
    assert addr.parse_forward("0.0.0.0:8080:80") == addr.PortForward("0.0.0.0", 8080, 80)
    for bad in ("80", "a:1:2", "1.2.3:1:2", "0:80", "8080:70000"):
        with pytest.raises(SpecError, match="ADDR"):
            addr.parse_forward(bad)
    any_ = addr.parse_forward("0.0.0.0:8080:80")
    assert any_.clashes(addr.parse_forward("10.0.0.1:8080:81"))
    assert not addr.parse_forward("10.0.0.2:8080:80").clashes(
        addr.parse_forward("10.0.0.1:8080:80"))
    with pytest.raises(ConflictError, match="already forwarded to VM 'a'"):
        addr.check_forwards([any_], {"a": [addr.parse_forward("8080:1")]})
    with pytest.raises(SpecError, match="not an address of this host"):
        addr.check_forwards([addr.parse_forward("10.9.9.9:1:2")], {}, {"10.0.0.1"})


# -- nftables ------------------------------------------------------------------------

NET = nft.ManagedNet(table="fusuma-lan0", bridge="fzb-lan0", subnet="10.0.5.0/24",
                     nat=True, isolated=False, filtering=True)
PORTS = [nft.Port("fzt-3-0", "52:54:00:00:00:03", "10.0.5.2"),
         nft.Port("fzt-4-0", "52:54:00:00:00:04", "10.0.5.3")]


def chain(t: nft.Table, name: str) -> nft.Chain:
    return next(c for c in t.chains if c.name == name)


def test_inet_table_nat_forwards_and_separation() -> None:
    inet, bridge = nft.network_tables(NET, PORTS, [
        nft.Forward("0.0.0.0", 8080, "10.0.5.2", 80),
        nft.Forward("127.0.0.1", 2222, "10.0.5.3", 22)])
    assert (inet.family, inet.name, bridge.family) == ("inet", "fusuma-lan0", "bridge")
    assert chain(inet, "postrouting").rules[0] == (
        'ip saddr 10.0.5.0/24 ip daddr != 10.0.5.0/24 oifname != "fzb-lan0" masquerade')
    assert chain(inet, "prerouting").rules == (
        "fib daddr type local tcp dport 8080 dnat ip to 10.0.5.2:80",
        "ip daddr 127.0.0.1 tcp dport 2222 dnat ip to 10.0.5.3:22")
    assert chain(inet, "output").rules == chain(inet, "prerouting").rules
    fwd = chain(inet, "forward")
    assert fwd.hook == "forward" and fwd.rules == (
        'iifname "fzb-lan0" oifname "fzb-*" oifname != "fzb-lan0" counter drop',
        'oifname "fzb-lan0" iifname "fzb-*" iifname != "fzb-lan0" counter drop')
    assert chain(inet, "guard").rules == (
        'iifname "fzb-lan0" ip daddr 127.0.0.0/8 counter drop',)


def test_isolated_no_nat_no_filtering() -> None:
    n = nft.ManagedNet(table="t", bridge="fzb-x", subnet="10.0.7.0/24", nat=False,
                       isolated=True, filtering=False)
    tables = nft.network_tables(n, PORTS)
    assert [t.family for t in tables] == ["inet"]
    assert 'iifname "fzb-x" oifname "fzb-x" counter drop' in chain(tables[0], "forward").rules
    assert not any("10.0.7.0/24" in r for r in chain(tables[0], "postrouting").rules)


def test_bridge_table_allows_only_each_nics_own_mac_and_address() -> None:
    t = nft.bridge_table(NET, PORTS)
    sets = {s.name: s for s in t.sets}
    assert sets["ports"].elements == ('"fzt-3-0"', '"fzt-4-0"')
    assert sets["macs"].elements == ('"fzt-3-0" . 52:54:00:00:00:03',
                                     '"fzt-4-0" . 52:54:00:00:00:04')
    assert sets["ips"].elements == ('"fzt-3-0" . 10.0.5.2', '"fzt-4-0" . 10.0.5.3')
    rules = chain(t, "from_vm").rules
    assert rules[0] == "iifname . ether saddr != @macs counter drop"
    assert rules[-1] == "counter drop"
    dhcp = [r for r in rules if "udp dport 67" in r]
    assert dhcp and "ip saddr 0.0.0.0" in dhcp[0]
    assert chain(t, "prerouting").rules == ("iifname @ports jump from_vm",)
    text = t.render()
    assert text.startswith("table bridge fusuma-lan0 {") and "set ips {" in text
    empty = nft.bridge_table(NET, []).render()
    assert "elements" not in empty


def test_replace_script_swaps_whole_tables() -> None:
    script = nft.replace_script(nft.network_tables(NET, PORTS))
    lines = script.splitlines()
    assert lines[:2] == ["table inet fusuma-lan0", "delete table inet fusuma-lan0"]
    assert "table bridge fusuma-lan0" in lines and "delete table bridge fusuma-lan0" in lines


# -- dnsmasq -------------------------------------------------------------------------

FILES = dnsmasq.Files(conf=Path("/run/n/dnsmasq.conf"), hosts=Path("/run/n/hosts"),
                      leases=Path("/home/n/leases"), pid=Path("/run/n/dnsmasq.pid"))


def test_dnsmasq_configuration_is_its_own(monkeypatch: pytest.MonkeyPatch) -> None:
    lines = dnsmasq.config("fzb-lan0", "10.0.5.0/24", "10.0.5.1", "lan0", FILES, "dnsmasq")
    conf = dict(lines)
    assert ("interface", "fzb-lan0") in lines and ("except-interface", "lo") in lines
    assert "bind-interfaces" in conf and "no-hosts" in conf and "keep-in-foreground" in conf
    assert conf["listen-address"] == "10.0.5.1"
    assert conf["dhcp-range"] == "10.0.5.0,static,255.255.255.0,1h"
    assert conf["dhcp-leasefile"] == "/home/n/leases"
    assert conf["dhcp-hostsfile"] == "/run/n/hosts" and conf["pid-file"] == "/run/n/dnsmasq.pid"
    text = dnsmasq.render_config(lines)
    assert "bind-interfaces\n" in text and "interface=fzb-lan0\n" in text
    monkeypatch.setattr(dnsmasq, "binary", lambda: "/usr/sbin/dnsmasq")
    assert dnsmasq.argv(FILES) == ["/usr/sbin/dnsmasq", "--conf-file=/run/n/dnsmasq.conf"]
    # Ethernet's MTU: the guests are not told anything.
    assert "dhcp-option-force" not in conf


def test_dnsmasq_tells_the_guests_an_mtu_that_is_not_1500() -> None:
    for mtu in (1450, 9000):
        lines = dnsmasq.config("fzb-lan0", "10.0.5.0/24", "10.0.5.1", "lan0", FILES,
                               "dnsmasq", mtu)
        assert ("dhcp-option-force", f"26,{mtu}") in lines
        assert f"dhcp-option-force=26,{mtu}\n" in dnsmasq.render_config(lines)
    lines = dnsmasq.config("fzb-lan0", "10.0.5.0/24", "10.0.5.1", "lan0", FILES,
                           "dnsmasq", 1500)
    assert not [k for k, _ in lines if k.startswith("dhcp-option-force")]


def test_a_spanning_network_s_mtu_fits_the_uplink_after_the_vxlan() -> None:
    from fusuma.network import span

    assert span.span_mtu("eth0", 1500) == 1450
    assert span.span_mtu("eth0", 1550) == 1500
    assert span.span_mtu("eth0", 9216) == 9000        # no more than a network can have
    assert span.span_mtu("eth0", 1500, 1400) == 1400
    assert span.span_mtu("eth0", 1500, 1450) == 1450
    with pytest.raises(SpecError, match=r"^MTU 1451 is more than uplink eth0 \(MTU 1500\) "
                       r"carries after the VXLAN's 50 bytes of headers; give at most 1450 "
                       r"or raise eth0's MTU\.$"):
        span.span_mtu("eth0", 1500, 1451)
    with pytest.raises(SpecError, match=r"^MTU 1279 is outside 1280-9000"):
        span.span_mtu("eth0", 1500, 1279)
    with pytest.raises(SpecError, match=r"^uplink eth0's MTU 1320 leaves 1270 after the "
                       r"VXLAN's 50 bytes of headers, below 1280; raise its MTU\.$"):
        span.span_mtu("eth0", 1320)


def test_an_mtu_outside_1280_to_9000_is_refused() -> None:
    assert addr.check_mtu(1280) == 1280 and addr.check_mtu(9000) == 9000
    for bad in (0, 576, 1279, 9001, 65535):
        with pytest.raises(SpecError, match=rf"^MTU {bad} is outside 1280-9000 \(IPv6's "
                           r"minimum to jumbo frames\); pick one in that range\.$"):
            addr.check_mtu(bad)


def test_dnsmasq_hosts_one_line_per_nic() -> None:
    text = dnsmasq.render_hosts([dnsmasq.Host("52:54:00:00:00:0a", "10.0.5.10", "b"),
                                 dnsmasq.Host("52:54:00:00:00:02", "10.0.5.2", "a"),
                                 dnsmasq.Host("52:54:00:00:00:03", "10.0.5.3", "a")])
    assert text == ("52:54:00:00:00:02,10.0.5.2,a\n52:54:00:00:00:03,10.0.5.3\n"
                    "52:54:00:00:00:0a,10.0.5.10,b\n")


# -- QEMU argv -----------------------------------------------------------------------


def nic(i: int, queues: int, fds: tuple[int, ...]) -> NicConfig:
    return NicConfig(id=f"nic{i}", mac=f"52:54:00:00:00:0{i}", queues=queues,
                     tap=f"fzt-1-{i}", bridge="fzb-lan0", network="lan0", fds=fds)


def test_nics_are_taps_by_descriptor_multiqueue_with_vcpus() -> None:
    c = cfg(nics=[nic(0, 1, (40,)), nic(1, 2, (41, 42))], ports=[(8080, 80)])
    argv = build_argv(c)
    assert opt(argv, "-netdev") == ["tap,id=nic0,fd=40,vhost=off",
                                    "tap,id=nic1,fds=41:42,vhost=off"]
    devs = opt(argv, "-device")
    assert "virtio-net-pci,netdev=nic0,mac=52:54:00:00:00:00,romfile=" in devs
    assert "virtio-net-pci,netdev=nic1,mac=52:54:00:00:00:01,romfile=,mq=on,vectors=6" in devs
    assert not any(n.startswith("user") for n in opt(argv, "-netdev"))
    assert opt(argv, "-append")[0].endswith(" fusuma.net=dhcp")
    assert {40, 41, 42} <= set(c.passed_fds())
    assert "tun" not in " ".join(argv)


def test_no_nic_keeps_the_user_mode_network() -> None:
    ds = device_set(cfg(ports=[(8080, 80)]))
    assert [d.driver for d in ds.devices].count("virtio-net-pci") == 1
    argv = build_argv(cfg(ports=[(8080, 80)]))
    assert opt(argv, "-netdev") == ["user,id=net0,hostfwd=tcp:127.0.0.1:8080-:80"]
    assert "fusuma.net=dhcp" not in opt(argv, "-append")[0]


def test_nic_without_descriptors_is_a_bug() -> None:
    with pytest.raises(ValueError, match="no tap descriptors"):
        build_argv(cfg(nics=[nic(0, 1, ())]))


# -- records, NIC plans --------------------------------------------------------------


@pytest.fixture
def db(tmp_path: Path) -> Database:
    d = Database(tmp_path / "state.db")
    d.add_partition(PartitionRecord("p0", [0], 1024))
    d.add_network(NetworkRecord("lan0", "managed", "fzb-lan0", "10.0.5.0/29", nat=True,
                                filtering=True))
    d.add_network(NetworkRecord("ext", "bridged", "br0"))
    return d


def test_nics_recorded_and_deleted_with_their_vm(db: Database) -> None:
    db.add_vm(VmRecord("a", "p0", 1, 256))
    db.add_nics([NicRecord("a", 0, "lan0", "52:54:00:00:00:01", "10.0.5.2")])
    assert db.network_users("lan0") == ["a"]
    with pytest.raises(StateError, match="used by VM"):
        db.remove_network("lan0")
    with pytest.raises(ConflictError, match="MAC or address is taken"):
        db.add_nics([NicRecord("a", 1, "lan0", "52:54:00:00:00:01", None)])
    db.remove_vm("a")
    assert db.nics() == [] and db.network_users("lan0") == []
    db.remove_network("lan0")
    with pytest.raises(NotFoundError, match="no network named 'lan0'"):
        db.network("lan0")


def test_older_state_file_s_networks_get_an_mtu_of_1500(tmp_path: Path) -> None:
    path = tmp_path / "state.db"
    Database(path).close()
    old = sqlite3.connect(path)
    old.executescript("DROP TABLE nics; DROP TABLE networks; CREATE TABLE networks ("
                      "name TEXT PRIMARY KEY, type TEXT NOT NULL, bridge TEXT NOT NULL "
                      "UNIQUE, subnet TEXT, nat INTEGER NOT NULL DEFAULT 0, isolated "
                      "INTEGER NOT NULL DEFAULT 0, filtering INTEGER NOT NULL DEFAULT 0, "
                      "keeper_pid INTEGER, created_at REAL NOT NULL);"
                      "INSERT INTO networks (name, type, bridge, subnet, created_at) "
                      "VALUES ('lan0', 'managed', 'fzb-lan0', '10.0.5.0/24', 1.0);")
    old.commit()
    old.close()
    db = Database(path)
    assert db.network("lan0").mtu == 1500
    db.set_network_mtu("lan0", 1450)
    assert db.network("lan0").mtu == 1450


def test_older_state_file_gets_network_tables(tmp_path: Path) -> None:
    path = tmp_path / "state.db"
    Database(path).close()
    old = sqlite3.connect(path)
    old.executescript("DROP TABLE nics; DROP TABLE networks;")
    old.close()
    assert Database(path).networks() == []


def test_plan_nics(db: Database, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    paths = Paths(home=tmp_path, runtime=tmp_path / "r", shm=tmp_path / "s",
                  cache=tmp_path / "c", cgroup_prefix="fusuma-t")
    nets = NetworkManager(paths, db)
    monkeypatch.setattr(addr, "host_addresses", lambda: {"192.168.9.2"})
    got = nets.plan_nics("a", [NicRequest("lan0"), NicRequest("lan0", ip="10.0.5.6"),
                               NicRequest("ext", mac="52:54:00:00:00:aa")],
                         ["192.168.9.2:8080:80"])
    assert [(n.index, n.network, n.ip) for n in got] == [
        (0, "lan0", "10.0.5.2"), (1, "lan0", "10.0.5.6"), (2, "ext", None)]
    assert got[2].mac == "52:54:00:00:00:aa" and len({n.mac for n in got}) == 3
    db.add_vm(VmRecord("a", "p0", 1, 256, ports=["192.168.9.2:8080:80"]))
    db.add_nics(got)
    with pytest.raises(ConflictError, match="already VM a's NIC"):
        nets.plan_nics("b", [NicRequest("lan0", mac="52:54:00:00:00:aa")], [])
    with pytest.raises(ConflictError, match=r"10\.0\.5\.6 is already VM a's"):
        nets.plan_nics("b", [NicRequest("lan0", ip="10.0.5.6")], [])
    with pytest.raises(SpecError, match="bridged: fusuma gives no addresses"):
        nets.plan_nics("b", [NicRequest("ext", ip="10.0.5.6")], [])
    with pytest.raises(SpecError, match="bridged networks only"):
        nets.plan_nics("b", [NicRequest("ext")], ["8081:80"])
    with pytest.raises(ConflictError, match="already forwarded to VM 'a'"):
        nets.plan_nics("b", [NicRequest("lan0")], ["0.0.0.0:8080:80"])
    with pytest.raises(NotFoundError, match="no network named 'nope'"):
        nets.plan_nics("b", [NicRequest("nope")], [])
    assert [(p.tap, p.ip) for p in nets.ports("lan0")] == [("fzt-1-0", "10.0.5.2"),
                                                           ("fzt-1-1", "10.0.5.6")]
    assert nets.forwards("lan0") == [nft.Forward("192.168.9.2", 8080, "10.0.5.2", 80)]
    # What a cloud-init guest's network-config sets: the MTU of each NIC on a managed
    # network whose MTU is not 1500 (a bridged network's is the host's business).
    assert nets.nic_mtus(got) == []
    db.set_network_mtu("lan0", 1450)
    db.set_network_mtu("ext", 9000)
    assert nets.nic_mtus(got) == [(got[0].mac, 1450), (got[1].mac, 1450)]


def test_parse_nic() -> None:
    assert parse_nic("lan0") == NicRequest("lan0")
    assert parse_nic("lan0,ip=10.0.5.9,mac=52:54:00:00:00:01") == NicRequest(
        "lan0", "52:54:00:00:00:01", "10.0.5.9")
    for bad in ("lan0,ip=1,ip=2", "lan0,foo=1", "Bad!"):
        with pytest.raises(SpecError):
            parse_nic(bad)


# -- spec ----------------------------------------------------------------------------


def test_spec_networks_and_nics_round_trip() -> None:
    text = """
[[network]]
name = "lan0"
subnet = "10.0.5.0/24"
isolated = true

[[network]]
name = "ext"
type = "bridged"
parent = "br0"

[[partition]]
name = "p0"
cpus = "0"
memory_mib = 1024

[[vm]]
name = "a"
partition = "p0"
nics = [{ network = "lan0", ip = "10.0.5.9" }, { network = "ext", mac = "52:54:00:00:00:AA" }]
ports = ["0.0.0.0:8080:80"]
"""
    spec = parse_spec(text, "s.toml")
    assert [n.name for n in spec.network] == ["lan0", "ext"]
    assert spec.vm[0].nics[1].mac == "52:54:00:00:00:aa"
    assert parse_spec(dump_spec(spec)) == spec
    with pytest.raises(SpecError, match=r"s.toml: network\[0\].subnet: subnet"):
        parse_spec('[[network]]\nname = "x"\nsubnet = "1.2.3.0/24"\n', "s.toml")
    with pytest.raises(SpecError, match="duplicate network name"):
        parse_spec('[[network]]\nname = "x"\n[[network]]\nname = "x"\n', "s.toml")
    with pytest.raises(SpecError, match="forwarded twice"):
        parse_spec(text.replace('["0.0.0.0:8080:80"]', '["0.0.0.0:8080:80", "8080:81"]'))


# -- faults: one sentence, nothing half-made ------------------------------------------


def test_missing_nft_and_dnsmasq_are_one_sentence(monkeypatch: pytest.MonkeyPatch) -> None:
    from fusuma.errors import HostError

    monkeypatch.setattr(nft, "NFT", "fusuma-no-such-nft")
    with pytest.raises(HostError, match=r"nftables is missing .*apt-get install nftables"):
        nft.check_installed()
    monkeypatch.setattr(dnsmasq.shutil, "which", lambda *a, **k: None)
    with pytest.raises(HostError, match="dnsmasq is missing; install it with"):
        dnsmasq.binary()


class FakeKernel:
    """Bridges, tables and keepers as a dict: what NetworkManager.create made."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, fail: str = "") -> None:
        from fusuma.network import keeper, link

        self.links: set[str] = set()
        self.tables: set[str] = set()
        self.fail = fail
        monkeypatch.setattr(link, "exists", lambda n: n in self.links)
        monkeypatch.setattr(link, "is_bridge", lambda n: n in self.links)
        self.mtus: dict[str, int] = {}
        monkeypatch.setattr(link, "create_bridge", lambda n, g, mtu=1500: (
            self.links.add(n), self.mtus.__setitem__(n, mtu)))
        monkeypatch.setattr(link, "delete_link", self._del_link)
        monkeypatch.setattr(link, "sysctl", lambda p, v: False)
        monkeypatch.setattr(nft, "check_installed", lambda: None)
        monkeypatch.setattr(nft, "apply", self._apply)
        monkeypatch.setattr(nft, "delete", lambda f, n: self.tables.discard(f"{f} {n}"))
        monkeypatch.setattr(dnsmasq, "binary", lambda: "/usr/sbin/dnsmasq")
        monkeypatch.setattr(addr, "host_routes", lambda: [addr.Route(
            addr.ipaddress.IPv4Network("192.168.1.0/24"), "eth0")])
        monkeypatch.setattr(keeper, "keeper_pid", lambda *a: None)
        monkeypatch.setattr(keeper, "dnsmasq_pid", lambda f: None)
        monkeypatch.setattr(NetworkManager, "start_keeper",
                            lambda mgr, rec, timeout=0: self._start(rec))
        monkeypatch.setattr(NetworkManager, "stop_keeper", lambda s, r: False)

    def _del_link(self, n: str) -> bool:
        self.links.discard(n)
        return True

    def _apply(self, tables: list[nft.Table]) -> None:
        if self.fail == "nft":
            from fusuma.errors import NetworkError

            raise NetworkError("`nft -f -` failed: Error: no such hook.")
        self.tables |= {f"{t.family} {t.name}" for t in tables}

    def _start(self, rec: NetworkRecord) -> int:
        if self.fail == "dnsmasq":
            from fusuma.errors import NetworkError

            raise NetworkError("dnsmasq of network 'lan9' did not come up in 15 s.")
        return 4242


@pytest.mark.parametrize("fail", ["nft", "dnsmasq"])
def test_a_failed_create_leaves_nothing(db: Database, tmp_path: Path,
                                        monkeypatch: pytest.MonkeyPatch, fail: str) -> None:
    from fusuma.errors import NetworkError

    kernel = FakeKernel(monkeypatch, fail)
    paths = Paths(home=tmp_path, runtime=tmp_path / "r", shm=tmp_path / "s",
                  cache=tmp_path / "c", cgroup_prefix="fusuma-t")
    monkeypatch.setattr(Paths, "ensure_runtime", lambda self: None)
    nets = NetworkManager(paths, db)
    with pytest.raises(NetworkError):
        nets.create("lan9", subnet="10.9.9.0/24")
    assert db.find_network("lan9") is None
    assert kernel.links == set() and kernel.tables == set()
    assert not (tmp_path / "r" / "networks" / "lan9").exists()


def test_create_refusals_change_nothing(db: Database, tmp_path: Path,
                                        monkeypatch: pytest.MonkeyPatch) -> None:
    kernel = FakeKernel(monkeypatch)
    paths = Paths(home=tmp_path, runtime=tmp_path / "r", shm=tmp_path / "s",
                  cache=tmp_path / "c", cgroup_prefix="fusuma-t")
    monkeypatch.setattr(Paths, "ensure_runtime", lambda self: None)
    nets = NetworkManager(paths, db)
    cases = [
        ({"subnet": "192.168.1.0/25"}, ConflictError, r"host's route to 192\.168\.1\.0/24"),
        ({"subnet": "10.0.5.0/24"}, ConflictError, "overlaps network lan0's"),
        ({"type_": "bridged", "parent": "br9"}, SpecError, "parent bridge 'br9' does not"),
        ({"type_": "bridged"}, SpecError, "needs --parent"),
        ({"type_": "bridged", "parent": "x", "isolated": True}, SpecError, "--isolated"),
        ({"parent": "br0"}, SpecError, "--parent is for bridged"),
        ({"mtu": 1279}, SpecError, r"^MTU 1279 is outside 1280-9000"),
        ({"mtu": 9001}, SpecError, r"^MTU 9001 is outside 1280-9000"),
        ({"type_": "bridged", "parent": "x", "mtu": 1400}, SpecError,
         r"--mtu belong to managed networks .*its bridge's MTU is the host's"),
    ]
    for kw, exc, why in cases:
        with pytest.raises(exc, match=why):
            nets.create("lan9", **kw)  # type: ignore[arg-type]
    kernel.links.add("fzb-lan9")
    with pytest.raises(ConflictError, match="interface fzb-lan9 exists already"):
        nets.create("lan9", subnet="10.9.9.0/24")
    assert db.find_network("lan9") is None and kernel.tables == set()
    kernel.links.discard("fzb-lan9")
    rec = nets.create("lan9")      # no --subnet: the first free 10.x.y.0/24
    assert rec.subnet == "10.100.0.0/24" and rec.keeper_pid == 4242
    assert kernel.links == {"fzb-lan9"} and kernel.mtus["fzb-lan9"] == rec.mtu == 1500
    assert "dhcp-option-force" not in (tmp_path / "r" / "networks" / "lan9" /
                                       "dnsmasq.conf").read_text()
    small = nets.create("lan8", mtu=1400)
    assert small.mtu == 1400 and kernel.mtus["fzb-lan8"] == 1400
    assert nets.status("lan8").as_json()["mtu"] == 1400
    assert "dhcp-option-force=26,1400\n" in (tmp_path / "r" / "networks" / "lan8" /
                                             "dnsmasq.conf").read_text()
    nets.delete("lan8")
    assert kernel.tables == {"inet fusuma-t-lan9", "bridge fusuma-t-lan9"}
    hosts = tmp_path / "r" / "networks" / "lan9" / "hosts"
    assert hosts.read_text() == "" and oct(hosts.stat().st_mode)[-3:] == "644"


TCP = """  sl  local_address rem_address   st tx_queue rx_queue tr tm->when retrnsmt   uid
   0: 0100007F:1F90 00000000:0000 0A 00000000:00000000 00:00000000 00000000     0
   1: 00000000:0016 00000000:0000 0A 00000000:00000000 00:00000000 00000000     0
   2: 0100007F:1F91 0100007F:D2F0 01 00000000:00000000 00:00000000 00000000     0
"""
TCP6 = """  sl  local_address                         remote_address                        st
   0: 00000000000000000000000000000000:01BB 00000000000000000000000000000000:0000 0A
   1: 00000000000000000000000001000000:0277 00000000000000000000000000000000:0000 0A
"""


def test_listening_sockets_are_read_from_proc_net_tcp() -> None:
    got = addr.parse_listeners(TCP, TCP6)
    # 127.0.0.1:8080 and *:22 listen; 127.0.0.1:8081 is a connection; ::1:631 is IPv6
    # only; [::]:443 takes IPv4 too.
    assert got == {("127.0.0.1", 8080), ("0.0.0.0", 22), ("::", 443)}


@pytest.mark.parametrize("forward", ["127.0.0.1:8080:80", "0.0.0.0:8080:80",
                                     "10.0.0.5:22:22", "127.0.0.1:443:443"])
def test_a_forward_onto_a_listening_host_port_is_refused(forward: str) -> None:
    f = addr.parse_forward(forward)
    with pytest.raises(ConflictError) as exc:
        addr.check_free([f], addr.parse_listeners(TCP, TCP6))
    said = str(exc.value)
    assert said.startswith(f"host port {f.host_port} on {f.addr} is in use by a host "
                           "service") and said.endswith("pick another port."), said


def test_a_forward_beside_a_listening_address_is_free() -> None:
    # 8080 listens on 127.0.0.1 only: the same port on another address is free.
    addr.check_free([addr.parse_forward("10.0.0.5:8080:80"),
                     addr.parse_forward("9000:80")], addr.parse_listeners(TCP, TCP6))


def test_nics_shown_with_the_kernels_word_on_each_tap(db: Database,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    from fusuma.network import link
    from fusuma.views import networks as views

    calls: list[str] = []

    def links(prefix: str) -> list[str]:
        calls.append(prefix)
        return [f"fzt-{db.vm('a').slot}-0"]    # NIC 0's tap exists, NIC 1's does not

    monkeypatch.setattr(link, "links", links)
    db.add_vm(VmRecord("plain", "p0", 1, 256))
    # Without a NIC anywhere the kernel is not asked.
    assert views.nics_by_vm(db, db.vms()) == {"plain": []} and calls == []
    db.add_vm(VmRecord("a", "p0", 1, 256))
    db.add_nics([NicRecord("a", 0, "lan0", "52:54:00:00:00:01", "10.0.5.2"),
                 NicRecord("a", 1, "ext", "52:54:00:00:00:02", None)])
    a = db.vm("a")
    got = views.nics_by_vm(db, db.vms())
    assert got["plain"] == [] and calls == ["fzt-"]
    assert got["a"] == [
        {"index": 0, "network": "lan0", "mac": "52:54:00:00:00:01", "ip": "10.0.5.2",
         "tap": f"fzt-{a.slot}-0", "tap_present": True},
        {"index": 1, "network": "ext", "mac": "52:54:00:00:00:02", "ip": None,
         "tap": f"fzt-{a.slot}-1", "tap_present": False}]
    assert views.vm_nics(db, a) == got["a"]


def test_a_network_a_template_keeps_is_not_deleted(db: Database, tmp_path: Path,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    from fusuma.state.db import TemplateRecord

    FakeKernel(monkeypatch)
    paths = Paths(home=tmp_path, runtime=tmp_path / "r", shm=tmp_path / "s",
                  cache=tmp_path / "c", cgroup_prefix="fusuma-t")
    db.add_template(TemplateRecord(
        name="t", ram_path="/s/t.template", state_path="/h/t/state", size_bytes=1,
        memory_mib=256, vcpus=1, machine="pc-q35-7.2", qemu_version="10.0.2", devices="{}",
        image="minimal", state_sha256="0", source_vm="gone", networks=["lan0"]))
    with pytest.raises(StateError, match=r"kept by template\(s\) t \(their clones") as err:
        NetworkManager(paths, db).delete("lan0")
    assert str(err.value).count(". ") == 0
    assert db.find_network("lan0") is not None
    db.remove_template("t")
    NetworkManager(paths, db).delete("lan0")
    assert db.find_network("lan0") is None


def test_a_spanning_networks_gateway_mac_and_table() -> None:
    from fusuma.errors import NetworkError
    from fusuma.network import ifnames, span

    assert span.gateway_mac(124) == "02:66:7a:00:00:7c"
    assert span.gateway_mac(2**24 - 1) == "02:66:7a:ff:ff:ff"
    for bad in (0, 2**24):
        with pytest.raises(NetworkError, match="outside 1-16777215"):
            span.gateway_mac(bad)
    assert ifnames.vxlan_name("lan") == "fzv-lan" and len(ifnames.vxlan_name("x" * 40)) == 15
    assert ifnames.span_table_name("fusuma-t", "lan") == "fusuma-t-lan-span"
    text = span.span_table("fusuma-t-lan-span", "fzv-lan", span.gateway_mac(124)).render()
    # The gateway's frames never leave by the VXLAN or come in by it; DHCP never crosses.
    assert 'oifname "fzv-lan" ether saddr 02:66:7a:00:00:7c counter drop' in text
    assert 'iifname "fzv-lan" ether saddr 02:66:7a:00:00:7c counter drop' in text
    assert 'oifname "fzv-lan" ether type ip udp dport { 67, 68 } counter drop' in text
    assert 'iifname "fzv-lan" ether type ip udp dport { 67, 68 } counter drop' in text
    assert text.startswith("table bridge fusuma-t-lan-span {")


def test_a_network_spanning_hosts_fits_the_smallest_uplink() -> None:
    from types import SimpleNamespace

    from fusuma.cluster.networks import smallest_uplink
    from fusuma.network import span

    def hosts(*mtus: object) -> SimpleNamespace:
        items = [{"metadata": {"name": f"h{i}"}, "status": {"uplinkMtu": m}}
                 for i, m in enumerate(mtus)]
        return SimpleNamespace(host="h0", hosts_informer=SimpleNamespace(items=lambda: items))

    # This host (h0) reports 9000 too; h2 has a 1500-byte uplink: every host gets 1450.
    least = smallest_uplink(hosts(9000, 9000, 1500), "eth0", 9000)  # type: ignore[arg-type]
    assert least == ("the uplink of host h2", 1500)
    assert span.span_mtu(*least) == 1450
    # Hosts that report nothing (older agents) or nonsense are left out.
    assert smallest_uplink(hosts(9000, None, True, "1500", 0), "eth0", 9000) == (  # type: ignore[arg-type]
        "eth0", 9000)
    # This host's own entry never names itself as another host.
    assert smallest_uplink(hosts(1400, 9000), "eth0", 1500) == ("eth0", 1500)  # type: ignore[arg-type]
