"""What the host's OOM killer thinks of fusuma's processes (``/proc/PID/oom_score_adj``).

The memory governor keeps the host out of the OOM killer's way; should it come anyway
(a process outside fusuma grows), it should pick something other than a fusuma QEMU,
and a burstable guest's QEMU before a guaranteed one's:

    supervisor        -900   it holds the QMP sockets: without it no VM is governed
    guaranteed QEMU   -800
    burstable QEMU    -400

The kernel adds ``oom_score_adj`` (-1000..1000) to each process's badness (its share of
memory, in thousandths), so a QEMU at -400 is picked only once nothing else holds more
than 40% of the host's memory more than it does. Lowering a score needs
``CAP_SYS_RESOURCE``; where fusuma runs without it (a container, a sandbox), the kernel
refuses (EACCES) and fusuma says so once per process and leaves the scores at 0: the
host's OOM killer then weighs fusuma's processes like any other.
"""

from __future__ import annotations

import logging
from pathlib import Path

LOG = logging.getLogger(__name__)

SUPERVISOR = -900
GUARANTEED_QEMU = -800
BURSTABLE_QEMU = -400

PROC = Path("/proc")

_refused = False       # said once per process


def qemu_score(memory_class: str) -> int:
    """The score of a QEMU whose VM has ``memory_class``."""
    return BURSTABLE_QEMU if memory_class == "burstable" else GUARANTEED_QEMU


def set_score(pid: int, score: int, what: str, proc: Path = PROC) -> bool:
    """Give process ``pid`` (``what``: for the log) ``score``; False when the kernel
    refused it (said once per process at warning level, then at debug) or the process
    is gone."""
    global _refused
    try:
        with open(proc / str(pid) / "oom_score_adj", "w") as f:
            f.write(f"{score}\n")
        return True
    except (PermissionError, OSError) as exc:
        if isinstance(exc, (FileNotFoundError, ProcessLookupError)):
            return False
        level = logging.DEBUG if _refused else logging.WARNING
        _refused = True
        LOG.log(level, "cannot set oom_score_adj %d for %s (pid %d): %s; lowering it needs "
                "CAP_SYS_RESOURCE, so the host's OOM killer weighs fusuma's processes like "
                "any other", score, what, pid, exc.strerror or exc)
        return False


def score_of(pid: int, proc: Path = PROC) -> int | None:
    try:
        return int((proc / str(pid) / "oom_score_adj").read_text())
    except (OSError, ValueError):
        return None
