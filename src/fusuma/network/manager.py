"""The operations on networks (create, delete, bring back after a reboot) and on the
NICs of a VM being defined, as the CLI, the API and ``fusuma up`` run them.

Each operation checks everything first (so a refused request changes nothing), then
makes the kernel's objects in a transaction (fusuma.undo.Reverter): the record, the
bridge, the nftables tables, dnsmasq's files and its keeper; a failure half-way undoes
what was made.
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import signal
import subprocess
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from fusuma import spawn
from fusuma.errors import (
    ConflictError,
    FusumaError,
    HostError,
    NetworkError,
    SpecError,
    StateError,
)
from fusuma.frozen import frozen
from fusuma.names import check_name
from fusuma.network import addr, dnsmasq, ifnames, keeper, link, nft
from fusuma.paths import PASSABLE_DIR, PRIVATE_DIR, Paths, ensure_dir
from fusuma.qemu import process
from fusuma.state import Database, NetworkRecord, NicRecord
from fusuma.state.lock import locked
from fusuma.undo import Reverter

if TYPE_CHECKING:
    from fusuma.host.systemd import Units

LOG = logging.getLogger(__name__)
TYPES = ("managed", "bridged")


@frozen
class NicRequest:
    """A NIC a VM asks for: ``NET[,mac=..][,ip=..]``."""

    network: str
    mac: str | None = None
    ip: str | None = None


def parse_nic(text: str) -> NicRequest:
    """``NET[,mac=MAC][,ip=ADDR]`` as the CLI takes it."""
    name, *opts = text.split(",")
    fields: dict[str, str] = {}
    for o in opts:
        k, eq, v = o.partition("=")
        if not eq or k not in ("mac", "ip") or k in fields:
            raise SpecError(f"NIC {text!r}: {o!r} is not mac=MAC or ip=ADDR (each once); "
                            "write NET[,mac=52:54:00:..][,ip=10.0.5.9].")
        fields[k] = v
    check_name("network", name)
    return NicRequest(name, fields.get("mac"), fields.get("ip"))


@frozen
class NetworkStatus:
    record: NetworkRecord
    bridge_up: bool
    keeper_pid: int | None
    dnsmasq_pid: int | None
    users: list[str]

    @property
    def state(self) -> str:
        if not self.bridge_up:
            return "down"
        if self.record.managed and self.dnsmasq_pid is None:
            return "no-dhcp"
        return "up"

    def as_json(self) -> dict[str, object]:
        r = self.record
        gateway = None
        if r.subnet:
            gateway = str(addr.parse_subnet(r.subnet).gateway)
        return {"name": r.name, "type": r.type, "bridge": r.bridge, "subnet": r.subnet,
                "gateway": gateway, "nat": r.nat, "isolated": r.isolated,
                "filtering": r.filtering, "mtu": r.mtu, "state": self.state,
                "keeper_pid": self.keeper_pid, "dnsmasq_pid": self.dnsmasq_pid,
                "vms": self.users}


class NetworkManager:
    def __init__(self, paths: Paths, db: Database,
                 notice: Callable[[str], None] | None = None) -> None:
        self.paths = paths
        self.db = db
        self.notice = notice or (lambda text: LOG.warning("%s", text))

    # -- names ------------------------------------------------------------------------
    def table(self, network: str) -> str:
        return ifnames.table_name(self.paths.cgroup_prefix, network)

    def files(self, network: str) -> dnsmasq.Files:
        return keeper.files(self.paths, network)

    # -- create -----------------------------------------------------------------------
    def _pick_subnet(self, routes: Sequence[addr.Route]) -> addr.Subnet:
        others = [n.subnet for n in self.db.networks() if n.subnet]
        for a in range(100, 200):
            for b in range(256):
                s = addr.parse_subnet(f"10.{a}.{b}.0/24")
                with contextlib.suppress(ConflictError):
                    addr.check_overlap(s, routes, [("", o) for o in others])
                    return s
        raise ConflictError("no free /24 found in 10.100.0.0-10.199.255.0; give --subnet.")

    def check_create(self, name: str, type_: str, subnet: str | None, parent: str | None,
                     nat: bool | None, isolated: bool, filtering: bool | None,
                     mtu: int | None = None) -> NetworkRecord:
        """Every refusal of ``create``, before anything changes; the record to make."""
        check_name("network", name)
        if type_ not in TYPES:
            raise SpecError(f"network type {type_!r} is not managed or bridged.")
        if self.db.find_network(name) is not None:
            raise ConflictError(f"a network named {name!r} already exists.")
        if type_ == "bridged":
            given = [o for o, v in (("--subnet", subnet), ("--nat", nat),
                                    ("--filtering", filtering),
                                    ("--mtu", mtu is not None)) if v]
            if isolated:
                given.append("--isolated")
            if given:
                raise SpecError(f"network {name!r} is bridged: {', '.join(given)} belong "
                                "to managed networks (a bridged one has no DHCP, NAT or "
                                "filtering of fusuma's, and its bridge's MTU is the "
                                "host's).")
            if not parent:
                raise SpecError(f"bridged network {name!r} needs --parent BRIDGE, a bridge "
                                "the host has (`ip link show type bridge`).")
            if not link.exists(parent):
                raise SpecError(f"parent bridge {parent!r} does not exist; create it first "
                                "or name one of `ip link show type bridge`.")
            if not link.is_bridge(parent):
                raise SpecError(f"{parent!r} is not a bridge (`ip -d link show {parent}`); "
                                "name a Linux bridge.")
            for other in self.db.networks():
                if other.bridge == parent:
                    raise ConflictError(f"bridge {parent} is network {other.name}'s "
                                        "already; attach VMs to that network.")
            return NetworkRecord(name=name, type=type_, bridge=parent,
                                 mtu=link.mtu(parent) or addr.DEFAULT_MTU)
        if parent:
            raise SpecError(f"network {name!r} is managed: fusuma makes its bridge; "
                            "--parent is for bridged networks.")
        addr.check_mtu(addr.DEFAULT_MTU if mtu is None else mtu)
        nft.check_installed()
        dnsmasq.binary()
        routes = addr.host_routes()
        others = [(n.name, n.subnet) for n in self.db.networks() if n.subnet]
        sub = addr.parse_subnet(subnet) if subnet else self._pick_subnet(routes)
        addr.check_overlap(sub, routes, others)
        bridge = ifnames.bridge_name(name)
        if link.exists(bridge) or any(n.bridge == bridge for n in self.db.networks()):
            raise ConflictError(f"interface {bridge} exists already (another fusuma's, or "
                                f"left over): remove it (`ip link del {bridge}`) or pick "
                                "another network name.")
        return NetworkRecord(name=name, type=type_, bridge=bridge, subnet=sub.cidr,
                             nat=True if nat is None else nat, isolated=isolated,
                             filtering=True if filtering is None else filtering,
                             mtu=addr.DEFAULT_MTU if mtu is None else mtu)

    @locked
    def create(self, name: str, type_: str = "managed", *, subnet: str | None = None,
               parent: str | None = None, nat: bool | None = None,
               isolated: bool = False, filtering: bool | None = None,
               mtu: int | None = None) -> NetworkRecord:
        rec = self.check_create(name, type_, subnet, parent, nat, isolated, filtering, mtu)
        with Reverter() as rev:
            self.db.add_network(rec)
            rev.add(lambda: self.db.remove_network(name), "record")
            if rec.managed:
                rev.add(lambda: self._remove_kernel(rec), "bridge, tables, dnsmasq")
                self._make_kernel(rec)
            rev.commit()
        return self.db.network(name)

    def _make_kernel(self, rec: NetworkRecord) -> list[str]:
        """Bring a managed network's bridge, tables and dnsmasq up where missing;
        returns what was made."""
        done = []
        assert rec.subnet is not None
        sub = addr.parse_subnet(rec.subnet)
        if not link.exists(rec.bridge):
            link.create_bridge(rec.bridge, sub.gateway_cidr(), rec.mtu)
            done.append(f"bridge {rec.bridge}")
        elif link.set_mtu(rec.bridge, rec.mtu):
            done.append(f"MTU {rec.mtu} on {rec.bridge}")
        if rec.nat and link.sysctl("net/ipv4/ip_forward", "1"):
            self.notice("fusuma: notice: IPv4 forwarding was off; turned on "
                        "(net.ipv4.ip_forward = 1) for network "
                        f"{rec.name}'s NAT.")
        self.refresh(rec.name)
        done.append(f"nftables tables {self.table(rec.name)}")
        if keeper.keeper_pid(self.paths, rec.name, rec.keeper_pid) is None:
            self.db.set_keeper_pid(rec.name, self.start_keeper(rec))
            done.append(f"dnsmasq of {rec.name}")
        return done

    def _remove_kernel(self, rec: NetworkRecord) -> None:
        self.stop_keeper(rec)
        for family in ("inet", "bridge"):
            nft.delete(family, self.table(rec.name))
        # A network that spanned hosts (fusuma.network.span): its VXLAN port and table.
        link.delete_link(ifnames.vxlan_name(rec.name))
        nft.delete("bridge", ifnames.span_table_name(self.paths.cgroup_prefix, rec.name))
        if rec.managed:
            link.delete_link(rec.bridge)
        shutil.rmtree(self.paths.network_run_dir(rec.name), ignore_errors=True)
        shutil.rmtree(self.paths.network_dir(rec.name), ignore_errors=True)

    # -- delete -----------------------------------------------------------------------
    @locked
    def delete(self, name: str) -> None:
        rec = self.db.network(name)
        users = self.db.network_users(name)
        if users:
            raise StateError(f"network {name!r} is used by VM(s) {', '.join(users)}; "
                             "delete them (or their NICs) first.")
        kept = [t.name for t in self.db.templates() if name in t.networks]
        if kept:
            raise StateError(f"network {name!r} is kept by template(s) {', '.join(kept)} "
                             "(their clones get NICs on it); delete them first.")
        if rec.managed:
            self._remove_kernel(rec)
        self.db.remove_network(name)

    @locked
    def ensure(self, name: str) -> list[str]:
        """Bring network ``name`` back as its record says (after a reboot, a killed
        keeper); returns what was made."""
        rec = self.db.network(name)
        if not rec.managed:
            if not link.is_bridge(rec.bridge):
                raise NetworkError(f"network {name}'s parent bridge {rec.bridge} is "
                                   "gone; create it again (fusuma does not own it).")
            return []
        return self._make_kernel(rec)

    @locked
    def set_mtu(self, name: str, mtu: int) -> bool:
        """Give managed network ``name`` MTU ``mtu``: its record, its bridge and the taps
        on it now, and dnsmasq's option (guests learn it at their next lease renewal);
        True if it had another."""
        rec = self.db.network(name)
        addr.check_mtu(mtu)
        if not rec.managed or rec.mtu == mtu:
            return False
        self.db.set_network_mtu(name, mtu)
        if link.exists(rec.bridge):
            link.set_mtu(rec.bridge, mtu)
        for p in self.ports(name):
            if link.exists(p.tap):
                link.set_mtu(p.tap, mtu)
        self.refresh(name)
        return True

    # -- the kernel's side of NICs ----------------------------------------------------
    def managed_net(self, rec: NetworkRecord) -> nft.ManagedNet:
        assert rec.subnet is not None
        return nft.ManagedNet(table=self.table(rec.name), bridge=rec.bridge,
                              subnet=rec.subnet, nat=rec.nat, isolated=rec.isolated,
                              filtering=rec.filtering)

    def ports(self, network: str) -> list[nft.Port]:
        out = []
        for n in self.db.nics(network=network):
            vm = self.db.find_vm(n.vm)
            if vm is not None and vm.slot:
                out.append(nft.Port(ifnames.tap_name(vm.slot, n.index), n.mac, n.ip))
        return out

    def forwards(self, network: str) -> list[nft.Forward]:
        """Port forwards to VMs whose first managed NIC is on ``network``."""
        out = []
        for vm in self.db.vms():
            nic = first_managed(self.db, self.db.nics(vm=vm.name))
            if nic is None or nic.network != network or nic.ip is None:
                continue
            for p in vm.ports:
                f = addr.parse_forward(p)
                out.append(nft.Forward(f.addr, f.host_port, nic.ip, f.guest_port))
        return out

    def refresh(self, name: str) -> None:
        """Render network ``name``'s tables and dnsmasq files from the records and put
        them in place (tables atomically; dnsmasq re-reads its hosts on SIGHUP)."""
        rec = self.db.network(name)
        if not rec.managed:
            return
        nft.apply(nft.network_tables(self.managed_net(rec), self.ports(name),
                                     self.forwards(name)))
        self.write_files(rec)
        pid = keeper.dnsmasq_pid(self.files(name))
        if pid is not None:
            process.kill(pid, signal.SIGHUP)

    def write_files(self, rec: NetworkRecord) -> None:
        assert rec.subnet is not None
        self.paths.ensure_runtime()
        ensure_dir(self.paths.network_run_dir(rec.name), PASSABLE_DIR)
        ensure_dir(self.paths.network_dir(rec.name), PRIVATE_DIR)
        f = self.files(rec.name)
        sub = addr.parse_subnet(rec.subnet)
        conf = dnsmasq.render_config(dnsmasq.config(
            rec.bridge, rec.subnet, str(sub.gateway), rec.name, f, dnsmasq.user(),
            rec.mtu))
        hosts = dnsmasq.render_hosts([dnsmasq.Host(n.mac, n.ip, n.vm)
                                      for n in self.db.nics(network=rec.name) if n.ip])
        for path, text in ((f.conf, conf), (f.hosts, hosts)):
            tmp = path.with_suffix(".tmp")
            tmp.write_text(text)
            tmp.chmod(0o644)
            tmp.replace(path)

    # -- the keeper -------------------------------------------------------------------
    def units(self) -> Units | None:
        """fusuma's systemd units where supervisors run as units (then each network's
        keeper is one too, in fusuma's slice), else None."""
        from fusuma.host import cgroups
        from fusuma.host.cgroups import CgroupSystemdDriver

        try:
            cg = cgroups.for_paths(self.paths)
        except FusumaError:
            return None
        return cg.units if isinstance(cg, CgroupSystemdDriver) else None

    def start_keeper(self, rec: NetworkRecord, timeout: float = 15.0) -> int:
        """Start network ``rec``'s keeper; return its pid once dnsmasq runs."""
        log = self.paths.network_dir(rec.name) / "keeper.log"
        units = self.units()
        if units is not None:
            return self._start_keeper_unit(units, rec, log, timeout)
        env = spawn.child_env({**os.environ, **self.paths.as_env()})
        with open(log, "ab") as out:
            child = subprocess.Popen(spawn.module_argv(keeper.KEEPER_MODULE, rec.name),
                                     stdin=subprocess.DEVNULL, stdout=out, stderr=out,
                                     start_new_session=True, close_fds=True, env=env,
                                     cwd=spawn.CWD)
        deadline = time.monotonic() + timeout
        f = self.files(rec.name)
        while time.monotonic() < deadline:
            if child.poll() is not None:
                raise NetworkError(f"the dnsmasq keeper of network {rec.name!r} exited at "
                                   f"start: {process.tail(log, 1)}")
            if keeper.dnsmasq_pid(f) is not None:
                return child.pid
            time.sleep(0.05)
        self._end(child.pid)
        child.wait()
        raise NetworkError(f"dnsmasq of network {rec.name!r} did not come up in "
                           f"{timeout:.0f} s: {process.tail(log, 1)} (see {log}).")

    def _start_keeper_unit(self, units: Units, rec: NetworkRecord, log: Path,
                           timeout: float) -> int:
        """Start the keeper as ``fusuma-network@INSTANCE`` and wait for its dnsmasq; a
        unit that fails is stopped again and says why."""
        from fusuma.host import systemd

        unit = units.network(rec.name)
        # The unit gets this namespace's settings (and a checkout's PYTHONPATH), not
        # the CLI's whole environment.
        env = spawn.child_env({k: v for k, v in os.environ.items()
                               if k.startswith("FUSUMA_") or k == "PYTHONPATH"})
        env.update(self.paths.as_env())
        try:
            units.install()
            units.write_network(rec.name, env, log,
                                systemd.named_netns("a network's dnsmasq keeper"))
            units.start(unit)
        except HostError as exc:
            units.forget(unit)
            raise NetworkError(f"the dnsmasq keeper of network {rec.name!r} did not "
                               f"start: {exc}") from exc
        deadline = time.monotonic() + timeout
        f = self.files(rec.name)
        active = units.active_check(unit)
        while time.monotonic() < deadline:
            if keeper.dnsmasq_pid(f) is not None:
                pid = units.main_pid(unit)
                if pid is not None:
                    return pid
            if not active():
                why = process.tail(log, 1) or units.why_failed(unit)
                units.forget(unit)
                raise NetworkError(f"the dnsmasq keeper of network {rec.name!r} ({unit}) "
                                   f"exited at start: {why}")
            time.sleep(0.05)
        units.forget(unit)
        raise NetworkError(f"dnsmasq of network {rec.name!r} did not come up in "
                           f"{timeout:.0f} s: {process.tail(log, 1)} (see {log} and "
                           f"`systemctl status {unit}`).")

    def stop_keeper(self, rec: NetworkRecord) -> bool:
        """End the keeper and its dnsmasq (an orphaned dnsmasq too, by its checked
        pid); True if anything was running. Where the keeper is a systemd unit, the
        unit is stopped and its drop-ins removed."""
        units = self.units() if rec.managed else None
        was = False
        if units is not None:
            unit = units.network(rec.name)
            was = units.active(unit)
            units.forget(unit)
        pid = keeper.keeper_pid(self.paths, rec.name, rec.keeper_pid)
        was = was or pid is not None
        if pid is not None:
            self._end(pid)
        dpid = keeper.dnsmasq_pid(self.files(rec.name))
        if dpid is not None:
            self._end(dpid)
            was = True
        with contextlib.suppress(FusumaError):
            self.db.set_keeper_pid(rec.name, None)
        return was

    @staticmethod
    def _end(pid: int, timeout: float = 10.0) -> None:
        process.kill(pid, signal.SIGTERM)
        deadline = time.monotonic() + timeout
        while process.pid_alive(pid) and time.monotonic() < deadline:
            with contextlib.suppress(ChildProcessError):
                os.waitpid(pid, os.WNOHANG)
            time.sleep(0.05)
        if process.pid_alive(pid):
            process.kill(pid)
        with contextlib.suppress(ChildProcessError):
            os.waitpid(pid, os.WNOHANG)

    @locked
    def restart(self, name: str) -> int:
        """A new keeper (and dnsmasq) for managed network ``name``."""
        rec = self.db.network(name)
        if not rec.managed:
            raise StateError(f"network {name!r} is bridged: it has no dnsmasq of fusuma's.")
        self.stop_keeper(rec)
        self._make_kernel(self.db.network(name))
        return int(self.db.network(name).keeper_pid or 0)

    # -- reading ----------------------------------------------------------------------
    def status(self, name: str) -> NetworkStatus:
        rec = self.db.network(name)
        return NetworkStatus(rec, link.is_bridge(rec.bridge),
                             keeper.keeper_pid(self.paths, name, rec.keeper_pid),
                             keeper.dnsmasq_pid(self.files(name)) if rec.managed else None,
                             self.db.network_users(name))

    def statuses(self) -> list[NetworkStatus]:
        return [self.status(n.name) for n in self.db.networks()]

    # -- NICs of a VM being defined ---------------------------------------------------
    def plan_nics(self, vm: str, wanted: Sequence[NicRequest],
                  ports: Sequence[str]) -> list[NicRecord]:
        """The NIC records of VM ``vm`` (MACs generated once, addresses checked or
        allocated), and a check of its port forwards; nothing is written."""
        all_nics = self.db.nics()
        macs = {n.mac: n.vm for n in all_nics}
        out: list[NicRecord] = []
        for i, req in enumerate(wanted):
            net = self.db.network(req.network)
            if req.mac is not None:
                mac = addr.check_mac(req.mac)
                owner = macs.get(mac) or next((n.vm for n in out if n.mac == mac), None)
                if owner is not None:
                    raise ConflictError(f"MAC {mac} is already VM {owner}'s NIC; pick "
                                        "another or leave mac= out.")
            else:
                mac = addr.new_mac([*macs, *(n.mac for n in out)])
            ip = None
            if net.managed:
                assert net.subnet is not None
                sub = addr.parse_subnet(net.subnet)
                taken = {n.ip: n.vm for n in [*all_nics, *out]
                         if n.network == net.name and n.ip}
                ip = (addr.check_ip(sub, req.ip, taken) if req.ip is not None
                      else addr.allocate_ip(sub, taken))
            elif req.ip is not None:
                raise SpecError(f"network {net.name!r} is bridged: fusuma gives no "
                                "addresses there (its own DHCP, if any, does); leave ip= "
                                "out.")
            out.append(NicRecord(vm=vm, index=i, network=net.name, mac=mac, ip=ip))
        self.check_ports(vm, out, ports)
        return out

    def nic_mtus(self, nics: Sequence[NicRecord]) -> list[tuple[str, int]]:
        """(MAC, MTU) of the NICs on managed networks whose MTU is not 1500: what a
        cloud-init guest's network-config sets (fusuma.images.seed)."""
        mtus = {n.name: n.mtu for n in self.db.networks() if n.managed}
        return [(n.mac, mtus[n.network]) for n in nics
                if mtus.get(n.network, addr.DEFAULT_MTU) != addr.DEFAULT_MTU]

    def check_ports(self, vm: str, nics: Sequence[NicRecord], ports: Sequence[str]) -> None:
        mine = [addr.parse_forward(p) for p in ports]
        if not mine:
            return
        if nics and first_managed(self.db, nics) is None:
            raise SpecError(f"VM {vm!r} has NICs on bridged networks only: port forwards "
                            "need a NIC on a managed network (fusuma's NAT), or no NIC "
                            "(user-mode networking).")
        if not nics:
            odd = [f for f in mine if f.addr != addr.LOOPBACK]
            if odd:
                raise SpecError(f"port forward {odd[0].addr}:{odd[0].host_port}: a VM "
                                "without --nic forwards from 127.0.0.1 only (QEMU's "
                                "user-mode network); give it a NIC on a managed network "
                                "to forward from other addresses.")
        others = {v.name: [addr.parse_forward(p) for p in v.ports]
                  for v in self.db.vms() if v.name != vm and v.ports}
        local = addr.host_addresses() if nics else None
        addr.check_forwards(mine, others, local)
        if nics:
            addr.check_free(mine, addr.host_listeners())


def first_managed(db: Database, nics: Sequence[NicRecord]) -> NicRecord | None:
    """The NIC that port forwards go to: the VM's first on a managed network."""
    for n in sorted(nics, key=lambda n: n.index):
        rec = db.find_network(n.network)
        if rec is not None and rec.managed:
            return n
    return None
