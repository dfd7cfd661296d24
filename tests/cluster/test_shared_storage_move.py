"""A VM that boots by firmware (SeaBIOS) with its files on shared storage, moved live
between hosts in the lab without copying its disk. The lab's hosts are one machine, so
one directory declared shared on h0 and h1 (`fusuma storage add DIR --shared`) is the
same files for both, as an NFS export would be; h2 does not declare it. One guest (the
Debian image the tests build, imported on h0 and h1), booted once:

1. a move to h2: one sentence (h2 shares no such directory), nothing changes;
2. the destination's QEMU killed -9 while the stream runs (slowed down): the move goes
   back, the guest runs on at h0 with its data, its disk the same file; h1 has
   nothing of it, the shared files stay;
3. the move to h1 and back to h0: the same inode throughout, no NBD export or mirror
   job (each QEMU's QMP log), the destination's images activated only after
   "forward" (late-block-activate), the data's checksum intact; stopped, ``qemu-img
   check`` finds the disk clean; deleted, its files are gone from the directory.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from fusuma.images import diskimage
from fusuma.migration import FAULT_STREAM_BPS
from tests.cluster.conftest import Cluster, wait_for
from tests.cluster.test_cluster import vm_yaml
from tests.cluster.test_firmware_move import (
    BLOB,
    CHECK,
    VM,
    img_check,
    nothing_of_it,
    qemus,
    refused_move,
    sh,
)
from tests.cluster.test_firmware_move import files as home
from tests.cluster.test_move_tls import agents_restored, moved, patch_host, restart_agents

__all__ = ["agents_restored"]          # the fixture, used by name

WRITE = f"head -c 24M /dev/urandom > {BLOB} && sync && sha256sum {BLOB}"
pytestmark = [pytest.mark.cluster, pytest.mark.timeout(1500)]

SLOW = str(2 * 2**20)          # bytes/s: a stream slow enough to kill its destination
FAST = str(2**40)              # the source QEMU keeps a limit: lifted for the real move


def qmp_log(c: Cluster, host: str) -> str:
    return (home(c, host) / "qmp.log").read_text(errors="replace")


@pytest.fixture
def shared_dir(agents_restored: Cluster, tmp_path: Path) -> Iterator[Path]:
    """One directory, declared shared on h0 and h1 (not h2); undeclared after."""
    c = agents_restored
    d = tmp_path / "nfs"
    for h in ("h0", "h1"):
        c.host(h).run("storage", "add", str(d), "--shared")
    try:
        yield d
    finally:
        c.delete_all_vms()
        for h in ("h0", "h1"):
            with contextlib.suppress(Exception):
                c.host(h).run("storage", "remove", str(d))


def test_a_vm_on_shared_storage_moves_between_hosts_without_its_disk(
        agents_restored: Cluster, shared_dir: Path) -> None:
    c, d = agents_restored, shared_dir
    t0 = time.monotonic()
    image = diskimage.build(Path(os.environ.get("FUSUMA_CACHE", "/var/cache/fusuma")))
    for h in ("h0", "h1"):
        c.host(h).run("image", "import", "deb", str(image))
    c.apply(vm_yaml(VM, host="h0", partition="p0", memoryMiB=256, image="deb",
                    boot="bios", accel="tcg", storage=str(d)))
    wait_for(lambda: c.running(VM), 300, "the VM running on h0")
    wait_for(lambda: c.host("h0").run("vm", "exec", VM, "--timeout", "20", "--",
                                      "/bin/true", check=False, timeout=60).code == 0,
             800, "its guest agent")
    boot_s = time.monotonic() - t0
    before = sh(c, "h0", WRITE).split()[0]
    disk = d / f"vm-{VM}" / "disk.qcow2"
    ino = disk.stat().st_ino
    assert (home(c, "h0") / "storage").read_text().strip() == str(d / f"vm-{VM}")
    assert not (home(c, "h0") / "disk.qcow2").exists()
    pid0 = c.vm(VM)["status"]["pid"]
    assert qemus(c) == {"h0": [pid0]}

    # 1. h2 does not share the directory: one sentence, nothing changes.
    t = time.monotonic()
    last = refused_move(c, "h2")
    assert last["message"] == (
        f"move to h2 failed (VM '{VM}''s files are in {d}/vm-{VM} on its host, which is "
        "not in a directory host h2 declared shared (`fusuma storage add DIR --shared` "
        "there, for a directory it sees too): it moves only to a host that shares its "
        "storage); the VM stays on h0."), last
    st = c.vm(VM)["status"]
    assert (st["state"], st["host"], st["pid"]) == ("Running", "h0", pid0), st
    assert qemus(c) == {"h0": [pid0]}
    nothing_of_it(c, "h2")
    patch_host(c, VM, "h0")
    refused_s = time.monotonic() - t

    # 2. The destination's QEMU killed while the stream runs: back, data intact.
    t = time.monotonic()
    restart_agents(c, {FAULT_STREAM_BPS: SLOW}, "h0")
    patch_host(c, VM, "h1")
    move = wait_for(lambda: (m := c.vm(VM)["status"].get("move") or {})
                    .get("phase") == "Streaming" and m.get("destPid") and m, 180,
                    "the move streaming")
    assert move.get("sharedStorage") is True and not move.get("nbd"), move
    time.sleep(1)
    os.kill(int(move["destPid"]), signal.SIGKILL)
    last = wait_for(lambda: (v := c.vm(VM)["status"]).get("lastMove", {}).get("id")
                    == move["id"] and not v.get("move") and v.get("state") == "Running"
                    and v["lastMove"], 120, "the move back")
    assert last["result"] == "failed", last
    assert c.vm(VM)["status"]["host"] == "h0" and qemus(c) == {"h0": [pid0]}
    assert sh(c, "h0", CHECK).split()[0] == before
    assert disk.stat().st_ino == ino
    wait_for(lambda: not home(c, "h1").exists(), 60, "h1 to forget the VM")
    nothing_of_it(c, "h1")
    assert disk.exists() and (d / f"vm-{VM}" / "seed.iso").exists()
    killed_s = time.monotonic() - t

    # 3. There and back: the same file, no disk copied.
    t = time.monotonic()
    restart_agents(c, {FAULT_STREAM_BPS: FAST}, "h0")
    last = moved(c, VM, "h1", timeout=300)
    assert (last["result"], last["decision"]) == ("ok", "forward"), last
    pid1 = c.vm(VM)["status"]["pid"]
    assert qemus(c) == {"h1": [pid1]} and pid1 != pid0
    assert sh(c, "h1", CHECK).split()[0] == before
    assert disk.stat().st_ino == ino
    nothing_of_it(c, "h0")
    log1 = qmp_log(c, "h1")
    assert "'capability': 'late-block-activate', 'state': True" in log1, log1[-3000:]
    assert "nbd-server-start" not in log1 and "blockdev-mirror" not in log1
    there_s = time.monotonic() - t
    t = time.monotonic()
    patch_host(c, VM, "h0")
    last = moved(c, VM, "h0", timeout=300)
    assert (last["result"], last["decision"]) == ("ok", "forward"), last
    assert sh(c, "h0", CHECK).split()[0] == before
    assert disk.stat().st_ino == ino
    nothing_of_it(c, "h1")
    log0 = qmp_log(c, "h0")
    assert "'capability': 'late-block-activate', 'state': True" in log0, log0[-3000:]
    assert "nbd-server-start" not in log0 and "blockdev-mirror" not in log0
    back_s = time.monotonic() - t
    c.lab.kubectl("patch", "fusumavm", VM, "--type=merge",
                  "-p", json.dumps({"spec": {"running": False}}))
    wait_for(lambda: c.vm(VM)["status"].get("state") == "Stopped", 120, "stopped")
    check = img_check(disk)
    assert check.returncode == 0 and "No errors were found" in check.stdout, \
        check.stdout + check.stderr
    c.lab.kubectl("delete", "fusumavm", VM, "--wait=false")
    wait_for(lambda: not (d / f"vm-{VM}").exists(), 120, "its files deleted")
    assert list(d.iterdir()) == []
    print(f"boot {boot_s:.1f} s, refused {refused_s:.1f} s, killed {killed_s:.1f} s, "
          f"there {there_s:.1f} s, back {back_s:.1f} s (downtime "
          f"{last.get('downtimeMs')} ms), total {time.monotonic() - t0:.1f} s")
