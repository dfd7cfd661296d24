"""The kernel names of a network's objects: its bridge, its nftables tables, each NIC's
tap. Pure functions of fusuma's own names, so that every process (the CLI, a partition
supervisor, a move's other side) derives the same name without asking anyone.

Linux interface names hold at most 15 characters (IFNAMSIZ - 1). Every bridge fusuma
makes starts with ``fzb-`` and every tap with ``fzt-``: nftables rules match the
prefixes (``"fzb-*"``) to keep VMs of different networks apart, and a reader of
``ip link`` sees at once what is fusuma's.
"""

from __future__ import annotations

import hashlib

IFNAMSIZ = 15
BRIDGE_PREFIX = "fzb-"
TAP_PREFIX = "fzt-"
VXLAN_PREFIX = "fzv-"


def _fit(prefix: str, name: str) -> str:
    """``prefix + name`` if it fits in an interface name, else a cut of ``name`` with a
    hash of the whole, so two long names never share an interface name."""
    if len(prefix) + len(name) <= IFNAMSIZ:
        return prefix + name
    digest = hashlib.sha256(name.encode()).hexdigest()[:4]
    room = IFNAMSIZ - len(prefix) - len(digest) - 1
    return f"{prefix}{name[:room]}-{digest}"


def bridge_name(network: str) -> str:
    """The bridge of managed network ``network``: ``fzb-NAME`` (cut with a hash when
    long)."""
    return _fit(BRIDGE_PREFIX, network)


def tap_name(slot: int, index: int) -> str:
    """The tap of NIC ``index`` of the VM in ``slot`` (its record's rowid, which also
    names its QEMU's uid: fusuma.qemu.privilege): ``fzt-SLOT-INDEX``. It names the VM
    and the NIC, not a QEMU: both QEMUs of a move attach to the same tap."""
    if not 0 < slot < 10**7 or not 0 <= index < 100:
        raise ValueError(f"no tap name for slot {slot}, NIC {index}")
    return f"{TAP_PREFIX}{slot}-{index}"


def table_name(prefix: str, network: str) -> str:
    """The nftables tables of network ``network`` (one ``inet``, one ``bridge``):
    ``PREFIX-NAME``, with this host's cgroup prefix (``fusuma`` unless a test or a
    second fusuma sets FUSUMA_CGROUP_PREFIX), so nothing else's table is ever touched."""
    return f"{prefix}-{network}"


def vxlan_name(network: str) -> str:
    """The VXLAN port of a network that spans hosts (fusuma.network.span): ``fzv-NAME``."""
    return _fit(VXLAN_PREFIX, network)


def span_table_name(prefix: str, network: str) -> str:
    """The bridge table that keeps a spanning network's gateway and DHCP to each host."""
    return f"{table_name(prefix, network)}-span"
