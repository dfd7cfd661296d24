"""The memory governor's balloon targets, kept on disk beside its supervisor's state.

QEMU reports where a balloon *stands* (``query-balloon``), not the target it was given:
a supervisor killed while a balloon inflates leaves a guest on its way to a target no
one remembers. So the governor writes each target here before it asks QEMU for it
(``balloons.json`` in the partition's directory), with the pid of the QEMU it is meant
for; its successor takes a target whose QEMU still runs under that pid, asks QEMU for it
again (the kill may have come between the write and the request) and goes on from it.
A target whose QEMU is gone or has another pid (the VM was restarted, moved) is stale
and ignored: the balloon a new QEMU starts with is its whole RAM.

The file::

    {"version": 1, "vms": {"b0": {"pid": 4242, "target_mib": 192}}}

Only VMs with a balloon below their RAM are listed. A file that cannot be read is
logged and taken as empty (QEMU's figures are then the governor's starting point).
"""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path

from fusuma.frozen import frozen

LOG = logging.getLogger(__name__)

VERSION = 1
FILE_NAME = "balloons.json"
# A write's temporary file, renamed over the file (by the writer's pid).
TEMP_PREFIX = f".{FILE_NAME}."


def temp_files(directory: Path) -> list[Path]:
    """Temporary files of writes in ``directory`` (a writer killed before its rename
    leaves one)."""
    return sorted(directory.glob(f"{TEMP_PREFIX}*"))


@frozen
class Target:
    """A balloon target the governor set: for the QEMU with ``pid``, ``target_mib``."""

    pid: int
    target_mib: int


def parse(text: str) -> dict[str, Target]:
    """The targets in a file's text; ValueError when it is not such a file."""
    data = json.loads(text)
    if not isinstance(data, dict) or data.get("version") != VERSION or \
            not isinstance(data.get("vms"), dict):
        raise ValueError(f"not a version {VERSION} balloon file")
    out: dict[str, Target] = {}
    for name, entry in data["vms"].items():
        if not isinstance(entry, dict):
            raise ValueError(f"entry {name!r} is not an object")
        pid, mib = entry.get("pid"), entry.get("target_mib")
        if type(pid) is not int or type(mib) is not int or pid <= 0 or mib <= 0:
            raise ValueError(f"entry {name!r} needs a positive pid and target_mib")
        out[str(name)] = Target(pid, mib)
    return out


def render(targets: dict[str, Target]) -> str:
    return json.dumps({"version": VERSION, "vms": {
        name: {"pid": t.pid, "target_mib": t.target_mib}
        for name, t in sorted(targets.items())}}, indent=1) + "\n"


def load(path: Path, pids: dict[str, int]) -> dict[str, Target]:
    """The targets of ``path`` whose VM runs now under the pid they were set for
    (``pids``: VM name to its QEMU's pid); stale ones are dropped."""
    try:
        found = parse(path.read_text())
    except FileNotFoundError:
        return {}
    except (OSError, ValueError) as exc:
        LOG.warning("ignoring the balloon targets in %s: %s", path, exc)
        return {}
    return {name: t for name, t in found.items() if pids.get(name) == t.pid}


def save(path: Path, targets: dict[str, Target]) -> None:
    """Write ``targets`` whole (a new file renamed over the old: a kill leaves one or
    the other, never half of one)."""
    if not targets:
        path.unlink(missing_ok=True)
        return
    tmp = path.with_name(f"{TEMP_PREFIX}{os.getpid()}")
    with open(tmp, "w") as f:
        f.write(render(targets))
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
