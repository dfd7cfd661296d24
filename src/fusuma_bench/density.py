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

The run itself (VMs, segment, template, measurements) is fusuma_bench.density_run;
this module holds the modes, the decisions and the arithmetic, testable without a VM.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from fusuma.capacity import SUPERVISOR_MIB
from fusuma.errors import FusumaError, ResourceError
from fusuma.frozen import frozen
from fusuma_bench.dcss import PAPER as DCSS_PAPER
from fusuma_bench.steady import settle as settle

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
# Settling after each step: fusuma_bench.steady.settle with its defaults (in the KSM
# modes KSM settles first: its wait takes longer than the settle's minimum).
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
@frozen
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
