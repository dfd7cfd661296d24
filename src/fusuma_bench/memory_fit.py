"""The fit part of `fusuma bench memory` (see fusuma_bench.memory): the modes of
`bench density`, run by its Bench with minimal burstable guests, against fusuma's
admission at each overcommit."""

from __future__ import annotations

import contextlib
import time
from typing import Any

from fusuma.capacity import SUPERVISOR_MIB, definition_overhead, partition_share
from fusuma.errors import FusumaError, ResourceError
from fusuma.memshare.segments import SegmentManager
from fusuma.partition.manager import PartitionManager
from fusuma.spec import PartitionSpec
from fusuma.vm import VmManager
from fusuma_bench import density, httpload
from fusuma_bench.density import (
    KSM_PAGES_TO_SCAN,
    KSM_SLEEP_MS,
    MAX_FAILED_STARTS,
    PARTITION,
    READY_TIMEOUT_S,
    SOURCE_VM,
    ModeRun,
    Progress,
    per_vm_mib,
)
from fusuma_bench.density_run import Bench, vm_name
from fusuma_bench.memory import BALLAST, Config, OvercommitFit, admits, fit_vm


class FitBench(Bench):
    """`bench density`'s run with minimal guests that are burstable, each defined (fusuma
    admits it or not) before it is started (it runs within the budget or not)."""

    image_kind = "minimal"
    bench_name = "memory"

    def __init__(self, parts: PartitionManager, vms: VmManager, segs: SegmentManager,
                 cfg: Config, progress: Progress = lambda s: None) -> None:
        super().__init__(parts, vms, segs, density.Config(
            budget_mib=cfg.budget_mib, modes=cfg.modes, memory_mib=cfg.memory_mib,
            max_vms=cfg.max_vms, qemu=cfg.qemu, quick=cfg.quick), progress=progress)
        self.mcfg = cfg
        self.fits: dict[str, list[OvercommitFit]] = {}
        self.overhead = 0
        self.template_mib = 0

    def _ready(self, name: str, port: int, started: float, timeout: float) -> float:
        try:
            self.vms.wait_agent(name, timeout)
        except FusumaError as exc:
            raise httpload.NotReady(f"{name}'s guest agent did not answer within "
                                    f"{timeout:.0f} s of its start ({exc}).") from exc
        return round((time.monotonic() - started) * 1000, 1)

    def _create_args(self, mode: str, name: str, port: int) -> list[str]:
        args = ["vm", "create", name, "-p", PARTITION, "--memory-class", "burstable",
                "--memory-min", str(self.mcfg.floor_mib)]
        if mode.startswith("template"):
            args += ["--template", density.TEMPLATE]
        else:
            args += ["--image", self.image_kind, "--memory", str(self.mcfg.memory_mib)]
        if "ksm" in mode:
            args += ["--mergeable"]
        return args

    # -- one mode ------------------------------------------------------------------------
    def _fill(self, mode: str, r: ModeRun) -> None:
        cfg = self.mcfg
        fits: list[OvercommitFit] = []
        self.fits[mode] = fits
        if "ksm" in mode:
            self.ksm.set_run(1, pages_to_scan=KSM_PAGES_TO_SCAN, sleep_millisecs=KSM_SLEEP_MS)
        self.overhead = definition_overhead("auto")
        room = self.parts.host.memory_available_for_partitions_mib
        # The ballast holds all the host's room but the budget; its QEMU's share is in
        # the partition, so it is taken from its RAM.
        ballast = room - cfg.budget_mib - self.overhead
        self.parts.create(PartitionSpec(name=PARTITION, cpus=list(self.parts.host.cpus),
                                        memory_mib=SUPERVISOR_MIB + self.overhead,
                                        qemu=self.qemu,
                                        memory_overcommit=cfg.overcommits[0]))
        self._cli("vm", "create", BALLAST, "-p", PARTITION, "--image", self.image_kind,
                  "--memory", str(ballast))
        if mode.startswith("template"):
            self._grow(self.overhead)            # the template's source VM, for a while
            r.template_mib = self._make_template()
            self._cli("vm", "delete", SOURCE_VM, "--force")
            self._grow(-self.overhead)
            self.template_mib = cfg.memory_mib
        r.first_event = self.parts.db.last_event_id()
        defined: list[str] = []
        over_budget = False
        for oc in cfg.overcommits:
            self.parts.resize(PARTITION, memory_overcommit=oc)
            refusal, stop = None, "admission"
            while True:
                if len(defined) >= cfg.max_vms:
                    stop = "cap"
                    break
                refusal = self._admit(mode, defined)
                if refusal is not None:
                    break
                if over_budget:
                    continue
                if not self._start(mode, defined[-1], r):
                    if r.failed_starts >= MAX_FAILED_STARTS:
                        raise ResourceError(f"{r.failed_starts} VMs did not start (see "
                                            "the VMs' console logs)")
                    continue
                host, waited, ok = self._settled(mode, r)
                if host > cfg.budget_mib:
                    self.say(f"{mode}: with {len(r.names) + 1} VMs the host uses {host} "
                             f"MiB, more than the budget of {cfg.budget_mib} MiB: stopping "
                             "the newest (it stays admitted)")
                    self.vms.stop(defined[-1])
                    over_budget = True
                    continue
                r.names.append(defined[-1])
                self._point(mode, r, host, waited, ok)
            fits.append(OvercommitFit(oc, len(defined), len(r.names),
                                      r.points[-1][1] if r.points else None, stop, refusal))
            self.say(f"{mode} at overcommit {oc:g}: {len(defined)} admitted, "
                     f"{len(r.names)} running in the budget")

    def _grow(self, mib: int) -> None:
        rec = self.parts.db.partition(PARTITION)
        self.parts.resize(PARTITION, memory_mib=rec.memory_mib + mib)

    def _admit(self, mode: str, defined: list[str]) -> str | None:
        """Grow the partition by one VM's share and define the VM; None when fusuma
        admitted both, else its refusal (the partition back as it was)."""
        name = vm_name(self._index)
        self._index += 1
        share = partition_share(fit_vm(mode, self.mcfg.memory_mib, self.mcfg.floor_mib,
                                       self.overhead))
        try:
            self._grow(share)
        except ResourceError as exc:
            return str(exc)
        res = self._cli(*self._create_args(mode, name, 0), check=False)
        if res.returncode != 0:
            lines = [ln for ln in res.stderr.splitlines() if ln.strip()]
            with contextlib.suppress(FusumaError):
                self._grow(-share)
            return lines[-1].removeprefix("fusuma: error: ") if lines else "refused"
        defined.append(name)
        return None

    def _start(self, mode: str, name: str, r: ModeRun) -> bool:
        t0 = time.monotonic()
        self.say(f"{mode}: starting {name}")
        res = self._cli("vm", "start", name, check=False)
        try:
            if res.returncode != 0:
                lines = res.stderr.strip().splitlines()
                raise httpload.NotReady(lines[-1] if lines else "`vm start` failed")
            r.start_ms.append(self._ready(name, 0, t0, READY_TIMEOUT_S))
            return True
        except httpload.NotReady as exc:
            r.failed_starts += 1
            self.say(f"{mode}: {name}: {exc}")
            with contextlib.suppress(FusumaError):
                self.vms.stop(name)
            return False

    def _finish(self, mode: str, r: ModeRun) -> None:
        fp = self._footprint(mode)
        r.private_mib = [round(p.private_kib / 1024, 1) for p in fp.processes]

    # -- the result ------------------------------------------------------------------------
    def results(self, runs: list[ModeRun]) -> list[dict[str, Any]]:
        cfg = self.mcfg
        out = []
        for r in runs:
            vm = fit_vm(r.mode, cfg.memory_mib, cfg.floor_mib, self.overhead)
            fixed = cfg.memory_mib if r.mode.startswith("template") else 0
            out.append({
                "mode": r.mode, "stop": r.stop, "note": r.note,
                "overcommits": [f.as_json(admits(cfg.budget_mib, vm, f.overcommit, fixed,
                                                 cfg.max_vms))
                                for f in self.fits.get(r.mode, [])],
                "per_vm_mib": per_vm_mib(r.points),
                "first_vm_mib": r.points[0][1] if r.points else None,
                "host_mib": [{"vms": n, "mib": h} for n, h in r.points],
                "tcg_buffer_mib": list(r.tcg_mib), "start_ms": list(r.start_ms),
                "settle_s": list(r.settle_s), "unsettled": r.unsettled,
                "failed_starts": r.failed_starts, "private_mib": list(r.private_mib),
                "template_mib": r.template_mib, "ksm_resets": r.ksm_resets})
        return out
