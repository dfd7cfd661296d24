"""A managed network that spans hosts: one layer-2 segment over a VXLAN between the
hosts' bridges, so that a VM moved to another host keeps its MAC, its address and its
TCP connections.

Each host has the network as a managed network of its own (its bridge ``fzb-NAME``,
tables, dnsmasq) and one more port on that bridge: a VXLAN device ``fzv-NAME`` (VNI and
subnet the same on every host, from the cluster's one definition), whose flood list is
the other hosts' addresses (``bridge fdb append 00:00:00:00:00:00 ... dst PEER``);
unicast destinations are learnt from the frames that arrive, and a VM that moved
teaches them its new place with QEMU's ``announce-self``.

**Gateway and DHCP on every host (a distributed gateway).** Every host's bridge holds the
gateway address *and the same MAC* (:func:`gateway_mac`, from the VNI), and every host's
dnsmasq serves the static leases of the VMs defined on it. The VXLAN carries neither:
nftables (:func:`span_table`) drops frames from the gateway's MAC and DHCP on the VXLAN
port. So a VM's gateway is always the host it runs on (NAT leaves from there, as it
did before it moved); its ARP entry for the gateway stays right after a move (same
MAC); its lease moves with its record (the destination defines the VM with the same
MAC and address, so its dnsmasq has the lease, the source's forgets it). One DHCP
server for the whole network would be a single point of failure and would have to
learn every host's VMs; per-host dnsmasqs with disjoint ranges would change a moved
VM's address. Addresses stay unique across hosts because they are allocated cluster
wide (fusuma.cluster: the FusumaVM's NIC asks for one, or the cluster picks it).

**MTU.** The VXLAN's 50 bytes of headers (outer Ethernet, IPv4, UDP, VXLAN) must fit
in the uplink's MTU (the link that holds the host's cluster address), so the network's
MTU is at most the uplink's minus 50: 1450 on a 1500-byte uplink (:func:`span_mtu`,
the default of a FusumaNetwork; a larger one is refused). The bridge, its taps and the
VXLAN port all get the network's MTU, and the guests are told it: dnsmasq sends DHCP
option 26 (fusuma.network.dnsmasq), fusuma's images apply it (udhcpc), cloud-init
guests get it in their network-config. Without that, a guest would send 1500-byte
frames that the VXLAN drops: pings pass, full-size TCP segments between hosts never
arrive. An uplink of 1550 or more carries full 1500-byte frames.

The price: a host's own stack reaches only the VMs that run on it (its ARP for a VM on
another host never crosses).
"""

from __future__ import annotations

import json
from collections.abc import Sequence

from fusuma.errors import NetworkError, SpecError
from fusuma.network import addr, ifnames, link, nft

VXLAN_PORT = 4789
# Outer Ethernet (14), IPv4 (20), UDP (8) and VXLAN (8) headers.
VXLAN_OVERHEAD = 50
ZERO_MAC = "00:00:00:00:00:00"
MAX_VNI = 2**24 - 1


def check_vni(vni: int) -> int:
    if not 1 <= vni <= MAX_VNI:
        raise NetworkError(f"VXLAN id {vni} is outside 1-{MAX_VNI}; pick another.")
    return vni


def gateway_mac(vni: int) -> str:
    """The MAC every host's bridge of the network with VXLAN id ``vni`` has: locally
    administered, unicast, the same on every host."""
    check_vni(vni)
    return "02:66:7a:" + ":".join(f"{(vni >> s) & 0xff:02x}" for s in (16, 8, 0))


def uplink(local: str) -> tuple[str, int]:
    """The link that holds ``local`` (the host's cluster address) and its MTU."""
    dev = link.address_device(local)
    mtu = link.mtu(dev) if dev else None
    if dev is None or mtu is None:
        raise NetworkError(f"no interface of this host has address {local}, the host's "
                           "cluster address; the network cannot span hosts from it.")
    return dev, mtu


def span_mtu(uplink_dev: str, uplink_mtu: int, want: int | None = None) -> int:
    """The MTU of a network spanning hosts over ``uplink_dev`` (MTU ``uplink_mtu``):
    ``want``, or the most the uplink carries after the VXLAN's headers; one sentence
    if that does not fit."""
    most = uplink_mtu - VXLAN_OVERHEAD
    if want is None:
        if most < addr.MIN_MTU:
            raise SpecError(f"uplink {uplink_dev}'s MTU {uplink_mtu} leaves {most} after "
                            f"the VXLAN's {VXLAN_OVERHEAD} bytes of headers, below "
                            f"{addr.MIN_MTU}; raise its MTU.")
        return min(most, addr.MAX_MTU)
    addr.check_mtu(want)
    if want > most:
        raise SpecError(f"MTU {want} is more than uplink {uplink_dev} (MTU {uplink_mtu}) "
                        f"carries after the VXLAN's {VXLAN_OVERHEAD} bytes of headers; "
                        f"give at most {most} or raise {uplink_dev}'s MTU.")
    return want


def span_table(table: str, vxlan: str, gw_mac: str) -> nft.Table:
    """The bridge table that keeps the gateway and DHCP to each host: nothing from the
    gateway's MAC leaves by the VXLAN or arrives from it, no DHCP crosses it."""
    vx = json.dumps(vxlan)
    dhcp = "udp dport { 67, 68 }"
    return nft.Table("bridge", table, (
        nft.Chain("from_peers", (f"iifname {vx} ether saddr {gw_mac} counter drop",
                         f"iifname {vx} ether type ip {dhcp} counter drop"),
                  hook="prerouting", priority="-200"),
        nft.Chain("forward", (f"oifname {vx} ether type ip {dhcp} counter drop",),
                  hook="forward"),
        nft.Chain("output", (f"oifname {vx} ether saddr {gw_mac} counter drop",),
                  hook="output"),
    ))


def _bridge_cmd(*args: str) -> str:
    return link.command("bridge", *args)


def flood_peers(vxlan: str) -> set[str]:
    """The addresses VXLAN device ``vxlan`` floods to (its all-zero FDB entries)."""
    rows = json.loads(_bridge_cmd("-j", "fdb", "show", "dev", vxlan) or "[]")
    return {str(r["dst"]) for r in rows if r.get("mac") == ZERO_MAC and "dst" in r}


def attach(network: str, bridge: str, table: str, vni: int, local: str,
           peers: Sequence[str], mtu: int = addr.DEFAULT_MTU) -> list[str]:
    """Make ``bridge`` (network ``network``'s, managed, up, MTU ``mtu``) a part of the
    segment with VXLAN id ``vni``: its gateway MAC, a VXLAN port from ``local``
    flooding to ``peers`` with MTU ``mtu`` (refused if the uplink cannot carry it), the
    span table (named ``table``). Idempotent; returns what changed."""
    check_vni(vni)
    span_mtu(*uplink(local), mtu)
    vx = ifnames.vxlan_name(network)
    mac = gateway_mac(vni)
    done = []
    if link.exists(vx):
        info = link.kind_data(vx)
        if info.get("id") != vni or info.get("local") != local:
            raise NetworkError(f"interface {vx} exists with VXLAN id {info.get('id')} from "
                               f"{info.get('local')}, not {vni} from {local}; remove it "
                               f"(`ip link del {vx}`).")
    else:
        link.ip("link", "add", vx, "mtu", str(mtu), "type", "vxlan", "id", str(vni),
                "local", local, "dstport", str(VXLAN_PORT))
        done.append(f"VXLAN {vx} (id {vni})")
    if link.set_mtu(vx, mtu):
        done.append(f"MTU {mtu} on {vx}")
    if done or ("bridge", table) not in nft.tables():
        nft.apply([span_table(table, vx, mac)])
        done.append(f"table {table}")
    if link.master(vx) != bridge:
        link.ip("link", "set", bridge, "address", mac)
        link.ip("link", "set", vx, "master", bridge)
        link.ip("link", "set", vx, "up")
        done.append(f"port of {bridge}")
    have = flood_peers(vx)
    want = {p for p in peers if p != local}
    for p in sorted(want - have):
        _bridge_cmd("fdb", "append", ZERO_MAC, "dev", vx, "dst", p)
        done.append(f"peer {p}")
    for p in sorted(have - want):
        _bridge_cmd("fdb", "del", ZERO_MAC, "dev", vx, "dst", p)
        done.append(f"no peer {p}")
    return done


def detach(network: str, table: str) -> bool:
    """Remove network ``network``'s VXLAN port and span table; True if either was
    there."""
    gone = link.delete_link(ifnames.vxlan_name(network))
    return nft.delete("bridge", table) or gone
