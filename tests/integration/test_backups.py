"""Backups of a running VM and restores into a new one, with real QEMU block jobs.

One guest (the Debian disk image the tests build, booted by OVMF: so the NVRAM is
backed up too) serves every case of this module, booted once in p0 (one core); the
restored VM boots once, in p1 (the other core), while the kill case runs in p0. In order:

- bad input, one sentence each and nothing changed: an unknown VM, a destination that
  exists and is not a backup, ``--incremental`` with no backup, a VM with no disk of
  its own;
- the guest writes a file, a full backup; it writes another, an incremental one (much
  smaller); ``qemu-img check`` is clean on every file;
- a corrupt manifest and a changed disk file: the restore is refused, nothing made;
- the chain restored into a new VM: its NVRAM is the backup's, its disk passes
  ``qemu-img check``; it starts booting;
- ``vm restore`` killed (kill -9 of the CLI) while its qemu-img writes the new VM's
  disk: ``ps`` showed the VM held by the restore; once the process is dead the restore
  is undone (no VM, no file, no qemu-img), the backup unchanged;
- the supervisor killed (kill -9) during a backup's copy: no point with a manifest is
  left half-made, the guest's data is intact, ``ps`` is true, and the chain's next
  incremental backup works (QEMU holds nothing of the dead one, its bitmap is kept);
- a backup into a storage directory whose filesystem fills: one sentence, no point
  left, the guest thawed and running on in the same QEMU;
- the VM's QEMU killed during a backup's copy: the backup fails in one sentence and
  leaves no point, ``ps`` says crashed and no QEMU runs, the guest's files read back
  from the disk; started again (no boot awaited), a full backup works (a new chain:
  ``--incremental`` on the old one is refused, its bitmap is gone; on the new one it
  works), and the source disk passes ``qemu-img check`` once the VM is stopped;
- the restored VM, booted: both files are there (checksums), the one written after
  the backups is not, cloud-init gave it its own hostname; its disk checks clean;
- a raw disk attached to the stopped guest (QEMU started again, no boot awaited): in
  every point as a compressed qcow2, whole in an incremental one too (one sentence says
  so), an incremental after it was detached refused; restored as a new raw disk of the
  new VM with the last point's bytes.

Measured (2 cores, TCG): 183 s in all (147 s before the restore and QEMU kill cases),
75 s of it the first boot (the restored VM boots beside the other cases).
"""

from __future__ import annotations

import hashlib
import json
import os
import signal
import sqlite3
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from fusuma.images import diskimage
from tests.conftest import FULL_OS_BOOT_S, FUSUMA, Host
from tests.integration import guestdisk
from tests.integration.phasekill import finish, job_of, kill_in_phase, kill_when
from tests.integration.test_firmware_vms import qemus_of

pytestmark = [pytest.mark.integration, pytest.mark.timeout(1800)]

VM = "src"
MARK = "/var/tmp/fusuma-backup"
TIMES: dict[str, float] = {}
BOOTING: dict[str, tuple[float, subprocess.Popen[str]]] = {}


def sh(host: Host, vm: str, script: str, timeout: float = 120) -> str:
    return host.run("vm", "exec", vm, "--", "/bin/sh", "-c", script, timeout=timeout).out


def one_sentence(err: str) -> str:
    lines = [ln for ln in err.strip().splitlines()
             if ln.strip() and not ln.startswith("... ")]
    assert len(lines) == 1 and "Traceback" not in err, err
    return lines[0]


def job_phase(host: Host, obj: str) -> tuple[str, dict[str, object]] | None:
    with sqlite3.connect(host.home / "state.db") as conn:
        row = conn.execute("SELECT phase, detail FROM jobs WHERE obj=?", (obj,)).fetchone()
    return None if row is None else (str(row[0]), json.loads(row[1] or "{}"))


def qemu_check(path: Path) -> None:
    res = subprocess.run(["qemu-img", "check", "-f", "qcow2", str(path)],
                         capture_output=True, text=True, timeout=120)
    assert res.returncode == 0 and "No errors were found" in res.stdout, (path, res)


@pytest.fixture(scope="module")
def guest(module_host: Host) -> Iterator[Host]:
    host = module_host
    t0 = time.monotonic()
    cache = Path(os.environ.get("FUSUMA_CACHE", "/var/cache/fusuma"))
    host.run("image", "import", "deb", str(diskimage.build(cache)))
    # One core, this worker's first: a partition of both would put the one vCPU on
    # core 0 whichever worker runs it (vCPUs go round-robin from a partition's first
    # core), beside the other worker's guests there.
    host.run("partition", "create", "p0", "--cpus", host.core(0), "--memory", "1000")
    host.run("vm", "create", VM, "-p", "p0", "--image", "deb", "--memory", "384",
             "--boot", "uefi")
    host.run("vm", "start", VM, "--wait", "--timeout", str(FULL_OS_BOOT_S),
             timeout=FULL_OS_BOOT_S + 60)
    TIMES["boot"] = time.monotonic() - t0
    yield host
    print("\ntimes (s): " + ", ".join(f"{k} {v:.1f}" for k, v in TIMES.items()))


def backups(host: Host) -> Path:
    return host.home / "backups"


def listing(d: Path) -> list[str]:
    return sorted(os.listdir(d)) if d.exists() else []


def test_bad_input_is_one_sentence_and_changes_nothing(guest: Host) -> None:
    host = guest
    t0 = time.monotonic()
    notback = host.home / "disks" / "notabackup"
    notback.mkdir(parents=True)
    (notback / "mine.txt").write_text("mine")
    host.run("vm", "create", "kern", "-p", "p0")     # fusuma's own image: no disk
    cases = [
        (("vm", "backup", "nope", "b"), "nope"),
        (("vm", "backup", VM, str(notback)), "exists and is not a backup"),
        (("vm", "backup", VM, str(notback), "--incremental"), "exists and is not a backup"),
        (("vm", "backup", VM, "fresh", "--incremental"), "take a full backup first"),
        (("vm", "backup", "kern", "k"), "no disk of its own to back up"),
        (("vm", "backup", VM, "/etc/fusuma-b"), "outside the storage directories"),
        (("vm", "restore", "none", "r0"), "there is no backup at"),
    ]
    for args, says in cases:
        line = one_sentence(host.fail(*args).err)
        assert says in line, (args, line)
    assert os.listdir(notback) == ["mine.txt"]
    assert not backups(host).exists() or os.listdir(backups(host)) == []
    assert not Path("/etc/fusuma-b").exists()
    assert {v["name"] for v in host.ps()["vms"]} == {VM, "kern"}
    assert host.vm(VM)["state"] == "running" and job_phase(host, f"vm:{VM}") is None
    host.run("vm", "delete", "kern")
    TIMES["bad input"] = time.monotonic() - t0


def test_full_and_incremental_backups_restore_into_a_new_vm(guest: Host) -> None:
    host = guest
    sh(host, VM, f"head -c 16777216 /dev/urandom > {MARK}-1 && sha256sum {MARK}-1 > "
                 f"{MARK}-1.sum && sync")
    t = time.monotonic()
    full = host.run("vm", "backup", VM, "nightly", "--json", timeout=400).json()
    TIMES["full backup"] = time.monotonic() - t
    sh(host, VM, f"head -c 4194304 /dev/urandom > {MARK}-2 && sha256sum {MARK}-2 > "
                 f"{MARK}-2.sum && sync")
    t = time.monotonic()
    inc = host.run("vm", "backup", VM, "nightly", "--incremental", "--json",
                   timeout=400).json()
    TIMES["incremental backup"] = time.monotonic() - t
    chain = backups(host) / "nightly"
    assert (full["kind"], full["point"], inc["kind"], inc["point"]) == \
        ("full", 1, "incremental", 2)
    assert full["frozen"] and inc["frozen"]        # the guest agent froze and thawed
    assert sh(host, VM, f"touch {MARK}-thawed && echo ok").strip() == "ok"
    assert sorted(os.listdir(chain)) == ["0001", "0002"]
    for p in ("0001", "0002"):
        assert sorted(os.listdir(chain / p)) == ["boot.qcow2", "manifest.json", "nvram.fd"]
        qemu_check(chain / p / "boot.qcow2")
        assert (chain / p).stat().st_mode & 0o777 == 0o700
    # The full point holds at least the 16 MiB of random data; the incremental about
    # the 4 MiB written since, not the disk again.
    assert full["bytes"] > 16 * 2**20
    assert inc["bytes"] < full["bytes"] / 5, (full["bytes"], inc["bytes"])
    info = json.loads(subprocess.run(["qemu-img", "info", "--output=json",
                                      str(chain / "0002" / "boot.qcow2")],
                                     capture_output=True, text=True, check=True).stdout)
    assert info["backing-filename"] == "../0001/boot.qcow2"
    man = json.loads((chain / "0002" / "manifest.json").read_text())
    assert (man["vm"]["name"], man["vm"]["boot"], man["vm"]["memory_mib"]) == \
        (VM, "uefi", 384)
    print(f"\nfull backup: {full['bytes'] / 2**20:.1f} MiB in {full['seconds']:.1f} s; "
          f"incremental: {inc['bytes'] / 2**20:.1f} MiB in {inc['seconds']:.1f} s "
          f"(disk {full['disk_bytes'] / 2**30:.1f} GiB)")

    # A bad chain: one sentence, no VM made, the backup untouched.
    broken = backups(host) / "broken"
    subprocess.run(["cp", "-a", str(chain), str(broken)], check=True)
    disk = broken / "0002" / "boot.qcow2"
    data = bytearray(disk.read_bytes())
    data[-1] ^= 1
    disk.write_bytes(bytes(data))
    line = one_sentence(host.fail("vm", "restore", "broken", "r1").err)
    assert "is not the file the backup wrote" in line, line
    (broken / "0001" / "manifest.json").write_text("{garbage")
    line = one_sentence(host.fail("vm", "restore", "broken", "r1").err)
    assert "manifest" in line and "is corrupt" in line, line
    assert "r1" not in {v["name"] for v in host.ps()["vms"]}
    assert not (host.home / "vms" / "r1").exists()

    # Restore the chain into a new VM, booted once in a partition of its own on the
    # other core (the restored VM boots while the kill case runs in p0).
    host.run("partition", "create", "p1", "--cpus", host.core(1), "--memory", "700")
    t = time.monotonic()
    res = host.run("vm", "restore", "nightly", "copy", "-p", "p1", "--json",
                   timeout=400).json()
    TIMES["restore"] = time.monotonic() - t
    assert (res["point"], res["points"], res["source_vm"], res["partition"]) == \
        (2, 2, VM, "p1")
    # Its NVRAM is the backup's (before OVMF runs and may write it).
    assert (host.home / "vms" / "copy" / "nvram.fd").read_bytes() == \
        (chain / "0002" / "nvram.fd").read_bytes()
    qemu_check(host.home / "vms" / "copy" / "disk.qcow2")
    # It boots (once) in p1 while the next case runs in p0; the last case checks it.
    BOOTING["copy"] = (time.monotonic(), subprocess.Popen(
        [*host.wrap, *FUSUMA, "vm", "start", "copy", "--wait", "--timeout",
         str(FULL_OS_BOOT_S)],
        env=host.env, text=True, stdout=subprocess.PIPE, stderr=subprocess.PIPE))


def convert_pids(path: Path) -> list[int]:
    """qemu-img processes that name ``path`` (the kernel's view)."""
    out = []
    for d in Path("/proc").iterdir():
        try:
            argv = (d / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if d.name.isdigit() and argv[0].endswith(b"qemu-img") \
                and str(path).encode() in argv:
            out.append(int(d.name))
    return out


def test_a_restore_killed_mid_way_is_undone(guest: Host) -> None:
    """`vm restore` killed -9 while its qemu-img writes the new VM's disk: the VM it
    was making shows as being restored while that runs, and once its process is dead
    the restore is undone (by the next command on it, or within a second or two by its
    partition's supervisor): no VM, no file, no qemu-img left, the backup unchanged."""
    host = guest
    t0 = time.monotonic()
    chain = backups(host) / "nightly"
    before = {p.name: sorted(os.listdir(chain / p.name)) for p in chain.iterdir()}
    tmp = host.home / "vms" / "half" / ".restore.qcow2"
    host.run("partition", "resize", "p0", "--memory", "1600")     # room for it
    cli = subprocess.Popen([*FUSUMA, "vm", "restore", "nightly", "half", "-p", "p0"],
                           env=host.env, text=True, stdout=subprocess.PIPE,
                           stderr=subprocess.PIPE)
    seen: dict[str, object] = {}

    def converting() -> bool:
        job = job_of(host, "vm:half")
        return job is not None and job[0] == "flatten" and convert_pids(tmp) != []

    def look() -> None:
        seen["ps"] = next((v for v in host.ps()["vms"] if v["name"] == "half"), None)

    kill_when(cli.pid, converting, cli, stopped=look)
    finish(cli)
    # While it ran, ps named the VM and what held it.
    ps = seen["ps"]
    assert isinstance(ps, dict) and ps["job"]["kind"] == "restore", ps
    # What a user types next: the dead restore is undone first, so the delete has
    # nothing left to do (or the partition's supervisor undid it already).
    res = host.run("vm", "delete", "half", check=False)
    assert res.code == 0 or "no VM named 'half'" in one_sentence(res.err), res
    assert "half" not in {v["name"] for v in host.ps()["vms"]}
    assert job_phase(host, "vm:half") is None
    assert not (host.home / "vms" / "half").exists() and convert_pids(tmp) == []
    assert {p.name: sorted(os.listdir(chain / p.name)) for p in chain.iterdir()} == before
    TIMES["restore killed"] = time.monotonic() - t0


def test_supervisor_killed_during_a_backup(guest: Host) -> None:
    host = guest
    t0 = time.monotonic()
    sh(host, VM, f"head -c 8388608 /dev/urandom > {MARK}-3 && sha256sum {MARK}-3 > "
                 f"{MARK}-3.sum && sync")
    p = subprocess.Popen([*host.wrap, *FUSUMA, "vm", "backup", VM, "killed",
                          "--max-bandwidth", "4"], env=host.env, text=True,
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        deadline = time.monotonic() + 120
        while True:
            ph = job_phase(host, f"vm:{VM}")
            if ph is not None and ph[0] == "copy" and int(str(ph[1].get("done", 0))) > 0:
                break
            assert time.monotonic() < deadline and p.poll() is None, (ph, p.poll())
            time.sleep(0.1)
        os.kill(int(host.part("p0")["supervisor_pid"]), signal.SIGKILL)
        _, err = p.communicate(timeout=60)
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()
    assert p.returncode != 0
    one_sentence(err)
    if host.part("p0")["state"] != "running":
        host.run("partition", "restart", "p0")
    # The next command on the VM finds the dead job recovered.
    deadline = time.monotonic() + 60
    while job_phase(host, f"vm:{VM}") is not None:
        host.run("vm", "exec", VM, "--", "/bin/true", check=False)
        assert time.monotonic() < deadline, job_phase(host, f"vm:{VM}")
        time.sleep(0.5)
    killed = backups(host) / "killed"
    points = [p.name for p in killed.iterdir()] if killed.exists() else []
    assert not [p for p in points if (killed / p / "manifest.json").exists()]
    assert points == [], points      # the half-made point is removed
    # ps is true: one QEMU runs the guest, the one ps names; the guest is thawed.
    v = host.vm(VM)
    assert v["state"] == "running" and qemus_of(VM) == [v["pid"]], (v, qemus_of(VM))
    assert sh(host, VM, f"cd / && sha256sum -c {MARK}-1.sum {MARK}-3.sum && "
                        f"touch {MARK}-after").split() == \
        [f"{MARK}-1:", "OK", f"{MARK}-3:", "OK"]
    # QEMU holds no backup node or job of the dead backup, and the dead backup's
    # bitmap is gone while the chain's is kept: an incremental backup continues it.
    inc = host.run("vm", "backup", VM, "nightly", "--incremental", "--json",
                   timeout=400).json()
    assert (inc["point"], inc["kind"]) == (3, "incremental")
    qemu_check(backups(host) / "nightly" / "0003" / "boot.qcow2")
    TIMES["kill case"] = time.monotonic() - t0


def test_a_full_disk_during_a_backup_is_one_sentence_and_the_vm_runs_on(
        guest: Host, tmp_path: Path) -> None:
    """A backup into a storage directory on a filesystem too small for it (a 4 MiB
    tmpfs): one sentence, no point left, the guest thawed and running in the same QEMU
    with its job released, and the chain in FUSUMA_HOME untouched."""
    host = guest
    t0 = time.monotonic()
    small = tmp_path / "small"
    small.mkdir(mode=0o700)
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=4m,mode=0700", "fusuma-test-full",
                    str(small)], check=True)
    try:
        host.run("storage", "add", str(small))
        pid = host.vm(VM)["pid"]
        nightly = listing(backups(host) / "nightly")
        line = one_sentence(host.fail("vm", "backup", VM, str(small / "b")).err)
        assert "filled its filesystem" in line and str(small / "b") in line, line
        assert "nothing of it was kept and the VM runs on" in line, line
        # Nothing half-made: no point, no chain; the VM as it was, thawed.
        assert not (small / "b").exists() or os.listdir(small / "b") == [], \
            os.listdir(small / "b")
        v = host.vm(VM)
        assert (v["state"], v["pid"], v["job"]) == ("running", pid, None), v
        assert qemus_of(VM) == [pid]
        sh(host, VM, f"touch {MARK}-after-full && sync")
        assert listing(backups(host) / "nightly") == nightly
        host.run("storage", "remove", str(small))
    finally:
        subprocess.run(["umount", str(small)], check=False)
    TIMES["full disk"] = time.monotonic() - t0


def test_qemu_killed_during_a_backup(guest: Host, tmp_path: Path) -> None:
    """The VM's QEMU killed -9 while the backup copies: the backup fails in one
    sentence and leaves no point; ps says crashed and no QEMU runs; the guest's data
    is on the disk; the VM starts again and a full backup works (the chain's bitmap,
    which QEMU could not save, no longer counts: an incremental is refused), and the
    disk passes ``qemu-img check`` once stopped."""
    host = guest
    t0 = time.monotonic()
    want = {f: sh(host, VM, f"sha256sum < {MARK}-{f}").split()[0] for f in ("1", "3")}
    where = {f: guestdisk.extents(host, VM, f"{MARK}-{f}") for f in want}
    sizes = {"1": 16 * 2**20, "3": 8 * 2**20}
    disk = host.home / "vms" / VM / "disk.qcow2"
    pid = int(host.vm(VM)["pid"])
    cli = subprocess.Popen([*host.wrap, *FUSUMA, "vm", "backup", VM, "crash",
                            "--max-bandwidth", "4"], env=host.env, text=True,
                           stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    kill_in_phase(host, f"vm:{VM}", pid, lambda j: j[0] == "copy"
                  and int(str(j[1].get("done", 0))) > 0, cli)
    code, err = finish(cli)
    assert code != 0, err
    one_sentence(err)
    deadline = time.monotonic() + 30          # the supervisor handles the exit
    while (v := host.vm(VM))["state"] != "crashed":
        assert time.monotonic() < deadline, v
        time.sleep(0.2)
    assert (v["pid"], v["job"]) == (None, None) and qemus_of(VM) == [], v
    crash = backups(host) / "crash"
    assert not crash.exists()                 # the point, and the chain it began
    for f, w in where.items():
        got = guestdisk.read_disk(disk, w, sizes[f], tmp_path)
        assert hashlib.sha256(got).hexdigest() == want[f], f
    TIMES["QEMU killed"] = time.monotonic() - t0

    # It starts again (QEMU only: the guest need not boot for a backup) and backs up.
    t = time.monotonic()
    host.run("vm", "start", VM)
    full = host.run("vm", "backup", VM, "crash", "--json", timeout=400).json()
    assert (full["point"], full["kind"]) == (1, "full")
    qemu_check(crash / "0001" / "boot.qcow2")
    line = one_sentence(host.fail("vm", "backup", VM, "nightly", "--incremental").err)
    assert "dirty bitmap is gone" in line, line
    inc = host.run("vm", "backup", VM, "crash", "--incremental", "--json",
                   timeout=400).json()
    assert (inc["point"], inc["kind"]) == (2, "incremental")
    host.run("vm", "stop", VM, "--timeout", "10", timeout=120)
    assert qemus_of(VM) == []
    qemu_check(disk)
    for f, w in where.items():
        got = guestdisk.read_disk(disk, w, sizes[f], tmp_path)
        assert hashlib.sha256(got).hexdigest() == want[f], f
    TIMES["backups after the crash"] = time.monotonic() - t


def test_the_restored_vm_holds_the_data_of_each_backup(guest: Host) -> None:
    host = guest
    t0, p = BOOTING.pop("copy")
    try:
        _, err = p.communicate(timeout=FULL_OS_BOOT_S + 60)
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()
    assert p.returncode == 0, err
    TIMES["restored boot"] = time.monotonic() - t0
    # The data written before the full backup and before the incremental one.
    got = sh(host, "copy", f"cd / && sha256sum -c {MARK}-1.sum {MARK}-2.sum")
    assert got.split() == [f"{MARK}-1:", "OK", f"{MARK}-2:", "OK"], got
    assert sh(host, "copy", f"test -e {MARK}-3 || echo absent").strip() == "absent"
    # A new cloud-init instance: it set the new VM's hostname.
    deadline = time.monotonic() + 300
    while sh(host, "copy", "hostname").strip() != "copy":
        assert time.monotonic() < deadline
        time.sleep(2)
    host.run("vm", "stop", "copy", "--timeout", "60", timeout=120)
    qemu_check(host.home / "vms" / "copy" / "disk.qcow2")
    host.run("vm", "delete", "copy")


def test_a_raw_disk_is_backed_up_whole_in_every_point_and_restored(
        guest: Host, tmp_path: Path) -> None:
    """A raw disk attached to the (stopped) guest: started again (QEMU only, the guest
    need not boot for a backup), a full backup holds it as a compressed qcow2 beside
    the thin disk; what it holds then changes, and an incremental backup copies it
    whole (a raw file keeps no dirty bitmap: one sentence says so), with no backing
    file. Restored, the new VM has a raw disk of its own, NEW-NAME, attached, holding
    the last point's bytes; the first point's copy holds the first bytes."""
    host = guest
    t0 = time.monotonic()
    if host.vm(VM)["state"] != "stopped":       # run alone (-k): the module's boot
        host.run("vm", "stop", VM, "--timeout", "60", timeout=120)
    host.run("disk", "add", "d0", "-p", "p0", "--size-mib", "16")
    raw = host.home / "disks" / "d0.img"
    first, second = os.urandom(3 * 2**20), os.urandom(2 * 2**20)
    with raw.open("r+b") as f:                    # stopped: the file is the disk
        f.write(first)
    at_first = tmp_path / "first.raw"
    at_first.write_bytes(raw.read_bytes())
    host.run("vm", "attach", VM, "d0")
    host.run("vm", "start", VM)
    full = host.run("vm", "backup", VM, "withraw", "--json", timeout=400).json()
    chain = backups(host) / "withraw"
    assert (full["kind"], full["whole"]) == ("full", [])
    assert sorted(os.listdir(chain / "0001")) == \
        ["boot.qcow2", "disk-d0.qcow2", "manifest.json", "nvram.fd"]
    # The guest does not use the disk: the host writes it (through the page cache QEMU
    # reads from too), so the next point must hold the new bytes.
    with raw.open("r+b") as f:
        f.seek(8 * 2**20)
        f.write(second)
        os.fsync(f.fileno())
    at_second = raw.read_bytes()
    res = host.run("vm", "backup", VM, "withraw", "--incremental", timeout=400)
    assert "raw disk(s) d0 copied whole into this point" in res.out, res.out
    man = json.loads((chain / "0002" / "manifest.json").read_text())
    assert man["kind"] == "incremental"
    assert {d["drive"]: d["backing"] for d in man["disks"]} == \
        {"disk-fusuma-boot": "../0001/boot.qcow2", "disk-d0": None}
    for p in ("0001", "0002"):
        qemu_check(chain / p / "disk-d0.qcow2")
    same = subprocess.run(["qemu-img", "compare", "-q", "-f", "qcow2", "-F", "raw",
                           str(chain / "0001" / "disk-d0.qcow2"), str(at_first)],
                          capture_output=True, text=True, timeout=120)
    assert same.returncode == 0, same
    # An incremental needs the disks the chain began with.
    host.run("vm", "stop", VM, "--timeout", "10", timeout=120)
    host.run("vm", "detach", VM, "d0")
    host.run("vm", "start", VM)
    line = one_sentence(host.fail("vm", "backup", VM, "withraw", "--incremental").err)
    assert "disks changed since backup point 2" in line, line
    host.run("vm", "stop", VM, "--timeout", "10", timeout=120)
    assert sorted(os.listdir(chain)) == ["0001", "0002"]

    # Restored: the new VM's own raw disk, attached, with the last point's bytes.
    t = time.monotonic()
    got = host.run("vm", "restore", "withraw", "rr", "-p", "p0", "--json",
                   timeout=400).json()
    TIMES["restore with a raw disk"] = time.monotonic() - t
    assert got["disks"] == ["rr-d0"], got
    disks = {d["name"]: d for d in host.run("disk", "list", "--json").json()}
    assert (disks["rr-d0"]["vm"], disks["rr-d0"]["partition"]) == ("rr", "p0"), disks
    made = host.home / "disks" / "rr-d0.img"
    assert made.read_bytes() == at_second
    host.run("vm", "delete", "rr")
    host.run("disk", "remove", "rr-d0", "--delete-file")
    host.run("disk", "remove", "d0", "--delete-file")
    assert not made.exists() and not raw.exists()
    TIMES["raw disk backups"] = time.monotonic() - t0
