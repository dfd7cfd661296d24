"""Memory admission (fusuma.capacity) on a real host: a refusal shows the sum, says how to
fix it, and leaves nothing behind; a small tmpfs as the shm directory stands in for a
host whose shared memory is short."""

from __future__ import annotations

import contextlib
import re
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.conftest import Host
from tests.fault.movekit import qemu_pids
from tests.fault.test_bad_input import assert_one_sentence
from tests.fault.test_migration_faults import only_in

pytestmark = [pytest.mark.fault, pytest.mark.timeout(240)]

SHM_MIB = 300


@pytest.fixture
def small_shm(host: Host) -> Iterator[Host]:
    """``host`` with its shm directory on a 300 MiB tmpfs of its own.

    This teardown runs before ``host``'s: it takes everything down, checks the shm
    directory for leftovers while the tmpfs is still mounted, then unmounts it (``host``
    then checks processes, cgroups and sockets as usual)."""
    mnt = Path(f"/dev/shm/fusuma-test-{host.tag}-mnt")
    mnt.mkdir()
    try:
        subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={SHM_MIB}m,mode=0755", "tmpfs",
                        str(mnt)], check=True)
    except BaseException:
        mnt.rmdir()
        raise
    # Before the first command: every fusuma process of the test sees this directory.
    host.shm = mnt / "fusuma"
    host.env["FUSUMA_SHM_DIR"] = str(host.shm)
    try:
        yield host
    finally:
        host.run("down", check=False, timeout=120)
        left = [p.name for p in host.shm.iterdir()] if host.shm.exists() else []
        with contextlib.suppress(OSError):
            host.shm.rmdir()
        subprocess.run(["umount", str(mnt)], check=False)
        if subprocess.run(["mountpoint", "-q", str(mnt)], check=False).returncode == 0:
            subprocess.run(["umount", "-l", str(mnt)], check=False)
        mnt.rmdir()
    assert not left, f"left in the shm directory: {left}"


def shm_files(host: Host) -> list[str]:
    return sorted(p.name for p in host.shm.iterdir()) if host.shm.exists() else []


def test_vm_create_refused_with_the_sum(host: Host) -> None:
    # a's budget holds its supervisor and one QEMU (guest RAM is admitted host-wide).
    host.run("partition", "create", "a", "--cpus", host.core(0), "--memory", "300")
    host.run("vm", "create", "v0", "-p", "a", "--memory", "256")
    err = host.fail("vm", "create", "v1", "-p", "a", "--memory", "256").err
    assert_one_sentence(err)
    m = re.search(r"partition 'a' has no room for 'v1': 64 \+ v0 (\d+) \+ v1 (\d+) = (\d+) "
                  r"> 300 MiB; grow it with `fusuma partition resize a --memory (\d+)` or "
                  r"give the VM less memory\.", err)
    assert m, err
    v0, v1, total, hint = map(int, m.groups())
    assert v0 == v1 < 256 and total == 64 + v0 + v1 == hint > 300
    # Nothing of v1 was created: no record, no directory, no cgroup leaf.
    assert [v["name"] for v in host.ps()["vms"]] == ["v0"]
    assert not (host.home / "vms" / "v1").exists()
    assert not list(Path("/sys/fs/cgroup").glob(f"*/{host.prefix}/a/vm.v1"))
    # The hint is right: after that resize the same VM fits.
    host.run("partition", "resize", "a", "--memory", str(hint))
    host.run("vm", "create", "v1", "-p", "a", "--memory", "256")


def test_copy_move_refused_without_room_for_a_second_ram_file(small_shm: Host) -> None:
    host = small_shm
    host.run("partition", "create", "a", "--cpus", host.core(0), "--memory", "768")
    host.run("partition", "create", "b", "--cpus", host.core(1), "--memory", "768")
    host.run("vm", "create", "v", "-p", "a", "--memory", "256", "--start")
    pid = host.vm("v")["pid"]
    assert shm_files(host) == ["v.ram"]
    res = host.fail("migrate", "v", "--to", "b", "--mode", "copy")
    assert_one_sentence(res.err)
    assert res.code == 5, res.err
    # v's own RAM file fills as its guest touches it (faulted lazily, cgroup v1): what
    # it has not touched yet counts too, beside the second copy.
    m = re.search(rf"a copy move of 'v' needs (\d+) MiB in {re.escape(str(host.shm))} "
                  rf"\(tmpfs\) but (\d+) MiB is free there \(v \(second copy\) 256 "
                  rf"(?:\+ unfilled v (\d+) = (\d+) )?> (\d+) MiB free\); use --mode "
                  rf"zero-copy", res.err)
    assert m, res.err
    need, free, unfilled, total, free2 = (int(x) if x else 0 for x in m.groups())
    assert need == (total or 256) == 256 + unfilled and free == free2 < need
    assert free <= SHM_MIB
    assert 0 <= unfilled <= 256      # all of it when the guest has touched none yet
    # Nothing started: v runs where it was, on the same QEMU, with its one RAM file.
    only_in(host, "v", "a")
    assert host.vm("v")["pid"] == pid and qemu_pids(host, "v") == [pid]
    assert shm_files(host) == ["v.ram"]


def test_vm_start_refused_when_the_ram_file_cannot_fit(small_shm: Host) -> None:
    host = small_shm
    host.run("partition", "create", "a", "--cpus", host.core(0), "--memory", "1024")
    host.run("vm", "create", "v", "-p", "a", "--memory", "512")
    res = host.fail("vm", "start", "v")
    assert_one_sentence(res.err)
    assert res.code == 5, res.err
    m = re.search(rf"starting 'v' needs 512 MiB in {re.escape(str(host.shm))} \(tmpfs\) but "
                  rf"(\d+) MiB is free there \(v 512 > (\d+) MiB free\); free memory there",
                  res.err)
    assert m, res.err
    assert int(m.group(1)) <= SHM_MIB
    # Nothing left behind: the VM is stopped, no QEMU, no RAM file, no cgroup leaf.
    vm = host.vm("v")
    assert vm["state"] == "stopped" and vm["pid"] is None, vm
    assert qemu_pids(host, "v") == []
    assert shm_files(host) == []
    assert not list(Path("/sys/fs/cgroup").glob(f"*/{host.prefix}/a/vm.v"))
    # A VM that fits starts on the same filesystem.
    host.run("vm", "create", "w", "-p", "a", "--memory", "128", "--start")
    assert host.vm("w")["state"] == "running"
