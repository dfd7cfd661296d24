"""The ``meta`` block every result file carries: revision, date, host, accelerator."""

from __future__ import annotations

import datetime as dt
import json
import os
import platform
import subprocess
from pathlib import Path
from typing import Any

from fusuma import __version__


def git_revision() -> str:
    here = Path(__file__).resolve().parent
    try:
        out = subprocess.run(["git", "-C", str(here), "rev-parse", "HEAD"],
                             capture_output=True, text=True, timeout=5, check=True)
        dirty = subprocess.run(["git", "-C", str(here), "status", "--porcelain", "--",
                                str(here.parent)], capture_output=True, text=True, timeout=5)
        return out.stdout.strip() + ("-dirty" if dirty.stdout.strip() else "")
    except (OSError, subprocess.SubprocessError):
        return f"fusuma-{__version__}"


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def qemu_version(binary: str = "qemu-system-x86_64") -> str:
    try:
        out = subprocess.run([binary, "--version"], capture_output=True, text=True,
                             timeout=10)
        return out.stdout.splitlines()[0] if out.stdout else "unknown"
    except (OSError, subprocess.SubprocessError):
        return "not installed"


def meta(accel: str, **extra: Any) -> dict[str, Any]:
    return {"git_revision": git_revision(),
            "date": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
            "host": platform.node(), "host_cpu": cpu_model(), "host_cores": os.cpu_count(),
            "kernel": platform.release(), "qemu": qemu_version(), "accel": accel,
            "fusuma_version": __version__, **extra}


def write_result(path: Path, data: dict[str, Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json.dumps(data, indent=2) + "\n")
    tmp.replace(path)
