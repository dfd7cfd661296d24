"""Least privilege with real QEMUs: each VM's QEMU runs under its own unprivileged uid
behind the seccomp sandbox; no other user reaches a RAM file, log or socket; one VM's
uid cannot reach another VM's; and the VMs still boot, run commands, migrate and use
their disks.

Other users are played by real processes: ``setpriv`` runs a small Python probe as
``nobody`` (65534) or as a VM's uid, and it reports the errno of each attempt."""

from __future__ import annotations

import json
import stat
import subprocess
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import Host
from tests.integration.test_migration import WRITE, intact

pytestmark = [pytest.mark.integration, pytest.mark.timeout(600)]

NOBODY = 65534
DENIED = {"EACCES", "EPERM"}
PROBE = r"""
import errno, json, os, socket, sys
out = []
for kind, path in json.loads(sys.argv[1]):
    try:
        if kind == "read":
            os.close(os.open(path, os.O_RDONLY))
        elif kind == "write":
            os.close(os.open(path, os.O_RDWR))
        elif kind == "connect":
            s = socket.socket(socket.AF_UNIX)
            try:
                s.connect(path)
            finally:
                s.close()
        elif kind == "list":
            os.listdir(path)
        out.append("ok")
    except OSError as exc:
        out.append(errno.errorcode.get(exc.errno, str(exc.errno)))
print(json.dumps(out))
"""


def attempt(uid: int, checks: list[tuple[str, Path]]) -> dict[tuple[str, str], str]:
    """Run each (kind, path) as ``uid`` (gid ``uid``, no groups); their outcomes."""
    p = subprocess.run(["setpriv", f"--reuid={uid}", f"--regid={uid}", "--clear-groups",
                        "/usr/bin/python3", "-I", "-c", PROBE,
                        json.dumps([(k, str(p)) for k, p in checks])],
                       capture_output=True, text=True, cwd="/", timeout=30, check=True)
    return dict(zip(((k, str(p)) for k, p in checks), json.loads(p.stdout), strict=True))


def ids(pid: int) -> dict[str, list[int]]:
    """The Uid, Gid and Groups lines of /proc/PID/status, and Seccomp."""
    out: dict[str, list[int]] = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        key, _, value = line.partition(":")
        if key in ("Uid", "Gid", "Groups", "Seccomp"):
            out[key] = [int(v) for v in value.split()]
    return out


def mode_owner(path: Path) -> tuple[int, int, int]:
    st = path.lstat()
    return stat.S_IMODE(st.st_mode), st.st_uid, st.st_gid


def pids(host: Host) -> dict[str, int]:
    return {v["name"]: int(v["pid"]) for v in host.ps()["vms"] if v["pid"]}


def test_each_qemu_runs_as_its_own_uid_and_nobody_reaches_its_files(host: Host) -> None:
    host.run("up")
    running = pids(host)
    assert set(running) == {"vm0", "vm1"}

    # (a) No QEMU runs as root; each VM has its own uid (and gid), no groups; the
    # seccomp sandbox is on (Seccomp: 2 = filter mode).
    uid: dict[str, int] = {}
    for vm, pid in running.items():
        st = ids(pid)
        assert len(set(st["Uid"])) == 1 and st["Uid"][0] != 0, (vm, st)
        assert st["Gid"] == st["Uid"] and st["Groups"] == [], (vm, st)
        assert st["Seccomp"] == [2], (vm, st)
        uid[vm] = st["Uid"][0]
    assert uid["vm0"] != uid["vm1"]
    assert all(u >= 1_500_000_000 for u in uid.values())

    # The modes that make it so.
    assert mode_owner(host.shm) == (0o700, 0, 0)
    for d in (host.runtime, host.runtime / "vms", host.runtime / "partitions"):
        assert mode_owner(d) == (0o711, 0, 0), d
    for vm in running:
        assert mode_owner(host.shm / f"{vm}.ram") == (0o600, uid[vm], uid[vm])
        assert mode_owner(host.runtime / "vms" / vm) == (0o700, uid[vm], uid[vm])
        assert mode_owner(host.home / "vms" / vm)[:2] == (0o700, 0)
    for p in ("p0", "p1"):
        assert mode_owner(host.home / "partitions" / p)[:2] == (0o700, 0)

    # (b) A real unprivileged user reaches no RAM file, log or socket.
    rams = [host.shm / f"{vm}.ram" for vm in running]
    logs = sorted(p for p in (host.home / "vms").rglob("*") if p.is_file())
    socks = sorted(host.runtime.rglob("*.sock"))
    assert {p.name for p in logs} >= {"console.log", "qmp.log", "qemu.log"}
    assert {p.name for p in socks} >= {"qmp.sock", "qga.sock", "console.sock", "p0.sock"}
    checks = ([("read", p) for p in rams + logs] + [("write", p) for p in rams]
              + [("connect", p) for p in socks]
              + [("list", host.shm), ("list", host.runtime / "vms" / "vm0")])
    got = attempt(NOBODY, checks)
    assert set(got.values()) <= DENIED, {k: v for k, v in got.items() if v not in DENIED}

    # (c) vm0's QEMU uid cannot open vm1's RAM file, socket or /proc files ...
    vm1 = host.runtime / "vms" / "vm1"
    checks = [("read", host.shm / "vm1.ram"), ("write", host.shm / "vm1.ram"),
              ("connect", vm1 / "qmp.sock"), ("connect", vm1 / "qga.sock"),
              ("list", vm1), ("read", Path(f"/proc/{running['vm1']}/environ")),
              ("list", Path(f"/proc/{running['vm1']}/fd"))]
    got = attempt(uid["vm0"], checks)
    assert set(got.values()) <= DENIED, {k: v for k, v in got.items() if v not in DENIED}
    # ... while it does reach its own run dir (so the probe can succeed at all).
    assert attempt(uid["vm0"], [("list", host.runtime / "vms" / "vm0")]) == {
        ("list", str(host.runtime / "vms" / "vm0")): "ok"}

    # (d) The VM still works: a command, and a zero-copy move there and back with
    # data written before it intact.
    assert host.run("vm", "exec", "vm0", "--", "/bin/true").code == 0
    md5 = host.run("vm", "exec", "vm0", "--", "/bin/sh", "-c", WRITE).out.split()[0]
    for to in ("p1", "p0"):
        res = host.run("migrate", "vm0", "--to", to, "--json").json()
        assert res["mode"] == "zero-copy"
        vm0 = host.vm("vm0")
        assert vm0["partition"] == to and vm0["state"] == "running"
        st = ids(int(vm0["pid"]))
        assert st["Uid"] == [uid["vm0"]] * 4 and st["Seccomp"] == [2]
        assert intact(host, "vm0")
        assert mode_owner(host.shm / "vm0.ram") == (0o600, uid["vm0"], uid["vm0"])

    # No guest payload in the per-VM log: commands and sizes only.
    qmp_log = (host.home / "vms" / "vm0" / "qmp.log").read_text()
    assert "guest-exec" in qmp_log
    assert md5 not in qmp_log and "/tmp/blob" not in qmp_log and "urandom" not in qmp_log


def test_disk_of_an_unprivileged_qemu(host: Host) -> None:
    host.run("partition", "create", "a", "--cpus", host.core(0), "--memory", "768")
    img = host.home / "disks" / "d0.img"
    host.run("disk", "add", "d0", str(img), "-p", "a", "--size-mib", "16")
    # Created by root under umask 077 in a root-only directory: QEMU's uid could not
    # open it by path; the supervisor passes it as fds.
    assert mode_owner(img)[:2] == (0o600, 0)
    host.run("vm", "create", "va", "-p", "a", "--disk", "d0", "--start")
    va: dict[str, Any] = host.vm("va")
    assert ids(int(va["pid"]))["Uid"][0] != 0
    pattern = "fusuma-disk-" + host.tag
    out = host.run("vm", "exec", "va", "--", "/bin/sh", "-c",
                   f"printf {pattern} | dd of=/dev/vda bs=512 conv=sync,fsync 2>/dev/null"
                   " && echo 3 > /proc/sys/vm/drop_caches"
                   f" && head -c {len(pattern)} /dev/vda")
    assert out.out == pattern
    assert img.read_bytes()[:len(pattern)].decode() == pattern   # it reached the file
    assert mode_owner(img)[:2] == (0o600, 0)
