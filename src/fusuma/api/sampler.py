"""Samples for the dashboard's sparklines: every ``SAMPLE_S``, each running VM's CPU %,
vCPU wait % and host memory for the last ``HISTORY_S``; the memory also serves
``GET /1.0/vms`` while it is fresh."""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from fusuma.paths import Paths
from fusuma.state import Database

LOG = logging.getLogger(__name__)

SAMPLE_S = 2.0
MEMORY_MAX_AGE_S = 2.0 * SAMPLE_S
HISTORY_S = 300.0


@dataclass
class _VmSeries:
    pid: int
    prev: Any = None
    points: collections.deque[dict[str, Any]] = field(
        default_factory=lambda: collections.deque(maxlen=int(HISTORY_S / SAMPLE_S) + 1))


class Sampler:
    """Every SAMPLE_S: each running VM's CPU % and vCPU wait % (between two readings of
    its threads' schedstat) and its PSS."""

    def __init__(self, paths: Paths, db: Callable[[], Database]) -> None:
        self.paths = paths
        self.db = db
        self.series: dict[str, _VmSeries] = {}
        # (name, pid) -> (monotonic time, host_memory JSON): what GET /1.0/vms shows.
        self._memory: dict[tuple[str, int], tuple[float, dict[str, Any] | None]] = {}
        self._task: asyncio.Task[None] | None = None
        self._lock = threading.Lock()

    async def start(self) -> None:
        self._task = asyncio.create_task(self._run(), name="ui-sampler")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task

    async def _run(self) -> None:
        while True:
            try:
                await asyncio.to_thread(self.sample)
            except Exception:
                LOG.exception("dashboard sampler failed")
            await asyncio.sleep(SAMPLE_S)

    def sample(self) -> None:
        from fusuma.governor import measure
        from fusuma.vm.view import VmView, read_memory

        now = time.time()
        live: set[str] = set()
        for rec in self.db().vms():
            if rec.pid is None or VmView(rec).state not in ("running", "paused",
                                                             "migrating"):
                continue
            live.add(rec.name)
            with self._lock:
                s = self.series.get(rec.name)
                if s is None or s.pid != rec.pid:
                    # A new QEMU (a start, a move): same VM, history kept.
                    old = s.points if s else None
                    s = _VmSeries(rec.pid)
                    if old:
                        s.points.extend(old)
                    self.series[rec.name] = s
            cur = measure.read(rec.pid)
            if not cur.threads:
                continue
            point: dict[str, Any] = {"t": round(now, 1)}
            if s.prev is not None:
                load = measure.load(s.prev, cur)
                point["cpu_pct"] = round(load.cpu_pct, 1)
                point["wait_pct"] = round(load.wait_pct, 1)
            s.prev = cur
            mem = read_memory(rec.pid, rec.segments, self.paths.segments_dir,
                              clone=rec.template is not None)
            if mem is not None:
                point["pss_mib"] = mem["pss_mib"]
            with self._lock:
                self._memory[(rec.name, rec.pid)] = (time.monotonic(), mem)
                s.points.append(point)
        with self._lock:
            for key in [k for k in self._memory if k[0] not in live]:
                del self._memory[key]
            for gone in set(self.series) - live:
                # Keep a stopped VM's history until it is older than the window.
                pts = self.series[gone].points
                if not pts or pts[-1]["t"] < now - HISTORY_S:
                    del self.series[gone]

    def memory(self, name: str, pid: int) -> dict[str, Any] | None:
        """The host memory of VM ``name``'s QEMU ``pid`` from the last sample, if that
        is at most MEMORY_MAX_AGE_S old (else None: the caller reads /proc)."""
        with self._lock:
            got = self._memory.get((name, pid))
        if got is None or time.monotonic() - got[0] > MEMORY_MAX_AGE_S:
            return None
        return got[1]

    def history(self) -> dict[str, list[dict[str, Any]]]:
        with self._lock:
            return {k: list(v.points) for k, v in self.series.items()}
