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
3. ``kill -9`` of the source host's supervisor of the guest's partition, of the source
   agent (started again at once) and of the destination's supervisor, each while the
   mirror copies: the move goes back (or, had the decision been "forward" already,
   on: then the guest runs at h1 and is moved back), with the same checks as 2 and
   one QEMU of the guest across the hosts, `ps` and the FusumaVM's status true;
4. the move to h1, the destination's supervisor killed -9 once "forward" is recorded
   (its incoming QEMU, then the only copy of the guest, serves the disk over NBD: the
   supervisor started again takes it back and runs the guest): the guest runs there
   with its data, read from the mirrored disk; the NVRAM and the seed are the
   source's, byte for byte; h0 has nothing left of it; stopped, ``qemu-img check``
   finds the destination's overlay clean.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import signal
import subprocess
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from fusuma.cluster.hostmove import FAULT_DECIDED_DELAY, FAULT_MIRROR_SPEED
from fusuma.images import diskimage
from tests.cluster.conftest import Cluster, wait_for
from tests.cluster.test_cluster import vm_yaml
from tests.cluster.test_move_tls import agents_restored, moved, patch_host, restart_agents
from tests.fault.movekit import qemu_pids

__all__ = ["agents_restored"]          # the fixture, used by name

pytestmark = [pytest.mark.cluster, pytest.mark.timeout(1500)]

VM = "fw"
BLOB = "/var/tmp/fusuma-blob"
# A vendor GUID of the test's own, for the EFI variable the guest writes.
VAR = "/sys/firmware/efi/efivars/FusumaMove-0b6f3c1e-7d2a-4c5b-9e8f-1a2b3c4d5e6f"
WRITE = (f"head -c 24M /dev/urandom > {BLOB} && sha256sum {BLOB} > {BLOB}.sum && "
         f"printf '\\007\\000\\000\\000moved' > {VAR} && sync && cat {BLOB}.sum")
CHECK = f"sync; echo 3 > /proc/sys/vm/drop_caches; sha256sum {BLOB}"


def sh(c: Cluster, host: str, script: str) -> str:
    # 24 MiB through sha256sum and a sync: minutes in a TCG guest of a loaded host.
    return c.host(host).run("vm", "exec", VM, "--timeout", "400", "--", "/bin/sh", "-c",
                            script, timeout=450).out


def files(c: Cluster, host: str) -> Path:
    return c.host(host).home / "vms" / VM


def qemus(c: Cluster) -> dict[str, list[int]]:
    """Each host's QEMUs of the guest (the kernel's view), hosts that have one."""
    out = {h: qemu_pids(c.host(h), VM) for h in ("h0", "h1", "h2")}
    return {h: p for h, p in out.items() if p}


def img_check(path: Path, *opts: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["qemu-img", "check", *opts, "-f", "qcow2", str(path)],
                          capture_output=True, text=True, check=False, timeout=120)


def refused_move(c: Cluster, host: str) -> dict[str, object]:
    """Ask the guest to move to ``host`` and wait for that move's refusal: its record."""
    patch_host(c, VM, host)
    return wait_for(lambda: (c.vm(VM)["status"].get("lastMove") or {}).get("result")
                    == "failed" and c.vm(VM)["status"]["lastMove"], 120, "the refusal")


def nothing_of_it(c: Cluster, host: str) -> None:
    """Host ``host`` has no VM, file or QEMU of the guest."""
    assert VM not in [v["name"] for v in c.host(host).ps()["vms"]], host
    assert not files(c, host).exists(), sorted(files(c, host).iterdir())


def supervisor_pid(c: Cluster, host: str) -> int:
    """The pid of the supervisor of the guest's partition (p0) on ``host``."""
    return int(next(p["supervisor_pid"] for p in c.host(host).ps()["partitions"]
                    if p["name"] == "p0"))


def mirroring(c: Cluster) -> dict[str, Any]:
    """Begin the move to h1 (the spec's host set anew: a new generation, tried at once)
    and return its record once the mirror is writing h1's disk."""
    patch_host(c, VM, "h0")
    patch_host(c, VM, "h1")
    move = wait_for(
        lambda: (m := c.vm(VM)["status"].get("move") or {}).get("phase") == "Streaming"
        and m.get("destPid") and m, 180, "the move streaming")
    assert isinstance(move, dict)
    made = files(c, "h1") / "disk.qcow2"
    size0 = made.stat().st_size
    wait_for(lambda: made.stat().st_size > size0 + 2**20, 60,
             "the mirror writing the destination's disk")
    return move


def ended(c: Cluster, move: dict[str, Any]) -> dict[str, Any]:
    """Move ``move``'s lastMove once it is over and the guest runs."""
    out = wait_for(
        lambda: (v := c.vm(VM)["status"]).get("lastMove", {}).get("id") == move["id"]
        and not v.get("move") and v.get("state") == "Running" and c.running(VM)
        and v["lastMove"], 240, f"the end of move {move['id']}")
    assert isinstance(out, dict)
    return out


def runs_once_on(c: Cluster, host: str, before: str, tmp: Path) -> int:
    """The guest runs in one QEMU across the hosts, on ``host``, as the FusumaVM and
    that host's `ps` say, with its data; its disk there is sound (a copy checked as
    QEMU opens a dirty image, then again); the other hosts keep nothing of it. Its
    QEMU's pid."""
    other = "h0" if host == "h1" else "h1"
    wait_for(lambda: not files(c, other).exists() and not qemus(c).get(other), 120,
             f"{other} to remove what it made")
    nothing_of_it(c, other)
    nothing_of_it(c, "h2")
    st = c.vm(VM)["status"]
    (pid,) = qemus(c)[host]
    assert qemus(c) == {host: [pid]} and (st["host"], st["pid"], st["state"]) == (
        host, pid, "Running"), (qemus(c), st)
    ps = [v for v in c.host(host).ps()["vms"] if v["name"] == VM]
    assert [(v["state"], v["pid"]) for v in ps] == [("running", pid)], ps
    assert sh(c, host, CHECK).split()[0] == before
    copy = tmp / f"{host}-disk.qcow2"
    shutil.copyfile(files(c, host) / "disk.qcow2", copy)
    repaired = img_check(copy, "-r", "all")
    check = img_check(copy)
    assert repaired.returncode == 0 and check.returncode == 0 and \
        "No errors were found" in check.stdout, repaired.stdout + check.stdout
    copy.unlink()
    return pid


def killed_mid_mirror(c: Cluster, kill: Callable[[dict[str, Any]], None], before: str,
                      tmp: Path) -> tuple[str, int]:
    """One move to h1 whose mirror ``kill`` interrupts: it ends back at h0 (or, had
    "forward" been recorded first, at h1, whence the guest is moved back); each end
    checked (``runs_once_on``). The decision and the guest's pid at h0 after."""
    move = mirroring(c)
    kill(move)
    last = ended(c, move)
    if last["result"] == "ok":
        assert last["decision"] == "forward", last
        runs_once_on(c, "h1", before, tmp)
        patch_host(c, VM, "h0")
        moved(c, VM, "h0", timeout=300)
    else:
        assert (last["result"], last.get("decision")) == ("failed", "back"), last
        patch_host(c, VM, "h0")
    return str(last.get("decision")), runs_once_on(c, "h0", before, tmp)


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
             800, "fw's guest agent")
    boot_s = time.monotonic() - t0 - import_s
    before = sh(c, "h0", WRITE).split()[0]
    pid0 = c.vm(VM)["status"]["pid"]
    assert qemus(c) == {"h0": [pid0]}

    # 1. h2 has not the image: one sentence, nothing changes.
    t = time.monotonic()
    last = refused_move(c, "h2")
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

    # 3. kill -9 of the source's supervisor, the source agent, the destination's
    # supervisor, each while the mirror copies.
    slow = {FAULT_MIRROR_SPEED: str(2 * 2**20)}
    kills: dict[str, str] = {}
    t = time.monotonic()
    decision, pid = killed_mid_mirror(
        c, lambda m: os.kill(supervisor_pid(c, "h0"), signal.SIGKILL), before, tmp_path)
    assert pid == pid0 and decision == "back"     # it never reached "forward"
    kills["source supervisor"] = f"{time.monotonic() - t:.1f} s"
    t = time.monotonic()

    def source_agent(m: dict[str, Any]) -> None:
        lh = c.lab_host("h0")
        c.lab.stop_agent(lh, signal.SIGKILL)
        c.lab.start_agent(lh, env=slow)

    decision, pid0 = killed_mid_mirror(c, source_agent, before, tmp_path)
    kills["source agent"] = f"{decision} {time.monotonic() - t:.1f} s"
    t = time.monotonic()
    decision, pid = killed_mid_mirror(
        c, lambda m: os.kill(supervisor_pid(c, "h1"), signal.SIGKILL), before, tmp_path)
    assert pid == pid0 and decision == "back"
    kills["destination supervisor"] = f"{time.monotonic() - t:.1f} s"

    # 4. The move, its destination's supervisor killed once "forward" is recorded
    # (h1's agent waits there): the agent starts it again, which takes the incoming
    # QEMU back (it serves the guest's disk) and the guest runs at h1.
    t = time.monotonic()
    nvram = (files(c, "h0") / "nvram.fd").read_bytes()
    seed = (files(c, "h0") / "seed.iso").read_bytes()
    from fusuma.qemu.firmware import ovmf

    assert nvram != ovmf()[1].read_bytes(), "the guest's NVRAM is still the template"
    restart_agents(c, {}, "h0")
    restart_agents(c, {FAULT_DECIDED_DELAY: "8"}, "h1")
    sup1 = supervisor_pid(c, "h1")
    log1 = c.host("h1").home / "partitions" / "p0" / "supervisor.log"
    seen = log1.stat().st_size
    patch_host(c, VM, "h0")
    patch_host(c, VM, "h1")
    decided = wait_for(lambda: (m := c.vm(VM)["status"].get("move") or {})
                       .get("decision") and m, 300, "the decision", every=0.1)
    os.kill(sup1, signal.SIGKILL)
    assert (decided["decision"], decided["decidedBy"]) == ("forward", "h1"), decided
    last = moved(c, VM, "h1", timeout=300)
    with log1.open("rb") as f:
        f.seek(seen)
        adopted = f.read().decode(errors="replace")
    assert "as the incoming side of a move from another host serving its disk" in \
        adopted, adopted[-2000:]
    assert (last["result"], last["decision"]) == ("ok", "forward"), last
    pid1 = c.vm(VM)["status"]["pid"]
    assert qemus(c) == {"h1": [pid1]} and pid1 != pid0 and pid1 == decided["destPid"]
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
          f"killed {killed_s:.1f} s, {kills}, moved {moved_s:.1f} s (downtime "
          f"{last.get('downtimeMs')} ms), {hashlib.sha256(nvram).hexdigest()[:12]}")
