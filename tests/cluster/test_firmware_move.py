"""A VM that boots by firmware (OVMF) from a thin disk, moved live between hosts in the
lab: its disk's top layer mirrored over NBD to a fresh overlay on the destination's copy
of the image, its seed carried, its NVRAM in the stream. One guest (the Debian image the
tests build, imported on h0 and h1 like any user's image, not on h2), booted once:

1. a move to h2, which has not the image: one sentence naming the image and its
   checksum, and nothing changes (the guest runs on at h0, in the same QEMU; h2 has
   nothing of it);
2. the destination's QEMU killed -9 while the mirror copies (slowed down): the move goes
   back, the guest runs on at h0 with its data (its checksum, ``qemu-img check``), h1
   has nothing of it;
3. the move to h1: the guest runs there with its data, read from the mirrored disk;
   the NVRAM and the seed are the source's, byte for byte; h0 has nothing left of it;
   stopped, ``qemu-img check`` finds the destination's overlay clean.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import signal
import subprocess
import time
from pathlib import Path

import pytest

from fusuma.cluster.hostmove import FAULT_MIRROR_SPEED
from fusuma.images import diskimage
from tests.cluster.conftest import Cluster, wait_for
from tests.cluster.test_cluster import vm_yaml
from tests.cluster.test_move_tls import agents_restored, moved, patch_host, restart_agents
from tests.fault.movekit import qemu_pids

__all__ = ["agents_restored"]          # the fixture, used by name

pytestmark = [pytest.mark.cluster, pytest.mark.timeout(900)]

VM = "fw"
BLOB = "/var/tmp/fusuma-blob"
# A vendor GUID of the test's own, for the EFI variable the guest writes.
VAR = "/sys/firmware/efi/efivars/FusumaMove-0b6f3c1e-7d2a-4c5b-9e8f-1a2b3c4d5e6f"
WRITE = (f"head -c 24M /dev/urandom > {BLOB} && sha256sum {BLOB} > {BLOB}.sum && "
         f"printf '\\007\\000\\000\\000moved' > {VAR} && sync && cat {BLOB}.sum")
CHECK = f"sync; echo 3 > /proc/sys/vm/drop_caches; sha256sum {BLOB}"


def sh(c: Cluster, host: str, script: str) -> str:
    return c.host(host).run("vm", "exec", VM, "--", "/bin/sh", "-c", script,
                            timeout=120).out


def files(c: Cluster, host: str) -> Path:
    return c.host(host).home / "vms" / VM


def qemus(c: Cluster) -> dict[str, list[int]]:
    """Each host's QEMUs of the guest (the kernel's view), hosts that have one."""
    out = {h: qemu_pids(c.host(h), VM) for h in ("h0", "h1", "h2")}
    return {h: p for h, p in out.items() if p}


def img_check(path: Path, *opts: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["qemu-img", "check", *opts, "-f", "qcow2", str(path)],
                          capture_output=True, text=True, check=False, timeout=120)


def nothing_of_it(c: Cluster, host: str) -> None:
    """Host ``host`` has no VM, file or QEMU of the guest."""
    assert VM not in [v["name"] for v in c.host(host).ps()["vms"]], host
    assert not files(c, host).exists(), sorted(files(c, host).iterdir())


def test_a_firmware_vm_moves_between_hosts_with_its_disk_mirrored(
        agents_restored: Cluster, tmp_path: Path) -> None:
    c = agents_restored
    t0 = time.monotonic()
    image = diskimage.build(Path(os.environ.get("FUSUMA_CACHE", "/var/cache/fusuma")))
    sha = ""
    for h in ("h0", "h1"):
        sha = str(c.host(h).run("image", "import", "deb", str(image), "--json")
                  .json()["sha256"])
    import_s = time.monotonic() - t0
    c.apply(vm_yaml(VM, host="h0", partition="p0", memoryMiB=384, image="deb",
                    boot="uefi", accel="tcg"))
    wait_for(lambda: c.running(VM), 300, "fw running on h0")
    wait_for(lambda: c.host("h0").run("vm", "exec", VM, "--timeout", "20", "--",
                                      "/bin/true", check=False, timeout=60).code == 0,
             400, "fw's guest agent")
    boot_s = time.monotonic() - t0 - import_s
    before = sh(c, "h0", WRITE).split()[0]
    pid0 = c.vm(VM)["status"]["pid"]
    assert qemus(c) == {"h0": [pid0]}

    # 1. h2 has not the image: one sentence, nothing changes.
    t = time.monotonic()
    patch_host(c, VM, "h2")
    last = wait_for(lambda: (c.vm(VM)["status"].get("lastMove") or {}).get("result")
                    == "failed" and c.vm(VM)["status"]["lastMove"], 120, "the refusal")
    assert last["message"] == (
        f"move to h2 failed (host h2 has no image with checksum sha256:{sha} (image "
        "'deb' of the VM's host); import the same image there first); the VM stays on "
        "h0."), last
    st = c.vm(VM)["status"]
    assert (st["state"], st["host"]) == ("Running", "h0"), st
    assert qemus(c) == {"h0": [pid0]} and c.vm(VM)["status"]["pid"] == pid0
    nothing_of_it(c, "h2")
    patch_host(c, VM, "h0")
    refused_s = time.monotonic() - t

    # 2. The destination's QEMU killed during the mirror: the move goes back.
    t = time.monotonic()
    restart_agents(c, {FAULT_MIRROR_SPEED: str(2 * 2**20)}, "h0")
    patch_host(c, VM, "h1")
    move = wait_for(lambda: (m := c.vm(VM)["status"].get("move") or {})
                    .get("phase") == "Streaming" and m.get("destPid") and m, 180,
                    "the move streaming")
    made = files(c, "h1") / "disk.qcow2"
    size0 = made.stat().st_size
    wait_for(lambda: made.stat().st_size > size0 + 2**20, 60,
             "the mirror writing the destination's disk")
    os.kill(int(move["destPid"]), signal.SIGKILL)
    last = wait_for(lambda: (v := c.vm(VM)["status"]).get("lastMove", {}).get("id")
                    == move["id"] and not v.get("move") and v.get("state") == "Running"
                    and v["lastMove"], 120, "the move back")
    assert last["result"] == "failed", last
    assert c.vm(VM)["status"]["host"] == "h0" and qemus(c) == {"h0": [pid0]}
    assert sh(c, "h0", CHECK).split()[0] == before
    # The source's overlay, flushed by the guest's sync just now, as QEMU left it: its
    # refcounts are lazy (lazy_refcounts=on, the image marked dirty while open), so a
    # copy is checked the way QEMU opens a dirty image (refcounts rebuilt), then again:
    # every table and cluster consistent.
    copy = tmp_path / "source-disk.qcow2"
    shutil.copyfile(files(c, "h0") / "disk.qcow2", copy)
    repaired = img_check(copy, "-r", "all")
    check = img_check(copy)
    assert repaired.returncode == 0 and check.returncode == 0 and \
        "No errors were found" in check.stdout, repaired.stdout + check.stdout
    wait_for(lambda: not files(c, "h1").exists(), 60, "h1 to remove what it made")
    nothing_of_it(c, "h1")
    killed_s = time.monotonic() - t

    # 3. The move: the agent restarted as usual tries it again at once.
    t = time.monotonic()
    nvram = (files(c, "h0") / "nvram.fd").read_bytes()
    seed = (files(c, "h0") / "seed.iso").read_bytes()
    from fusuma.qemu.firmware import ovmf

    assert nvram != ovmf()[1].read_bytes(), "the guest's NVRAM is still the template"
    restart_agents(c, {}, "h0")
    last = moved(c, VM, "h1", timeout=300)
    assert (last["result"], last["decision"]) == ("ok", "forward"), last
    pid1 = c.vm(VM)["status"]["pid"]
    assert qemus(c) == {"h1": [pid1]} and pid1 != pid0
    assert sh(c, "h1", CHECK).split()[0] == before
    assert sh(c, "h1", f"od -An -c {VAR}").split()[-5:] == list("moved")
    there = files(c, "h1")
    assert (there / "nvram.fd").read_bytes() == nvram
    assert (there / "seed.iso").read_bytes() == seed
    info = json.loads(subprocess.run(
        ["qemu-img", "info", "-U", "--output=json", str(there / "disk.qcow2")],
        capture_output=True, text=True, check=True).stdout)
    assert info["backing-filename"].startswith(str(c.host("h1").home)), info
    nothing_of_it(c, "h0")
    moved_s = time.monotonic() - t
    c.lab.kubectl("patch", "fusumavm", VM, "--type=merge",
                  "-p", json.dumps({"spec": {"running": False}}))
    wait_for(lambda: c.vm(VM)["status"].get("state") == "Stopped", 120, "fw stopped")
    check = img_check(there / "disk.qcow2")
    assert check.returncode == 0 and "No errors were found" in check.stdout, \
        check.stdout + check.stderr
    print(f"import x2 {import_s:.1f} s, boot {boot_s:.1f} s, refused {refused_s:.1f} s, "
          f"killed {killed_s:.1f} s, moved {moved_s:.1f} s (downtime "
          f"{last.get('downtimeMs')} ms), {hashlib.sha256(nvram).hexdigest()[:12]}")
