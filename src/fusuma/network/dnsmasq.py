"""A managed network's dnsmasq (Debian's dnsmasq-base): DHCP and DNS for its VMs.

fusuma gives it a configuration file of its own (``--conf-file=``: never
/etc/dnsmasq.conf, never /etc/hosts), its own lease, hosts and pid files, and binds it
to the network's bridge only (``bind-interfaces``, ``except-interface=lo``). It hands
out only the addresses fusuma recorded (``dhcp-range=...,static`` and one
``dhcp-host`` line per NIC in the hosts file): a VM's address is known before it boots,
which is what the filtering rules (fusuma.network.nft) allow it to send from. The hosts
file is re-read on SIGHUP, so a VM defined or deleted needs no restart. Its supervisor
is fusuma.network.keeper.
"""

from __future__ import annotations

import ipaddress
import pwd
import shutil
from collections.abc import Sequence
from pathlib import Path

from fusuma.errors import HostError
from fusuma.frozen import frozen

DNSMASQ = "dnsmasq"
# The unprivileged user dnsmasq runs as (Debian's dnsmasq-base makes it); nobody
# where it does not exist.
USERS = ("dnsmasq", "nobody")
LEASE_TIME = "1h"


@frozen
class Files:
    """Where one network's dnsmasq keeps its files (fusuma.paths: the runtime dir's
    ``networks/NAME``, passable by dnsmasq's user; the lease file under FUSUMA_HOME)."""

    conf: Path
    hosts: Path
    leases: Path
    pid: Path


@frozen
class Host:
    mac: str
    ip: str
    name: str


def user() -> str:
    for u in USERS:
        try:
            pwd.getpwnam(u)
            return u
        except KeyError:
            continue
    return "root"


def config(bridge: str, subnet: str, gateway: str, domain: str, files: Files,
           run_as: str, mtu: int = 1500) -> list[tuple[str, str | None]]:
    """The configuration file as (option, value) lines, in order. A network whose MTU
    is not Ethernet's 1500 (one spanning hosts: the VXLAN's headers take 50 bytes) tells
    its guests with DHCP option 26, interface-mtu, sent whether asked for or not (as
    Incus does): a guest that kept 1500 would send frames the VXLAN drops."""
    net = ipaddress.IPv4Network(subnet)
    mtu_option = [("dhcp-option-force", f"26,{mtu}")] if mtu != 1500 else []
    return [
        ("keep-in-foreground", None),
        ("no-hosts", None),                  # not /etc/hosts: only this network's VMs
        ("no-poll", None),
        ("strict-order", None),
        ("bind-interfaces", None),
        ("interface", bridge),
        ("except-interface", "lo"),
        ("listen-address", gateway),
        ("pid-file", str(files.pid)),
        ("dhcp-leasefile", str(files.leases)),
        ("dhcp-hostsfile", str(files.hosts)),
        ("dhcp-range", f"{net.network_address},static,{net.netmask},{LEASE_TIME}"),
        ("dhcp-option", f"option:router,{gateway}"),
        ("dhcp-option", f"option:dns-server,{gateway}"),
        *mtu_option,
        ("dhcp-authoritative", None),
        ("dhcp-no-override", None),
        ("domain", domain),
        ("local", f"/{domain}/"),
        ("expand-hosts", None),
        ("user", run_as),
        ("log-facility", "-"),           # to its keeper's log
        ("quiet-dhcp", None),            # no line per lease: the log stays small
    ]


def render_config(lines: Sequence[tuple[str, str | None]]) -> str:
    return "".join(f"{k}={v}\n" if v is not None else f"{k}\n" for k, v in lines)


def render_hosts(hosts: Sequence[Host]) -> str:
    """The dhcp-hostsfile: ``MAC,IP,NAME`` per NIC (a VM's first NIC gets its name)."""
    seen: set[str] = set()
    out = []
    for h in sorted(hosts, key=lambda h: ipaddress.IPv4Address(h.ip)):
        name = h.name if h.name not in seen else ""
        seen.add(h.name)
        out.append(",".join(x for x in (h.mac, h.ip, name) if x) + "\n")
    return "".join(out)


def argv(files: Files) -> list[str]:
    """dnsmasq's command line: everything else is in its configuration file."""
    return [binary(), f"--conf-file={files.conf}"]


def binary() -> str:
    path = shutil.which(DNSMASQ, path="/usr/sbin:/usr/bin:/sbin:/bin")
    if path is None:
        raise HostError("dnsmasq is missing; install it with `apt-get install "
                        "dnsmasq-base`.")
    return path
