"""Waiting on the bench's lab cluster (``fusuma_bench.cluster`` and its cases)."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from fusuma.errors import FusumaError


def ready(o: dict[str, Any]) -> bool:
    """Whether FusumaVM ``o`` says it runs: Running, and Ready in its conditions."""
    st = o.get("status") or {}
    conds = {c["type"]: c["status"] for c in st.get("conditions") or []}
    return st.get("state") == "Running" and conds.get("Ready") == "True"


def wait(fn: Callable[[], Any], timeout: float, what: str, every: float = 0.5) -> Any:
    """``fn()``'s first true answer, asked every ``every`` s; FusumaError after
    ``timeout`` s (``what``: what was waited for, for the sentence)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        got = fn()
        if got:
            return got
        time.sleep(every)
    raise FusumaError(f"timed out after {timeout:.0f} s waiting for {what}.")
