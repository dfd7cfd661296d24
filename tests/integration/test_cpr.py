"""`fusuma maintain P --in-place`: each VM moves to a new QEMU process in its own
partition by QEMU's cpr-transfer (QEMU 10.0, the version `fusuma qemu install 10.0`
unpacks). No second partition exists, and the mode is the old QEMU's own word
(`query-migrate-parameters`, recorded in the move's result before it quits)."""

from __future__ import annotations

import os
import urllib.request
from pathlib import Path

import pytest

from tests.conftest import Host
from tests.fault.movekit import qemu_pids

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]

WRITE = ("dd if=/dev/urandom of=/tmp/blob bs=1M count=32 2>/dev/null && "
         "md5sum /tmp/blob > /tmp/blob.md5 && cat /tmp/blob.md5")
# A web server in the guest, answering on the forwarded port with a known page.
SERVE = ("mkdir -p /tmp/www && echo fusuma-cpr-$(cat /proc/sys/kernel/random/boot_id) "
         "> /tmp/www/index.html && httpd -p 80 -h /tmp/www && cat /tmp/www/index.html")
PORT = 18631
DISK_WRITE = ("dd if=/dev/urandom of=/dev/vda bs=1M count=4 2>/dev/null && sync && "
              "head -c 4194304 /dev/vda | md5sum | cut -d' ' -f1")
# Read back past the page cache, then write: the new QEMU holds the image read-write.
DISK_CHECK = ("echo 3 > /proc/sys/vm/drop_caches && head -c 4194304 /dev/vda | md5sum | "
              "cut -d' ' -f1 && dd if=/dev/zero of=/dev/vda bs=1M count=1 seek=8 "
              "2>/dev/null && sync && echo written")


def need_qemu_10(host: Host) -> None:
    listed = host.run("qemu", "list", "--json", check=False)
    if listed.code != 0 or not any(q["series"] == "10.0" for q in listed.json()):
        pytest.skip("QEMU 10.0 is not installed here; `fusuma qemu install 10.0`")


def page(port: int) -> str:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/", timeout=10) as r:
        return str(r.read().decode().strip())


def intact(host: Host, vm: str) -> bool:
    res = host.run("vm", "exec", vm, "--", "/bin/sh", "-c", "md5sum -c /tmp/blob.md5",
                   check=False)
    assert "No such file" not in res.err, res.err
    return res.code == 0


def test_in_place_moves_every_vm_to_a_new_qemu_by_cpr_transfer(host: Host) -> None:
    need_qemu_10(host)
    host.run("partition", "create", "p0", "--cpus", host.core(0), "--memory", "1024",
             "--qemu", "10.0")
    host.run("vm", "create", "vm0", "-p", "p0", "--port", f"{PORT}:80", "--start")
    # vm1 has a disk: its image's data and its write access survive the move.
    host.run("disk", "add", "d0", "-p", "p0", "--size-mib", "64")
    host.run("vm", "create", "vm1", "-p", "p0", "--disk", "d0", "--start")
    for vm in ("vm0", "vm1"):
        host.run("vm", "exec", vm, "--", "/bin/sh", "-c", WRITE)
    on_disk = host.run("vm", "exec", "vm1", "--", "/bin/sh", "-c", DISK_WRITE).out.strip()
    served = host.run("vm", "exec", "vm0", "--", "/bin/sh", "-c", SERVE).out.strip()
    assert page(PORT) == served
    before = {v["name"]: v for v in host.ps()["vms"]}
    for v in before.values():
        cmd = Path(f"/proc/{v['pid']}/cmdline").read_bytes().decode()
        assert "aux-ram-share=on" in cmd, "a QEMU 10.0 VM must start ready for cpr"
    rams = {p.name: p.stat().st_ino for p in host.shm.glob("*.ram")}

    res = host.run("maintain", "p0", "--in-place", "--json").json()

    assert res["in_place"] and res["via"] is None
    moves = {m["vm"]: m for m in res["moves"]}
    assert sorted(moves) == ["vm0", "vm1"]
    for name, m in moves.items():
        assert (m["from"], m["to"]) == ("p0", "p0")
        assert m["method"] == m["mode"] == "cpr-transfer"
        # The old QEMU's own word, asked over QMP once it had completed.
        assert m["qemu_mode"] == "cpr-transfer"
        assert m["downtime_ms"] is not None and 0 < m["downtime_ms"] < 1000
        assert m["qemu_downtime_ms"] is not None
        # Device state only: the 32 MiB blob in guest RAM did not cross.
        assert 0 < m["bytes_sent"] < 4 * 2**20
        assert m["source_pid"] == before[name]["pid"] and m["dest_pid"] != m["source_pid"]
    # No second partition stood in: one partition, one QEMU per guest, a new one.
    assert [p["name"] for p in host.ps()["partitions"]] == ["p0"]
    for name in ("vm0", "vm1"):
        v = host.vm(name)
        assert (v["partition"], v["state"]) == ("p0", "running")
        assert v["pid"] == moves[name]["dest_pid"] != before[name]["pid"]
        assert qemu_pids(host, name) == [v["pid"]]
        assert not os.path.exists(f"/proc/{before[name]['pid']}")
        assert os.readlink(f"/proc/{v['pid']}/exe").startswith("/")
        assert "aux-ram-share=on" in Path(f"/proc/{v['pid']}/cmdline").read_bytes().decode()
        assert intact(host, name)
        assert not list((host.runtime / "vms" / name).glob("in-*"))
    # The guest kept its RAM file (the same inode: handed over, not copied) and its
    # boot: the page it serves names the same boot.
    assert {p.name: p.stat().st_ino for p in host.shm.glob("*.ram")} == rams
    assert host.run("vm", "exec", "vm1", "--", "/bin/sh", "-c", DISK_CHECK).out.strip() \
        == f"{on_disk}\nwritten"
    assert page(PORT) == served
    # A second in-place move works from the new QEMUs.
    again = host.run("maintain", "p0", "--in-place", "--json").json()
    assert [m["qemu_mode"] for m in again["moves"]] == ["cpr-transfer"] * 2
    assert intact(host, "vm1") and page(PORT) == served
