"""Whether a pid is a VM's QEMU: its command line, and the uid it runs as (real
processes with a QEMU-like command line; no QEMU needed)."""

from __future__ import annotations

import os
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from fusuma.qemu.process import FIRST_SANDBOX_UID, is_vm_process

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="starts processes as other uids")

UID = 1_999_123_456


@pytest.fixture
def procs() -> Iterator[list[subprocess.Popen[bytes]]]:
    started: list[subprocess.Popen[bytes]] = []
    yield started
    for p in started:
        p.kill()
        p.wait(10)


def lookalike(procs: list[subprocess.Popen[bytes]], run: Path, uid: int | None,
              vm: str = "vm1") -> int:
    """A process whose argv says it is ``vm``'s QEMU with sockets in ``run``."""
    p = subprocess.Popen(
        ["/usr/bin/python3", "-c", "import time; time.sleep(60)", "-name",
         f"guest={vm},debug-threads=on", "-qmp", f"unix:path={run}/qmp.sock,server=on"],
        user=uid, group=uid)
    procs.append(p)
    deadline = time.monotonic() + 10      # until exec has replaced the argv
    while f"guest={vm}".encode() not in Path(f"/proc/{p.pid}/cmdline").read_bytes():
        assert time.monotonic() < deadline
        time.sleep(0.01)
    return p.pid


def test_the_vm_uid_that_owns_the_run_dir_is_one(procs: list, tmp_path: Path) -> None:
    run = tmp_path / "vm1"
    run.mkdir()
    os.chown(run, UID, UID)
    pid = lookalike(procs, run, UID)
    assert is_vm_process(pid, "vm1", run)
    assert not is_vm_process(pid, "vm2", run)               # another VM's name
    assert not is_vm_process(pid, "vm1", tmp_path / "other")  # another run dir


def test_a_lookalike_of_another_uid_is_not(procs: list, tmp_path: Path) -> None:
    run = tmp_path / "vm1"
    run.mkdir()
    os.chown(run, UID, UID)
    assert not is_vm_process(lookalike(procs, run, 1000), "vm1", run)   # a login user
    assert not is_vm_process(lookalike(procs, run, None), "vm1", run)   # root
    assert not is_vm_process(lookalike(procs, run, UID + 1), "vm1", run)


def test_without_its_run_dir_only_a_sandbox_uid_is(procs: list, tmp_path: Path) -> None:
    run = tmp_path / "gone"
    assert is_vm_process(lookalike(procs, run, UID), "vm1", run)
    assert not is_vm_process(lookalike(procs, run, FIRST_SANDBOX_UID - 1), "vm1", run)
