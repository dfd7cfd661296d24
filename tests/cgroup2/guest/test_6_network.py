"""A managed network on a systemd host (this guest's PID 1, cgroup v2): its dnsmasq's
keeper runs as fusuma-network@lan0.service in fusuma.slice, dnsmasq in that unit's
cgroup; a killed dnsmasq is started again by its keeper with its leases, a killed keeper
by systemd (and the new one adopts the dnsmasq still serving); `down` leaves no unit,
cgroup, bridge, tap, nftables table or dnsmasq.

Everything fusuma makes lives in a network namespace of this module's (fusuma runs under
``nsenter --net``), never in the guest's own: the units get the namespace too
(NetworkNamespacePath=), the partition's supervisor as well, which makes the VM's tap
there; that VM (the minimal image under nested TCG, 128 MiB) gets its lease. A DHCP
client (busybox udhcpc) on a veth port of the bridge, in a second namespace, asks for
the address fusuma recorded for its MAC. One `fusuma up` makes the network, the
partition and the VMs (each CLI call costs seconds under TCG); the tests share them, in
order."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from kit import CGROUP, Fusuma, alive, cgroup_of, close_servers, read, show, wait_for

from fusuma.network.ifnames import table_name
from fusuma.paths import Paths

NS, CLIENT_NS = "cg2-net", "cg2-net-client"
NETNS = Path("/run/netns") / NS
SUBNET = "10.123.7"
UNIT = "fusuma-network@lan0.service"
SUPERVISOR = "fusuma-supervisor@p0.service"
CG = CGROUP / "fusuma.slice" / UNIT
BRIDGE, TABLE = "fzb-lan0", table_name("fusuma", "lan0")
VM_MAC, VM_IP = "52:54:00:c2:06:10", f"{SUBNET}.10"          # v0, a real guest's NIC
CLIENT_MAC, CLIENT_IP = "52:54:00:c2:06:20", f"{SUBNET}.20"  # v1, the veth client's
PATHS = Paths.from_env()
LEASES = PATHS.network_dir("lan0") / "leases"
PIDFILE = PATHS.network_run_dir("lan0") / "dnsmasq.pid"
SPEC_FILE = Path("/run/fusuma-cg2/net.toml")
SPEC = f"""\
[[network]]
name = "lan0"
subnet = "{SUBNET}.0/24"

[[partition]]
name = "p0"
cpus = "1"
memory_mib = 384

[[vm]]
name = "v0"
partition = "p0"
memory_mib = 128
qos = "best-effort"
nics = [{{ network = "lan0", mac = "{VM_MAC}", ip = "{VM_IP}" }}]

[[vm]]
name = "v1"
partition = "p0"
memory_mib = 128
autostart = false
nics = [{{ network = "lan0", mac = "{CLIENT_MAC}", ip = "{CLIENT_IP}" }}]
"""
UDHCPC_SCRIPT = Path("/run/fusuma-cg2/udhcpc.sh")
LEASED = Path("/run/fusuma-cg2/udhcpc.ip")

# What the tests learn on the way (pids), in order.
SEEN: dict[str, float] = {}


def sh(*argv: str, timeout: float = 60) -> str:
    p = subprocess.run(argv, capture_output=True, text=True, timeout=timeout)
    assert p.returncode == 0, f"{' '.join(argv)}: {p.stdout}{p.stderr}"
    return p.stdout


def links(ns: str | None = NS) -> dict[str, dict[str, Any]]:
    where = ["-n", ns] if ns else []
    return {x["ifname"]: x for x in json.loads(sh("ip", *where, "-j", "-d", "link", "show"))}


def tables() -> set[tuple[str, str]]:
    out = json.loads(sh("nsenter", f"--net={NETNS}", "--", "nft", "-j", "list", "tables"))
    return {(t["table"]["family"], t["table"]["name"]) for t in out["nftables"]
            if "table" in t}


def netns_of(path: str | Path) -> tuple[int, int]:
    st = os.stat(path)
    return st.st_dev, st.st_ino


def procs(cgroup: Path) -> set[int]:
    return {int(x) for x in read(cgroup / "cgroup.procs").split()}


def dnsmasq_pid() -> int | None:
    """The live dnsmasq of lan0 (its pidfile, checked against its command line)."""
    try:
        pid = int(PIDFILE.read_text())
        cmd = Path(f"/proc/{pid}/cmdline").read_bytes()
    except (OSError, ValueError):
        return None
    return pid if b"dnsmasq" in cmd and alive(pid) else None


def dnsmasqs() -> list[int]:
    """Every process whose command line names lan0's dnsmasq configuration."""
    conf = f"--conf-file={PATHS.network_run_dir('lan0') / 'dnsmasq.conf'}".encode()
    out = []
    for p in Path("/proc").iterdir():
        if p.name.isdigit():
            try:
                if conf in (p / "cmdline").read_bytes().split(b"\0"):
                    out.append(int(p.name))
            except OSError:
                continue
    return out


def lease_line(mac: str) -> str:
    try:
        text = LEASES.read_text()
    except OSError:
        return ""
    return next((ln for ln in text.splitlines() if f" {mac} " in f" {ln} "), "")


def ask_for_a_lease() -> str:
    """busybox udhcpc on the client's veth: the address dnsmasq gives it."""
    LEASED.unlink(missing_ok=True)
    sh("nsenter", f"--net=/run/netns/{CLIENT_NS}", "--", "/fusuma/bin/busybox", "udhcpc",
       "-i", "eth0", "-f", "-q", "-n", "-t", "5", "-T", "1", "-s", str(UDHCPC_SCRIPT))
    return LEASED.read_text().strip()


@pytest.fixture(scope="module")
def fz() -> Iterator[Fusuma]:
    for ns in (NS, CLIENT_NS):
        sh("ip", "netns", "add", ns)
        sh("ip", "-n", ns, "link", "set", "lo", "up")
    UDHCPC_SCRIPT.parent.mkdir(parents=True, exist_ok=True)
    SPEC_FILE.write_text(SPEC)
    UDHCPC_SCRIPT.write_text(f'#!/bin/sh\n[ "$1" = bound ] && echo "$ip" > {LEASED}\n'
                             "exit 0\n")
    UDHCPC_SCRIPT.chmod(0o755)
    f = Fusuma(wrap=["nsenter", f"--net={NETNS}", "--"])
    try:
        yield f
    finally:
        if "down" not in SEEN:                          # a test failed half-way
            f.run("down", check=False)
        close_servers(f.wrap)                           # its fork server is in NS
        for ns in (CLIENT_NS, NS):
            subprocess.run(["ip", "netns", "del", ns], check=False, capture_output=True)


def test_the_keeper_is_a_unit_in_the_slice_and_dnsmasq_runs_in_its_cgroup(
        fz: Fusuma) -> None:
    # --no-wait: v0 boots (nested TCG, best effort) while the keeper's tests run;
    # test_the_vm_gets_its_lease waits for what matters, its lease.
    out = fz.run("up", str(SPEC_FILE), "--no-wait").out
    assert "create network lan0 (managed)" in out, out
    SEEN["start"] = time.monotonic()                    # v0's QEMU runs
    assert show(UNIT, "ActiveState") == "active"
    assert show(UNIT, "Slice") == "fusuma.slice"
    assert show(UNIT, "ControlGroup") == f"/fusuma.slice/{UNIT}"
    assert show(UNIT, "NetworkNamespacePath") == str(NETNS)
    keeper, dns = int(show(UNIT, "MainPID")), dnsmasq_pid()
    assert dns is not None and dnsmasqs() == [dns]
    # The kernel's view: the keeper and its dnsmasq, alone in the unit's cgroup below
    # fusuma.slice, in fusuma's network namespace (not the guest's own).
    assert cgroup_of(dns) == CG and procs(CG) == {keeper, dns}
    assert netns_of(f"/proc/{dns}/ns/net") == netns_of(NETNS) != netns_of("/proc/1/ns/net")
    assert links()[BRIDGE]["linkinfo"]["info_kind"] == "bridge"
    assert BRIDGE not in links(None)
    assert {("inet", TABLE), ("bridge", TABLE)} <= tables()


def test_a_vm_nic_is_a_tap_made_in_fusumas_namespace(fz: Fusuma) -> None:
    # The supervisor makes the tap and puts it on the bridge: its unit runs there too.
    assert show(SUPERVISOR, "NetworkNamespacePath") == str(NETNS)
    taps = {n: x for n, x in links().items() if n.startswith("fzt-")}
    assert len(taps) == 1, taps
    assert next(iter(taps.values()))["master"] == BRIDGE, taps
    assert not [n for n in links(None) if n.startswith("fzt-")]


def test_a_dhcp_client_on_the_bridge_gets_its_recorded_address(fz: Fusuma) -> None:
    sh("ip", "-n", NS, "link", "add", "cg2c0", "type", "veth", "peer", "name", "eth0",
       "netns", CLIENT_NS)
    sh("ip", "-n", NS, "link", "set", "cg2c0", "master", BRIDGE, "up")
    sh("ip", "-n", CLIENT_NS, "link", "set", "eth0", "address", CLIENT_MAC, "up")
    assert ask_for_a_lease() == CLIENT_IP
    assert CLIENT_IP in lease_line(CLIENT_MAC)


def test_a_killed_dnsmasq_is_started_again_by_its_keeper_with_its_leases(
        fz: Fusuma) -> None:
    old = dnsmasq_pid()
    assert old is not None
    keeper = int(show(UNIT, "MainPID"))
    os.kill(old, signal.SIGKILL)
    wait_for("a new dnsmasq", lambda: dnsmasq_pid() not in (None, old), 20)
    new = dnsmasq_pid()
    assert new is not None
    # The keeper did it, in the unit's cgroup; systemd had nothing to do.
    assert int(show(UNIT, "MainPID")) == keeper and show(UNIT, "NRestarts") == "0"
    assert cgroup_of(new) == CG and procs(CG) == {keeper, new}
    assert CLIENT_IP in lease_line(CLIENT_MAC)          # read back from its lease file
    assert ask_for_a_lease() == CLIENT_IP               # and the new one answers
    SEEN["dnsmasq"] = new


def test_a_killed_keeper_is_restarted_by_systemd_and_adopts_dnsmasq(fz: Fusuma) -> None:
    dns = int(SEEN["dnsmasq"])
    old = int(show(UNIT, "MainPID"))
    os.kill(old, signal.SIGKILL)

    def restarted() -> bool:
        pid = show(UNIT, "MainPID")
        return pid not in ("0", str(old)) and show(UNIT, "ActiveState") == "active"
    wait_for("systemd to start the keeper again", restarted, 20)
    keeper = int(show(UNIT, "MainPID"))
    assert show(UNIT, "NRestarts") == "1"
    assert alive(dns) and dnsmasq_pid() == dns and dnsmasqs() == [dns]
    assert cgroup_of(keeper) == CG and procs(CG) == {keeper, dns}
    log = PATHS.network_dir("lan0") / "keeper.log"
    wait_for("the new keeper to adopt dnsmasq",
             lambda: f"adopted dnsmasq pid {dns}" in log.read_text(), 20)
    st = fz.run("network", "show", "lan0", "--json").json()
    assert (st["keeper_pid"], st["dnsmasq_pid"], st["state"]) == (keeper, dns, "up")


def test_the_vm_gets_its_lease(fz: Fusuma) -> None:
    wait_for("v0's lease", lambda: VM_IP in lease_line(VM_MAC), 240)
    print(f"v0 had its lease {time.monotonic() - SEEN['start']:.0f} s after its start")


def test_down_leaves_nothing(fz: Fusuma) -> None:
    sh("ip", "netns", "del", CLIENT_NS)                 # the client's veth pair with it
    fz.run("down")
    SEEN["down"] = 1
    for unit in (UNIT, SUPERVISOR):
        assert show(unit, "ActiveState") == "inactive", unit
    for d in ("/run/systemd/system", "/run/systemd/system.control"):
        assert not list(Path(d).glob("fusuma-*")), list(Path(d).glob("fusuma-*"))
    wait_for("systemd to remove the unit's cgroup", lambda: not CG.exists(), 10)
    assert dnsmasqs() == []
    assert not [n for n in links() if n.startswith(("fzb-", "fzt-"))]
    assert not [t for t in tables() if t[1].startswith(TABLE)]
    assert not PATHS.network_dir("lan0").exists()
    assert not PATHS.network_run_dir("lan0").exists()
