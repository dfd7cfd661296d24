"""Shared by the move fault tests: a small two-partition host, a guest with known
data, a move held at a chosen phase, and the checks every outcome must pass."""

from __future__ import annotations

import json
import os
import signal
import sqlite3
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tests.conftest import FUSUMA, Host

WRITE = ("dd if=/dev/urandom of=/tmp/blob bs=1M count=8 2>/dev/null && "
         "md5sum /tmp/blob > /tmp/blob.md5 && cat /tmp/blob.md5")

# How long a move is held at a phase: long enough for a handful of CLIs to start and
# find it there. A kill matrix, which only kills, holds it shorter (``hold_move``).
HOLD_S = "4"
# Phase of a move -> (the environment that holds the move there, the job phase that
# says it is there, the mode used).
PHASES: dict[str, tuple[dict[str, str], str, str]] = {
    "prepared": ({"FUSUMA_FAULT_SLEEP_BEFORE_STREAM": HOLD_S}, "prepared", "zero-copy"),
    # Copy mode, throttled: a stream that lasts seconds (zero-copy's lasts ms).
    "mid-stream": ({"FUSUMA_FAULT_STREAM_BYTES_PER_S": str(8 * 2**20)}, "streaming",
                   "copy"),
    "streamed": ({"FUSUMA_FAULT_SLEEP_BEFORE_DECIDE": HOLD_S}, "streamed", "zero-copy"),
    "resumed": ({"FUSUMA_FAULT_SLEEP_AFTER_SWITCH": HOLD_S}, "switched", "zero-copy"),
    "released": ({"FUSUMA_FAULT_SLEEP_AFTER_RELEASE": HOLD_S}, "released", "zero-copy"),
}
TARGETS = ("cli", "source-supervisor", "destination-supervisor", "source-qemu",
           "destination-qemu")


def qemu_pids(host: Host, vm: str, marker: str = "") -> list[int]:
    """This namespace's QEMUs of ``vm`` (other tests may run a vm0 of their own)."""
    out = []
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                cmd = (d / "cmdline").read_bytes().decode(errors="replace")
                stat = (d / "stat").read_text()
            except OSError:
                continue
            if f"guest={vm},debug-threads=on" in cmd and marker in cmd \
                    and f"{host.runtime}/" in cmd \
                    and stat.rsplit(")", 1)[1].split()[0] not in ("Z", "X"):
                out.append(int(d.name))
    return out


def job(host: Host, vm: str) -> dict[str, Any] | None:
    con = sqlite3.connect(str(host.home / "state.db"), timeout=30)
    try:
        row = con.execute("SELECT phase, detail, owner_pid FROM jobs WHERE obj=?",
                          (f"vm:{vm}",)).fetchone()
    finally:
        con.close()
    if row is None:
        return None
    return {"phase": row[0], "detail": json.loads(row[1] or "{}"), "owner_pid": row[2]}


@dataclass(frozen=True)
class Nic:
    """A NIC for the guest (a host whose commands run in a network namespace): its
    managed network, that network's subnet, the guest's address on it."""

    network: str
    subnet: str
    ip: str


def two_partitions(host: Host, vm: str = "vm0", nic: Nic | None = None) -> str:
    """p0 (core 0) runs ``vm`` with 8 MiB of known data (and ``nic``, its address
    leased); p1 (core 1) is empty. Returns the data's md5 line."""
    host.run("partition", "create", "p0", "--cpus", host.core(0), "--memory", "1024")
    host.run("partition", "create", "p1", "--cpus", host.core(1), "--memory", "1024")
    extra = []
    if nic is not None:
        host.run("network", "create", nic.network, "--subnet", nic.subnet)
        extra = ["--nic", f"{nic.network},ip={nic.ip}"]
    host.run("vm", "create", vm, "-p", "p0", *extra, "--start")
    if nic is not None:
        host.run("vm", "exec", vm, "--", "/bin/sh", "-c",
                 f"for i in $(seq 90); do ip -4 -o addr show eth0 | grep -q "
                 f"'inet {nic.ip}/' && exit 0; sleep 1; done; exit 1")
    return host.run("vm", "exec", vm, "--", "/bin/sh", "-c", WRITE).out.strip()


def ready(host: Host, vm: str = "vm0", nic: Nic | None = None) -> str:
    """The start of a case on a host shared by a module's cases (``module_host``): p0
    and p1 running, ``vm`` running in p0 with its known data. Only what the previous
    case changed is made again (a move back, the data after a guest was lost); a host
    in any other state is taken down and built anew. Returns the data's md5 line."""
    try:
        ps = host.ps()
        parts = {p["name"]: p["state"] for p in ps["partitions"]}
        v = next((v for v in ps["vms"] if v["name"] == vm), None)
    except (AssertionError, ValueError):
        parts, v = {}, None
    if parts != {"p0": "running", "p1": "running"} or v is None \
            or v["state"] != "running" or len(qemu_pids(host, vm)) != 1:
        host.run("down", check=False, timeout=120)
        return two_partitions(host, vm, nic)
    if v["partition"] != "p0":
        host.run("migrate", vm, "--to", "p0")
    res = host.run("vm", "exec", vm, "--", "/bin/sh", "-c", "cat /tmp/blob.md5 && "
                   "md5sum -c /tmp/blob.md5 >/dev/null", check=False)
    if res.code == 0:
        return res.out.strip()
    return host.run("vm", "exec", vm, "--", "/bin/sh", "-c", WRITE).out.strip()


def intact(host: Host, vm: str) -> bool:
    res = host.run("vm", "exec", vm, "--", "/bin/sh", "-c", "md5sum -c /tmp/blob.md5",
                   check=False)
    return res.code == 0


@dataclass
class Held:
    proc: subprocess.Popen[str]
    mode: str
    pids: dict[str, int | None]


def hold_move(host: Host, phase: str, vm: str = "vm0", to: str = "p1",
              hold: str | None = None) -> Held:
    """Start moving ``vm`` to ``to`` and return once it is held at ``phase`` (for
    ``hold`` seconds instead of HOLD_S, if given)."""
    env_extra, job_phase, mode = PHASES[phase]
    if hold is not None:
        env_extra = {k: hold if v == HOLD_S else v for k, v in env_extra.items()}
    ps = host.ps()
    sup = {p["name"]: p["supervisor_pid"] for p in ps["partitions"]}
    src_qemu = next(v["pid"] for v in ps["vms"] if v["name"] == vm)
    proc = subprocess.Popen([*host.wrap, *FUSUMA, "migrate", vm, "--to", to, "--mode", mode],
                            env={**host.env, **env_extra}, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        j = job(host, vm)
        if j is not None and j["phase"] == job_phase:
            break
        if proc.poll() is not None:
            raise AssertionError(f"the move ended before phase {job_phase}: "
                                 f"{proc.communicate()}")
        time.sleep(0.01)
    else:
        raise AssertionError(f"the move never reached phase {job_phase}")
    if phase == "mid-stream":
        time.sleep(0.5)
    # The destination's QEMU runs in an in-* dir; the source's may too, if the guest
    # came to it by an earlier move (its command line keeps the paths it started with).
    dest = [p for p in qemu_pids(host, vm, "/in-") if p != src_qemu]
    return Held(proc, mode, {
        "cli": proc.pid, "source-supervisor": sup["p0"], "destination-supervisor": sup["p1"],
        "source-qemu": src_qemu if src_qemu in qemu_pids(host, vm) else None,
        "destination-qemu": dest[0] if dest else None})


def wait_resolved(host: Host, held: Held, vm: str = "vm0", timeout: float = 30) -> float:
    """Seconds until the move's job is gone (finished, undone or recovered)."""
    t0 = time.monotonic()
    deadline = t0 + timeout
    while time.monotonic() < deadline:
        if held.proc.poll() is not None and job(host, vm) is None:
            return time.monotonic() - t0
        time.sleep(0.05)
    raise AssertionError(f"the move's job is still there after {timeout:.0f} s: "
                         f"{job(host, vm)}")


def kill(pid: int | None) -> bool:
    if pid is None:
        return False
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        return False
    return True


def check_truth(host: Host, vm: str = "vm0") -> dict[str, Any]:
    """At most one QEMU runs the guest; ps says exactly what runs; data intact."""
    for p in host.ps()["partitions"]:
        if p["state"] != "running":    # a killed supervisor: what an operator (or
            host.run("partition", "restart", p["name"])   # systemd) does next
    pids = qemu_pids(host, vm)
    assert len(pids) <= 1, f"two QEMUs run {vm}: {pids}"
    v = host.vm(vm)
    out: dict[str, Any] = {"state": v["state"], "partition": v["partition"]}
    assert not list((host.runtime / "vms" / vm).glob("in-*")), "unsettled destination"
    if pids:
        assert v["state"] == "running" and v["pid"] == pids[0], (v, pids)
        assert intact(host, vm), "the guest's data changed"
        out["checksum"] = "intact"
        rams = sorted(p.name for p in host.shm.glob(f"{vm}*.ram"))
        assert len(rams) == 1, rams     # its own RAM file, and no other left
    else:
        assert v["state"] == "crashed", v
        out["checksum"] = "guest lost"
        assert not list(host.shm.glob(f"{vm}*.ram")), "a dead guest's RAM file was left"
    return out


def next_move_works(host: Host, vm: str = "vm0") -> None:
    v = host.vm(vm)
    if v["state"] == "crashed":
        host.run("vm", "start", vm)
        host.run("vm", "exec", vm, "--", "/bin/true")
    to = "p1" if host.vm(vm)["partition"] == "p0" else "p0"
    res = host.run("migrate", vm, "--to", to, "--json").json()
    assert res["to"] == to
    assert host.vm(vm)["partition"] == to and len(qemu_pids(host, vm)) == 1
    assert host.run("vm", "exec", vm, "--", "/bin/true").code == 0
