"""The host lock: re-entrant in one process, exclusive across processes."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

from fusuma.state.lock import host_lock

HOLD = """
import sys, time
from pathlib import Path
from fusuma.state.lock import host_lock
with host_lock(Path(sys.argv[1])):
    print("got", flush=True)
    time.sleep(float(sys.argv[2]))
"""


def test_reentrant_and_exclusive(tmp_path: Path) -> None:
    with host_lock(tmp_path), host_lock(tmp_path):   # nested: no self-deadlock
        child = subprocess.Popen([sys.executable, "-c", HOLD, str(tmp_path), "0"],
                                 stdout=subprocess.PIPE, text=True)
        time.sleep(0.5)
        assert child.poll() is None, "another process got the lock while we held it"
    t0 = time.monotonic()
    out, _ = child.communicate(timeout=10)
    assert out == "got\n" and time.monotonic() - t0 < 5
