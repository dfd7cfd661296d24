"""In-guest side of the cgroup v2 tests: runs inside the debian-host guest (systemd as
PID 1, cgroup2 at /sys/fs/cgroup), never on the host (tests/cgroup2/conftest.py keeps
it out of the host's collection). Each test's outcome goes to RESULTS as JSON, which
the host-side test (tests/cgroup2/test_in_guest.py) reads back through the guest agent.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from kit import close_servers

RESULTS = Path(os.environ.get("FUSUMA_CG2_RESULTS", "/run/fusuma-cg2/results.json"))
_results: dict[str, dict[str, Any]] = {}
_HZ = os.sysconf("SC_CLK_TCK")


def _guest_cpu() -> float:
    """CPU seconds the whole guest spent (all vCPUs, /proc/stat), idle and iowait not."""
    f = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    return (sum(f) - f[3] - f[4]) / _HZ


_START: dict[str, float] = {}


@pytest.hookimpl(wrapper=True, tryfirst=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Any:
    rep = yield
    setattr(item, "rep_" + rep.when, rep)
    cur = _results.setdefault(item.nodeid, {"outcome": "passed", "seconds": 0.0,
                                            "detail": ""})
    # The guest's CPU during the test, set-up to teardown (all vCPUs).
    if rep.when == "setup":
        _START[item.nodeid] = _guest_cpu()
    elif rep.when == "teardown" and item.nodeid in _START:
        cur["guest_cpu_s"] = round(_guest_cpu() - _START[item.nodeid], 1)
    cur["seconds"] = round(cur["seconds"] + rep.duration, 2)
    if rep.failed or (rep.skipped and cur["outcome"] == "passed"):
        cur["outcome"] = "failed" if rep.failed else "skipped"
        text = str(rep.longrepr) if rep.longrepr else ""
        # The error's own message first: a log that keeps only the head of a long
        # traceback still says what failed (e.g. a CLI call's exit and stderr).
        crash = getattr(rep.longrepr, "reprcrash", None)
        head = f"{crash.message[:1500]}\n--- traceback:\n" if crash is not None else ""
        cur["detail"] = (cur["detail"] + f"\n[{rep.when}] " + head + text[-3000:]).strip()
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps(_results, indent=1))
    return rep


@pytest.fixture(scope="session", autouse=True)
def _fork_servers() -> Iterator[None]:
    """The CLI's fork servers (guest/forkcli.py) end with the session."""
    yield
    close_servers()
