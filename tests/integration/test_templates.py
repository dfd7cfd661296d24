"""Templates and clones with real QEMU 10.0 guests (the minimal image): a booted VM
stopped into a template, two clones that run at once with identities of their own,
the template's file untouched by them, their private memory, and their moves."""

from __future__ import annotations

import hashlib
import sqlite3
import time
from pathlib import Path
from typing import Any

import pytest

from fusuma.memshare import holes
from fusuma.memshare.templates import clone_mac
from tests.conftest import Host

pytestmark = [pytest.mark.integration, pytest.mark.timeout(400)]


def sh(host: Host, vm: str, script: str) -> str:
    res = host.run("vm", "exec", vm, "--json", "--", "/bin/sh", "-c", script).json()
    assert res["exit_code"] == 0, res
    out: str = res["stdout"]
    return out


def sha256(path: str | Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            h.update(chunk)
    return h.hexdigest()


def private_kib(pid: int) -> int:
    """Private_Clean + Private_Dirty of a process: pages no other process maps."""
    total = 0
    for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines():
        if line.startswith(("Private_Clean:", "Private_Dirty:")):
            total += int(line.split()[1])
    return total


def ready_events(host: Host) -> list[dict[str, Any]]:
    import json

    with sqlite3.connect(host.home / "state.db") as conn:
        rows = conn.execute("SELECT source, context FROM events WHERE action = "
                            "'vm-clone-ready' ORDER BY id").fetchall()
    return [{"vm": src.rsplit("/", 1)[1], **json.loads(ctx)} for src, ctx in rows]


def allocated_mib(path: Path) -> float:
    return path.stat().st_blocks * 512 / 2**20


def test_clones_share_the_template_and_move_by_copy(host: Host) -> None:
    # Its supervisors punch what clones fill in the template's holes every second (ten
    # by default), so the test sees it without waiting long.
    host.env[holes.TRIM_ENV] = "1"
    host.run("partition", "create", "p10", "--cpus", host.core(0), "--memory", "1400",
             "--qemu", "10.0")
    host.run("partition", "create", "q10", "--cpus", host.core(1), "--memory", "1024",
             "--qemu", "10.0")
    host.run("vm", "create", "src", "-p", "p10", "--port", "18765:80", "--start")
    src_id = sh(host, "src", "cat /etc/machine-id 2>/dev/null || echo none").split()
    booted = private_kib(host.vm("src")["pid"])

    t = host.run("template", "create", "t", "--from", "src", "--json").json()
    assert t["source_vm"] == "src" and t["memory_mib"] == 256 and t["intact"]
    assert t["network"] and t["devices"][-1] == "vmgenid"
    assert host.vm("src")["state"] == "stopped"
    ram = Path(t["ram_path"])
    assert ram.name == "t.template" and oct(ram.stat().st_mode & 0o777) == "0o640"
    assert ram.stat().st_uid == 0 and ram.stat().st_size == 256 * 2**20
    before = sha256(ram)
    made = allocated_mib(ram)
    assert made < 200, made       # its zero pages are holes (the guest used less)

    for c in ("c1", "c2"):
        host.run("vm", "create", c, "-p", "p10", "--template", "t", "--start")
    ids = {c: sh(host, c, "hostname; cat /etc/machine-id; cat /sys/class/net/eth0/address"
                 ).split() for c in ("c1", "c2")}
    for c, (name, machine_id, mac) in ids.items():
        assert name == c and mac == clone_mac(c)
        assert machine_id != src_id[0]
    assert ids["c1"][1] != ids["c2"][1]
    events = ready_events(host)
    assert {e["vm"] for e in events} == {"c1", "c2"}
    assert all(e["error"] is None and e["agent_ms"] > 0 for e in events), events
    print("clone start to guest agent (ms):", [e["agent_ms"] for e in events],
          "restore (ms):", [e["restore_ms"] for e in events])

    # Both clones map the template: each has far less memory of its own than a booted VM.
    for c in ("c1", "c2"):
        mine = private_kib(host.vm(c)["pid"])
        assert mine < booted * 0.5, (c, mine, booted)
    report = host.run("share", "report", "--json").json()
    rows = {v["name"]: v for v in report["vms"]}
    assert rows["c1"]["template"]["name"] == "t" and rows["c1"]["split_mib"]["template"] > 0
    assert report["savings_mib"]["templates"] > 0

    # The clones write and free memory (a discard could only fail on the read-only file);
    # the template's pages stay as they were.
    for c in ("c1", "c2"):
        sh(host, c, "dd if=/dev/urandom of=/tmp/blob bs=1M count=24 2>/dev/null; rm /tmp/blob; "
                    "sync; echo 3 > /proc/sys/vm/drop_caches")
    assert sha256(ram) == before
    # Their copy-on-write faults on the template's holes filled pages of its file (tmpfs
    # allocates them there); their supervisor punched them again, and the template is
    # no bigger than when it was made. Tolerance 2 MiB: a page a running clone reads but
    # never writes is filled again at its next read after a punch.
    log = host.home / "partitions" / "p10" / "supervisor.log"
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and (
            allocated_mib(ram) > made + 2 or "its clones filled punched again" not in
            log.read_text()):
        time.sleep(0.2)
    assert "its clones filled punched again" in log.read_text()
    assert allocated_mib(ram) <= made + 2, (allocated_mib(ram), made)
    assert sha256(ram) == before
    # A clone never hands pages back (its RAM is the template's file, read-only).
    assert host.vm("c1")["ram"]["page_reporting"] is False
    res = host.fail("vm", "trim", "c1")
    assert "is a clone of template" in res.err and "never hands pages back" in res.err

    res = host.fail("migrate", "c1", "--to", "q10")
    assert "copy-on-write" in res.err and "--mode copy" in res.err
    assert host.vm("c1")["partition"] == "p10"
    # A live copy move (QEMU 10.0 tracks TCG's writes) keeps the guest's data.
    digest = sh(host, "c2", "dd if=/dev/urandom of=/tmp/keep bs=1M count=8 2>/dev/null; "
                            "md5sum /tmp/keep").split()[0]
    moved = host.run("migrate", "c2", "--to", "q10", "--mode", "copy", "--json").json()
    assert moved["mode"] == "copy" and not moved["paused"]
    assert host.vm("c2")["partition"] == "q10"
    assert sh(host, "c2", "md5sum /tmp/keep; hostname").split()[::2] == [digest, "c2"]

    res = host.fail("template", "delete", "t")
    assert "c1, c2" in res.err
    host.run("vm", "delete", "c1", "--force")
    host.run("vm", "delete", "c2", "--force")
    assert sha256(ram) == before
    host.run("template", "delete", "t")
    assert not ram.exists() and not (host.home / "templates" / "t").exists()
    assert host.run("template", "list", "--json").json() == []
    # The VM the template was made from boots afresh.
    host.run("vm", "start", "src", "--wait")
    assert sh(host, "src", "hostname").strip() == "src"
