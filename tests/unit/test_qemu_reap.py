"""A QEMU's end is handled without waiting for the kernel's reap of it.

The kernel's reap of an ended QEMU (``wait4``) took up to 400 ms on this 2-core host
with a partition's other guests busy; the supervisor did it on its event loop, so each
in-place move's release (and everything else the supervisor served meanwhile) waited
for it. Its status is now read without reaping (``waitid(WNOWAIT)``) and the reap runs
on a worker thread.
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from fusuma.qemu.instance import QemuInstance, Role, exit_status
from fusuma.qemu.qmp import Qmp


def _state(pid: int) -> str:
    return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]


def _ended(child: subprocess.Popen[bytes]) -> None:
    """Wait (without reaping) until ``child`` has ended."""
    deadline = time.monotonic() + 10
    while os.waitid(os.P_PID, child.pid, os.WEXITED | os.WNOHANG | os.WNOWAIT) is None:
        assert time.monotonic() < deadline, "the child did not end"
        time.sleep(0.005)


def test_the_status_of_an_ended_child_is_read_without_reaping_it() -> None:
    child = subprocess.Popen([sys.executable, "-c", "raise SystemExit(3)"])
    _ended(child)
    assert exit_status(child.pid) == 3
    assert _state(child.pid) == "Z"          # still there, for the worker to reap
    assert child.wait() == 3


def test_a_killed_child_says_its_signal_as_popen_does() -> None:
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    os.kill(child.pid, signal.SIGKILL)
    _ended(child)
    assert exit_status(child.pid) == -signal.SIGKILL
    assert child.wait() == -signal.SIGKILL


def test_a_running_child_or_a_stranger_has_no_status_yet() -> None:
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        assert exit_status(child.pid) is None
    finally:
        child.kill()
        child.wait()
    assert exit_status(1) is None            # not our child


class SlowReap(subprocess.Popen):  # type: ignore[type-arg]
    """A child whose reap takes as long as the kernel's did on a loaded host."""

    def wait(self, timeout: float | None = None) -> int:
        time.sleep(0.6)
        return super().wait(timeout)


@pytest.mark.parametrize("role", [Role.LEAVING, Role.RUNNING])
def test_a_slow_reap_holds_neither_the_event_loop_nor_a_released_sources_exit(
        tmp_path: Path, role: Role) -> None:
    """A move's released source (LEAVING) is ended without waiting for its reap; any
    other QEMU's end waits for it (a disk's qemu-img may follow), off the loop."""
    child = SlowReap([sys.executable, "-c", "import time; time.sleep(60)"])
    gaps: list[float] = []
    recorded: list[float] = []

    async def on_exit(inst: QemuInstance) -> None:
        recorded.append(time.monotonic())

    async def run() -> tuple[float, Any, int | None]:
        inst = QemuInstance("v", child.pid, Qmp("v", tmp_path / "q.sock",
                                                logging.getLogger("q")),
                            run_dir=tmp_path / "run-v", ram_file=None,
                            role=role, child=child)
        inst.watch(on_exit)
        stop = asyncio.Event()

        async def tick() -> None:
            last = time.monotonic()
            while not stop.is_set():
                await asyncio.sleep(0.01)
                now = time.monotonic()
                gaps.append(now - last)
                last = now
        ticker = asyncio.ensure_future(tick())
        await asyncio.sleep(0.05)
        t0 = time.monotonic()
        os.kill(child.pid, signal.SIGKILL)
        await asyncio.wait_for(inst.exited.wait(), 10)
        took = time.monotonic() - t0
        await asyncio.sleep(0.8)                 # the reap ends meanwhile
        stop.set()
        await ticker
        return took, inst._reap, inst.status

    try:
        took, reap, status = asyncio.run(run())
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()
    assert recorded, "the exit was never handled"
    if role == Role.LEAVING:
        assert took < 0.4, f"the exit waited for the reap ({took:.2f} s)"
    else:
        assert took >= 0.6, f"the exit did not wait for the reap ({took:.2f} s)"
    assert max(gaps) < 0.4, f"the event loop stalled {max(gaps):.2f} s during the reap"
    assert status == -signal.SIGKILL
    assert reap is not None and reap.done() and reap.result() == -signal.SIGKILL
    assert exit_status(child.pid) is None     # reaped: no longer our child


def test_a_qemu_seen_ended_is_never_signalled_by_its_old_pid(tmp_path: Path) -> None:
    """Once the pidfd said the QEMU ended, a worker may reap it at any moment and its
    pid go to another process: kill() then only waits for the exit's handling."""
    other = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        inst = QemuInstance("v", other.pid, Qmp("v", tmp_path / "q.sock",
                                                logging.getLogger("q")),
                            run_dir=tmp_path / "run-v", ram_file=None, role=Role.RUNNING)
        inst.gone_at = time.monotonic()        # its pid now names ``other``

        async def run() -> None:
            asyncio.get_running_loop().call_later(0.1, inst.exited.set)
            await inst.kill(timeout=5)
        asyncio.run(run())
        assert other.poll() is None, "the process that took the pid was killed"
    finally:
        other.kill()
        other.wait()
