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

The next VM is started while the last one's cost, added again, stays within the budget;
a VM whose measurement lands above the budget is removed again, so the count is the
largest that fitted. Per mode the result holds the VMs that fitted, what each VM
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
import socket
import statistics
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from fusuma.bench.dcss import PAPER as DCSS_PAPER
from fusuma.bench.meta import meta
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
HTTP_TIMEOUT_S = 10.0     # one request
READY_TIMEOUT_S = 180.0   # from `vm create --start` to the first HTTP answer
LOOP_TIMEOUT_S = 300.0    # the whole request loop of a mode
CLI_TIMEOUT_S = 300.0
# Settling after each VM (measured here, TCG, 2 cores: a booted guest's memory holds
# still within ~2 MiB a few seconds after its first HTTP answer; page reporting starts
# 2 s after free memory crosses its threshold): wait SETTLE_MIN_S, then read every
# SETTLE_EVERY_S until SETTLE_WINDOW readings lie within max(SETTLE_TOL_MIB,
# SETTLE_TOL_FRAC of the total), at most SETTLE_MAX_S.
SETTLE_MIN_S = 3.0
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


def next_step(host_mib: Sequence[float], budget_mib: float, max_vms: int) -> str | None:
    """None to start another VM, else why the mode stops: "cap" (``max_vms`` reached) or
    "budget" (the last VM's cost, added once more, would pass the budget). With fewer
    than two VMs there is no cost per added VM to go by yet: the next one is started
    and its measurement decides."""
    n = len(host_mib)
    if n >= max_vms:
        return "cap"
    if n >= 2 and host_mib[-1] + max(0.0, host_mib[-1] - host_mib[-2]) > budget_mib:
        return "budget"
    return None


def per_vm_mib(host_mib: Sequence[float]) -> float | None:
    """What each VM beyond the first added: (host(N) - host(1)) / (N - 1)."""
    if len(host_mib) < 2:
        return None
    return round((host_mib[-1] - host_mib[0]) / (len(host_mib) - 1), 1)


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
    """What one mode measured; ``host_mib[i]`` is the host memory with i + 1 VMs."""

    mode: str
    host_mib: list[float] = field(default_factory=list)
    start_ms: list[float] = field(default_factory=list)
    cli_ms: list[float] = field(default_factory=list)
    settle_s: list[float] = field(default_factory=list)
    unsettled: int = 0
    exec_anon_mib: list[float] = field(default_factory=list)
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
    page_cache_mib: list[float] = field(default_factory=list)
    files: dict[str, Any] = field(default_factory=dict)
    template_mib: float | None = None
    page_reporting: bool | None = None

    @property
    def vms(self) -> int:
        return len(self.host_mib)


def derive(runs: Sequence[ModeRun]) -> list[dict[str, Any]]:
    """The per-mode records of the result file (saving against mode none's cost per
    added VM, when none ran)."""
    base = next((per_vm_mib(r.host_mib) for r in runs if r.mode == "none"), None)
    out: list[dict[str, Any]] = []
    for r in runs:
        per_vm = per_vm_mib(r.host_mib)
        exec_per_vm = per_vm_mib(r.exec_anon_mib)
        out.append({
            "mode": r.mode, "vms": r.vms, "per_vm_mib": per_vm,
            "saving_pct": None if r.mode == "none" else saving_pct(per_vm, base),
            "start_ms_median": _median(r.start_ms),
            "requests_per_s": r.requests_per_s,
            "first_vm_mib": r.host_mib[0] if r.host_mib else None,
            "host_mib": list(r.host_mib),
            "per_vm_without_tcg_buffer_mib": None if per_vm is None or exec_per_vm is None
            else round(per_vm - exec_per_vm, 1),
            "tcg_buffer_mib": list(r.exec_anon_mib),
            "page_cache_mib": list(r.page_cache_mib),
            "private_mib_median": _median(r.private_mib),
            "private_without_tcg_buffer_mib_median": _median(r.private_no_tcg_mib),
            "cli_ms_median": _median(r.cli_ms),
            "start_ms": list(r.start_ms), "settle_s": list(r.settle_s),
            "unsettled": r.unsettled, "rejected_mib": r.rejected_mib, "stop": r.stop,
            "note": r.note, "requests": r.requests,
            "failed_requests": r.failed_requests,
            "host_after_requests_mib": r.host_after_requests_mib,
            "ksm_saved_mib": r.ksm_saved_mib, "template_mib": r.template_mib,
            "page_reporting": r.page_reporting, "files": r.files})
    return out


# -- HTTP ---------------------------------------------------------------------------------
def free_port(taken: set[int]) -> int:
    """A loopback TCP port nothing listens on now (the VM's QEMU binds it next)."""
    for _ in range(100):
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.bind(("127.0.0.1", 0))
            port = int(s.getsockname()[1])
        if port not in taken:
            taken.add(port)
            return port
    raise HostError("no free loopback TCP port for a VM's forwarded HTTP port.")


def get(port: int, timeout: float = HTTP_TIMEOUT_S) -> bool:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/", timeout=timeout) as r:
            r.read()
            return bool(r.status == 200)
    except (OSError, urllib.error.URLError):
        return False


def wait_http(port: int, started: float, timeout: float = READY_TIMEOUT_S) -> float:
    """Poll until the guest behind ``port`` answers; ms since ``started``."""
    deadline = started + timeout
    while time.monotonic() < deadline:
        if get(port, timeout=min(HTTP_TIMEOUT_S, max(0.5, deadline - time.monotonic()))):
            return round((time.monotonic() - started) * 1000, 1)
        time.sleep(0.05)
    raise FusumaError(f"apache2 in the guest behind port {port} did not answer within "
                      f"{timeout:.0f} s of `vm create --start`.")


def request_loop(ports: Sequence[int], total: int, concurrency: int = HTTP_CONCURRENCY,
                 timeout_s: float = LOOP_TIMEOUT_S) -> tuple[float | None, int, int]:
    """``total`` GETs round-robin over ``ports``, ``concurrency`` at a time, stopping at
    ``timeout_s``; returns (requests/s of the answered ones, answered, failed)."""
    lock = threading.Lock()
    state = {"next": 0, "ok": 0, "failed": 0}
    started = time.monotonic()

    def worker() -> None:
        while time.monotonic() - started < timeout_s:
            with lock:
                i = state["next"]
                if i >= total:
                    return
                state["next"] = i + 1
            ok = get(ports[i % len(ports)])
            with lock:
                state["ok" if ok else "failed"] += 1

    with ThreadPoolExecutor(max_workers=concurrency) as pool:
        for _ in range(concurrency):
            pool.submit(worker)
    elapsed = time.monotonic() - started
    rps = round(state["ok"] / elapsed, 1) if state["ok"] and elapsed > 0 else None
    return rps, state["ok"], state["failed"]


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
                         "partition_qemu": self.qemu or "system",
                         "cores": list(self.parts.host.cpus),
                         "image": image.digest[:16], "root_mount": ROOT_MOUNT,
                         "tcg_tb_mib": tcg_tb_mib() if accel == "tcg" else None,
                         "settle": {"min_s": SETTLE_MIN_S, "every_s": SETTLE_EVERY_S,
                                    "window": SETTLE_WINDOW, "tol_mib": SETTLE_TOL_MIB,
                                    "tol_frac": SETTLE_TOL_FRAC, "max_s": SETTLE_MAX_S},
                         "ksm_pages_to_scan": KSM_PAGES_TO_SCAN,
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
        if not r.vms and r.stop != "failed":
            msg = below_one_vm(self.cfg.budget_mib, r.rejected_mib or 0.0, mode,
                               self.cfg.memory_mib)
            if first:
                raise ResourceError(msg)
            r.stop, r.note = "below one VM", msg
            self.say(f"{mode}: {msg}")
        return r

    def _fill(self, mode: str, r: ModeRun) -> None:
        """Start VMs while the next one is expected to fit (see next_step)."""
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
        while (why := next_step(r.host_mib, cfg.budget_mib, cap)) is None:
            i = r.vms
            self.say(f"{mode}: starting VM {i + 1}")
            cli_ms, ready_ms = self._start_vm(mode, i)
            host, waited, ok = self._settled(mode)
            if host > cfg.budget_mib:
                r.rejected_mib = host
                self.say(f"{mode}: with VM {i + 1} the host uses {host} MiB, more than the "
                         f"budget of {cfg.budget_mib} MiB: removing it")
                self.vms.delete(vm_name(i), force=True)
                r.stop = "budget"
                return
            r.host_mib.append(host)
            r.cli_ms.append(cli_ms)
            r.start_ms.append(ready_ms)
            r.settle_s.append(waited)
            r.unsettled += 0 if ok else 1
            fp = self._footprint(mode, cache=True)
            r.exec_anon_mib.append(round(sum(p.exec_anon_kib for p in fp.processes)
                                         / 1024, 1))
            r.page_cache_mib.append(sum(f.mib for f in fp.cached))
            self.say(f"{mode}: {i + 1} VM(s): host {host} MiB (answered HTTP "
                     f"{ready_ms:.0f} ms after `vm create --start`, settled in "
                     f"{waited:.0f} s)")
        r.stop = why
        if why == "cap" and cap < cfg.max_vms:
            r.note = (f"stopped at {cap} VMs, the most this host admits in this mode "
                      "(fusuma admits each VM's whole RAM and QEMU overhead, not what it "
                      "uses), before the budget was reached")

    def _finish(self, mode: str, r: ModeRun) -> None:
        """With every VM of the mode running: the request loop, then the last readings."""
        ports = [self.ports[vm_name(i)] for i in range(r.vms)]
        self.say(f"{mode}: {self.cfg.requests} requests over {r.vms} VM(s)")
        r.requests_per_s, r.requests, r.failed_requests = request_loop(
            ports, self.cfg.requests)
        fp = self._footprint(mode, cache=True)
        r.host_after_requests_mib = fp.total_mib
        r.private_mib = [round(p.private_kib / 1024, 1) for p in fp.processes]
        r.private_no_tcg_mib = [round((p.private_kib - p.exec_anon_kib) / 1024, 1)
                                for p in fp.processes]
        r.files = fp.as_json()
        if "ksm" in mode:
            r.ksm_saved_mib = round(self.ksm.read_settings().saved_bytes / 2**20, 1)
        recs = [self.parts.db.vm(vm_name(i)) for i in range(r.vms)]
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

    def _settled(self, mode: str) -> tuple[float, float, bool]:
        """The host memory once it holds still (in the KSM modes: once KSM settled
        too); (MiB, seconds waited, whether it settled in time)."""
        ksm_ok = True
        started = time.monotonic()
        if "ksm" in mode:
            time.sleep(SETTLE_MIN_S)
            try:
                self.ksm.wait_settled(KSM_SETTLE_TIMEOUT_S)
            except StateError as exc:
                ksm_ok = False
                self.say(f"{mode}: {exc}")
        host, _, ok = settle(lambda: self._footprint(mode).total_mib)
        return host, round(time.monotonic() - started, 1), ok and ksm_ok

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

    def _start_vm(self, mode: str, i: int) -> tuple[float, float]:
        """Create and start VM ``i`` with the CLI; (ms the CLI took, ms until the guest
        answered HTTP), both from the CLI's launch."""
        name = vm_name(i)
        port = free_port(self.taken)
        self.ports[name] = port
        t0 = time.monotonic()
        self._cli(*self._create_args(mode, name, port))
        cli_ms = round((time.monotonic() - t0) * 1000, 1)
        return cli_ms, wait_http(port, t0)

    def _make_template(self) -> float | None:
        """Boot the template's source VM (root on the disk, apache2 answering), let it
        settle, make the template of it; what the shm dir holds afterwards (the
        template's RAM, if it is kept there), MiB."""
        port = free_port(self.taken)
        self.say(f"booting {SOURCE_VM} for template {TEMPLATE}")
        t0 = time.monotonic()
        self._cli("vm", "create", SOURCE_VM, "-p", PARTITION, "--image", "debian",
                  "--memory", str(self.cfg.memory_mib), "--port", f"{port}:80", "--start")
        wait_http(port, t0)
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

