"""The run of `fusuma bench memory` (see fusuma_bench.memory): the fit part, then the
burst part, and the result file."""

from __future__ import annotations

import time
from typing import Any

from fusuma.errors import FusumaError
from fusuma.host.accel import probe_accel
from fusuma.images import find_image
from fusuma.memshare.segments import SegmentManager
from fusuma.partition.manager import PartitionManager
from fusuma.qemu.cmdline import tcg_tb_mib
from fusuma.vm import VmManager
from fusuma_bench.memory import (
    SEGMENT_SKIP,
    TARGET_MARGIN_MIB,
    Config,
    Progress,
    targets,
)
from fusuma_bench.memory_burst import Burst
from fusuma_bench.memory_fit import FitBench
from fusuma_bench.report import meta
from fusuma_bench.steady import settle_params


class Bench:
    def __init__(self, parts: PartitionManager, vms: VmManager, segs: SegmentManager,
                 cfg: Config, progress: Progress = lambda s: None) -> None:
        self.parts = parts
        self.vms = vms
        self.cfg = cfg
        self.say = progress
        self.fit = FitBench(parts, vms, segs, cfg, progress)

    def check_host(self) -> None:
        """Refuse, in one sentence, what would stop the run before anything is made
        (partitions that exist, no minimal image, no KSM for a ksm mode)."""
        self.fit.check_host()
        if "burst" in self.cfg.parts:
            Burst(self.parts, self.vms, self.cfg, self.say)     # two cores, or one sentence

    def run(self) -> dict[str, Any]:
        cfg = self.cfg
        accel = probe_accel("auto").name
        started_meta = meta(accel)
        started = time.monotonic()
        fit: list[dict[str, Any]] = []
        if "fit" in cfg.parts and cfg.modes:
            fit = self.fit.results(self.fit.run_modes())
        burst: dict[str, Any] | None = None
        if "burst" in cfg.parts:
            try:
                burst = Burst(self.parts, self.vms, cfg, self.say).run()
            except FusumaError as exc:
                burst = {"failed": str(exc)}
                self.say(f"burst: failed: {exc}")
        data = {"meta": {**meta(accel), "git_revision": started_meta["git_revision"],
                         "date": started_meta["date"],
                         "duration_s": round(time.monotonic() - started, 1),
                         "benchmark": "memory", "quick": cfg.quick, "parts": list(cfg.parts),
                         "budget_mib": cfg.budget_mib, "modes": list(cfg.modes),
                         "segment_modes": SEGMENT_SKIP,
                         "overcommits": list(cfg.overcommits),
                         "memory_mib": cfg.memory_mib, "floor_mib": cfg.floor_mib,
                         "max_vms": cfg.max_vms, "overhead_mib": self.fit.overhead or None,
                         "partition_qemu": self.fit.qemu or "system",
                         "cores": list(self.parts.host.cpus),
                         "host_room_mib":
                             self.parts.host.memory_available_for_partitions_mib,
                         "image": find_image(self.parts.paths.cache,
                                             kind="minimal").digest[:16],
                         "tcg_tb_mib": tcg_tb_mib() if accel == "tcg" else None,
                         "settle": settle_params(),
                         "target_margin_mib": TARGET_MARGIN_MIB},
                "fit": fit, "burst": burst}
        data["targets"] = [{"target": t, "measured": m, "met": ok}
                           for t, m, ok in targets(data)]
        return data
