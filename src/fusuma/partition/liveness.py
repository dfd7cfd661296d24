"""Is a partition's supervisor alive? Read from /proc every time, never cached.

Light on purpose: `fusuma ps` asks this for every partition and should not import the
partition manager (cgroups, the supervisor client, the capacity checks) to do it.
"""

from __future__ import annotations

import contextlib

from fusuma.paths import Paths
from fusuma.qemu import process

SUPERVISOR_MODULE = "fusuma.supervisor"


def supervisor_pid(paths: Paths, name: str, recorded_pid: int | None) -> int | None:
    """The live supervisor's pid of partition ``name``, checked against its command line
    (the pid in the DB, else the one in its pidfile); None when none is alive."""
    candidates = [recorded_pid]
    with contextlib.suppress(OSError, ValueError):
        candidates.append(int(paths.supervisor_pidfile(name).read_text()))
    return process.daemon_pid(candidates, SUPERVISOR_MODULE, name)
