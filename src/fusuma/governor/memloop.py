"""The memory governor's loop, run as an asyncio task inside a partition supervisor.

Every ``interval`` seconds it reads the host's free memory (``MemAvailable``) and memory
pressure (``/proc/pressure/memory``), and for each running VM of the partition its
record (class, floor, RAM), what its guest RAM holds (``Actions.resident``) and
its RAM cgroup's counters (``CgroupDriver.ram_pressure``); asks
:func:`~fusuma.governor.mempolicy.decide` what to change and does it: a QMP
``balloon`` target, a guest agent asked to compact its memory (so free page reporting
hands whole blocks back) or to drop its caches. Each change is kept with its reason and
numbers (``governor status``).

The host's target of free memory is half of what fusuma keeps for the host itself
(``HostInfo.memory_reserved_mib``), at least 256 MiB (``FUSUMA_MEMORY_TARGET_FREE_MIB``
sets another): the governor starts taking memory back well before the kernel would
have to. Each tick it also asks QEMU where each burstable VM's balloon stands
(``balloon_actual_mib`` in the status: what the guest has given so far).

Each balloon target is written to ``balloons.json`` beside the supervisor's state
(:mod:`fusuma.governor.balloons`, with the pid of the QEMU it is for) before QEMU is
asked for it. A supervisor that starts (or restarts, re-adopting running VMs) takes the
targets whose QEMU still runs under that pid, asks QEMU for each again and goes on from
it (a ``resume`` decision); for any other VM it reads the balloon's size from QEMU
(``query-balloon``). So a governor killed mid-reclaim is followed by one that knows the
targets, not only where the balloons stood when it looked, and puts back any balloon
below its VM's floor (or any balloon of a guaranteed VM) at its first tick.

Each partition's governor acts on its own VMs only; with several partitions each takes
its own burstable VMs' part of the shortfall, so together they may take back more than
the shortfall (never below a floor, and given back once the host is roomy).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import time
from collections import deque
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

from fusuma.governor import balloons
from fusuma.governor.loop import Ticking
from fusuma.governor.mempolicy import (
    CgroupPressure,
    HostMemory,
    MemControl,
    MemState,
    MemThresholds,
    MemVm,
    decide,
)
from fusuma.governor.policy import Decision
from fusuma.host.cgroups import CgroupDriver
from fusuma.state import Database, VmRecord

INTERVAL_S = 2.0
HISTORY = 256
MIB = 2**20
# The guest's side of each step (busybox sh suffices).
COMPACT_ARGV = ["/bin/sh", "-c", "echo 1 > /proc/sys/vm/compact_memory 2>/dev/null; true"]
DROP_ARGV = ["/bin/sh", "-c", "sync; echo 3 > /proc/sys/vm/drop_caches; "
             "echo 1 > /proc/sys/vm/compact_memory 2>/dev/null; true"]
ACTION_TIMEOUT_S = 30.0
# Seconds between writing a balloon target down and asking QEMU for it (a fault test
# kills the supervisor in that window).
FAULT_BALLOON_DELAY = "FUSUMA_FAULT_BALLOON_DELAY"


def mem_available_mib(path: Path = Path("/proc/meminfo")) -> float | None:
    try:
        for line in path.read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) / 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


def memory_psi(path: Path = Path("/proc/pressure/memory")) -> float | None:
    """The host's memory PSI ``some avg10`` (%), None without PSI."""
    try:
        for line in path.read_text().splitlines():
            if line.startswith("some "):
                return float(dict(f.split("=", 1) for f in line.split()[1:])["avg10"])
    except (OSError, ValueError, KeyError):
        return None
    return None


def target_free_mib(reserved_mib: int) -> float:
    """Half of what fusuma keeps for the host, at least 256 MiB; FUSUMA_MEMORY_TARGET_
    FREE_MIB sets another (a test makes the host look short with a huge one)."""
    with contextlib.suppress(KeyError, ValueError):
        return float(os.environ["FUSUMA_MEMORY_TARGET_FREE_MIB"])
    return float(max(256, reserved_mib // 2))


class Actions:
    """What the loop does to a VM, given by the supervisor (its QEMUs and agents)."""

    def __init__(self, balloon: Callable[[str, int], Awaitable[None]],
                 balloon_now: Callable[[str], Awaitable[int | None]],
                 guest: Callable[[str, list[str]], Awaitable[None]],
                 resident: Callable[[VmRecord, int], int | None],
                 has_balloon: Callable[[VmRecord], bool]) -> None:
        self.balloon = balloon            # (vm, target MiB)
        self.balloon_now = balloon_now    # vm -> MiB the balloon leaves the guest
        self.guest = guest                # (vm, argv) through its guest agent
        self.resident = resident          # bytes its guest RAM holds on the host
        self.has_balloon = has_balloon    # its guest runs with the balloon device


class MemoryGovernor(Ticking):
    """One partition's memory governor; the supervisor owns it."""

    def __init__(self, partition: str, cg: CgroupDriver, db: Database,
                 pids: Callable[[], dict[str, int]], actions: Actions, reserved_mib: int,
                 log: logging.Logger, interval: float = INTERVAL_S,
                 thresholds: MemThresholds | None = None, store: Path | None = None
                 ) -> None:
        self.partition = partition
        self.cg = cg
        self.db = db
        self.pids = pids
        self.actions = actions
        self.target_free_mib = target_free_mib(reserved_mib)
        self.log = log.getChild("memory")
        self.interval = interval
        self.th = thresholds or MemThresholds()
        self.controls: dict[str, MemControl] = {}
        self.state = MemState()
        self.fails: dict[str, float] = {}
        self.seen: dict[str, MemVm] = {}
        self.actual: dict[str, int | None] = {}   # balloon sizes QEMU reports
        self._balloons: dict[tuple[str, str | None], bool] = {}
        self.host: HostMemory | None = None
        self.decisions: deque[Decision] = deque(maxlen=HISTORY)
        self.ticks = 0
        self.errors = 0
        self.last_error: str | None = None
        self._tasks: set[asyncio.Task[None]] = set()
        self.store = store                          # balloons.json (None: kept nowhere)
        self._stored: dict[str, balloons.Target] | None = None   # None: not written yet

    # -- measuring ----------------------------------------------------------------------
    def _vm(self, rec: VmRecord, pid: int) -> MemVm:
        from fusuma import capacity

        key = (rec.name, rec.devices)
        on = self._balloons.get(key)
        if on is None:      # parsed once per device set, not at every tick
            on = self._balloons[key] = self.actions.has_balloon(rec)
        floor = capacity.memory_floor(rec)
        if floor >= rec.memory_mib:
            # Never reclaimed: nothing to read (a clone's smaps walk costs milliseconds).
            return MemVm(rec.name, rec.memory_class, rec.memory_mib, floor, None,
                         balloon=on)
        held = self.actions.resident(rec, pid)
        pressure = CgroupPressure()
        if rec.shared_ram and rec.ram_path:
            got = self.cg.ram_pressure(Path(rec.ram_path).name.removesuffix(".ram"))
            fails = got["fails"]
            delta = 0
            if fails is not None:
                delta = int(max(0.0, fails - self.fails.get(rec.name, fails)))
                self.fails[rec.name] = fails
            pressure = CgroupPressure(
                psi_pct=got["psi"], failcnt_delta=delta,
                usage_mib=None if got["usage"] is None else got["usage"] / MIB,
                limit_mib=None if got["limit"] is None else got["limit"] / MIB)
        return MemVm(rec.name, rec.memory_class, rec.memory_mib, floor,
                     None if held is None else held / MIB, pressure, page_reporting=on,
                     balloon=on, agent=True)

    def _measure(self) -> tuple[list[MemVm], HostMemory, dict[str, int]]:
        recs = {v.name: v for v in self.db.vms(self.partition)}
        pids = {name: pid for name, pid in self.pids().items() if name in recs}
        vms = [self._vm(recs[name], pid) for name, pid in sorted(pids.items())]
        for gone in set(self.fails) - {v.name for v in vms}:
            self.fails.pop(gone, None)
        self._balloons = {k: on for k, on in self._balloons.items() if k[0] in recs}
        free = mem_available_mib()
        host = HostMemory(free if free is not None else float("inf"), self.target_free_mib,
                          memory_psi())
        return vms, host, pids

    async def _adopt(self, vms: list[MemVm], pids: dict[str, int]) -> list[Decision]:
        """Controls for VMs seen for the first time: the target a predecessor wrote
        down for the same QEMU (asked of QEMU again), else where QEMU says the balloon
        stands (a predecessor may have inflated it)."""
        new = [v for v in vms if v.name not in self.controls]
        if not new:
            return []
        found = balloons.load(self.store, pids) if self.store is not None else {}
        said = []
        for v in new:
            kept = found.get(v.name)
            if kept is not None and v.balloon:
                target = min(v.ram_mib, kept.target_mib)
                self.controls[v.name] = MemControl(balloon_mib=target)
                said.append(Decision(time.time(), v.name, "resume", (
                    f"an earlier supervisor set the balloon of {v.name} to {target} MiB "
                    f"(QEMU pid {kept.pid}); asking QEMU for it again and going on"), {
                        "balloon_mib": float(target), "ram_mib": float(v.ram_mib),
                        "floor_mib": float(v.floor_mib)}))
                try:
                    await self.actions.balloon(v.name, target)
                except Exception as exc:
                    self.log.warning("memory governor: the balloon of %s: %s", v.name, exc)
                continue
            size = None
            if v.balloon:
                with contextlib.suppress(Exception):
                    size = await self.actions.balloon_now(v.name)
            self.controls[v.name] = MemControl(
                balloon_mib=v.ram_mib if size is None else min(v.ram_mib, size))
        return said

    def _write_targets(self, pids: dict[str, int]) -> None:
        """Write down every balloon below its VM's RAM, before QEMU is asked for it."""
        if self.store is None:
            return
        want = {name: balloons.Target(pids[name], ctl.balloon_mib)
                for name, ctl in self.controls.items()
                if name in pids and name in self.seen
                and ctl.balloon_mib < self.seen[name].ram_mib}
        if want == self._stored:
            return
        try:
            balloons.save(self.store, want)
            self._stored = want
        except OSError as exc:
            self.log.warning("memory governor: cannot write %s: %s", self.store, exc)

    # -- acting -------------------------------------------------------------------------
    def _spawn(self, what: str, aw: Awaitable[None]) -> None:
        async def guarded() -> None:
            try:
                await asyncio.wait_for(aw, ACTION_TIMEOUT_S)
            except Exception as exc:
                self.log.warning("memory governor: %s failed: %s", what, exc)
        task = asyncio.get_running_loop().create_task(guarded())
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _balloon(self, vm: str, mib: int) -> None:
        with contextlib.suppress(KeyError, ValueError):
            await asyncio.sleep(float(os.environ[FAULT_BALLOON_DELAY]))
        await self.actions.balloon(vm, mib)

    async def tick(self) -> list[Decision]:
        vms, host, pids = self._measure()
        resumed = await self._adopt(vms, pids)
        old = self.controls
        new, self.state, decisions = decide(vms, old, self.state, host, self.th, time.time())
        decisions = resumed + decisions
        self.controls = new
        self.seen = {v.name: v for v in vms}
        self._write_targets(pids)
        for v in vms:
            if v.burstable and v.balloon:
                with contextlib.suppress(Exception):
                    self.actual[v.name] = await self.actions.balloon_now(v.name)
        for gone in set(self.actual) - set(self.seen):
            self.actual.pop(gone, None)
        self.host = host
        for d in decisions:
            self.log.info("%s %s: %s", d.vm, d.action, d.reason)
            with contextlib.suppress(Exception):   # the decision stands; its event is
                self.db.emit_context("governor", f"memory-{d.action}",   # best effort
                                     f"/1.0/partitions/{self.partition}",
                                     {"partition": self.partition, **d.as_json()})
            if d.action == "trim":
                self._spawn(f"compacting {d.vm}", self.actions.guest(d.vm, COMPACT_ARGV))
            elif d.action == "drop-caches":
                self._spawn(f"dropping the caches of {d.vm}",
                            self.actions.guest(d.vm, DROP_ARGV))
        for name, ctl in new.items():
            prev = old.get(name)      # every VM has one: _adopt made it
            if prev is not None and prev.balloon_mib != ctl.balloon_mib and \
                    self.seen[name].balloon:
                self._spawn(f"the balloon of {name}",
                            self._balloon(name, ctl.balloon_mib))
        self.decisions.extend(decisions)
        self.ticks += 1
        return decisions

    # -- status -------------------------------------------------------------------------
    def status(self, limit: int = 50) -> dict[str, Any]:
        vms = []
        for name in sorted(self.controls):
            v = self.seen.get(name)
            vms.append({"name": name, **self.controls[name].as_json(),
                        "balloon_actual_mib": self.actual.get(name),
                        "class": v.memory_class if v else None,
                        "floor_mib": v.floor_mib if v else None,
                        "ram_mib": v.ram_mib if v else None,
                        "resident_mib": None if v is None or v.resident_mib is None
                        else round(v.resident_mib, 1)})
        recent = list(self.decisions)[-limit:] if limit > 0 else []
        h = self.host
        return {"interval_s": self.interval, "thresholds": self.th.as_json(),
                "target_free_mib": self.target_free_mib,
                "host_free_mib": None if h is None or h.free_mib == float("inf")
                else round(h.free_mib, 1),
                "host_psi_pct": None if h is None else h.psi_pct,
                "ticks": self.ticks, "errors": self.errors, "last_error": self.last_error,
                "vms": vms, "decisions": [d.as_json() for d in recent],
                "decisions_kept": len(self.decisions)}
