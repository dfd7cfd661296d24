"""The burst part of `fusuma bench memory` (see fusuma_bench.memory): burstable guests
grow past the host's target of free memory beside a guaranteed guest; the memory
governor's decision log times the shortage, the guaranteed guest's loops time its
speed."""

from __future__ import annotations

import contextlib
import os
import time
from pathlib import Path
from typing import Any

from fusuma.capacity import SUPERVISOR_MIB, definition_overhead
from fusuma.errors import FusumaError, ResourceError
from fusuma.governor.memloop import mem_available_mib
from fusuma.partition.manager import PartitionManager
from fusuma.spec import PartitionSpec
from fusuma.vm import VmManager
from fusuma_bench.density_run import run_cli
from fusuma_bench.memory import (
    BURST_FLOOR_MIB,
    BURST_PARTITION,
    BURST_PREFIX,
    BURST_RAM_MIB,
    GUARANTEED,
    GUARANTEED_PARTITION,
    GUARANTEED_RAM_MIB,
    LOOP_ITERATIONS,
    RECOVER_MAX_S,
    TARGET_MARGIN_MIB,
    Config,
    Progress,
    episode,
    median,
    speed_ratio,
)

CHUNK_MIB = 8
QUIET_S = 10.0             # the growth done, the host not short this long: it will not be
# A CPU-bound loop timed by the guest's clock (/proc/uptime, 10 ms ticks; under TCG the
# guest's clock is the host's): the speed the guest sees.
LOOP = ("read a _ </proc/uptime; i=0; while [ $i -lt {n} ]; do i=$((i+1)); done; "
        "read b _ </proc/uptime; echo $a $b")
GROW = ("setsid sh -c 'i=0; while [ $i -lt {chunks} ]; do dd if=/dev/zero "
        "of=/tmp/burst.$i bs=1M count={chunk} 2>/dev/null || exit 1; i=$((i+1)); done; "
        "echo grown >/tmp/grown' </dev/null >/dev/null 2>&1 &")
RELEASE = "rm -f /tmp/burst.* /tmp/grown"
CHECK = ("test -e /tmp/grown && echo grown || echo growing; "
         "dmesg | grep -ci 'out of memory' || true")


def oom_kills(path: Path = Path("/proc/vmstat")) -> int | None:
    for line in path.read_text().splitlines():
        if line.startswith("oom_kill "):
            return int(line.split()[1])
    return None


class Burst:
    def __init__(self, parts: PartitionManager, vms: VmManager, cfg: Config,
                 progress: Progress = lambda s: None) -> None:
        self.parts = parts
        self.vms = vms
        self.cfg = cfg
        self.say = progress
        self.env = {**os.environ, **parts.paths.as_env()}
        self.names = [f"{BURST_PREFIX}{i}" for i in range(cfg.burst_vms)]
        cpus = list(parts.host.cpus)
        if len(cpus) < 2:
            raise ResourceError("the burst needs two cores (one for the burstable guests, "
                                "one for the guaranteed guest); this host has "
                                f"{len(cpus)}: leave it out with --parts fit.")
        self.core_b, self.core_g = cpus[0], cpus[1]

    def run(self) -> dict[str, Any]:
        cfg = self.cfg
        oom0 = oom_kills()
        affinity = os.sched_getaffinity(0)
        os.sched_setaffinity(0, {self.core_b})    # the bench and its CLI calls: core 0
        try:
            out = self._run()
        finally:
            os.sched_setaffinity(0, affinity)
            self._cleanup()
        oom1 = oom_kills()
        out["oom_kills"] = None if oom0 is None or oom1 is None else oom1 - oom0
        out.update({"burst_vms": cfg.burst_vms, "ram_mib": BURST_RAM_MIB,
                    "floor_mib": BURST_FLOOR_MIB, "burst_mib": cfg.burst_mib,
                    "guaranteed_ram_mib": GUARANTEED_RAM_MIB, "runs": cfg.runs,
                    "hold_s": cfg.hold_s,
                    "loop_iterations": LOOP_ITERATIONS, "cores": {
                        "burstable": self.core_b, "guaranteed": self.core_g}})
        return out

    def _run(self) -> dict[str, Any]:
        cfg = self.cfg
        overhead = definition_overhead("auto")
        self.parts.create(PartitionSpec(
            name=BURST_PARTITION, cpus=[self.core_b], memory_overcommit=2.0,
            memory_mib=SUPERVISOR_MIB + cfg.burst_vms * overhead + 64))
        self.parts.create(PartitionSpec(name=GUARANTEED_PARTITION, cpus=[self.core_g],
                                        memory_mib=SUPERVISOR_MIB + overhead + 64))
        for name in self.names:
            self._cli("vm", "create", name, "-p", BURST_PARTITION, "--memory",
                      str(BURST_RAM_MIB), "--memory-class", "burstable", "--memory-min",
                      str(BURST_FLOOR_MIB), "--start")
        self._cli("vm", "create", GUARANTEED, "-p", GUARANTEED_PARTITION, "--memory",
                  str(GUARANTEED_RAM_MIB), "--qos", "guaranteed", "--start")
        for name in [*self.names, GUARANTEED]:
            self.vms.wait_agent(name, 120.0)
        self.say(f"burst: {len(self.names)} burstable guests and {GUARANTEED} up; "
                 f"{cfg.runs} timed loops alone")
        alone = [self._loop() for _ in range(cfg.runs)]
        free = mem_available_mib()
        if free is None:
            raise ResourceError("the host has no MemAvailable in /proc/meminfo: the "
                                "memory governor cannot read its free memory.")
        margin = max(TARGET_MARGIN_MIB, cfg.burst_vms * cfg.burst_mib // 4)
        target = round(free - margin)
        self.env["FUSUMA_MEMORY_TARGET_FREE_MIB"] = str(target)
        for part in (BURST_PARTITION, GUARANTEED_PARTITION):
            self._cli("partition", "restart", part)
        pids = {v.name: v.pid for v in self.parts.db.vms()}
        self.say(f"burst: target {target} MiB free ({free:.0f} free now); each burstable "
                 f"guest writes {cfg.burst_mib} MiB")
        held0 = self._ram_files_mib()
        started = time.time()
        grow = GROW.format(chunks=cfg.burst_mib // CHUNK_MIB, chunk=CHUNK_MIB)
        for name in self.names:
            self._exec(name, grow)
        during: list[float] = []
        balloons: list[int] = []
        released: float | None = None
        grown_at: float | None = None
        held1 = held0
        rec: dict[str, Any] = {}
        free_seen: list[tuple[float, float]] = []
        while True:
            during.append(self._loop())
            free_seen.append((round(time.time() - started, 2), mem_available_mib() or 0.0))
            st = self._status(BURST_PARTITION)
            balloons += [v["balloon_actual_mib"] for v in st["vms"]
                         if v["balloon_actual_mib"] is not None]
            rec = episode(st["decisions"], started, released)
            now = time.time()
            if grown_at is None and self._grown():
                grown_at, held1 = now, self._ram_files_mib()
            # Released once the governor has nothing left to take, or when the host was
            # not short QUIET_S after the growth (it will not be), or at cfg.hold_s.
            if released is None and ((grown_at is not None and (
                    self._done(st) or (rec["first_short_at"] is None
                                       and now - grown_at > QUIET_S)))
                    or now - started > cfg.hold_s):
                for name in self.names:
                    self._exec(name, RELEASE)
                released = time.time()
                self.say(f"burst: released after {released - started:.0f} s; "
                         f"steps so far {rec['steps']}")
            if released is not None and ((rec["recovered_at"] is not None
                                         and len(during) >= cfg.runs)
                                         or now - released > RECOVER_MAX_S):
                break
        after = [self._loop() for _ in range(cfg.runs)]
        checks = {name: self._exec(name, CHECK).split() for name in self.names}
        alive = {v.name: v.pid for v in self.parts.db.vms()} == pids
        log = [d for d in self._status(BURST_PARTITION)["decisions"] if d["at"] >= started]
        rec = episode(log, started, released)
        g_st = self._status(GUARANTEED_PARTITION)
        touched = [d for d in g_st["decisions"] if d["vm"] == GUARANTEED]
        self.say(f"burst: shortage {rec['short_s']} s, back {rec['release_to_recovered_s']}"
                 f" s after the release; guaranteed guest at "
                 f"{speed_ratio(alone + after, during)} of its speed")
        return {"target_free_mib": target, "free_before_mib": round(free, 1),
                "target_margin_mib": margin,
                "ram_files_grew_mib": round(held1 - held0, 1),
                "grown_after_s": None if grown_at is None else round(grown_at - started, 2),
                "host_free_seen_mib": [{"s": t, "mib": round(f, 1)} for t, f in free_seen],
                "host_free_seen_min_mib": round(min(f for _, f in free_seen), 1),
                "released_after_s": round(released - started, 2) if released else None,
                "episode": rec, "alone_s": alone + after, "during_s": during,
                "alone_s_median": median(alone + after), "during_s_median": median(during),
                "speed_ratio": speed_ratio(alone + after, during),
                "balloon_actual_min_mib": min(balloons, default=None),
                "guests_alive": alive,
                "guest_oom_kills": sum(int(c[-1]) for c in checks.values() if c),
                "guaranteed_decisions": len(touched), "decisions": log}

    # -- pieces ---------------------------------------------------------------------------
    def _loop(self) -> float:
        a, b = self._exec(GUARANTEED, LOOP.format(n=LOOP_ITERATIONS)).split()
        return round(float(b) - float(a), 3)

    def _exec(self, name: str, script: str) -> str:
        res = self.vms.exec(name, ["/bin/sh", "-c", script], timeout=60.0)
        if res.exit_code != 0:
            raise ResourceError(f"`{script[:40]}...` in {name} exited {res.exit_code}: "
                                f"{res.stderr.decode(errors='replace').strip()}")
        return res.stdout.decode(errors="replace")

    def _ram_files_mib(self) -> float:
        """What the burstable guests' RAM files hold on the host (allocated blocks)."""
        held = 0
        for name in self.names:
            with contextlib.suppress(OSError):
                held += self.parts.paths.ram_file(name).stat().st_blocks * 512
        return held / 2**20

    def _grown(self) -> bool:
        return all(self._exec(n, CHECK).split()[0] == "grown" for n in self.names)

    @staticmethod
    def _done(st: dict[str, Any]) -> bool:
        """The governor has nothing left to take: every burstable balloon at its floor
        (and there, as QEMU says), or it said no-step-left."""
        floors = all(v["balloon_mib"] <= BURST_FLOOR_MIB and v["balloon_actual_mib"]
                     is not None and v["balloon_actual_mib"] <= BURST_FLOOR_MIB + 8
                     for v in st["vms"] if v["class"] == "burstable")
        return floors or any(d["action"] == "no-step-left" for d in st["decisions"])

    def _status(self, part: str) -> dict[str, Any]:
        from fusuma.supervisor import rpc

        st = self.parts.client(part).send(rpc.GovernorStatus(limit=256), timeout=10.0)
        return st.status["memory"]  # type: ignore[no-any-return]

    def _cli(self, *args: str) -> None:
        run_cli(self.env, *args)

    def _cleanup(self) -> None:
        for part in (BURST_PARTITION, GUARANTEED_PARTITION):
            if self.parts.db.find_partition(part) is not None:
                try:
                    self.parts.delete(part, force=True)
                except FusumaError as exc:
                    self.say(f"cleanup of partition {part} failed: {exc}")
