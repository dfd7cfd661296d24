"""`fusuma network ...`: networks that VMs' NICs attach to (fusuma.network)."""

from __future__ import annotations

import click

from fusuma.cli.common import Ctx, emit_json, pass_ctx, table


@click.group()
def network() -> None:
    """Networks for VMs: bridges with DHCP, DNS, NAT and filtering, or the host's own.

    \b
    managed  a Linux bridge fusuma makes (fzb-NAME), with the subnet's first address
             on it as the VMs' gateway, DHCP and DNS from a dnsmasq of fusuma's own
             (static leases: every NIC's address is recorded when its VM is defined),
             NAT to the host's uplink and port forwards through nftables tables of its
             own (inet/bridge PREFIX-NAME), and filtering: a VM can send only from its
             own MAC and address, and VMs of different networks cannot reach each
             other.
    bridged  a bridge the host already has (--parent br0): VMs sit on that segment,
             fusuma gives no addresses there and filters nothing.

    A VM without --nic keeps QEMU's user-mode network. Each NIC is a tap that the
    partition's supervisor (root) makes and hands to QEMU as descriptors; QEMU never
    gets CAP_NET_ADMIN. Creating and deleting networks needs root (the API's admin
    role); attaching a VM to an existing one is an operator's."""


@network.command("create")
@click.argument("name")
@click.option("--type", "type_", type=click.Choice(["managed", "bridged"]),
              default="managed", show_default=True, help="See `fusuma network --help`.")
@click.option("--subnet", metavar="CIDR", default=None,
              help="managed: an IPv4 private subnet, /16 to /29, that no host route "
                   "overlaps, e.g. 10.0.5.0/24; the gateway is its first address.  "
                   "[default: the first free 10.x.y.0/24 from 10.100.0.0]")
@click.option("--nat/--no-nat", default=None,
              help="managed: masquerade the VMs' traffic leaving by any other interface "
                   "(turns net.ipv4.ip_forward on).  --no-nat: routed only.  [default: nat]")
@click.option("--isolated", is_flag=True,
              help="managed: VMs see only the gateway (and through it, the NAT), never "
                   "each other.")
@click.option("--filtering/--no-filtering", default=None,
              help="managed: drop frames a VM sends from another MAC or IPv4 address than "
                   "its own (DHCP from 0.0.0.0 allowed), and IPv6.  [default: on]")
@click.option("--mtu", type=int, default=None,
              help="managed: the MTU of its bridge and taps, 1280 to 9000; when not 1500, "
                   "dnsmasq tells the guests (DHCP option 26).  [default: 1500; a network "
                   "spanning hosts: the uplink's minus the VXLAN's 50]")
@click.option("--parent", metavar="BRIDGE", default=None,
              help="bridged: the host's bridge to attach to (it must exist).")
@click.option("--json", "as_json", is_flag=True)
@pass_ctx
def create(c: Ctx, name: str, type_: str, subnet: str | None, nat: bool | None,
           isolated: bool, filtering: bool | None, mtu: int | None, parent: str | None,
           as_json: bool) -> None:
    """Create network NAME.

    \b
    Examples:
      fusuma network create lan0 --subnet 10.0.5.0/24
      fusuma network create dmz --subnet 10.0.6.0/24 --isolated
      fusuma network create tun --mtu 1400
      fusuma network create office --type bridged --parent br0
      fusuma vm create web0 -p p0 --nic lan0 --port 0.0.0.0:8080:80 --start"""
    c.nets.create(name, type_, subnet=subnet, parent=parent, nat=nat, isolated=isolated,
                  filtering=filtering, mtu=mtu)
    st = c.nets.status(name)
    if as_json:
        emit_json(st.as_json())
        return
    r = st.record
    if r.managed:
        data = st.as_json()
        click.echo(f"network {name}: managed, bridge {r.bridge}, subnet {r.subnet}, "
                   f"gateway {data['gateway']}, MTU {r.mtu}, dnsmasq pid {st.dnsmasq_pid}")
    else:
        click.echo(f"network {name}: bridged on {r.bridge}")


def network_row(d: dict[str, object]) -> list[str]:
    flags = [f for f in ("nat", "isolated", "filtering") if d.get(f)]
    vms = d.get("vms") or []
    assert isinstance(vms, list)
    return [str(d["name"]), str(d["type"]), str(d["bridge"]), str(d["subnet"] or "-"),
            ",".join(flags) or "-", str(d["mtu"]), str(len(vms)), str(d["state"])]


@network.command("list")
@click.option("--json", "as_json", is_flag=True)
@pass_ctx
def list_(c: Ctx, as_json: bool) -> None:
    """List networks: type, bridge, subnet, options, MTU, VMs and state (--json: each
    with its NICs: VM, MAC, address, tap).

    State: up; no-dhcp (a managed network whose dnsmasq is not running: `fusuma
    network restart NAME`); down (its bridge is gone: `fusuma up`)."""
    from fusuma.views.networks import networks_data

    data = networks_data(c)
    if as_json:
        emit_json(data)
        return
    click.echo(table([network_row(d) for d in data],
                     ["name", "type", "bridge", "subnet", "options", "mtu", "vms",
                      "state"]))


@network.command("show")
@click.argument("name")
@click.option("--json", "as_json", is_flag=True)
@pass_ctx
def show(c: Ctx, name: str, as_json: bool) -> None:
    """Show network NAME and its VMs' NICs (MAC, address, tap, and whether the kernel
    has that tap now: a VM that is not running has none)."""
    from fusuma.views.networks import network_data

    d = network_data(c, name)
    if as_json:
        emit_json(d)
        return
    for key in ("name", "type", "bridge", "subnet", "gateway", "nat", "isolated",
                "filtering", "mtu", "state", "keeper_pid", "dnsmasq_pid"):
        click.echo(f"{key + ':':13}{d[key] if d[key] is not None else '-'}")
    if d["nics"]:
        click.echo()
        click.echo(table([[n["vm"], str(n["index"]), n["mac"], n["ip"] or "-",
                           tap_cell(n)] for n in d["nics"]],
                         ["vm", "nic", "mac", "address", "tap"]))


def tap_cell(n: dict[str, object]) -> str:
    """A NIC's tap as the tables show it: its name, "(none)" when the kernel has no
    such tap (its VM is not running)."""
    if not n["tap"]:
        return "-"
    return str(n["tap"]) + ("" if n["tap_present"] else " (none)")


@network.command("delete")
@click.argument("name")
@pass_ctx
def delete(c: Ctx, name: str) -> None:
    """Delete network NAME: its bridge (managed), nftables tables, dnsmasq and files.

    Refused, naming them, while VMs have NICs on it. A bridged network's parent bridge
    is the host's and stays."""
    c.nets.delete(name)
    click.echo(f"deleted network {name}")


@network.command("restart")
@click.argument("name")
@pass_ctx
def restart(c: Ctx, name: str) -> None:
    """Bring managed network NAME back: its bridge and tables where missing, a new
    keeper and dnsmasq (leases kept)."""
    pid = c.nets.restart(name)
    click.echo(f"network {name}: dnsmasq keeper pid {pid}")
