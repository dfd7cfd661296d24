"""`fusuma bench dcss`: the DCSS experiment (papers README §4) on fusuma.

Debian guests (the ``debian`` image: apache2 installed) boot one after another in one
scratch partition holding every core, in four modes:

- ``none``         the root on a read-only virtio-blk disk: each guest reads it into its
                   own page cache (the paper's DASD row)
- ``segment``      the root from one shared segment, virtio-pmem + erofs DAX (DCSS)
- ``ksm``          as none, with private RAM marked mergeable and KSM running
- ``segment+ksm``  both

and two loads: ``idle`` (measured after boot) and ``apache2`` (every VM has served
``--requests`` requests of its default page to ``ab`` through its forwarded port).
At each VM count the memory of the VMs' QEMU processes is read from smaps: the total
PSS (shared pages split among the processes mapping them, so a segment's one copy
counts once) and the part of it that is the guest's own memory (guest RAM and segment
mappings), which is what the paper's WSS measures. It is read once it holds still
(fusuma_bench.steady.settle: the guests report freed pages for a while after boot and
after a load) and, in the KSM modes, once KSM's count of shared pages stopped changing
first.

The cost of each added VM is the least-squares slope of total PSS over the VM counts;
the saving of a mode is how much smaller its slope is than mode none's. The host's
KSM settings are restored afterwards and everything made is removed, also on failure.
"""

from __future__ import annotations

import contextlib
import logging
import re
import shutil
import statistics
import subprocess
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from fusuma.capacity import SUPERVISOR_MIB, vm_footprint
from fusuma.errors import FusumaError, HostError, ResourceError
from fusuma.host.accel import probe_accel
from fusuma.images import find_image
from fusuma.memshare.ksm import Ksm, KsmSettings
from fusuma.memshare.report import vm_memory
from fusuma.memshare.segments import SegmentManager
from fusuma.memshare.smaps import Mapping, read_smaps
from fusuma.partition.manager import PartitionManager
from fusuma.spec import PartitionSpec, VmSpec
from fusuma.state import VmRecord
from fusuma.vm import VmManager
from fusuma_bench import httpload
from fusuma_bench.report import meta
from fusuma_bench.steady import SETTLE_MIN_S, settle, settle_params

LOG = logging.getLogger(__name__)

PARTITION = "bench-dcss"
SEGMENT = "bench-dcss-root"
VM_PREFIX = "bench-dcss-"
MODES = ("none", "segment", "ksm", "segment+ksm")
LOADS = ("idle", "apache2")
DEFAULT_COUNTS = (1, 2, 4, 8)
QUICK_COUNTS = (1, 2)
DEFAULT_REQUESTS = 1000
QUICK_REQUESTS = 300
AB_CONCURRENCY = 4
AB_RUNS = 3              # per VM; its requests/s is the median
QUICK_AB_RUNS = 1
BASE_PORT = 18600
MARGIN_MIB = 128
BOOT_TIMEOUT_S = 300.0
HTTP_TIMEOUT_S = 120.0
KSM_SETTLE_TIMEOUT_S = 300.0
# Fast scanning so KSM settles before each measurement: 4000 pages (16 MiB) every
# 20 ms. While apache2 is measured KSM scans at the kernel's default rate instead
# (100 pages every 20 ms), as a host would run it: at the fast rate its scanner takes
# a good part of one of this host's two cores and the requests/s would measure that.
KSM_PAGES_TO_SCAN = 4000
KSM_SLEEP_MS = 20
KSM_LOAD_PAGES_TO_SCAN = 100
# The paper (dcss.md): Table 1 (per Linux guest, WSS), Table 3 (apache2), Fig. 3.
PAPER = {
    "table1": [{"method": "DASD", "wss_mb": 236, "saved_pct": None},
               {"method": "NSS (kernel shared)", "wss_mb": 230, "saved_pct": 2.7},
               {"method": "DCSS (root fs shared)", "wss_mb": 183, "saved_pct": 22.5},
               {"method": "NSS+DCSS", "wss_mb": 177, "saved_pct": 25.2}],
    "table3": [{"method": "DASD", "apache2_mb": 7.5, "saved_pct": None},
               {"method": "DCSS", "apache2_mb": 4.9, "saved_pct": 34.8}],
    "fig3": [{"app": "Iceweasel", "per_vm_mb_plain": 164, "per_vm_mb_dcss": 121,
              "saved_pct": 26.0},
             {"app": "OpenOffice Impress", "per_vm_mb_plain": 252, "per_vm_mb_dcss": 142,
              "saved_pct": 43.7}],
}

Progress = Callable[[str], None]


def vm_name(i: int) -> str:
    return f"{VM_PREFIX}{i}"


def parse_ab(text: str) -> tuple[float, int]:
    """Requests per second and failed requests from ``ab``'s report."""
    rps = re.search(r"Requests per second:\s+([\d.]+)", text)
    failed = re.search(r"Failed requests:\s+(\d+)", text)
    if rps is None:
        raise ValueError("ab printed no 'Requests per second' line")
    return float(rps.group(1)), int(failed.group(1)) if failed else 0


def slope(points: Sequence[tuple[int, float]]) -> float | None:
    """Least-squares slope of y over x; None with fewer than two distinct x."""
    xs = [float(x) for x, _ in points]
    if len(set(xs)) < 2:
        return None
    mx = statistics.fmean(xs)
    my = statistics.fmean(y for _, y in points)
    sxx = sum((x - mx) ** 2 for x in xs)
    return sum((x - mx) * (y - my) for x, (_, y) in zip(xs, points, strict=True)) / sxx


def guest_kib(mappings: list[Mapping], memory_mib: int, ram_file: str | None,
              segment_files: set[str]) -> int:
    """PSS of the guest's own memory inside a QEMU process: its RAM mapping (the RAM
    file, or for private RAM the anonymous mapping of the RAM's size) and its segment
    mappings."""
    size = memory_mib * 2**20
    total = 0
    for m in mappings:
        path = m.file_path
        named = bool(path) and (path == ram_file or path in segment_files)
        anon_ram = (ram_file is None and not path
                    and size <= m.end - m.start <= size + 8 * 2**20)
        if named or anon_ram:
            total += m.pss_kib
    return total


@dataclass
class Point:
    mode: str
    load: str
    vms: int
    total_pss_mib: float
    guest_mib: float
    total_rss_mib: float
    segments_pss_mib: float
    ksm_saved_mib: float | None
    requests_per_s: float | None
    failed_requests: int
    boot_s: float
    settle_s: float = 0.0        # waited for the memory to hold still
    settled: bool = True         # ... and it did, before the settle's limit

    def as_json(self) -> dict[str, Any]:
        return dict(self.__dict__)


def run(parts: PartitionManager, vms: VmManager, segs: SegmentManager,
        counts: Sequence[int] = DEFAULT_COUNTS, modes: Sequence[str] = MODES,
        loads: Sequence[str] = LOADS, memory_mib: int = 256,
        requests: int = DEFAULT_REQUESTS, ksm: Ksm | None = None,
        ab_runs: int = AB_RUNS, progress: Progress = lambda s: None) -> dict[str, Any]:
    ksm = ksm or Ksm()
    accel = probe_accel("auto").name
    counts = sorted(set(counts))
    cores = _check_host(parts, counts, memory_mib, accel, modes, loads, ksm)
    # KSM is the host's: put back only what a ksm mode of this run changes.
    saved = (ksm.read_settings()
             if ksm.available() and any("ksm" in m for m in modes) else None)
    started = meta(accel)      # the revision and date the run started with
    points: list[Point] = []
    try:
        if any("segment" in m for m in modes):
            progress(f"making segment {SEGMENT} from the debian image's root")
            segs.create(SEGMENT, from_image="debian", progress=progress)
        for load in loads:
            for mode in modes:
                points += _one_case(parts, vms, cores, mode, load, counts, memory_mib,
                                    requests, ab_runs, accel, ksm, progress)
    finally:
        progress("removing the scratch partition and segment")
        _cleanup(parts, segs, progress)
        if saved is not None:
            with contextlib.suppress(FusumaError):
                ksm.set_run(saved.run, pages_to_scan=saved.pages_to_scan,
                            sleep_millisecs=saved.sleep_millisecs)
    results = derive(points)
    return {"meta": {**meta(accel), "git_revision": started["git_revision"],
                     "date": started["date"], "finished": meta(accel)["date"],
                     **_params(counts, modes, loads, memory_mib, requests, ab_runs, cores,
                               parts)},
            "results": results, "summary": summarize(results), "paper": PAPER}


def _params(counts: Sequence[int], modes: Sequence[str], loads: Sequence[str],
            memory_mib: int, requests: int, ab_runs: int, cores: list[int],
            parts: PartitionManager) -> dict[str, Any]:
    return {"benchmark": "dcss", "counts": list(counts), "modes": list(modes),
            "loads": list(loads), "memory_mib": memory_mib, "requests": requests,
            "ab_concurrency": AB_CONCURRENCY, "ab_runs": ab_runs,
            "ksm_pages_to_scan": KSM_PAGES_TO_SCAN, "ksm_sleep_ms": KSM_SLEEP_MS,
            "ksm_load_pages_to_scan": KSM_LOAD_PAGES_TO_SCAN, "cores": cores,
            "settle": settle_params(),
            "image": find_image(parts.paths.cache, kind="debian").digest[:16]}


def derive(points: Sequence[Point]) -> list[dict[str, Any]]:
    """The issue's per-point records: per_vm_mib is what each VM beyond the first
    cost at this count ((total(n) - total(1)) / (n - 1); total(1) for n = 1), and
    saving_pct compares it with mode none at the same load and count."""
    first = {(p.mode, p.load): p for p in points if p.vms == min(
        q.vms for q in points if (q.mode, q.load) == (p.mode, p.load))}
    out: list[dict[str, Any]] = []
    per_vm: dict[tuple[str, str, int], float] = {}
    for p in points:
        f = first[(p.mode, p.load)]
        v = p.total_pss_mib if p.vms == f.vms else \
            (p.total_pss_mib - f.total_pss_mib) / (p.vms - f.vms)
        per_vm[(p.mode, p.load, p.vms)] = v
    for p in points:
        v = per_vm[(p.mode, p.load, p.vms)]
        base = per_vm.get(("none", p.load, p.vms))
        saving = None if not base else round(100 * (1 - v / base), 1)
        out.append({"mode": p.mode, "load": p.load, "vms": p.vms,
                    "total_pss_mib": p.total_pss_mib, "per_vm_mib": round(v, 1),
                    "saving_pct": saving, "requests_per_s": p.requests_per_s,
                    **{k: val for k, val in p.as_json().items()
                       if k not in ("mode", "load", "vms", "total_pss_mib",
                                    "requests_per_s")}})
    return out


def summarize(results: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per (mode, load): the slope of total PSS and of guest memory over the VM count,
    their saving against mode none, and requests/s against mode none."""
    rows: list[dict[str, Any]] = []
    keys = list(dict.fromkeys((r["mode"], r["load"]) for r in results))
    for mode, load in keys:
        pts = [r for r in results if (r["mode"], r["load"]) == (mode, load)]
        rows.append({"mode": mode, "load": load,
                     "slope_pss_mib": _round(slope([(r["vms"], r["total_pss_mib"])
                                                    for r in pts])),
                     "slope_guest_mib": _round(slope([(r["vms"], r["guest_mib"])
                                                      for r in pts])),
                     "requests_per_s": _round(_median([r["requests_per_s"] for r in pts
                                                       if r["requests_per_s"]]))})
    for row in rows:
        base = next((b for b in rows if b["mode"] == "none" and b["load"] == row["load"]),
                    None)
        for metric in ("pss", "guest"):
            b = base and base[f"slope_{metric}_mib"]
            v = row[f"slope_{metric}_mib"]
            row[f"saving_{metric}_pct"] = None if not b or v is None else \
                round(100 * (1 - v / b), 1)
        b = base and base["requests_per_s"]
        row["requests_vs_none_pct"] = None if not b or row["requests_per_s"] is None else \
            round(100 * row["requests_per_s"] / b - 100, 1)
    return rows


def _round(x: float | None) -> float | None:
    return None if x is None else round(x, 1)


def _median(xs: list[float]) -> float | None:
    return statistics.median(xs) if xs else None


def _check_host(parts: PartitionManager, counts: Sequence[int], memory_mib: int,
                accel: str, modes: Sequence[str], loads: Sequence[str],
                ksm: Ksm) -> list[int]:
    unknown = [m for m in modes if m not in MODES] + [x for x in loads if x not in LOADS]
    if unknown:
        raise ResourceError(f"unknown mode or load {unknown[0]!r}: modes are "
                            f"{', '.join(MODES)}; loads are {', '.join(LOADS)}.")
    existing = [p.name for p in parts.db.partitions()]
    if existing:
        raise ResourceError(f"the dcss benchmark needs every core of this host but "
                            f"partition(s) {', '.join(existing)} exist; remove them first "
                            "(`fusuma down`).")
    find_image(parts.paths.cache, kind="debian")
    if "apache2" in loads and shutil.which("ab") is None:
        raise HostError("ab (ApacheBench) is not on this host: run "
                        "`apt-get install apache2-utils`.")
    if any("ksm" in m for m in modes) and not ksm.available():
        raise HostError("KSM is not available on this host (/sys/kernel/mm/ksm is "
                        "missing): leave out the ksm modes with --modes none,segment.")
    need = _partition_mib(max(counts), memory_mib, accel)
    avail = parts.host.memory_available_for_partitions_mib
    if need > avail:
        raise ResourceError(f"{max(counts)} VMs of {memory_mib} MiB need {need} MiB but "
                            f"only {avail} MiB is available for partitions; use fewer "
                            "--vms or less --memory.")
    return list(parts.host.cpus)


def _partition_mib(n: int, memory_mib: int, accel: str) -> int:
    one = VmRecord(name="x", partition=PARTITION, vcpus=1, memory_mib=memory_mib,
                   accel_used=accel)
    return SUPERVISOR_MIB + n * vm_footprint(one) + MARGIN_MIB


def _spec(i: int, mode: str, memory_mib: int) -> VmSpec:
    fields: dict[str, Any] = {"name": vm_name(i), "partition": PARTITION,
                              "memory_mib": memory_mib, "image": "debian",
                              "ports": [f"{BASE_PORT + i}:80"]}
    if "segment" in mode:
        fields["segments"] = [f"{SEGMENT}:/"]
    if "ksm" in mode:
        fields["mergeable"] = True
    return VmSpec(**fields)


def _one_case(parts: PartitionManager, vms: VmManager, cores: list[int], mode: str,
              load: str, counts: Sequence[int], memory_mib: int, requests: int,
              ab_runs: int, accel: str, ksm: Ksm, progress: Progress) -> list[Point]:
    out: list[Point] = []
    tag = f"{mode}/{load}"
    try:
        if "ksm" in mode:
            ksm.set_run(1, pages_to_scan=KSM_PAGES_TO_SCAN, sleep_millisecs=KSM_SLEEP_MS)
        elif ksm.available():
            ksm.set_run(0)
        parts.create(PartitionSpec(name=PARTITION, cpus=cores,
                                   memory_mib=_partition_mib(max(counts), memory_mib, accel)))
        running = 0
        for n in counts:
            started = time.monotonic()
            while running < n:
                progress(f"{tag}: booting VM {running + 1} of {n}")
                vms.create(_spec(running, mode, memory_mib))
                vms.start(vm_name(running), wait_agent=BOOT_TIMEOUT_S)
                httpload.wait_http(BASE_PORT + running, time.monotonic(), HTTP_TIMEOUT_S)
                running += 1
            boot_s = time.monotonic() - started
            rps: list[float] = []
            failed = 0
            if load == "apache2":
                if "ksm" in mode:
                    ksm.set_run(1, pages_to_scan=KSM_LOAD_PAGES_TO_SCAN,
                                sleep_millisecs=KSM_SLEEP_MS)
                for i in range(n):
                    runs = []
                    for _ in range(max(1, ab_runs)):
                        r, f = _ab(BASE_PORT + i, requests)
                        runs.append(r)
                        failed += f
                    rps.append(statistics.median(runs))
                if "ksm" in mode:
                    ksm.set_run(1, pages_to_scan=KSM_PAGES_TO_SCAN,
                                sleep_millisecs=KSM_SLEEP_MS)
                progress(f"{tag}, {n} VM(s): apache2 {statistics.median(rps):.0f} "
                         f"requests/s (median over {n} VM(s) of each one's median of "
                         f"{ab_runs} runs), {failed} failed")
            settled: KsmSettings | None = None
            if "ksm" in mode:
                progress(f"{tag}, {n} VM(s): waiting for KSM to settle")
                settled = ksm.wait_settled(KSM_SETTLE_TIMEOUT_S)
            point = _settled_point(parts, vms, mode, load, n, memory_mib, settled)
            point.requests_per_s = round(statistics.median(rps), 1) if rps else None
            point.failed_requests = failed
            point.boot_s = round(boot_s, 1)
            out.append(point)
            progress(f"{tag}, {n} VM(s): total PSS {point.total_pss_mib} MiB, guest "
                     f"{point.guest_mib} MiB")
        return out
    finally:
        with contextlib.suppress(FusumaError):
            if parts.db.find_partition(PARTITION) is not None:
                parts.delete(PARTITION, force=True)


def _settled_point(parts: PartitionManager, vms: VmManager, mode: str, load: str, n: int,
                   memory_mib: int, settled: KsmSettings | None) -> Point:
    """The point of the last reading once the total PSS holds still (KSM, when it runs,
    has settled already: no minimum wait then)."""
    readings: list[Point] = []

    def total() -> float:
        readings.append(_measure(parts, vms, mode, load, n, memory_mib, settled))
        return readings[-1].total_pss_mib

    _, waited, ok = settle(total, min_s=0.0 if settled is not None else SETTLE_MIN_S)
    point = readings[-1]
    point.settle_s, point.settled = waited, ok
    return point


def _measure(parts: PartitionManager, vms: VmManager, mode: str, load: str, n: int,
             memory_mib: int, settled: KsmSettings | None) -> Point:
    seg_files = {SEGMENT: parts.paths.segment_file(SEGMENT)}
    seg_paths = {str(p) for p in seg_files.values()} | \
        {str(p.resolve()) for p in seg_files.values() if p.exists()}
    pss = rss = seg = guest = 0
    for i in range(n):
        rec = parts.db.vm(vm_name(i))
        if rec.pid is None:
            raise FusumaError(f"VM {rec.name!r} has no QEMU process to measure.")
        mem = vm_memory(rec.pid, seg_files)
        pss += mem.split.pss_kib
        rss += mem.split.rss_kib
        seg += mem.segments_pss_kib
        guest += guest_kib(read_smaps(rec.pid), memory_mib, rec.ram_path, seg_paths)
    return Point(mode=mode, load=load, vms=n, total_pss_mib=round(pss / 1024, 1),
                 guest_mib=round(guest / 1024, 1), total_rss_mib=round(rss / 1024, 1),
                 segments_pss_mib=round(seg / 1024, 1),
                 ksm_saved_mib=round(settled.saved_bytes / 2**20, 1) if settled else None,
                 requests_per_s=None, failed_requests=0, boot_s=0.0)


def _ab(port: int, requests: int) -> tuple[float, int]:
    argv = ["ab", "-q", "-n", str(requests), "-c", str(AB_CONCURRENCY),
            f"http://127.0.0.1:{port}/"]
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=900, check=False)
    try:
        return parse_ab(proc.stdout)
    except ValueError:
        tail = (proc.stderr or proc.stdout).strip().splitlines()
        raise FusumaError(f"ab against port {port} failed: "
                          f"{tail[-1] if tail else proc.returncode}") from None


def _cleanup(parts: PartitionManager, segs: SegmentManager, progress: Progress) -> None:
    if parts.db.find_partition(PARTITION) is not None:
        try:
            parts.delete(PARTITION, force=True)
        except FusumaError as exc:
            progress(f"cleanup of partition {PARTITION} failed: {exc}")
    if parts.db.find_segment(SEGMENT) is not None:
        try:
            segs.delete(SEGMENT)
        except FusumaError as exc:
            progress(f"cleanup of segment {SEGMENT} failed: {exc}")
