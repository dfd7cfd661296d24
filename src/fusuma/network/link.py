"""Bridges and taps: the kernel's links of a network (``ip`` for bridges, ioctls on
/dev/net/tun for taps, whose descriptors go to QEMU).

A VM's NIC is a tap that the partition supervisor (root) makes and hands to QEMU as
descriptors (``-netdev tap,fds=...``): QEMU, under its own uid and seccomp sandbox,
never opens /dev/net/tun and never holds CAP_NET_ADMIN. The tap is multiqueue even with
one queue, owned by the VM's uid and not persistent:

- multiqueue, so that a second QEMU of the same VM (a move's destination on this host)
  can attach queues of its own to the same device (TUNSETIFF by name without
  ``IFF_TUN_EXCL``) while the first still runs: the guest keeps its NIC, MAC, address
  and bridge port;
- owned by the VM's uid (TUNSETOWNER), the uid both QEMUs of a move run as, so that
  either may switch its queues on and off (TUNSETQUEUE), which QEMU does as the guest
  enables queues;
- not persistent: the device lives as long as a descriptor of it is open, so a QEMU
  that ends (or is killed) takes its tap with it, and nothing is left to clean up.
"""

from __future__ import annotations

import fcntl
import json
import os
import struct
import subprocess
from pathlib import Path
from typing import Any

from fusuma.errors import HostError, NetworkError
from fusuma.network import queues as q

TUN_DEVICE = "/dev/net/tun"
TUNSETIFF = 0x400454CA
TUNSETOWNER = 0x400454CC
TUNSETGROUP = 0x400454CE
IFF_TAP = 0x0002
IFF_MULTI_QUEUE = 0x0100
IFF_NO_PI = 0x1000
IFF_VNET_HDR = 0x4000
IFF_TUN_EXCL = 0x8000
TAP_FLAGS = IFF_TAP | IFF_NO_PI | IFF_VNET_HDR | IFF_MULTI_QUEUE
MAX_QUEUES = 8


def ip(*args: str) -> str:
    """Run ``ip ARGS``; NetworkError with ip's own words on failure."""
    return command("ip", *args)


def command(tool: str, *args: str) -> str:
    """Run iproute2's ``tool`` (``ip``, ``bridge``) with ``args``; NetworkError with the
    tool's own words on failure."""
    argv = [tool, *args]
    try:
        p = subprocess.run(argv, capture_output=True, text=True, timeout=30)
    except FileNotFoundError as exc:
        raise HostError(f"the `{tool}` command is missing; install iproute2.") from exc
    if p.returncode != 0:
        raise NetworkError(f"`{' '.join(argv)}` failed: {p.stderr.strip()}.", argv=argv,
                           detail=p.stderr)
    return p.stdout


def _show(name: str | None = None) -> list[dict[str, Any]]:
    """``ip -j -d link show [dev NAME]``: the kernel's view of this process's network
    namespace (netlink, not /sys/class/net, which shows the namespace /sys was mounted
    in: fusuma may run under ``nsenter --net``)."""
    argv = ["ip", "-j", "-d", "link", "show", *(["dev", name] if name else [])]
    try:
        p = subprocess.run(argv, capture_output=True, text=True, timeout=30)
    except FileNotFoundError as exc:
        raise HostError("the `ip` command is missing; install iproute2.") from exc
    if p.returncode != 0:
        return []
    try:
        rows = json.loads(p.stdout or "[]")
    except ValueError:
        return []
    return [r for r in rows if isinstance(r, dict)]


def exists(name: str) -> bool:
    return bool(_show(name))


def kind_data(name: str) -> dict[str, Any]:
    """What the kernel says of link ``name``'s kind (``linkinfo.info_data``: a VXLAN's
    id and local address, ...); empty if there is no such link."""
    for r in _show(name):
        return dict(r.get("linkinfo", {}).get("info_data", {}))
    return {}


def is_bridge(name: str) -> bool:
    return any(r.get("linkinfo", {}).get("info_kind") == "bridge" for r in _show(name))


def master(name: str) -> str | None:
    """The bridge ``name`` is a port of, if any."""
    for r in _show(name):
        return str(r["master"]) if "master" in r else None
    return None


def mtu(name: str) -> int | None:
    """Link ``name``'s MTU; None if there is no such link."""
    for r in _show(name):
        return int(r["mtu"])
    return None


def set_mtu(name: str, value: int) -> bool:
    """Give link ``name`` MTU ``value``; True if it had another."""
    if mtu(name) == value:
        return False
    ip("link", "set", "dev", name, "mtu", str(value))
    return True


def address_device(address: str) -> str | None:
    """The link of this namespace that holds IPv4 address ``address``, if any."""
    rows = json.loads(ip("-j", "-4", "addr", "show") or "[]")
    for r in rows:
        if any(a.get("local") == address for a in r.get("addr_info", [])):
            return str(r["ifname"])
    return None


def links(prefix: str) -> list[str]:
    """This namespace's links whose names start with ``prefix``."""
    return sorted(str(r["ifname"]) for r in _show() if str(r.get("ifname", ""))
                  .startswith(prefix))


def sysctl(path: str, value: str) -> bool:
    """Write ``value`` to /proc/sys/``path``; True when it changed."""
    f = Path("/proc/sys") / path
    try:
        if f.read_text().strip() == value:
            return False
        f.write_text(value)
    except OSError as exc:
        raise NetworkError(f"cannot set {path.replace('/', '.')} = {value}: "
                           f"{exc.strerror}.") from exc
    return True


def create_bridge(name: str, gateway_cidr: str | None, mtu: int = 1500) -> None:
    """A bridge with the gateway's address and MTU ``mtu``, up. No IPv6 on it (fusuma's
    networks are IPv4), and route_localnet, so the host's own connections to a loopback
    port forward can leave through it (fusuma.network.nft drops the reverse, a VM
    reaching the host's loopback). The MTU is set once the bridge exists (so the kernel
    counts it as the user's and does not lower it to its ports' minimum; fusuma gives
    every port, taps and VXLAN, the same)."""
    ip("link", "add", name, "type", "bridge")
    try:
        sysctl(f"net/ipv6/conf/{name}/disable_ipv6", "1") if Path(
            f"/proc/sys/net/ipv6/conf/{name}").exists() else None
        if gateway_cidr is not None:
            sysctl(f"net/ipv4/conf/{name}/route_localnet", "1")
            ip("addr", "add", gateway_cidr, "dev", name)
        ip("link", "set", name, "mtu", str(mtu), "up")
    except BaseException:
        delete_link(name)
        raise


def delete_link(name: str) -> bool:
    """Remove link ``name`` if it exists; True if it did."""
    if not exists(name):
        return False
    ip("link", "del", name)
    return True


def _ifreq(name: str, flags: int) -> bytes:
    return struct.pack("16sH22x", name.encode(), flags)


def open_tap(name: str, queues: int, owner: int, bridge: str) -> list[int]:
    """Make tap ``name`` with ``queues`` queues, owned by uid ``owner``, as a port of
    ``bridge`` with the bridge's MTU, up; return one descriptor per queue
    (close-on-exec: the caller passes them to QEMU). A tap of that name that exists
    already is refused (IFF_TUN_EXCL): another QEMU of the VM still holds it. On
    failure nothing stays open."""
    fds: list[int] = []
    try:
        for q in range(queues):
            try:
                fd = os.open(TUN_DEVICE, os.O_RDWR | os.O_CLOEXEC)
            except OSError as exc:
                raise HostError(f"cannot open {TUN_DEVICE} ({exc.strerror}); load the tun "
                                "module (`modprobe tun`).") from exc
            fds.append(fd)
            try:
                fcntl.ioctl(fd, TUNSETIFF, _ifreq(name, TAP_FLAGS | (IFF_TUN_EXCL if q == 0
                                                                     else 0)))
            except OSError as exc:
                if q == 0 and exc.errno == 16:   # EBUSY
                    raise NetworkError(f"tap {name} exists already: another QEMU of this "
                                       "VM still holds it (see `fusuma ps`).") from exc
                raise NetworkError(f"cannot make tap {name}: {exc.strerror}.") from exc
        fcntl.ioctl(fds[0], TUNSETOWNER, owner)
        fcntl.ioctl(fds[0], TUNSETGROUP, owner)
        ip("link", "set", "dev", name, *(("mtu", str(m)) if (m := mtu(bridge)) else ()),
           "master", bridge, "up")
    except BaseException:
        for fd in fds:
            os.close(fd)
        raise
    return fds


def queues_for(vcpus: int) -> int:
    """Queues of a VM's NIC: one per vCPU (multiqueue), at most MAX_QUEUES."""
    return max(1, min(vcpus, MAX_QUEUES))


def join_tap(name: str, queues: int, bridge: str) -> list[int]:
    """Open ``queues`` more queues of tap ``name``, which a running QEMU of the VM
    holds (a move's destination on this host: no ``IFF_TUN_EXCL``), and detach the
    first at once (``fusuma.network.queues``: the one QEMU never switches itself, so
    root attaches it when the move is decided). Refused if the tap is gone: its QEMU
    ended. On failure nothing stays open."""
    if not exists(name):
        raise NetworkError(f"tap {name} does not exist: the VM's running QEMU, which "
                           "holds it, has ended.")
    fds: list[int] = []
    try:
        for _ in range(queues):
            fd = os.open(TUN_DEVICE, os.O_RDWR | os.O_CLOEXEC)
            fds.append(fd)
            try:
                fcntl.ioctl(fd, TUNSETIFF, _ifreq(name, TAP_FLAGS))
            except OSError as exc:
                raise NetworkError(f"cannot open a queue of tap {name}: {exc.strerror}."
                                   ) from exc
        q.set_queue(fds[0], attach=False)
        if master(name) != bridge:
            ip("link", "set", name, "master", bridge)
    except BaseException:
        for fd in fds:
            os.close(fd)
        raise
    return fds
