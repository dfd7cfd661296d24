"""A network's nftables tables: typed data rendered to nft's own syntax, applied and
removed as whole tables, one atomic transaction each (``nft -f -``).

Each managed network has two tables of its own, named ``PREFIX-NET``
(fusuma.network.ifnames.table_name), and fusuma touches no other:

- ``inet``: NAT to the uplink (masquerade of the subnet leaving by any interface but the
  bridge), port forwards (DNAT in prerouting for other hosts, in output for the host
  itself), and the forward rules that keep VMs of different networks apart (no packet
  between this bridge and another ``fzb-*`` bridge) and, for an isolated network, apart
  from each other;
- ``bridge``: what a VM may send (filtering, Incus's ``security.mac_filtering`` and
  ``ipv4_filtering``): from each tap, only frames with the NIC's MAC, IPv4 and ARP with
  the NIC's address, and DHCP from 0.0.0.0 before the lease; everything else (another
  MAC or address, IPv6, VLAN tags, other protocols) is dropped and counted.

The tables are a pure function of the network's record, its NICs and their port
forwards (:func:`network_tables`), so they are rendered anew and swapped in whole
whenever a NIC or a forward changes: ``table`` + ``delete table`` + the new body in one
``nft -f``, which the kernel applies atomically.
"""

from __future__ import annotations

import json
import subprocess
from collections.abc import Sequence

from fusuma.errors import HostError, NetworkError
from fusuma.frozen import frozen
from fusuma.network.ifnames import BRIDGE_PREFIX

NFT = "nft"


@frozen
class NftSet:
    name: str
    type: str                         # "ifname . ether_addr"
    elements: tuple[str, ...] = ()

    def render(self) -> list[str]:
        out = [f"  set {self.name} {{", f"    type {self.type}"]
        if self.elements:
            out.append(f"    elements = {{ {', '.join(self.elements)} }}")
        return [*out, "  }"]


@frozen
class Chain:
    """A chain; a base chain when ``hook`` is set."""

    name: str
    rules: tuple[str, ...] = ()
    hook: str | None = None
    type: str = "filter"
    priority: str = "filter"
    policy: str = "accept"

    def render(self) -> list[str]:
        out = [f"  chain {self.name} {{"]
        if self.hook is not None:
            out.append(f"    type {self.type} hook {self.hook} priority {self.priority}; "
                       f"policy {self.policy};")
        out += [f"    {r}" for r in self.rules]
        return [*out, "  }"]


@frozen
class Table:
    family: str                       # "inet" | "bridge"
    name: str
    chains: tuple[Chain, ...]
    sets: tuple[NftSet, ...] = ()

    def render(self) -> str:
        lines = [f"table {self.family} {self.name} {{"]
        for s in self.sets:
            lines += s.render()
        for c in self.chains:
            lines += c.render()
        return "\n".join([*lines, "}"]) + "\n"


@frozen
class Port:
    """One NIC as the filter sees it: its tap, MAC and address."""

    tap: str
    mac: str
    ip: str | None


@frozen
class Forward:
    """A port forward: TCP to ``addr:host_port`` (addr "0.0.0.0": any of the host's
    addresses) goes to ``ip:guest_port``."""

    addr: str
    host_port: int
    ip: str
    guest_port: int

    def match(self) -> str:
        dst = "fib daddr type local" if self.addr == "0.0.0.0" else f"ip daddr {self.addr}"
        return f"{dst} tcp dport {self.host_port} dnat ip to {self.ip}:{self.guest_port}"


@frozen
class ManagedNet:
    """What the tables of one managed network are made from."""

    table: str
    bridge: str
    subnet: str
    nat: bool
    isolated: bool
    filtering: bool


def inet_table(n: ManagedNet, forwards: Sequence[Forward] = ()) -> Table:
    b = json.dumps(n.bridge)
    others = json.dumps(BRIDGE_PREFIX + "*")
    forward = [f"iifname {b} oifname {others} oifname != {b} counter drop",
               f"oifname {b} iifname {others} iifname != {b} counter drop"]
    if n.isolated:
        # Routed back out of the bridge it came in by (or bridged, where the kernel's
        # br_netfilter hands bridged IPv4 to this hook): one VM to another.
        forward.append(f"iifname {b} oifname {b} counter drop")
    post = [f"oifname {b} ip saddr 127.0.0.0/8 masquerade"]
    if n.nat:
        post.insert(0, f"ip saddr {n.subnet} ip daddr != {n.subnet} oifname != {b} "
                       "masquerade")
    dnat = tuple(f.match() for f in forwards)
    return Table("inet", n.table, (
        # The bridge has route_localnet (so that the host's own connections to a
        # loopback forward can leave by it): a VM must never reach the host's
        # loopback services through it.
        Chain("guard", (f"iifname {b} ip daddr 127.0.0.0/8 counter drop",),
              hook="prerouting", priority="raw"),
        Chain("forward", tuple(forward), hook="forward"),
        Chain("prerouting", dnat, hook="prerouting", type="nat", priority="dstnat"),
        Chain("output", dnat, hook="output", type="nat", priority="-100"),
        Chain("postrouting", tuple(post), hook="postrouting", type="nat",
              priority="srcnat"),
    ))


def bridge_table(n: ManagedNet, ports: Sequence[Port]) -> Table:
    taps = tuple(json.dumps(p.tap) for p in ports)
    macs = tuple(f"{json.dumps(p.tap)} . {p.mac}" for p in ports)
    ips = tuple(f"{json.dumps(p.tap)} . {p.ip}" for p in ports if p.ip)
    from_vm = (
        "iifname . ether saddr != @macs counter drop",
        "ether type arp iifname . arp saddr ether != @macs counter drop",
        "ether type arp arp saddr ip 0.0.0.0 accept",
        "ether type arp iifname . arp saddr ip @ips accept",
        "ether type ip udp sport 68 udp dport 67 ip saddr 0.0.0.0 "
        "ip daddr 255.255.255.255 accept",
        "ether type ip iifname . ip saddr @ips accept",
        "counter drop",
    )
    return Table("bridge", n.table, (
        Chain("prerouting", ("iifname @ports jump from_vm",), hook="prerouting",
              priority="-200"),
        Chain("from_vm", from_vm),
    ), sets=(NftSet("ports", "ifname", taps),
             NftSet("macs", "ifname . ether_addr", macs),
             NftSet("ips", "ifname . ipv4_addr", ips)))


def network_tables(n: ManagedNet, ports: Sequence[Port],
                   forwards: Sequence[Forward] = ()) -> list[Table]:
    """The tables of one managed network (the bridge table only with filtering)."""
    tables = [inet_table(n, forwards)]
    if n.filtering:
        tables.append(bridge_table(n, ports))
    return tables


def replace_script(tables: Sequence[Table]) -> str:
    """One nft script that puts ``tables`` in place of their current versions
    (``table`` first, so that ``delete`` never fails on a table not there yet)."""
    out = []
    for t in tables:
        out += [f"table {t.family} {t.name}", f"delete table {t.family} {t.name}",
                t.render()]
    return "\n".join(out)


def _nft(args: list[str], script: str | None = None) -> str:
    argv = [NFT, *args]
    try:
        p = subprocess.run(argv, input=script, capture_output=True, text=True, timeout=30)
    except FileNotFoundError as exc:
        raise HostError("nftables is missing (the `nft` command); install it with "
                        "`apt-get install nftables`.") from exc
    except subprocess.TimeoutExpired as exc:
        raise NetworkError(f"{' '.join(argv)} did not finish in 30 s.", argv=argv) from exc
    if p.returncode != 0:
        lines = p.stderr.strip().splitlines()
        first = lines[0] if lines else f"exit status {p.returncode}"
        raise NetworkError(f"`{' '.join(argv)}` failed: {first}.", argv=argv,
                           detail=p.stderr)
    return p.stdout


def apply(tables: Sequence[Table]) -> None:
    """Put ``tables`` in place, atomically."""
    if tables:
        _nft(["-f", "-"], replace_script(tables))


def delete(family: str, name: str) -> bool:
    """Remove table ``family name`` if it exists; True if it did."""
    if (family, name) not in tables():
        return False
    _nft(["delete", "table", family, name])
    return True


def tables() -> set[tuple[str, str]]:
    """Every table of this network namespace, as (family, name)."""
    data = json.loads(_nft(["-j", "list", "tables"]) or "{}")
    return {(str(t["table"]["family"]), str(t["table"]["name"]))
            for t in data.get("nftables", ()) if "table" in t}


def check_installed() -> None:
    """One sentence when nft is missing."""
    _nft(["--version"])
