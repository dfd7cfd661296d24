"""What a partition keeps in its directory (``FUSUMA_HOME/partitions/<p>``), and its
removal with the partition.

The directory holds the supervisor's log and its start lock (one start at a time, held
until the new supervisor's socket answers), the log of the recoveries it started, and
the memory governor's balloon targets (``fusuma.governor.balloons``; a supervisor killed
while writing them leaves the write's temporary file). A file missed here keeps the
directory after the partition is gone, so every file fusuma makes there is named here.
"""

from __future__ import annotations

import contextlib
import logging
from pathlib import Path

from fusuma.governor import balloons

LOG = logging.getLogger(__name__)

SUPERVISOR_LOG = "supervisor.log"
START_LOCK = "supervisor.start"
RECOVERY_LOG = "recovery.log"
FILES = (SUPERVISOR_LOG, START_LOCK, RECOVERY_LOG, balloons.FILE_NAME)


def remove(pdir: Path) -> list[str]:
    """Remove partition directory ``pdir`` with the files fusuma keeps there. Anything
    else found there is left, with the directory, and said (a warning); the names of
    what was left (empty when the directory is gone)."""
    for name in FILES:
        with contextlib.suppress(FileNotFoundError):
            (pdir / name).unlink()
    for tmp in balloons.temp_files(pdir):
        with contextlib.suppress(FileNotFoundError):
            tmp.unlink()
    try:
        pdir.rmdir()
    except FileNotFoundError:
        return []
    except OSError as exc:
        left = sorted(p.name for p in pdir.iterdir()) if pdir.is_dir() else []
        LOG.warning("kept %s: %s (%s)", pdir, exc.strerror, ", ".join(left) or "empty")
        return left or [str(pdir)]
    return []
