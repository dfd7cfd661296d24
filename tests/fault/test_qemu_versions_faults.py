"""QEMU versions going wrong: one not installed, a download with no network, a guest
whose machine type the destination lacks, the new QEMU failing during an upgrade, a
version removed while in use. Each is one clear sentence, and nothing changes."""

from __future__ import annotations

import os
import shutil
import stat
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import Host
from tests.fault.movekit import job, qemu_pids

pytestmark = [pytest.mark.fault, pytest.mark.timeout(300)]

WRITE = ("dd if=/dev/urandom of=/tmp/blob bs=1M count=8 2>/dev/null && "
         "md5sum /tmp/blob > /tmp/blob.md5")


def install_10(host: Host) -> dict[str, Any]:
    q: dict[str, Any] = host.run("qemu", "install", "10.0", "--json", timeout=900).json()
    return q


def one_sentence(err: str) -> str:
    line = err.strip().splitlines()[-1]
    assert line.startswith("fusuma: error: ") and line.endswith("."), err
    return line


def intact(host: Host, vm: str) -> bool:
    return host.run("vm", "exec", vm, "--", "/bin/sh", "-c", "md5sum -c /tmp/blob.md5",
                    check=False).code == 0


def test_a_version_that_is_not_installed(host: Host) -> None:
    res = host.fail("partition", "create", "p0", "--cpus", host.core(0), "--memory", "1024",
                    "--qemu", "9.9")
    line = one_sentence(res.err)
    assert "QEMU 9.9 is not installed" in line and "`fusuma qemu install 9.9`" in line
    assert host.ps()["partitions"] == []
    host.run("partition", "create", "p0", "--cpus", host.core(0), "--memory", "1024")
    host.run("partition", "create", "p1", "--cpus", host.core(1), "--memory", "1024")
    res = host.fail("maintain", "p0", "--via", "p1", "--qemu", "9.9")
    assert "`fusuma qemu install 9.9`" in one_sentence(res.err)
    assert all(p["qemu"] is None for p in host.ps()["partitions"])
    res = host.fail("qemu", "remove", "9.9")
    assert "not installed" in one_sentence(res.err)
    res = host.fail("partition", "create", "p2", "--cpus", host.core(1), "--memory", "1024",
                    "--qemu", "ten")
    one_sentence(res.err)


def test_a_download_that_fails_leaves_nothing_half_unpacked(host: Host) -> None:
    # A cache of its own (below /tmp, which other users can pass, as VMs' QEMUs must).
    cache = Path(f"/tmp/fz-cache-{host.tag}")
    env = {**host.env, "FUSUMA_CACHE": str(cache),
           "FUSUMA_DEBIAN_MIRROR": "http://127.0.0.1:9/debian"}
    saved, host.env = host.env, env
    try:
        res = host.fail("qemu", "install", "10.0")
        listed = host.run("qemu", "list", "--json").json()
        left = sorted(p.name for p in (cache / "qemu").iterdir())
    finally:
        host.env = saved
        shutil.rmtree(cache, ignore_errors=True)
    line = one_sentence(res.err)
    assert "cannot fetch QEMU 10.0" in line and "127.0.0.1:9" in line
    assert "FUSUMA_DEBIAN_MIRROR" in line
    assert res.code == 7
    # Progress went to stderr before the failure; nothing is left but the lock and probes.
    assert "reading the package lists" in res.err
    assert not [n for n in left if n not in (".lock", "probes.json")], left
    assert [q["series"] for q in listed if not q["system"]] == []


def test_a_guest_whose_machine_type_the_destination_lacks_is_refused_first(
        host: Host) -> None:
    install_10(host)
    host.run("partition", "create", "p0", "--cpus", host.core(0), "--memory", "1024")
    host.run("partition", "create", "p1", "--cpus", host.core(1), "--memory", "1024",
             "--qemu", "10.0")
    # 7.2 has no pc-q35-10.0: such a VM cannot even be defined there.
    res = host.fail("vm", "create", "x", "-p", "p0", "--machine", "pc-q35-10.0")
    assert "pc-q35-10.0" in one_sentence(res.err)
    assert host.ps()["vms"] == []
    host.run("vm", "create", "vm0", "-p", "p1", "--machine", "pc-q35-10.0", "--start")
    host.run("vm", "exec", "vm0", "--", "/bin/sh", "-c", WRITE)
    before = host.vm("vm0")
    assert before["machine"] == "pc-q35-10.0"
    for mode in ("zero-copy", "copy"):
        res = host.fail("migrate", "vm0", "--to", "p0", "--mode", mode)
        line = one_sentence(res.err)
        assert "pc-q35-10.0" in line and "predates" in line and "'p0'" in line, line
        # Refused before anything started: no job, no second QEMU, nothing moved.
        assert job(host, "vm0") is None
        assert qemu_pids(host, "vm0") == [before["pid"]]
        after = host.vm("vm0")
        assert (after["partition"], after["state"], after["pid"]) == (
            "p1", "running", before["pid"])
        assert not list((host.runtime / "vms" / "vm0").glob("in-*"))
    # maintain through a 7.2 partition is refused the same way, before the first move.
    res = host.fail("maintain", "p1", "--via", "p0")
    assert "pc-q35-10.0" in one_sentence(res.err)
    assert host.vm("vm0")["pid"] == before["pid"] and intact(host, "vm0")


def test_the_new_qemu_failing_during_an_upgrade_leaves_the_vm_on_the_old_one(
        host: Host) -> None:
    # A "new QEMU" that answers the version probe but dies at every start.
    wrapper = host.runtime / "qemu-broken"
    host.runtime.mkdir(parents=True, exist_ok=True)
    os.chmod(host.runtime, 0o711)
    wrapper.write_text("#!/bin/sh\n"
                       "case \"$1\" in --version|-machine) "
                       "exec /usr/bin/qemu-system-x86_64 \"$@\";; esac\n"
                       "echo 'qemu-broken: simulated crash at start' >&2\nexit 1\n")
    wrapper.chmod(0o755)
    assert stat.S_IMODE(wrapper.stat().st_mode) == 0o755
    host.run("partition", "create", "p0", "--cpus", host.core(0), "--memory", "1024")
    host.run("partition", "create", "p1", "--cpus", host.core(1), "--memory", "1024")
    host.run("vm", "create", "vm0", "-p", "p0", "--start")
    host.run("vm", "exec", "vm0", "--", "/bin/sh", "-c", WRITE)
    res = host.fail("maintain", "p0", "--via", "p1", "--qemu", str(wrapper))
    line = one_sentence(res.err)
    assert "simulated crash at start" in line and "back on its old QEMU" in line, line
    vm = host.vm("vm0")
    # The guest runs on the QEMU it had (the system's), in the partition it went to.
    assert (vm["partition"], vm["state"]) == ("p1", "running")
    assert os.readlink(f"/proc/{vm['pid']}/exe") == "/usr/bin/qemu-system-x86_64"
    assert qemu_pids(host, "vm0") == [vm["pid"]] and job(host, "vm0") is None
    assert intact(host, "vm0")
    # The partition went back to its old QEMU: the VM can come home.
    assert host.part("p0")["qemu"] is None
    host.run("migrate", "vm0", "--to", "p0")
    assert host.vm("vm0")["partition"] == "p0" and intact(host, "vm0")


def test_a_new_qemu_killed_while_it_waits_for_the_guest(host: Host) -> None:
    """The upgrade's destination QEMU (10.0) is killed during the move back: the move
    is undone and the guest keeps running on 7.2."""
    import subprocess
    import time

    from tests.conftest import FUSUMA

    install_10(host)
    host.run("partition", "create", "p0", "--cpus", host.core(0), "--memory", "1024")
    host.run("partition", "create", "p1", "--cpus", host.core(1), "--memory", "1024")
    host.run("vm", "create", "vm0", "-p", "p0", "--start")
    host.run("vm", "exec", "vm0", "--", "/bin/sh", "-c", WRITE)
    proc = subprocess.Popen([*FUSUMA, "maintain", "p0", "--via", "p1", "--qemu", "10.0"],
                            env={**host.env, "FUSUMA_FAULT_SLEEP_BEFORE_STREAM": "3"},
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 120
    killed = None
    while time.monotonic() < deadline and killed is None:
        j = job(host, "vm0")
        if j is not None and j["phase"] == "prepared" and \
                host.vm("vm0")["partition"] == "p1":
            for pid in qemu_pids(host, "vm0", "/in-"):
                if "/10.0/" in os.readlink(f"/proc/{pid}/exe"):
                    os.kill(pid, 9)
                    killed = pid
        time.sleep(0.05)
    out, err = proc.communicate(timeout=120)
    assert killed is not None, (out, err)
    assert proc.returncode != 0 and "back on its old QEMU" in err, err
    vm = host.vm("vm0")
    assert (vm["partition"], vm["state"]) == ("p1", "running")
    assert vm["qemu"].startswith("7.2.")
    assert qemu_pids(host, "vm0") == [vm["pid"]] and intact(host, "vm0")


def test_a_version_in_use_cannot_be_removed(host: Host) -> None:
    q10 = install_10(host)
    host.run("partition", "create", "p1", "--cpus", host.core(1), "--memory", "1024",
             "--qemu", "10.0")
    res = host.fail("qemu", "remove", "10.0")
    assert "partition p1" in one_sentence(res.err)
    host.run("vm", "create", "vm0", "-p", "p1", "--start")
    res = host.fail("qemu", "remove", "10.0")
    line = one_sentence(res.err)
    assert "VM vm0" in line and "partition p1" in line, line
    assert Path(q10["binary"]).exists()
    assert host.vm("vm0")["state"] == "running"
    res = host.fail("qemu", "remove", "7.2")
    assert "system's own" in one_sentence(res.err)
