"""A module planted in root's working directory: a local user leaves a ``fusuma/``
package and a ``fusuma.py`` in a directory (their home, /tmp) and root runs `fusuma
partition create` there. The CLI (the installed `fusuma` script) never had the
directory on ``sys.path``, but the supervisor it starts as ``python -m
fusuma.supervisor`` did, and imported the user's package as root. Now the supervisor
runs with ``-P`` in ``/`` (``fusuma.spawn``): the planted code never runs, the
supervisor is fusuma's own, and so is the one a restart starts."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import Host
from tests.unit.test_spawn import planted

pytestmark = [pytest.mark.fault, pytest.mark.timeout(180)]


def cli() -> list[str]:
    """The CLI as root runs it: the installed script (its directory, not the working
    directory, is first on its ``sys.path``)."""
    script = Path(sys.executable).parent / "fusuma"
    return [str(script)] if script.exists() else [sys.executable, "-P", "-m",
                                                  "fusuma.cli.main"]


def run_in(cwd: Path, host: Host, *args: str) -> None:
    p = subprocess.run([*cli(), *args], cwd=cwd, env=host.env, capture_output=True,
                       text=True, timeout=120)
    assert p.returncode == 0, f"fusuma {' '.join(args)}: {p.stdout}\n{p.stderr}"


def supervisor(host: Host, partition: str) -> tuple[int, list[str], str]:
    pid = host.part(partition)["supervisor_pid"]
    assert pid, host.part(partition)
    argv = Path(f"/proc/{pid}/cmdline").read_bytes().decode().split("\0")[:-1]
    return pid, argv, os.readlink(f"/proc/{pid}/cwd")


def test_a_planted_package_in_roots_cwd_is_never_imported(host: Host,
                                                          tmp_path: Path) -> None:
    cwd, marker = planted(tmp_path)
    # The planted package also claims the supervisor's module: it would run instead.
    (cwd / "fusuma" / "supervisor").mkdir()
    (cwd / "fusuma" / "supervisor" / "__main__.py").write_text(
        (cwd / "fusuma" / "__init__.py").read_text())
    run_in(cwd, host, "partition", "create", "p0", "--cpus", host.core(0), "--memory", "512")
    pid, argv, where = supervisor(host, "p0")
    assert argv[1:5] == ["-P", "-m", "fusuma.supervisor", "p0"], argv
    assert where == "/"
    run_in(cwd, host, "partition", "restart", "p0")
    pid2, argv2, where2 = supervisor(host, "p0")
    assert pid2 != pid and where2 == "/" and argv2[1] == "-P", argv2
    assert not marker.exists(), f"root imported the planted code: {marker.read_text()}"
