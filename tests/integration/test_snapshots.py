"""Snapshots of a VM booted by firmware from the Debian disk image the tests build,
booted once for the whole module (about a minute under TCG); every case runs against
it, in order:

1. refusals (fusuma's own image, a raw disk attached, a duplicate, an unknown name,
   ``--memory`` of a stopped VM), each one sentence that changes nothing, and the
   snapshots of a stopped VM (qemu-img) created, restored and deleted;
2. a disk snapshot of the running guest, its filesystems frozen by the guest agent
   and thawed; a ``--memory`` snapshot, whose restore brings back a file the guest
   wrote to a tmpfs (its RAM), so the RAM is in the snapshot although it lives in a
   shared file;
3. a zero-copy move, ``maintain --via`` (QEMU 7.2 -> 10.0) and ``maintain --in-place``
   keep every snapshot; a ``--memory`` snapshot taken after them (x-ignore-shared on
   in the QEMU a move made) holds the RAM, and the one taken on 7.2 loads into 10.0;
4. kill -9 of the supervisor while the ``--memory`` snapshot is loaded into the
   running guest, then while it is deleted: the next supervisor finishes the restore
   (the guest's RAM and file as they were, in the same QEMU) and completes the delete
   (gone from the record and the disk);
5. kill -9 of the supervisor, then of QEMU, while a ``--memory`` snapshot is written:
   no half snapshot is listed, ``ps`` is true, the guest's data is intact, and
   ``qemu-img check`` finds the disk clean;
6. the disk snapshot restored, running (stop, revert, start) and stopped.

Data are checked from the disk itself where the guest cannot: the guest names its
file's extents (``filefrag``) and the test reads those bytes with ``qemu-img dd``.
The module takes about 2¼ minutes (133 s), 1 of it the one boot."""

from __future__ import annotations

import hashlib
import os
import signal
import sqlite3
import subprocess
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from fusuma.images import diskimage
from tests.conftest import FULL_OS_BOOT_S, FUSUMA, Host
from tests.integration import guestdisk
from tests.integration.phasekill import finish, job_of, kill_in_phase
from tests.integration.test_firmware_vms import qemus_of, sh

pytestmark = [pytest.mark.integration, pytest.mark.timeout(1800)]

VM = "sv"
MARK = "/var/tmp/fz-snap"          # on the guest's disk
RAM_MARK = "/run/fz-ram"           # on a tmpfs: only in the guest's RAM
TIMES: dict[str, float] = {}
# What a case leaves the next: the extents and checksum of the guest's file at d1.
AT_D1: dict[str, object] = {}
# ... and of m1: the token in the guest's RAM, the checksum of its file.
AT_M1: dict[str, str] = {}


def took(what: str, since: float) -> None:
    TIMES[what] = time.monotonic() - since
    print(f"\n{what}: {TIMES[what]:.1f} s")


@pytest.fixture(scope="module")
def guest(module_host: Host) -> Iterator[Host]:
    """The module's one guest, VM ``sv`` in p0, booted by SeaBIOS."""
    host = module_host
    t0 = time.monotonic()
    image = diskimage.build(Path(os.environ.get("FUSUMA_CACHE", "/var/cache/fusuma")))
    host.run("image", "import", "deb", str(image))
    host.run("partition", "create", "p0", "--cpus", host.core(0), "--memory", "1536")
    host.run("partition", "create", "p1", "--cpus", host.core(1), "--memory", "1536")
    host.run("vm", "create", VM, "-p", "p0", "--image", "deb", "--memory", "320",
             "--boot", "bios")
    host.run("vm", "start", VM, "--wait", "--timeout", str(FULL_OS_BOOT_S),
             timeout=FULL_OS_BOOT_S + 60)
    took("boot", t0)
    yield host
    print("\nsnapshot tests: " + ", ".join(f"{k} {v:.1f} s" for k, v in TIMES.items()))


@pytest.fixture
def g(guest: Host, shared_logs: Host) -> Host:
    """The guest, for one case whose logs are saved if it fails."""
    return guest


def disk(host: Host, vm: str = VM) -> Path:
    return host.home / "vms" / vm / "disk.qcow2"


def on_disk(host: Host, vm: str = VM) -> set[str]:
    """The internal snapshots the VM's qcow2 holds (qemu-img's word, not fusuma's)."""
    out = subprocess.run(["qemu-img", "snapshot", "-U", "-l", str(disk(host, vm))],
                         capture_output=True, text=True, check=True).stdout
    return {line.split()[1] for line in out.splitlines()[2:] if line.split()}


def listed(host: Host, vm: str = VM) -> list[str]:
    return [s["name"] for s in host.run("vm", "snapshot", "list", vm, "--json").json()]


def extents(host: Host, path: str) -> list[tuple[int, int]]:
    return guestdisk.extents(host, VM, path)


def read_disk(host: Host, where: list[tuple[int, int]], size: int, tmp: Path) -> bytes:
    return guestdisk.read_disk(disk(host), where, size, tmp)


def job_phase(host: Host, vm: str = VM) -> str | None:
    job = job_of(host, f"vm:{vm}")
    return None if job is None else job[0]


def kill_during_save(host: Host, name: str, victim: str) -> subprocess.CompletedProcess[str]:
    """``vm snapshot create sv NAME --memory``, with ``victim`` (its partition's
    supervisor, or the VM's QEMU) killed -9 while the RAM is written."""
    part = host.vm(VM)["partition"]
    pid = (host.part(part)["supervisor_pid"] if victim == "supervisor"
           else host.vm(VM)["pid"])
    proc = subprocess.Popen([*FUSUMA, "vm", "snapshot", "create", VM, name, "--memory"],
                            env=host.env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)
    try:
        deadline = time.monotonic() + 60
        while job_phase(host) != "save":
            assert time.monotonic() < deadline and proc.poll() is None, \
                proc.communicate()
            time.sleep(0.01)
        time.sleep(0.1)          # inside QEMU's save (about 0.4 s for this guest)
        os.kill(int(pid), signal.SIGKILL)
        out, err = proc.communicate(timeout=300)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


def snapshot_row(host: Host, name: str, vm: str = VM) -> str | None:
    """The state of snapshot ``name``'s record, whatever it is (None: no record)."""
    with sqlite3.connect(host.home / "state.db", timeout=5) as db:
        row = db.execute("SELECT state FROM snapshots WHERE vm=? AND name=?",
                         (vm, name)).fetchone()
    return None if row is None else str(row[0])


def kill_supervisor_during(host: Host, ready: Callable[[tuple[str, dict[str, object]]],
                                                       bool], *args: str) -> str:
    """``vm snapshot ARGS`` with the VM's supervisor killed -9 inside the window
    ``ready`` names; its one-line error."""
    sup = int(host.part(host.vm(VM)["partition"])["supervisor_pid"])
    cli = subprocess.Popen([*FUSUMA, "vm", "snapshot", *args], env=host.env, text=True,
                           stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    kill_in_phase(host, f"vm:{VM}", sup, ready, cli)
    code, err = finish(cli)
    assert code != 0 and len(err.strip().splitlines()) == 1, (code, err)
    return err


def recovered(host: Host) -> None:
    """The next command on the VM has the next supervisor take the dead job over;
    wait until its recovery ended it."""
    host.run("vm", "exec", VM, "--", "/bin/true", check=False, timeout=400)
    deadline = time.monotonic() + 300
    while job_of(host, f"vm:{VM}") is not None:
        assert time.monotonic() < deadline, job_of(host, f"vm:{VM}")
        time.sleep(0.2)


def test_refusals_change_nothing_and_a_stopped_vm_snapshots_by_qemu_img(
        g: Host, tmp_path: Path) -> None:
    t0 = time.monotonic()
    small = ("-p", "p0", "--memory", "128")                    # never started
    g.run("vm", "create", "k0", *small)                          # fusuma's own image
    g.run("disk", "add", "d0", "-p", "p0", "--size-mib", "8")
    g.run("vm", "create", "r0", *small, "--image", "deb", "--disk", "d0")
    g.run("vm", "create", "s0", *small, "--image", "deb")
    cases = [
        (("create", "k0", "a"), "boots fusuma's own image 'minimal', whose disks are raw"),
        (("create", "r0", "a"), "has raw disk(s) d0 attached, which cannot hold snapshots"),
        (("create", "s0", "a", "--memory"), "VM 's0' is stopped: it has no memory to "
                                            "snapshot"),
        (("restore", "s0", "nope"), "VM 's0' has no snapshot named 'nope'"),
        (("delete", VM, "nope"), "VM 'sv' has no snapshot named 'nope'"),
        (("create", "s0", "../x"), "snapshot name '../x' is not allowed"),
    ]
    for args, says in cases:
        err = g.fail("vm", "snapshot", *args).err
        assert says in err and len(err.strip().splitlines()) == 1, (args, err)
    for vm in ("r0", "s0"):
        assert listed(g, vm) == [] and on_disk(g, vm) == set(), vm
    # A stopped VM: qemu-img, as the VM's uid.
    made = g.run("vm", "snapshot", "create", "s0", "base", "--json").json()
    assert (made["memory"], made["running"], made["frozen"]) == (False, False, False)
    assert made["disks"] == ["disk-fusuma-boot"]
    assert listed(g, "s0") == ["base"] and on_disk(g, "s0") == {"base"}
    err = g.fail("vm", "snapshot", "create", "s0", "base").err
    assert "VM 's0' already has a snapshot named 'base'" in err, err
    assert listed(g, "s0") == ["base"] and on_disk(g, "s0") == {"base"}
    assert g.run("vm", "snapshot", "restore", "s0", "base", "--json").json()["state"] == \
        "stopped"
    g.run("vm", "snapshot", "delete", "s0", "base")
    assert listed(g, "s0") == [] and on_disk(g, "s0") == set()
    for vm in ("k0", "r0", "s0"):
        g.run("vm", "delete", vm)
    g.run("disk", "remove", "d0", "--delete-file")
    took("refusals and a stopped VM", t0)


def test_running_guest_disk_snapshot_frozen_and_memory_snapshot_brings_back_its_ram(
        g: Host) -> None:
    t0 = time.monotonic()
    sh(g, VM, f"head -c 1048576 /dev/urandom > {MARK} && sync")
    AT_D1["sha"] = sh(g, VM, f"sha256sum < {MARK}").split()[0]
    AT_D1["where"] = extents(g, MARK)
    d1 = g.run("vm", "snapshot", "create", VM, "d1", "--json").json()
    assert (d1["memory"], d1["running"], d1["frozen"]) == (False, True, True), d1
    # Thawed: the guest writes on.
    sh(g, VM, f"rm {MARK} && head -c 1048576 /dev/urandom > {MARK} && "
              f"echo after-d1 > {MARK}.after && sync")
    assert sh(g, VM, f"sha256sum < {MARK}").split()[0] != AT_D1["sha"]
    assert sh(g, VM, "cat /sys/fs/ext4/*/errors_count 2>/dev/null | sort -u").strip() \
        in ("", "0")

    boot_id = sh(g, VM, "cat /proc/sys/kernel/random/boot_id").strip()
    token = os.urandom(8).hex()
    sh(g, VM, f"echo {token} > {RAM_MARK}")
    AT_M1.update(ram=token, sha=sh(g, VM, f"sha256sum < {MARK}").split()[0])
    t = time.monotonic()
    m1 = g.run("vm", "snapshot", "create", VM, "m1", "--memory", "--json").json()
    took("memory snapshot (320 MiB guest)", t)
    assert (m1["memory"], m1["running"], m1["frozen"]) == (True, True, False), m1
    # The state holds the guest's RAM, not only its devices (tens of MiB at least).
    assert m1["vmstate_bytes"] > 32 * 2**20, m1
    sh(g, VM, f"rm {RAM_MARK} && echo later > {RAM_MARK}.later")
    t = time.monotonic()
    res = g.run("vm", "snapshot", "restore", VM, "m1", "--json").json()
    took("memory restore", t)
    assert res["state"] == "running"
    assert sh(g, VM, f"cat {RAM_MARK}").strip() == token
    assert sh(g, VM, f"test -e {RAM_MARK}.later && echo yes || echo no").strip() == "no"
    assert sh(g, VM, "cat /proc/sys/kernel/random/boot_id").strip() == boot_id
    assert g.vm(VM)["state"] == "running" and qemus_of(VM) == [g.vm(VM)["pid"]]
    assert listed(g) == ["d1", "m1"] and on_disk(g) == {"d1", "m1"}
    took("disk and memory snapshots", t0)


def test_moves_keep_snapshots_and_a_memory_snapshot_after_a_zero_copy_move(g: Host) -> None:
    from tests.integration.test_cpr import need_qemu_10

    need_qemu_10(g)
    t0 = time.monotonic()
    pid = g.vm(VM)["pid"]
    g.run("migrate", VM, "--to", "p1", "--json", timeout=400)
    assert listed(g) == ["d1", "m1"] and on_disk(g) == {"d1", "m1"}
    g.run("maintain", "p1", "--via", "p0", "--qemu", "10.0", "--json", timeout=400)
    g.run("maintain", "p1", "--in-place", "--json", timeout=400)
    v = g.vm(VM)
    assert (v["partition"], v["state"]) == ("p1", "running") and v["pid"] != pid
    assert v["qemu"].startswith("10.0") and qemus_of(VM) == [v["pid"]]
    assert listed(g) == ["d1", "m1"] and on_disk(g) == {"d1", "m1"}
    took("moves (zero-copy, --via 7.2 -> 10.0, --in-place)", t0)

    # This QEMU was made by moves, which set x-ignore-shared: the snapshot must still
    # hold the RAM.
    t = time.monotonic()
    token = os.urandom(8).hex()
    sh(g, VM, f"echo {token} > {RAM_MARK}.2")
    g.run("vm", "snapshot", "create", VM, "m2", "--memory")
    sh(g, VM, f"rm {RAM_MARK}.2")
    g.run("vm", "snapshot", "restore", VM, "m2")
    assert sh(g, VM, f"cat {RAM_MARK}.2").strip() == token
    # The one taken on QEMU 7.2 loads into 10.0 (the same machine type).
    g.run("vm", "snapshot", "restore", VM, "m1")
    assert sh(g, VM, f"test -e {RAM_MARK}.2 && echo yes || echo no").strip() == "no"
    assert sh(g, VM, f"cat {MARK}.after 2>/dev/null || echo gone").strip() == "after-d1"
    g.run("vm", "snapshot", "delete", VM, "m2")
    assert listed(g) == ["d1", "m1"] and on_disk(g) == {"d1", "m1"}
    took("memory snapshots after the moves", t)


def test_kill_supervisor_during_a_snapshot_restore_and_delete(g: Host) -> None:
    """The memory snapshot m1 restored into the running guest: killed while QEMU loads
    it, the next supervisor loads it again (the restore is finished, not undone), in
    the same QEMU. Then m1 deleted: killed while its record says deleting, the next
    supervisor removes it from the disk and the record."""
    assert AT_M1, "runs after the memory snapshot's case"
    t0 = time.monotonic()
    pid = g.vm(VM)["pid"]
    sh(g, VM, f"rm -f {RAM_MARK} && echo later > {RAM_MARK}.later")
    kill_supervisor_during(g, lambda j: j[0] == "load" and "settings" in j[1],
                           "restore", VM, "m1")
    recovered(g)
    v = g.vm(VM)
    assert (v["state"], v["job"], v["pid"]) == ("running", None, pid), v
    assert qemus_of(VM) == [pid]
    assert sh(g, VM, f"test -e {RAM_MARK}.later && echo yes || echo no").strip() == "no"
    # The guest runs on from m1: its RAM and its file as they were then.
    assert sh(g, VM, f"cat {RAM_MARK}").strip() == AT_M1["ram"]
    assert sh(g, VM, f"sync; echo 3 > /proc/sys/vm/drop_caches; sha256sum < {MARK}"
              ).split()[0] == AT_M1["sha"]
    took("supervisor killed during a memory restore", t0)

    t = time.monotonic()
    kill_supervisor_during(g, lambda j: j[0] == "delete" and
                           snapshot_row(g, "m1") == "deleting", "delete", VM, "m1")
    assert listed(g) == ["d1"]           # being deleted: never listed
    recovered(g)
    assert snapshot_row(g, "m1") is None and listed(g) == ["d1"]
    assert on_disk(g) == {"d1"}
    v = g.vm(VM)
    assert v["state"] == "running" and qemus_of(VM) == [v["pid"]], v
    assert sh(g, VM, "echo alive").strip() == "alive"
    took("supervisor killed during a snapshot delete", t)


def test_kill_supervisor_then_qemu_during_a_snapshot_leaves_no_half_snapshot(
        g: Host, tmp_path: Path) -> None:
    t0 = time.monotonic()
    sh(g, VM, f"head -c 1048576 /dev/urandom > {MARK}.g && sync")
    want = sh(g, VM, f"sha256sum < {MARK}.g").split()[0]
    where = extents(g, f"{MARK}.g")
    pid = g.vm(VM)["pid"]

    # The supervisor: QEMU writes the state on; the next supervisor adopts the QEMU
    # and removes the snapshot it left.
    res = kill_during_save(g, "k1", "supervisor")
    assert res.returncode != 0, res
    # No supervisor runs: QEMU finishes the save on its own, and the snapshot is in the
    # disk; its record was never marked whole, so it is not listed.
    deadline = time.monotonic() + 10
    while "k1" not in on_disk(g):
        assert time.monotonic() < deadline, "QEMU did not finish the save"
        time.sleep(0.1)
    assert "k1" not in listed(g)
    # The next command that needs the supervisor starts one, which adopts the QEMU and
    # takes the job over; its recovery ends the job.
    g.run("vm", "exec", VM, "--", "/bin/true", check=False)
    deadline = time.monotonic() + 120
    while job_phase(g) is not None:
        assert time.monotonic() < deadline, job_phase(g)
        time.sleep(0.2)
    assert sh(g, VM, "echo alive").strip() == "alive"
    assert g.run("vm", "show", VM, "--json").json()["job"] is None
    assert listed(g) == ["d1"] and on_disk(g) == {"d1"}
    v = g.vm(VM)
    assert (v["state"], v["pid"]) == ("running", pid) and qemus_of(VM) == [pid]
    assert sh(g, VM, f"sync; echo 3 > /proc/sys/vm/drop_caches; sha256sum < {MARK}.g"
              ).split()[0] == want
    took("supervisor killed during a snapshot", t0)

    # QEMU: the guest is gone; no half snapshot, the disk clean, the data there.
    t = time.monotonic()
    res = kill_during_save(g, "k2", "qemu")
    assert res.returncode != 0 and "k2" not in listed(g), res
    v = g.vm(VM)
    assert (v["state"], v["pid"]) == ("crashed", None) and qemus_of(VM) == [], v
    assert g.run("vm", "show", VM, "--json").json()["job"] is None
    assert listed(g) == ["d1"] and on_disk(g) == {"d1"}
    check = subprocess.run(["qemu-img", "check", str(disk(g))], capture_output=True,
                           text=True)
    assert check.returncode == 0 and "No errors were found" in check.stdout, check
    assert hashlib.sha256(read_disk(g, where, 2**20, tmp_path)).hexdigest() == want
    took("QEMU killed during a snapshot", t)


def test_disk_snapshot_restored_running_and_stopped(g: Host, tmp_path: Path) -> None:
    """d1 back: the file as it was then. The running case (stop, revert, start) is
    checked from the disk at once, without waiting for the guest to boot (which never
    writes that file)."""
    where = AT_D1["where"]
    assert isinstance(where, list), "runs after the disk snapshot's case"

    def file_at_d1() -> bool:
        return hashlib.sha256(read_disk(g, where, 2**20, tmp_path)).hexdigest() == \
            AT_D1["sha"]

    t0 = time.monotonic()
    if g.vm(VM)["state"] != "running":
        g.run("vm", "start", VM)                # (a fresh boot: it crashed before)
    pid = g.vm(VM)["pid"]
    res = g.run("vm", "snapshot", "restore", VM, "d1", "--json", timeout=400).json()
    v = g.vm(VM)
    assert res["state"] == v["state"] == "running" and v["pid"] != pid, (res, v)
    assert qemus_of(VM) == [v["pid"]] and file_at_d1()
    took("disk restore of a running VM (stop, revert, start)", t0)
    g.run("vm", "stop", VM, "--timeout", "5")
    # Stopped: reverted by qemu-img, and it stays stopped.
    assert g.run("vm", "snapshot", "restore", VM, "d1", "--json").json()["state"] == \
        "stopped"
    assert g.vm(VM)["state"] == "stopped" and qemus_of(VM) == [] and file_at_d1()
    assert listed(g) == ["d1"] and on_disk(g) == {"d1"}
    check = subprocess.run(["qemu-img", "check", str(disk(g))], capture_output=True,
                           text=True)
    assert check.returncode == 0 and "No errors were found" in check.stdout, check
