"""`fusuma bench density`: how many Debian+apache2 VMs fit in a host memory budget.

For each mode, Debian guests (the ``debian`` image, apache2 running) start one by one
in a scratch partition holding every core, until the next one would take the host
memory in use past the budget:

- ``none``          the root on the image's read-only virtio-blk disk (a page-cache copy
                    in every guest), guest RAM in a shared file
- ``segment``       the root from one shared segment at ``/`` (virtio-pmem, erofs DAX)
- ``ksm``           as none, with private RAM marked mergeable and KSM running
- ``segment+ksm``   both
- ``template``      clones of a template made from one booted VM (root on the disk,
                    apache2 running): each maps the template's RAM copy-on-write
- ``template+ksm``  clones marked mergeable, KSM running

Every booted VM has the host's default free page reporting (clones have none: their RAM
is the template's). Host memory in use is measured with fusuma.memshare.footprint: the
QEMUs' own memory (PSS: the segment's mapped pages once among its users) plus the tmpfs
files counted once (RAM files and a template's RAM by their allocated blocks); the
host page cache of the segment or root disk beyond what is mapped (readahead, pages
QEMU read once) is reported beside it. After each VM answers HTTP through its
forwarded port the memory is left to settle (the guest reports freed pages, KSM
merges) before it is read.

The next VM is started while the last one's cost, added again, stays within the budget
(two at a time while the room left holds STEP_FAR such costs: each reading costs a
settle); a VM whose reading lands above the budget is removed again, so the count is
the largest that fitted. A VM that never answers HTTP is removed and counted; three
end the mode. Per mode the result holds the VMs that fitted, what each VM
beyond the first added (``per_vm_mib``: (host(N) - host(1)) / (N - 1)), the saving of
that against mode none, the median time from `vm create --start` to the first HTTP
answer, and the requests/s of a bounded request loop over all the mode's VMs.

VMs and templates are made with the `fusuma` CLI (a child process in this namespace),
the way a user makes them; the partition and the segment with the managers. The host's
KSM settings are restored afterwards and everything made is removed, also on failure.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from fusuma.capacity import SUPERVISOR_MIB, definition_overhead
from fusuma.errors import FusumaError, HostError, ResourceError, StateError
from fusuma.host.accel import probe_accel
from fusuma.images import find_image
from fusuma.memshare import footprint, reporting
from fusuma.memshare.ksm import Ksm, KsmSettings
from fusuma.memshare.segments import SegmentManager
from fusuma.partition.manager import PartitionManager
from fusuma.qemu.cmdline import tcg_tb_mib
from fusuma.spec import PartitionSpec
from fusuma.vm import VmManager
from fusuma_bench import httpload
from fusuma_bench.dcss import PAPER as DCSS_PAPER
from fusuma_bench.report import meta

LOG = logging.getLogger(__name__)

PARTITION = "bench-density"
SEGMENT = "bench-density-root"
TEMPLATE = "bench-density-tpl"
SOURCE_VM = "bench-density-src"
VM_PREFIX = "bench-density-"
ROOT_MOUNT = "/"          # where segment modes mount the segment in the guest
MODES = ("none", "segment", "ksm", "segment+ksm", "template", "template+ksm")
TEMPLATE_QEMU = "10.0"    # clones map the template read-only: QEMU >= 8.2 (issue 14)
DEFAULT_BUDGET_MIB = 4096
QUICK_BUDGET_MIB = 1536
DEFAULT_REQUESTS = 1000
QUICK_REQUESTS = 200
MEMORY_MIB = 256
MAX_VMS = 64              # per mode, whatever the budget: the run stays bounded
HTTP_CONCURRENCY = 4
READY_TIMEOUT_S = 180.0   # from `vm create --start` to a booted guest's first answer
CLONE_READY_TIMEOUT_S = 30.0   # ... and a clone's (it runs in well under a second)
LOOP_DEADLINE_S = 180.0   # the whole request loop of a mode
QUICK_LOOP_DEADLINE_S = 60.0
MAX_FAILED_STARTS = 3     # VMs of one mode that never answered: then the mode stops
CLI_TIMEOUT_S = 300.0
# While the room left is at least STEP_FAR times the last VM's cost, two VMs start
# before the next reading (the budget is far; each reading costs a settle).
STEP_FAR = 4.0
# Settling after each step (measured here, TCG, 2 cores, 256 MiB Debian guests: the
# host memory held still within 3 MiB at the first window in every step of a --quick
# run; page reporting starts 2 s after free memory crosses its threshold): wait
# SETTLE_MIN_S, then read every SETTLE_EVERY_S until SETTLE_WINDOW readings lie within
# max(SETTLE_TOL_MIB, SETTLE_TOL_FRAC of the total), at most SETTLE_MAX_S. In the KSM
# modes KSM settles first (its wait takes more than SETTLE_MIN_S).
SETTLE_MIN_S = 2.0
SETTLE_EVERY_S = 1.0
SETTLE_WINDOW = 3
SETTLE_TOL_MIB = 3.0
SETTLE_TOL_FRAC = 0.005
SETTLE_MAX_S = 30.0
# KSM scans fast while VMs are added (4000 pages every 20 ms, as bench dcss), and the
# memory is read once it has settled (two full scans changing pages_sharing < 1%).
KSM_PAGES_TO_SCAN = 4000
KSM_SLEEP_MS = 20
KSM_SETTLE_TIMEOUT_S = 300.0
# While the requests are measured KSM scans at the kernel's default rate (as bench dcss):
# at the settling rate its scanner takes a good part of one of the two cores.
KSM_LOAD_PAGES_TO_SCAN = 100
MARGIN_MIB = 256
PAPER = {"table1": DCSS_PAPER["table1"], "table3": DCSS_PAPER["table3"],
         "peers": [{"system": "Kata Containers VM templating (100 small guests)",
                    "saved_pct": 72},
                   {"system": "Difference Engine (up to)", "saved_pct": 90}]}

Progress = Callable[[str], None]


# -- the pure parts ---------------------------------------------------------------------
def parse_modes(text: str | None) -> list[str]:
    """``none,segment`` -> a checked list in the given order; None: every mode."""
    if not text:
        return list(MODES)
    modes = [m.strip() for m in text.split(",") if m.strip()]
    bad = [m for m in modes if m not in MODES]
    if bad or not modes:
        raise ResourceError(f"unknown mode {bad[0] if bad else text!r}: the modes are "
                            f"{', '.join(MODES)}.")
    return list(dict.fromkeys(modes))


Point = tuple[int, float]        # (VMs running, host memory in use MiB)


def next_step(points: Sequence[Point], budget_mib: float, cap: int,
              far: float = STEP_FAR) -> tuple[int, str | None]:
    """(how many VMs to start before the next reading, why the mode stops when 0).

    It stops at ``cap`` VMs ("cap"), or when the last VM's cost, added once more,
    would pass the budget ("budget"). Before two readings there is no cost per added
    VM to go by: one VM is started and its reading decides. Two start at once while the
    room left holds ``far`` times the last cost."""
    if not points:
        return 1, None
    n, host = points[-1]
    if n >= cap:
        return 0, "cap"
    if len(points) < 2:
        return 1, None
    n0, host0 = points[-2]
    cost = max(0.0, (host - host0) / (n - n0))
    room = budget_mib - host
    if room < cost:
        return 0, "budget"
    if cost > 0 and room >= far * cost and n + 2 <= cap:
        return 2, None
    return 1, None


def per_vm_mib(points: Sequence[Point]) -> float | None:
    """What each VM beyond the first added: (host(N) - host(1)) / (N - 1)."""
    if len(points) < 2 or points[-1][0] == points[0][0]:
        return None
    (n1, h1), (n, h) = points[0], points[-1]
    return round((h - h1) / (n - n1), 1)


def saving_pct(per_vm: float | None, base: float | None) -> float | None:
    """How much less a VM costs than in mode none, in percent."""
    if per_vm is None or not base:
        return None
    return round(100 * (1 - per_vm / base), 1)


def settle(sample: Callable[[], float], clock: Callable[[], float] = time.monotonic,
           sleep: Callable[[float], None] = time.sleep, min_s: float = SETTLE_MIN_S,
           every_s: float = SETTLE_EVERY_S, window: int = SETTLE_WINDOW,
           tol_mib: float = SETTLE_TOL_MIB, tol_frac: float = SETTLE_TOL_FRAC,
           max_s: float = SETTLE_MAX_S) -> tuple[float, float, bool]:
    """Read ``sample`` until ``window`` readings in a row lie within the tolerance;
    returns (the last reading, seconds waited, whether it settled before ``max_s``)."""
    start = clock()
    sleep(min_s)
    seen: list[float] = []
    while True:
        seen.append(sample())
        last = seen[-window:]
        if len(last) == window and max(last) - min(last) <= max(tol_mib,
                                                                 tol_frac * last[-1]):
            return last[-1], round(clock() - start, 1), True
        if clock() - start >= max_s:
            return seen[-1], round(clock() - start, 1), False
        sleep(every_s)


def below_one_vm(budget_mib: int, one_mib: float, mode: str, memory_mib: int) -> str:
    """The one sentence for a budget that does not hold a single VM."""
    return (f"a budget of {budget_mib} MiB is smaller than one VM: one Debian VM of "
            f"{memory_mib} MiB took {one_mib:.0f} MiB of host memory in mode {mode}; give "
            f"--budget-mib {int(one_mib) + 1} or more (--quick uses {QUICK_BUDGET_MIB}).")


def capacity(mode: str, avail_mib: int, memory_mib: int, overhead_mib: int,
             max_vms: int) -> tuple[int, int]:
    """(the scratch partition's memory, the most VMs fusuma admits) for ``mode`` on a
    host that gives partitions ``avail_mib``. Admission counts what each VM may come to
    use, not what it uses (fusuma.capacity): a VM with shared RAM its QEMU's overhead in
    the partition and its RAM host-wide; a VM with private RAM (KSM, a clone) both in
    the partition; a template mode also the source VM's RAM and the template's."""
    private = "ksm" in mode or mode.startswith("template")
    share = overhead_mib + (memory_mib if private else 0)
    per_host = 0 if private else memory_mib
    fixed = 2 * memory_mib if mode.startswith("template") else 0
    room = avail_mib - fixed - SUPERVISOR_MIB - MARGIN_MIB
    cap = max(0, min(max_vms, (room - share) // (share + per_host)))
    # one VM more than the cap: the template's source VM is defined beside its clones
    return SUPERVISOR_MIB + MARGIN_MIB + (cap + 1) * share, cap


def _median(xs: Sequence[float]) -> float | None:
    return round(statistics.median(xs), 1) if xs else None


@dataclass
class ModeRun:
    """What one mode measured. ``points`` hold (VMs, host MiB) after each step, and
    ``tcg_mib``, ``page_cache_mib``, ``settle_s`` one value per point."""

    mode: str
    points: list[Point] = field(default_factory=list)
    names: list[str] = field(default_factory=list)      # the VMs running, oldest first
    start_ms: list[float] = field(default_factory=list)
    cli_ms: list[float] = field(default_factory=list)
    settle_s: list[float] = field(default_factory=list)
    tcg_mib: list[float] = field(default_factory=list)
    page_cache_mib: list[float] = field(default_factory=list)
    unsettled: int = 0
    failed_starts: int = 0
    ksm_resets: int = 0
    first_event: int = 0
    clone_agent_ms: list[float] = field(default_factory=list)
    clone_restore_ms: list[float] = field(default_factory=list)
    private_mib: list[float] = field(default_factory=list)
    private_no_tcg_mib: list[float] = field(default_factory=list)
    rejected_mib: float | None = None
    stop: str = "budget"
    note: str | None = None
    requests_per_s: float | None = None
    requests: int = 0
    failed_requests: int = 0
    host_after_requests_mib: float | None = None
    ksm_saved_mib: float | None = None
    files: dict[str, Any] = field(default_factory=dict)
    template_mib: float | None = None
    page_reporting: bool | None = None

    @property
    def vms(self) -> int:
        return self.points[-1][0] if self.points else 0


def derive(runs: Sequence[ModeRun]) -> list[dict[str, Any]]:
    """The per-mode records of the result file (saving against mode none's cost per
    added VM, when none ran)."""
    base = next((per_vm_mib(r.points) for r in runs if r.mode == "none"), None)
    out: list[dict[str, Any]] = []
    for r in runs:
        per_vm = per_vm_mib(r.points)
        tcg = per_vm_mib([(n, t) for (n, _), t in zip(r.points, r.tcg_mib, strict=True)])
        out.append({
            "mode": r.mode, "vms": r.vms, "per_vm_mib": per_vm,
            "saving_pct": None if r.mode == "none" else saving_pct(per_vm, base),
            "start_ms_median": _median(r.start_ms),
            "requests_per_s": r.requests_per_s,
            "first_vm_mib": r.points[0][1] if r.points else None,
            "host_mib": [{"vms": n, "mib": h} for n, h in r.points],
            "per_vm_without_tcg_buffer_mib": None if per_vm is None or tcg is None
            else round(per_vm - tcg, 1),
            "tcg_buffer_mib": list(r.tcg_mib), "page_cache_mib": list(r.page_cache_mib),
            "private_mib_median": _median(r.private_mib),
            "private_without_tcg_buffer_mib_median": _median(r.private_no_tcg_mib),
            "cli_ms_median": _median(r.cli_ms), "start_ms": list(r.start_ms),
            "settle_s": list(r.settle_s), "unsettled": r.unsettled,
            "failed_starts": r.failed_starts, "rejected_mib": r.rejected_mib,
            "stop": r.stop, "note": r.note, "requests": r.requests,
            "failed_requests": r.failed_requests,
            "host_after_requests_mib": r.host_after_requests_mib,
            "clone_restore_ms_median": _median(r.clone_restore_ms),
            "clone_agent_ms_median": _median(r.clone_agent_ms),
            "ksm_saved_mib": r.ksm_saved_mib, "ksm_resets": r.ksm_resets,
            "template_mib": r.template_mib,
            "page_reporting": r.page_reporting, "files": r.files})
    return out


# -- the run ------------------------------------------------------------------------------
@dataclass(frozen=True)
class Config:
    budget_mib: int = DEFAULT_BUDGET_MIB
    modes: tuple[str, ...] = MODES
    requests: int = DEFAULT_REQUESTS
    memory_mib: int = MEMORY_MIB
    max_vms: int = MAX_VMS
    qemu: str = "auto"        # the QEMU of every mode's partition: auto, system or 10.0
    quick: bool = False
    loop_deadline_s: float = LOOP_DEADLINE_S


class CliFailed(FusumaError):
    """A `fusuma` child process exited non-zero; ``text`` is its last error line."""

    def __init__(self, args: Sequence[str], code: int, text: str) -> None:
        super().__init__(f"`fusuma {' '.join(args)}` failed ({code}): {text}")
        self.text = text


class Bench:
    def __init__(self, parts: PartitionManager, vms: VmManager, segs: SegmentManager,
                 cfg: Config, ksm: Ksm | None = None,
                 progress: Progress = lambda s: None) -> None:
        self.parts = parts
        self.vms = vms
        self.segs = segs
        self.cfg = cfg
        self.ksm = ksm or Ksm()
        self.say = progress
        self.paths = parts.paths
        self.env = {**os.environ, **self.paths.as_env()}
        self.ports: dict[str, int] = {}
        self.taken: set[int] = set()
        self.qemu: str | None = None
        self._index = 0               # VM names are never reused within a run
        self.skipped: dict[str, str] = {}

    # checks -------------------------------------------------------------------------
    def check_host(self) -> None:
        """Refuse, in one sentence, what would stop the run before anything is made."""
        cfg = self.cfg
        existing = [p.name for p in self.parts.db.partitions()]
        if existing:
            raise ResourceError(f"the density benchmark needs every core of this host but "
                                f"partition(s) {', '.join(existing)} exist; remove them "
                                "first (`fusuma down`).")
        find_image(self.paths.cache, kind="debian")
        if any("ksm" in m for m in cfg.modes) and not self.ksm.available():
            raise HostError("KSM is not available on this host (/sys/kernel/mm/ksm is "
                            "missing): leave out the ksm modes with --modes.")
        from fusuma.qemu import versions

        has_10 = versions.resolve_unpacked(self.paths, TEMPLATE_QEMU) is not None
        if cfg.qemu == "auto":
            self.qemu = TEMPLATE_QEMU if has_10 else None
        elif cfg.qemu != "system":
            versions.resolve(self.paths, cfg.qemu)
            self.qemu = cfg.qemu
        for mode in cfg.modes:
            if not mode.startswith("template"):
                continue
            if self.qemu != TEMPLATE_QEMU:
                self.skipped[mode] = (f"not available: clones need QEMU {TEMPLATE_QEMU} "
                                      f"(`fusuma qemu install {TEMPLATE_QEMU}`, then "
                                      "--qemu auto)")
            elif (why := self._template_cli()) is not None:
                self.skipped[mode] = why

    def _template_cli(self) -> str | None:
        res = self._cli("template", "--help", check=False)
        if res.returncode != 0:
            return ("not available: this fusuma has no `fusuma template` command "
                    "(templates are not implemented in this revision)")
        return None

    # the run ---------------------------------------------------------------------------
    def run(self) -> dict[str, Any]:
        cfg = self.cfg
        accel = probe_accel("auto").name
        started_meta = meta(accel)
        started = time.monotonic()
        saved = self.ksm.read_settings() if self.ksm.available() else None
        runs: list[ModeRun] = []
        try:
            if any("segment" in m for m in cfg.modes):
                self.say(f"making segment {SEGMENT} from the debian image's root")
                self.segs.create(SEGMENT, from_image="debian", progress=self.say)
            for mode in cfg.modes:
                if mode in self.skipped:
                    self.say(f"{mode}: skipped: {self.skipped[mode]}")
                    runs.append(ModeRun(mode, stop="skipped", note=self.skipped[mode]))
                    continue
                runs.append(self._mode(mode, first=not any(r.vms for r in runs)))
                if saved is not None and "ksm" in mode:
                    self._restore_ksm(saved)
        finally:
            self._cleanup()
            if saved is not None:
                self._restore_ksm(saved)
        image = find_image(self.paths.cache, kind="debian")
        return {"meta": {**meta(accel), "git_revision": started_meta["git_revision"],
                         "date": started_meta["date"],
                         "duration_s": round(time.monotonic() - started, 1),
                         "benchmark": "density", "budget_mib": cfg.budget_mib,
                         "quick": cfg.quick, "modes": list(cfg.modes),
                         "memory_mib": cfg.memory_mib, "requests": cfg.requests,
                         "http_concurrency": HTTP_CONCURRENCY, "max_vms": cfg.max_vms,
                         "loop_deadline_s": cfg.loop_deadline_s, "step_far": STEP_FAR,
                         "ready_timeout_s": {"booted": READY_TIMEOUT_S,
                                             "clone": CLONE_READY_TIMEOUT_S},
                         "partition_qemu": self.qemu or "system",
                         "cores": list(self.parts.host.cpus),
                         "image": image.digest[:16], "root_mount": ROOT_MOUNT,
                         "tcg_tb_mib": tcg_tb_mib() if accel == "tcg" else None,
                         "settle": {"min_s": SETTLE_MIN_S, "every_s": SETTLE_EVERY_S,
                                    "window": SETTLE_WINDOW, "tol_mib": SETTLE_TOL_MIB,
                                    "tol_frac": SETTLE_TOL_FRAC, "max_s": SETTLE_MAX_S},
                         "ksm_pages_to_scan": KSM_PAGES_TO_SCAN,
                         "ksm_load_pages_to_scan": KSM_LOAD_PAGES_TO_SCAN,
                         "ksm_sleep_ms": KSM_SLEEP_MS},
                "results": derive(runs), "paper": PAPER}

    def _restore_ksm(self, saved: KsmSettings) -> None:
        with contextlib.suppress(FusumaError):
            self.ksm.set_run(saved.run, pages_to_scan=saved.pages_to_scan,
                             sleep_millisecs=saved.sleep_millisecs)

    def _mode(self, mode: str, first: bool) -> ModeRun:
        """One mode from an empty partition to its removal. A failure ends the mode (its
        note says why) and the run goes on; a budget below one VM ends the run when no
        mode before measured anything (nothing is written then)."""
        r = ModeRun(mode)
        try:
            self._fill(mode, r)
            if r.vms:
                self._finish(mode, r)
        except FusumaError as exc:
            r.stop, r.note = "failed", str(exc)
            self.say(f"{mode}: failed: {exc}")
        finally:
            with contextlib.suppress(FusumaError):
                if self.parts.db.find_partition(PARTITION) is not None:
                    self.parts.delete(PARTITION, force=True)
            if mode.startswith("template"):
                self._delete_template()
        if not r.vms and r.stop == "budget" and r.rejected_mib is not None:
            msg = below_one_vm(self.cfg.budget_mib, r.rejected_mib, mode,
                               self.cfg.memory_mib)
            if first:
                raise ResourceError(msg)
            r.stop, r.note = "below one VM", msg
            self.say(f"{mode}: {msg}")
        return r

    def _fill(self, mode: str, r: ModeRun) -> None:
        """Start VMs while the next one is expected to fit (see next_step); a step
        whose reading lands above the budget gives back its VMs, newest first, until
        the reading fits or the step is undone."""
        cfg = self.cfg
        for f in self._disk_files(mode):
            footprint.drop_cache(f)
        if "ksm" in mode:
            self.ksm.set_run(1, pages_to_scan=KSM_PAGES_TO_SCAN,
                             sleep_millisecs=KSM_SLEEP_MS)
        part_mib, cap = capacity(mode, self.parts.host.memory_available_for_partitions_mib,
                                 cfg.memory_mib, definition_overhead("auto"), cfg.max_vms)
        self.parts.create(PartitionSpec(name=PARTITION, cpus=list(self.parts.host.cpus),
                                        memory_mib=part_mib, qemu=self.qemu))
        if mode.startswith("template"):
            r.template_mib = self._make_template()
        r.first_event = self.parts.db.last_event_id()
        while True:
            count, why = next_step(r.points, cfg.budget_mib, cap)
            if not count:
                r.stop = why or "budget"
                if why == "cap" and cap < cfg.max_vms:
                    r.note = (f"stopped at {cap} VMs, the most this host admits in this "
                              "mode (fusuma admits each VM's whole RAM and QEMU overhead, "
                              "not what it uses), before the budget was reached")
                return
            before = r.vms
            for _ in range(count):
                if not self._add_vm(mode, r) and r.failed_starts >= MAX_FAILED_STARTS:
                    r.stop = "failed starts"
                    r.note = (f"{r.failed_starts} VMs did not answer HTTP after their "
                              "start (see the VMs' console logs)")
                    return
            if len(r.names) == before:
                continue
            host, waited, ok = self._settled(mode, r)
            while host > cfg.budget_mib:
                r.rejected_mib = host
                self.say(f"{mode}: with {len(r.names)} VMs the host uses {host} MiB, more "
                         f"than the budget of {cfg.budget_mib} MiB: removing the newest")
                self.vms.delete(r.names.pop(), force=True)
                if len(r.names) == before:
                    r.stop = "budget"
                    return
                host, waited, ok = self._settled(mode, r)
            self._point(mode, r, host, waited, ok)
            if r.rejected_mib is not None:
                r.stop = "budget"
                return

    def _point(self, mode: str, r: ModeRun, host: float, waited: float, ok: bool) -> None:
        fp = self._footprint(mode, cache=True)
        r.points.append((len(r.names), host))
        r.settle_s.append(waited)
        r.unsettled += 0 if ok else 1
        r.tcg_mib.append(round(sum(p.exec_anon_kib for p in fp.processes) / 1024, 1))
        r.page_cache_mib.append(round(sum(f.mib for f in fp.cached), 1))
        self.say(f"{mode}: {len(r.names)} VM(s): host {host} MiB (settled in {waited:.0f} "
                 "s)")

    def _finish(self, mode: str, r: ModeRun) -> None:
        """With every VM of the mode running: the request loop, then the last readings."""
        ports = [self.ports[name] for name in r.names]
        self.say(f"{mode}: {self.cfg.requests} requests over {r.vms} VM(s)")
        if "ksm" in mode:      # scanning as a host runs it, not at the settling rate
            self.ksm.set_run(1, pages_to_scan=KSM_LOAD_PAGES_TO_SCAN,
                             sleep_millisecs=KSM_SLEEP_MS)
        r.requests_per_s, r.requests, r.failed_requests = httpload.request_loop(
            ports, self.cfg.requests, HTTP_CONCURRENCY, self.cfg.loop_deadline_s)
        fp = self._footprint(mode, cache=True)
        r.host_after_requests_mib = fp.total_mib
        r.private_mib = [round(p.private_kib / 1024, 1) for p in fp.processes]
        r.private_no_tcg_mib = [round((p.private_kib - p.exec_anon_kib) / 1024, 1)
                                for p in fp.processes]
        r.files = fp.as_json()
        if "ksm" in mode:
            r.ksm_saved_mib = round(self.ksm.read_settings().saved_bytes / 2**20, 1)
        for ev in self.parts.db.events_since(r.first_event, limit=100_000):
            ctx = ev["context"]
            if ev["action"] == "vm-clone-ready" and not ctx.get("error"):
                if ctx.get("restore_ms") is not None:
                    r.clone_restore_ms.append(float(ctx["restore_ms"]))
                if ctx.get("agent_ms") is not None:
                    r.clone_agent_ms.append(float(ctx["agent_ms"]))
        recs = [self.parts.db.vm(name) for name in r.names]
        r.page_reporting = all(reporting.recorded(v) for v in recs)
        self.say(f"{mode}: {r.vms} VM(s) in {self.cfg.budget_mib} MiB ({r.stop}); "
                 f"{r.requests_per_s} requests/s, {r.failed_requests} failed")

    # pieces ----------------------------------------------------------------------------
    def _disk_files(self, mode: str) -> list[Path]:
        if "segment" in mode:
            return [self.paths.segment_file(SEGMENT)]
        root = find_image(self.paths.cache, kind="debian").root
        return [root] if root is not None else []

    def _footprint(self, mode: str, cache: bool = False) -> footprint.Footprint:
        """The mode's VMs now; with ``cache``, the page cache of the disk files they
        read too (reported beside the total)."""
        pids = [v.pid for v in self.parts.db.vms(PARTITION)
                if v.pid is not None and v.name != SOURCE_VM]
        return footprint.measure(pids, [self.paths.shm],
                                 self._disk_files(mode) if cache else ())

    def _settled(self, mode: str, r: ModeRun) -> tuple[float, float, bool]:
        """The host memory once it holds still (in the KSM modes: once KSM settled
        too); (MiB, seconds waited, whether it settled in time)."""
        ksm_ok = True
        started = time.monotonic()
        if "ksm" in mode:
            ksm_ok = self._ksm_settled(mode, r)
            host, _, ok = settle(lambda: self._footprint(mode).total_mib, min_s=0.0)
        else:
            host, _, ok = settle(lambda: self._footprint(mode).total_mib)
        return host, round(time.monotonic() - started, 1), ok and ksm_ok

    def _ksm_settled(self, mode: str, r: ModeRun) -> bool:
        """Wait for KSM to settle. KSM is the host's: another program (another
        benchmark) may stop it or slow it down meanwhile; then it is set again, counted
        in ``r.ksm_resets``, and the wait starts over (three times at most)."""
        for _ in range(3):
            s = self.ksm.read_settings()
            if (s.run, s.pages_to_scan, s.sleep_millisecs) != (1, KSM_PAGES_TO_SCAN,
                                                                KSM_SLEEP_MS):
                r.ksm_resets += 1
                self.say(f"{mode}: KSM was changed by another program (run={s.run}, "
                         f"pages_to_scan={s.pages_to_scan}); setting it again")
                self.ksm.set_run(1, pages_to_scan=KSM_PAGES_TO_SCAN,
                                 sleep_millisecs=KSM_SLEEP_MS)
            try:
                self.ksm.wait_settled(KSM_SETTLE_TIMEOUT_S)
                return True
            except StateError as exc:
                self.say(f"{mode}: {exc}")
        return False

    def _create_args(self, mode: str, name: str, port: int) -> list[str]:
        args = ["vm", "create", name, "-p", PARTITION, "--port", f"{port}:80"]
        if mode.startswith("template"):
            args += ["--template", TEMPLATE]
        else:
            args += ["--image", "debian", "--memory", str(self.cfg.memory_mib)]
        if "segment" in mode:
            args += ["--segment", f"{SEGMENT}:{ROOT_MOUNT}"]
        if "ksm" in mode:
            args += ["--mergeable"]
        return [*args, "--start", "--json"]

    def _add_vm(self, mode: str, r: ModeRun) -> bool:
        """Create and start the next VM with the CLI and wait for its HTTP answer;
        whether it answered (one that did not is removed and counted)."""
        name = vm_name(self._index)
        self._index += 1
        port = httpload.free_port(self.taken)
        self.ports[name] = port
        self.say(f"{mode}: starting VM {len(r.names) + 1} ({name})")
        t0 = time.monotonic()
        self._cli(*self._create_args(mode, name, port))
        cli_ms = round((time.monotonic() - t0) * 1000, 1)
        timeout = CLONE_READY_TIMEOUT_S if mode.startswith("template") else READY_TIMEOUT_S
        try:
            ready_ms = httpload.wait_http(port, t0, timeout)
        except httpload.NotReady as exc:
            r.failed_starts += 1
            self.say(f"{mode}: {name}: {exc} Removing it.")
            with contextlib.suppress(FusumaError):
                self.vms.delete(name, force=True)
            return False
        r.names.append(name)
        r.cli_ms.append(cli_ms)
        r.start_ms.append(ready_ms)
        return True

    def _make_template(self) -> float | None:
        """Boot the template's source VM (root on the disk, apache2 answering), let it
        settle, make the template of it; what the shm dir holds afterwards (the
        template's RAM, if it is kept there), MiB."""
        port = httpload.free_port(self.taken)
        self.say(f"booting {SOURCE_VM} for template {TEMPLATE}")
        t0 = time.monotonic()
        self._cli("vm", "create", SOURCE_VM, "-p", PARTITION, "--image", "debian",
                  "--memory", str(self.cfg.memory_mib), "--port", f"{port}:80", "--start")
        httpload.wait_http(port, t0, READY_TIMEOUT_S)
        settle(lambda: self._footprint("none").total_mib)
        self.say(f"making template {TEMPLATE} from {SOURCE_VM}")
        self._cli("template", "create", TEMPLATE, "--from", SOURCE_VM, "--json")
        held = footprint.measure([], [self.paths.shm]).files_kib
        return round(held / 1024, 1) if held else None

    def _delete_template(self) -> None:
        res = self._cli("template", "delete", TEMPLATE, check=False)
        if res.returncode != 0 and "no template" not in (res.stderr + res.stdout).lower():
            self.say(f"cleanup of template {TEMPLATE}: "
                     f"{(res.stderr or res.stdout).strip()}")

    def _cli(self, *args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
        try:
            proc = subprocess.run([sys.executable, "-m", "fusuma.cli.main", *args],
                                  env=self.env, capture_output=True, text=True,
                                  timeout=CLI_TIMEOUT_S, check=False)
        except subprocess.TimeoutExpired:
            raise CliFailed(args, -1, f"no answer within {CLI_TIMEOUT_S:.0f} s") from None
        if check and proc.returncode != 0:
            lines = [ln for ln in proc.stderr.splitlines() if "PVM" not in ln]
            raise CliFailed(args, proc.returncode,
                            (lines[-1] if lines else proc.stdout.strip()).strip())
        return proc

    def _cleanup(self) -> None:
        if self.parts.db.find_partition(PARTITION) is not None:
            try:
                self.parts.delete(PARTITION, force=True)
            except FusumaError as exc:
                self.say(f"cleanup of partition {PARTITION} failed: {exc}")
        if self.parts.db.find_segment(SEGMENT) is not None:
            try:
                self.segs.delete(SEGMENT)
            except FusumaError as exc:
                self.say(f"cleanup of segment {SEGMENT} failed: {exc}")


def vm_name(i: int) -> str:
    return f"{VM_PREFIX}{i}"


def load_result(path: Path) -> dict[str, Any]:
    data: dict[str, Any] = json.loads(path.read_text())
    return data

