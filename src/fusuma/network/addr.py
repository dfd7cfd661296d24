"""Addresses of a managed network: its subnet and gateway, the host's routes it must
not overlap, each NIC's MAC and IPv4 address. Pure functions, but for
:func:`host_routes`, :func:`host_addresses` and :func:`host_listeners`, which read the
kernel's view."""

from __future__ import annotations

import ipaddress
import json
import random
import re
import subprocess
from collections.abc import Iterable

from fusuma.errors import ConflictError, HostError, SpecError
from fusuma.frozen import frozen

# QEMU's own OUI (what `-device virtio-net` gives by default): a VM's NIC looks like a
# QEMU NIC to every tool, and the locally administered bit is not needed to avoid
# clashing with real hardware on a bridge fusuma makes.
MAC_PREFIX = "52:54:00"
MAC_RE = re.compile(r"^[0-9a-f]{2}(:[0-9a-f]{2}){5}\Z")
# The user-mode network's NIC has QEMU's default MAC: never hand it out.
USER_MODE_MAC = "52:54:00:12:34:56"
MIN_PREFIX, MAX_PREFIX = 16, 29
# A network's MTU: IPv6's minimum up to jumbo frames; Ethernet's own by default.
MIN_MTU, MAX_MTU, DEFAULT_MTU = 1280, 9000, 1500


def check_mtu(mtu: int) -> int:
    """A network's MTU, or one sentence why not."""
    if not MIN_MTU <= mtu <= MAX_MTU:
        raise SpecError(f"MTU {mtu} is outside {MIN_MTU}-{MAX_MTU} (IPv6's minimum to "
                        "jumbo frames); pick one in that range.")
    return mtu


@frozen
class Subnet:
    """A managed network's IPv4 subnet; the gateway (the host, on the bridge) is its
    first address."""

    net: ipaddress.IPv4Network

    @property
    def gateway(self) -> ipaddress.IPv4Address:
        return self.net.network_address + 1

    @property
    def cidr(self) -> str:
        return str(self.net)

    def gateway_cidr(self) -> str:
        """The bridge's address with the prefix length: ``10.0.5.1/24``."""
        return f"{self.gateway}/{self.net.prefixlen}"


def parse_subnet(text: str) -> Subnet:
    """``10.0.5.0/24`` as a Subnet; one sentence for anything else."""
    try:
        net = ipaddress.IPv4Network(text, strict=True)
    except ValueError as exc:
        raise SpecError(f"subnet {text!r} is not an IPv4 network such as 10.0.5.0/24 "
                        f"({exc}).") from exc
    if not MIN_PREFIX <= net.prefixlen <= MAX_PREFIX:
        raise SpecError(f"subnet {text} has prefix /{net.prefixlen}; give one from "
                        f"/{MIN_PREFIX} to /{MAX_PREFIX}.")
    if not net.is_private or net.is_loopback or net.is_link_local:
        raise SpecError(f"subnet {text} is not a private range (10.0.0.0/8, "
                        "172.16.0.0/12, 192.168.0.0/16); a managed network's VMs are "
                        "NATed behind the host and must not take public addresses.")
    return Subnet(net)


@frozen
class Route:
    dst: ipaddress.IPv4Network
    dev: str


def host_routes() -> list[Route]:
    """The host's IPv4 routes in every table but default routes (``ip -j route show
    table all``)."""
    argv = ["ip", "-j", "-4", "route", "show", "table", "all"]
    try:
        p = subprocess.run(argv, capture_output=True, text=True, timeout=10, check=True)
        rows = json.loads(p.stdout or "[]")
    except FileNotFoundError as exc:
        raise HostError("the `ip` command is missing; install iproute2.") from exc
    except (subprocess.SubprocessError, ValueError) as exc:
        raise HostError(f"cannot read the host's routes with {' '.join(argv)}: {exc}."
                        ) from exc
    out = []
    for r in rows:
        dst = r.get("dst", "")
        if dst in ("default", "") or r.get("type") in ("broadcast", "multicast"):
            continue
        try:
            out.append(Route(ipaddress.IPv4Network(dst, strict=False), str(r.get("dev", "?"))))
        except ValueError:
            continue
    return out


def check_overlap(subnet: Subnet, routes: Iterable[Route],
                  networks: Iterable[tuple[str, str]] = ()) -> None:
    """Refuse a subnet that overlaps a host route (the host would no longer know where
    to send those packets) or another fusuma network's subnet."""
    for name, other in networks:
        if subnet.net.overlaps(ipaddress.IPv4Network(other)):
            raise ConflictError(f"subnet {subnet.cidr} overlaps network {name}'s "
                                f"{other}; pick another subnet.")
    for r in routes:
        if subnet.net.overlaps(r.dst):
            raise ConflictError(f"subnet {subnet.cidr} overlaps the host's route to "
                                f"{r.dst} (dev {r.dev}); pick a subnet the host does not "
                                "route yet (`ip route show table all`).")


def host_addresses() -> set[str]:
    """The host's own IPv4 addresses (``ip -j -4 addr``)."""
    try:
        p = subprocess.run(["ip", "-j", "-4", "addr", "show"], capture_output=True,
                           text=True, timeout=10, check=True)
        rows = json.loads(p.stdout or "[]")
    except (OSError, subprocess.SubprocessError, ValueError) as exc:
        raise HostError(f"cannot read the host's addresses with `ip -j addr`: {exc}."
                        ) from exc
    return {str(a["local"]) for r in rows for a in r.get("addr_info", ()) if "local" in a}


TCP_LISTEN = "0A"


def parse_listeners(*tables: str) -> set[tuple[str, int]]:
    """(address, port) of every listening TCP socket in ``/proc/net/tcp``-format
    ``tables`` (IPv4 addresses as dotted quads; an IPv6 socket as "::" when it is a
    wildcard, which takes IPv4 connections too, else skipped)."""
    out: set[tuple[str, int]] = set()
    for table in tables:
        for line in table.splitlines()[1:]:
            cols = line.split()
            if len(cols) < 4 or cols[3] != TCP_LISTEN or ":" not in cols[1]:
                continue
            hexaddr, _, hexport = cols[1].rpartition(":")
            try:
                port = int(hexport, 16)
                raw = bytes.fromhex(hexaddr)
            except ValueError:
                continue
            if len(raw) == 4:
                out.add((str(ipaddress.IPv4Address(raw[::-1])), port))
            elif len(raw) == 16 and not any(raw):
                out.add(("::", port))
    return out


def host_listeners() -> set[tuple[str, int]]:
    """The host's listening TCP sockets (this network namespace's)."""
    tables = []
    for name in ("tcp", "tcp6"):
        try:
            with open(f"/proc/net/{name}") as f:
                tables.append(f.read())
        except OSError:
            continue
    return parse_listeners(*tables)


def check_free(forwards: Iterable[PortForward], listeners: set[tuple[str, int]]) -> None:
    """Refuse a forward whose host port a host service listens on: the DNAT rule would
    take that service's connections away from it (QEMU's user-mode forwards could not:
    they bind the port, and fail when it is taken)."""
    for f in forwards:
        for a, port in listeners:
            if port == f.host_port and (a in (f.addr, ANY, "::") or f.addr == ANY):
                raise ConflictError(f"host port {f.host_port} on {f.addr} is in use by a "
                                    f"host service (a socket listens on {a}:{port}); a "
                                    "forward would take its connections away from it: "
                                    "pick another port.")


def check_mac(text: str) -> str:
    """A MAC a user gave, normalized (lower case); one sentence when it is no unicast
    Ethernet address."""
    mac = text.strip().lower().replace("-", ":")
    if not MAC_RE.match(mac):
        raise SpecError(f"MAC {text!r} is not an Ethernet address such as "
                        "52:54:00:12:ab:cd.")
    if int(mac[:2], 16) & 1:
        raise SpecError(f"MAC {text} is a multicast address; a NIC needs a unicast one.")
    if mac in ("00:00:00:00:00:00", USER_MODE_MAC):
        raise SpecError(f"MAC {text} is reserved; pick another or leave mac= out.")
    return mac


def new_mac(taken: Iterable[str], rng: random.Random | None = None) -> str:
    """A MAC no NIC of this host has: ``52:54:00`` and three random bytes."""
    used = set(taken) | {USER_MODE_MAC}
    r = rng or random.SystemRandom()
    for _ in range(1000):
        mac = MAC_PREFIX + "".join(f":{r.randrange(256):02x}" for _ in range(3))
        if mac not in used:
            return mac
    raise ConflictError("no free MAC address found after 1000 tries; delete some VMs.")


def check_ip(subnet: Subnet, text: str, taken: dict[str, str]) -> str:
    """An address a user asked for a NIC: inside the subnet, not its network, broadcast
    or gateway address, not another NIC's (``taken``: address -> VM)."""
    try:
        ip = ipaddress.IPv4Address(text)
    except ValueError as exc:
        raise SpecError(f"address {text!r} is not an IPv4 address.") from exc
    if ip not in subnet.net:
        raise SpecError(f"address {ip} is outside the network's subnet {subnet.cidr}; "
                        "pick one inside it or leave ip= out.")
    if ip in (subnet.net.network_address, subnet.net.broadcast_address, subnet.gateway):
        raise SpecError(f"address {ip} is the subnet's network, broadcast or gateway "
                        "address; pick another.")
    if str(ip) in taken:
        raise ConflictError(f"address {ip} is already VM {taken[str(ip)]}'s; pick "
                            "another or leave ip= out.")
    return str(ip)


def allocate_ip(subnet: Subnet, taken: Iterable[str]) -> str:
    """The first address of the subnet after the gateway that no NIC has."""
    used = set(taken)
    for ip in subnet.net.hosts():
        if ip != subnet.gateway and str(ip) not in used:
            return str(ip)
    raise ConflictError(f"subnet {subnet.cidr} has no free address left; delete a VM "
                        "or make a larger network.")


@frozen
class PortForward:
    """``[ADDR:]HOSTPORT:GUESTPORT`` (TCP); ADDR 127.0.0.1 when left out."""

    addr: str
    host_port: int
    guest_port: int

    def clashes(self, other: PortForward) -> bool:
        return self.host_port == other.host_port and (
            self.addr == other.addr or "0.0.0.0" in (self.addr, other.addr))


LOOPBACK = "127.0.0.1"
ANY = "0.0.0.0"


def parse_forward(text: str) -> PortForward:
    """A port forward as the CLI, the spec and the record write it."""
    parts = text.split(":")
    if len(parts) == 2:
        parts = [LOOPBACK, *parts]
    ok = len(parts) == 3 and all(p.isdigit() and 0 < int(p) < 65536 for p in parts[1:])
    if ok:
        try:
            ipaddress.IPv4Address(parts[0])
        except ValueError:
            ok = False
    if not ok:
        raise SpecError(f"port forward {text!r} must be [ADDR:]HOSTPORT:GUESTPORT with "
                        "an IPv4 ADDR and ports 1-65535, e.g. \"8080:80\" (127.0.0.1) or "
                        "\"0.0.0.0:8080:80\"")
    return PortForward(parts[0], int(parts[1]), int(parts[2]))


def check_forwards(mine: Iterable[PortForward], others: dict[str, list[PortForward]],
                   local: Iterable[str] | None = None) -> None:
    """Refuse a forward on an address the host does not have (``local``: its
    addresses; None: not checked) or one that another VM's forward (``others``: VM ->
    forwards) already takes."""
    have = None if local is None else {*local, ANY, LOOPBACK}
    for f in mine:
        if have is not None and f.addr not in have:
            raise SpecError(f"port forward {f.addr}:{f.host_port}: {f.addr} is not an "
                            "address of this host (`ip -4 addr`); name one of its "
                            "addresses, 0.0.0.0 (all of them) or leave it out (127.0.0.1).")
        for vm, theirs in others.items():
            if any(f.clashes(t) for t in theirs):
                raise ConflictError(f"host port {f.host_port} on {f.addr} is already "
                                    f"forwarded to VM {vm!r}; pick another port.")
