"""The guest is a stock host: systemd as PID 1, cgroup2 with cpuset, fusuma installed."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path


def test_stock_host() -> None:
    assert Path("/proc/1/comm").read_text().strip() == "systemd"
    controllers = Path("/sys/fs/cgroup/cgroup.controllers").read_text().split()
    assert {"cpuset", "cpu", "memory", "io"} <= set(controllers)
    out = subprocess.run([sys.executable, "-m", "fusuma.cli.main", "--version"],
                         capture_output=True, text=True, check=True).stdout
    assert "fusuma" in out
