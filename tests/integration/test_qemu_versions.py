"""Several QEMU versions side by side: the system's 7.2 and 10.0 from Debian's backports
suite (`fusuma qemu install 10.0`, downloaded once per machine into the shared
FUSUMA_CACHE), VMs pinned to a versioned machine type moving between them, and
`fusuma maintain --qemu 10.0` upgrading a partition under running VMs."""

from __future__ import annotations

import json
import os
import time
import urllib.request
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import Host

pytestmark = [pytest.mark.integration, pytest.mark.timeout(420)]

WRITE = ("dd if=/dev/urandom of=/tmp/blob bs=1M count=16 2>/dev/null && "
         "md5sum /tmp/blob > /tmp/blob.md5 && cat /tmp/blob.md5")
SERVE = ("mkdir -p /tmp/www && echo fusuma-$(cat /proc/sys/kernel/random/boot_id) "
         "> /tmp/www/index.html && httpd -p 80 -h /tmp/www && cat /tmp/www/index.html")
# A guest that keeps writing: 1 MiB files of random data, each checksummed right after
# it is written, until /tmp/stop appears (then it says how many it wrote).
WRITER = ("mkdir -p /tmp/w && : > /tmp/w.md5 && (i=0; while [ ! -e /tmp/stop ]; do "
          "dd if=/dev/urandom of=/tmp/w/$i bs=64k count=16 2>/dev/null; "
          "md5sum /tmp/w/$i >> /tmp/w.md5; i=$((i+1)); done; echo $i > /tmp/w.done) "
          "</dev/null >/dev/null 2>&1 &")
PORT = 18733


def install_10(host: Host) -> dict[str, Any]:
    """QEMU 10.0, installed once per machine (a second install is a no-op)."""
    res = host.run("qemu", "install", "10.0", "--json", timeout=900)
    q: dict[str, Any] = res.json()
    return q


def intact(host: Host, vm: str) -> bool:
    res = host.run("vm", "exec", vm, "--", "/bin/sh", "-c", "md5sum -c /tmp/blob.md5",
                   check=False)
    assert "No such file" not in res.err, res.err
    return res.code == 0


def page(port: int) -> str:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/", timeout=10) as r:
        return str(r.read().decode().strip())


def argv_of(pid: int) -> list[str]:
    return Path(f"/proc/{pid}/cmdline").read_bytes().decode().split("\0")


def record(host: Host, vm: str) -> dict[str, Any]:
    import sqlite3

    con = sqlite3.connect(str(host.home / "state.db"))
    try:
        row = con.execute("SELECT machine, devices, qemu_version FROM vms WHERE name=?",
                          (vm,)).fetchone()
    finally:
        con.close()
    return {"machine": row[0], "devices": json.loads(row[1]) if row[1] else None,
            "qemu_version": row[2]}


def test_install_list_and_a_partition_on_10_boots_a_vm(host: Host) -> None:
    q10 = install_10(host)
    assert q10["version"].startswith("10.0.") and not q10["system"]
    root = Path(q10["root"])
    assert root.is_relative_to(Path(host.env["FUSUMA_CACHE"]) / "qemu" / "10.0")
    # A second install reuses it.
    t0 = time.monotonic()
    assert host.run("qemu", "install", "10.0", "--json").json()["binary"] == q10["binary"]
    assert time.monotonic() - t0 < 10
    listed = {q["series"]: q for q in host.run("qemu", "list", "--json").json()}
    assert {"7.2", "10.0"} <= set(listed)
    assert listed["7.2"]["system"] and listed["7.2"]["binary"] == "/usr/bin/qemu-system-x86_64"
    for series in ("7.2", "10.0"):
        assert "pc-q35-7.2" in listed[series]["machines"]
    assert "pc-q35-10.0" in listed["10.0"]["machines"]
    assert "pc-q35-10.0" not in listed["7.2"]["machines"]
    assert listed["10.0"]["features"]["cpr-transfer"]
    assert listed["10.0"]["features"]["live-copy-tcg"]
    assert not listed["7.2"]["features"]["cpr-transfer"]
    assert not listed["7.2"]["features"]["live-copy-tcg"]
    text = host.run("qemu", "list").out
    assert "10.0.2" in text or q10["version"] in text

    host.run("partition", "create", "p0", "--cpus", host.core(0), "--memory", "1024")
    host.run("partition", "create", "p1", "--cpus", host.core(1), "--memory", "1024",
             "--qemu", "10.0")
    host.run("vm", "create", "old", "-p", "p0", "--start")
    host.run("vm", "create", "new", "-p", "p1", "--start")
    assert host.run("vm", "exec", "new", "--", "/bin/uname", "-r").out.strip()
    ps = host.ps()
    parts = {p["name"]: p for p in ps["partitions"]}
    assert parts["p0"]["qemu"] is None and parts["p0"]["qemu_version"].startswith("7.2.")
    assert parts["p1"]["qemu"] == "10.0" and parts["p1"]["qemu_version"] == q10["version"]
    vms = {v["name"]: v for v in ps["vms"]}
    assert vms["old"]["qemu"].startswith("7.2.") and vms["new"]["qemu"] == q10["version"]
    # Both pin the oldest installed QEMU's machine type, so both can go anywhere here.
    assert vms["old"]["machine"] == vms["new"]["machine"] == "pc-q35-7.2"
    table = host.run("ps").out
    assert q10["version"] in table and "QEMU" in table.upper()
    # The new QEMU runs unprivileged under the sandbox, with its own firmware first.
    pid = vms["new"]["pid"]
    assert os.readlink(f"/proc/{pid}/exe") == q10["binary"]
    argv = argv_of(pid)
    assert os.stat(f"/proc/{pid}").st_uid != 0
    assert "-sandbox" in argv
    dirs = [argv[i + 1] for i, a in enumerate(argv) if a == "-L"]
    assert dirs[:2] == [f"{root}/usr/share/qemu", f"{root}/usr/share/seabios"]
    assert any(a.startswith("pc-q35-7.2,") for a in argv)
    env = Path(f"/proc/{pid}/environ").read_bytes().decode().split("\0")
    assert f"QEMU_MODULE_DIR={root}/usr/lib/x86_64-linux-gnu/qemu" in env
    # The guest's devices are recorded when it boots.
    rec = record(host, "new")
    assert rec["machine"] == "pc-q35-7.2" and rec["devices"]["machine"] == "pc-q35-7.2"
    assert [d["driver"] for d in rec["devices"]["devices"]][:2] == [
        "virtio-serial-pci", "virtserialport"]


def test_moves_between_7_2_and_10_0_keep_the_guest_and_its_data(host: Host) -> None:
    q10 = install_10(host)
    host.run("partition", "create", "p0", "--cpus", host.core(0), "--memory", "1024")
    host.run("partition", "create", "p1", "--cpus", host.core(1), "--memory", "1024",
             "--qemu", "10.0")
    host.run("vm", "create", "vm0", "-p", "p0", "--memory", "256", "--start")
    host.run("vm", "exec", "vm0", "--", "/bin/sh", "-c", WRITE)
    devices = record(host, "vm0")["devices"]
    boot_id = host.run("vm", "exec", "vm0", "--", "/bin/cat",
                       "/proc/sys/kernel/random/boot_id").out
    steps = [("p1", "zero-copy", q10["version"]), ("p0", "zero-copy", "7.2."),
             ("p1", "copy", q10["version"]), ("p0", "copy", "7.2.")]
    for to, mode, version in steps:
        res = host.run("migrate", "vm0", "--to", to, "--mode", mode, "--json").json()
        assert (res["to"], res["mode"]) == (to, mode)
        if mode == "zero-copy":
            assert res["bytes_sent"] < 4 * 2**20, res
        v = host.vm("vm0")
        assert (v["partition"], v["state"]) == (to, "running")
        assert v["qemu"].startswith(version), (v["qemu"], version)
        assert os.readlink(f"/proc/{v['pid']}/exe") == (
            q10["binary"] if to == "p1" else "/usr/bin/qemu-system-x86_64")
        assert intact(host, "vm0"), f"data changed after {mode} to {to}"
        # The destination rebuilt exactly the recorded devices.
        assert record(host, "vm0")["devices"] == devices
        assert any(a.startswith("pc-q35-7.2,") for a in argv_of(v["pid"]))
    assert host.run("vm", "exec", "vm0", "--", "/bin/cat",
                    "/proc/sys/kernel/random/boot_id").out == boot_id, "the guest rebooted"

    # A guest booted on 10.0 (machine type pc-q35-7.2) goes to 7.2 and back too. It was
    # shown the same CPU as one booted on 7.2: 10.0's TCG `max` has instructions 7.2's
    # lacks (RDPID, SHA-NI, RDSEED...), which a guest told of them would use and then
    # fault on (SIGILL) once moved to 7.2.
    host.run("vm", "create", "vm1", "-p", "p1", "--start")
    host.run("vm", "exec", "vm1", "--", "/bin/sh", "-c", WRITE)
    cpu = "grep -m1 flags /proc/cpuinfo; grep -m1 'cpu family' /proc/cpuinfo"
    flags = {vm: host.run("vm", "exec", vm, "--", "/bin/sh", "-c", cpu).out
             for vm in ("vm0", "vm1")}
    assert flags["vm0"] == flags["vm1"], flags
    assert " rdpid" not in flags["vm1"] and " sha_ni" not in flags["vm1"]
    assert record(host, "vm1")["devices"]["cpu_features"] == devices["cpu_features"]
    for to in ("p0", "p1"):
        host.run("migrate", "vm1", "--to", to)
        assert host.vm("vm1")["partition"] == to
        assert intact(host, "vm1")


def test_maintain_upgrades_a_partition_from_7_2_to_10_0_under_running_vms(
        host: Host) -> None:
    q10 = install_10(host)
    host.run("partition", "create", "p0", "--cpus", host.core(0), "--memory", "1024")
    host.run("partition", "create", "p1", "--cpus", host.core(1), "--memory", "1024")
    host.run("vm", "create", "web", "-p", "p0", "--port", f"{PORT}:80", "--start")
    host.run("vm", "exec", "web", "--", "/bin/sh", "-c", WRITE)
    served = host.run("vm", "exec", "web", "--", "/bin/sh", "-c", SERVE).out.strip()
    assert page(PORT) == served
    assert host.vm("web")["qemu"].startswith("7.2.")

    res = host.run("maintain", "p0", "--via", "p1", "--qemu", "10.0", "--json").json()

    assert res["qemu"] == "10.0"
    assert [(m["from"], m["to"]) for m in res["moves"]] == [("p0", "p1"), ("p1", "p0")]
    for m in res["moves"]:
        assert m["mode"] == "zero-copy" and m["downtime_ms"] is not None
        assert 0 < m["downtime_ms"] < 1000
    p0 = host.part("p0")
    assert p0["qemu"] == "10.0" and p0["qemu_version"] == q10["version"]
    web = host.vm("web")
    assert (web["partition"], web["state"]) == ("p0", "running")
    assert web["qemu"] == q10["version"] and web["machine"] == "pc-q35-7.2"
    assert os.readlink(f"/proc/{web['pid']}/exe") == q10["binary"]
    assert intact(host, "web")
    assert page(PORT) == served, "the forwarded port does not answer after the upgrade"
    text = host.run("maintain", "p0", "--via", "p1").out
    assert "downtime" in text


def _live_copy(host: Host, to: str) -> tuple[dict[str, Any], int]:
    """Move vm0 by copy while its writer runs; returns the move and the files written
    during it."""
    host.run("vm", "exec", "vm0", "--", "/bin/sh", "-c", WRITER)
    time.sleep(1.0)
    before = int(host.run("vm", "exec", "vm0", "--", "/bin/sh", "-c",
                          "ls /tmp/w | wc -l").out)
    res = host.run("migrate", "vm0", "--to", to, "--mode", "copy", "--json").json()
    after = int(host.run("vm", "exec", "vm0", "--", "/bin/sh", "-c",
                         "ls /tmp/w | wc -l").out)
    host.run("vm", "exec", "vm0", "--", "/bin/sh", "-c",
             "touch /tmp/stop; while [ ! -e /tmp/w.done ]; do sleep 0.1; done")
    check = host.run("vm", "exec", "vm0", "--", "/bin/sh", "-c",
                     "md5sum -c /tmp/w.md5 | grep -vc ': OK$'; wc -l < /tmp/w.md5",
                     check=False)
    bad, total = (int(x) for x in check.out.split())
    assert total > 0 and bad == 0, f"{bad} of {total} files written during the move " \
                                   "changed"
    assert intact(host, "vm0")
    host.run("vm", "exec", "vm0", "--", "/bin/sh", "-c", "rm -rf /tmp/w /tmp/w.md5 "
             "/tmp/stop /tmp/w.done")
    return res, after - before


def test_live_copy_on_10_0_while_the_guest_writes_and_7_2_still_pauses(host: Host) -> None:
    install_10(host)
    host.run("partition", "create", "p0", "--cpus", host.core(0), "--memory", "1024",
             "--qemu", "10.0")
    host.run("partition", "create", "p1", "--cpus", host.core(1), "--memory", "1024",
             "--qemu", "10.0")
    host.run("vm", "create", "vm0", "-p", "p0", "--memory", "256", "--start")
    host.run("vm", "exec", "vm0", "--", "/bin/sh", "-c", WRITE)
    res, written = _live_copy(host, "p1")
    assert res["paused"] is False, res
    # Live: the guest ran (and wrote) through most of the transfer; it stopped only
    # for the last dirty pages.
    assert written > 0
    assert res["downtime_ms"] is not None and res["downtime_ms"] < res["total_ms"] / 2, res
    assert host.vm("vm0")["partition"] == "p1"

    # The same from a 7.2 source: the guest is paused for the copy (TCG dirty-bitmap bug).
    host.run("partition", "delete", "p0")
    host.run("partition", "create", "p2", "--cpus", host.core(0), "--memory", "1024")
    host.run("vm", "create", "vm1", "-p", "p2", "--memory", "128", "--start")
    host.run("vm", "exec", "vm1", "--", "/bin/true")
    res2 = host.run("migrate", "vm1", "--to", "p1", "--mode", "copy", "--json")
    assert res2.json()["paused"] is True
    assert "paused during the copy" in res2.err


def test_a_vm_started_before_machine_types_were_pinned_keeps_what_it_runs(
        host: Host) -> None:
    """A state file from an older fusuma: no pinned machine type, no device set (that
    fusuma passed plain `q35`, which QEMU 7.2 resolves to pc-q35-7.2 and 10.0 to
    pc-q35-10.0). Its first move pins what it runs with and records its devices."""
    import sqlite3

    install_10(host)
    host.env["FUSUMA_VMGENID"] = "0"   # that fusuma gave guests no vmgenid device
    host.run("partition", "create", "p0", "--cpus", host.core(0), "--memory", "1024")
    host.run("partition", "create", "p1", "--cpus", host.core(1), "--memory", "1024",
             "--qemu", "10.0")
    host.run("vm", "create", "vm0", "-p", "p0", "--start")
    host.run("vm", "exec", "vm0", "--", "/bin/sh", "-c", WRITE)
    con = sqlite3.connect(str(host.home / "state.db"))
    with con:
        con.execute("UPDATE vms SET machine=NULL, devices=NULL, qemu_version=NULL")
    con.close()
    assert host.vm("vm0")["machine"] is None and host.vm("vm0")["qemu"] is None
    host.run("migrate", "vm0", "--to", "p1")
    rec = record(host, "vm0")
    assert rec["machine"] == "pc-q35-7.2" and rec["devices"]["machine"] == "pc-q35-7.2"
    assert host.vm("vm0")["qemu"].startswith("10.0.")
    assert intact(host, "vm0")
    host.run("migrate", "vm0", "--to", "p0")
    assert intact(host, "vm0") and record(host, "vm0")["devices"] == rec["devices"]
