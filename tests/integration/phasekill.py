"""Kill -9 a process at a known point of a job: the phase its job records (and what
else the caller checks), seen while the process is stopped, so the kill lands inside
that window and not a moment after it. No sleeps decide it: the process is stopped
(SIGSTOP) as soon as the phase is seen, the window checked again while it cannot
move, and only then killed (else continued and watched again)."""

from __future__ import annotations

import os
import signal
import subprocess
import time
from collections.abc import Callable
from typing import Any

from tests.conftest import Host
from tests.fault.movekit import job

Phase = tuple[str, dict[str, Any]]


def job_of(host: Host, obj: str) -> Phase | None:
    """The job on VM object ``obj`` ("vm:NAME") as the state file has it: (phase,
    detail), or None (read by the move kit's reader)."""
    j = job(host, obj.removeprefix("vm:"))
    return None if j is None else (str(j["phase"]), j["detail"])


def kill_when(victim: int, window: Callable[[], bool], cli: subprocess.Popen[str],
              timeout: float = 120, stopped: Callable[[], None] | None = None) -> None:
    """Kill -9 process ``victim`` once ``window()`` holds while it is stopped (and
    ``stopped()`` has looked at the world as it is then). ``cli`` is the command under
    test: it must still run (else the window was missed and the test says so)."""
    deadline = time.monotonic() + timeout
    while True:
        if window():
            os.kill(victim, signal.SIGSTOP)
            if window():
                if stopped is not None:
                    stopped()
                os.kill(victim, signal.SIGKILL)
                return
            os.kill(victim, signal.SIGCONT)
        if cli.poll() is not None or time.monotonic() > deadline:
            out, err = cli.communicate()
            raise AssertionError(f"never saw the window; the command exited "
                                 f"{cli.returncode}: {out}{err}")
        time.sleep(0.005)


def kill_in_phase(host: Host, obj: str, victim: int, ready: Callable[[Phase], bool],
                  cli: subprocess.Popen[str], timeout: float = 120) -> Phase:
    """Kill -9 process ``victim`` once ``ready(job on obj)`` holds while it is
    stopped; the job as it was then."""
    seen: list[Phase] = []

    def window() -> bool:
        job = job_of(host, obj)
        seen[:] = [job] if job is not None else []
        return job is not None and ready(job)

    kill_when(victim, window, cli, timeout)
    return seen[0]


def finish(cli: subprocess.Popen[str], timeout: float = 300) -> tuple[int, str]:
    """The command's exit status and stderr, once it ends (killed if it does not)."""
    try:
        _, err = cli.communicate(timeout=timeout)
    finally:
        if cli.poll() is None:
            cli.kill()
            cli.wait()
    return cli.returncode, err
