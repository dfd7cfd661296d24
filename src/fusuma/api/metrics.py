"""``GET /metrics``: the host in Prometheus' text exposition format.

Names are in base units (seconds, bytes) and follow the KubeVirt and libvirt exporter
conventions. Two kinds of families:

Read at scrape time by :class:`HostCollector` (nothing cached between scrapes):

- ``fusuma_vm_state{vm,partition,state}``: 1 for the VM's current state as `fusuma ps`
  shows it (``VmView.state``: a recorded "running" whose QEMU is gone is "crashed").
- ``fusuma_vm_vcpus{vm}``, ``fusuma_vm_memory_guest_bytes{vm}``: the VM's definition.
- ``fusuma_vm_cpu_seconds_total{vm,partition,qos,thread}``: CPU time of the VM's QEMU,
  ``thread="vcpu"`` from the vCPU threads' ``/proc/PID/task/TID/schedstat``,
  ``thread="other"`` the process total (``/proc/PID/stat``) minus that.
- ``fusuma_vm_vcpu_delay_seconds_total{vm,vcpu}``: time each vCPU thread was runnable
  but waiting for a CPU (schedstat's run delay); the first sign of an overcommitted
  partition.
- ``fusuma_vm_memory_pss_bytes{vm,kind}`` (anon, file, shmem) and
  ``fusuma_vm_memory_rss_bytes{vm}``: the QEMU's ``/proc/PID/smaps_rollup``.
- ``fusuma_vm_ksm_merging_pages{vm}``: pages of the QEMU merged by KSM
  (``/proc/PID/ksm_stat``; absent where the kernel lacks it).
- ``fusuma_segment_pss_bytes{segment,vm}``: the VM's fair part of each shared segment
  it maps (``/proc/PID/smaps``, read only for VMs with segments).
- ``fusuma_partition_cpus{partition}``, ``fusuma_partition_memory_limit_bytes{partition}``:
  the partition's record; ``fusuma_partition_memory_usage_bytes{partition}``: memory
  charged to its cgroup; ``fusuma_partition_cpu_pressure_seconds_total{partition}``:
  PSI "some" of its cgroup, on cgroup v2 only (v1 has no per-group PSI: no samples);
  ``fusuma_partition_supervisor_up{partition}``: 1 while its supervisor is alive.
- ``fusuma_host_ksm_pages_sharing``: pages KSM saves host-wide (sysfs).
- ``fusuma_base_image_file_bytes{image}``, ``fusuma_base_image_cached_bytes{image}``,
  ``fusuma_base_image_vms{image}``, ``fusuma_base_image_saved_bytes{image}``: for each
  imported image that running VMs boot from, its file's size, its bytes in the host's
  page cache (mincore), the VMs whose QEMU holds it open and the saving of sharing its
  cached pages, (VMs - 1) x cached (fusuma.memshare.bases); an image whose file is not
  the one imported has no cached or saved sample.

Only a VM whose state is running, paused, migrating or stopping has per-process
samples; a QEMU that ends during the scrape just has none.

Derived from the event log by :class:`EventMetrics` (counted from the daemon's start):

- ``fusuma_vm_move_downtime_seconds{mode}``, ``fusuma_vm_move_duration_seconds{mode}``
  histograms of successful moves; ``fusuma_vm_moves_total{mode,result}`` (ok, failed,
  recovered); ``fusuma_governor_actions_total{partition,action}``;
  ``fusuma_events_total{type}``.

prometheus_client is imported here only, so no CLI command but `serve` loads it.
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any, TypeVar

from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Histogram,
    generate_latest,
)
from prometheus_client.metrics_core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from fusuma.errors import FusumaError
from fusuma.frozen import frozen
from fusuma.governor.measure import ThreadStat, read_threads
from fusuma.host.cgroups import CgroupDriver, CgroupV2Driver, parse_pressure_total
from fusuma.memshare.bases import BaseUser, bases_in_use
from fusuma.memshare.report import VmMemory, vm_memory
from fusuma.partition.liveness import supervisor_pid
from fusuma.paths import Paths
from fusuma.state import Database, PartitionRecord, VmRecord
from fusuma.vm.view import VmView

LOG = logging.getLogger(__name__)

# States in which a VM's QEMU runs and its /proc entry is read.
PROCESS_STATES = frozenset({"running", "paused", "migrating", "stopping"})
MOVE_MODES = ("zero-copy", "copy")
EVENT_TYPES = ("lifecycle", "operation", "governor")
# A zero-copy move's downtime is a few ms, a copy move's up to seconds.
DOWNTIME_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5,
                    1.0, 2.5, 5.0, 10.0)
# A whole move (preparation, transfer, switch-over) takes longer than its downtime.
DURATION_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0,
                    120.0, 300.0)
_CLK_TCK = os.sysconf("SC_CLK_TCK")

_T = TypeVar("_T")
_R = TypeVar("_R")


# -- read at scrape time -----------------------------------------------------------------

@frozen
class _Process:
    """What one scrape read of one VM's QEMU."""

    pid: int
    threads: dict[int, ThreadStat]
    cpu_s: float              # utime + stime of the whole process, exited threads too
    memory: VmMemory


@frozen
class _VmSample:
    record: VmRecord
    state: str
    process: _Process | None  # None: not running, or its QEMU ended during the scrape


@frozen
class _Families:
    vm_state: GaugeMetricFamily
    vm_vcpus: GaugeMetricFamily
    vm_guest_bytes: GaugeMetricFamily
    vm_cpu: CounterMetricFamily
    vm_vcpu_delay: CounterMetricFamily
    vm_pss: GaugeMetricFamily
    vm_rss: GaugeMetricFamily
    vm_ksm: GaugeMetricFamily
    segment_pss: GaugeMetricFamily
    partition_cpus: GaugeMetricFamily
    partition_limit: GaugeMetricFamily
    partition_usage: GaugeMetricFamily
    partition_pressure: CounterMetricFamily
    partition_supervisor: GaugeMetricFamily
    host_ksm_sharing: GaugeMetricFamily
    base_file: GaugeMetricFamily
    base_cached: GaugeMetricFamily
    base_vms: GaugeMetricFamily
    base_saved: GaugeMetricFamily

    @classmethod
    def new(cls) -> _Families:
        g, c = GaugeMetricFamily, CounterMetricFamily
        return cls(
            vm_state=g("fusuma_vm_state", "1 for the VM's current state (as `fusuma ps` "
                       "shows it).", labels=["vm", "partition", "state"]),
            vm_vcpus=g("fusuma_vm_vcpus", "vCPUs the VM is defined with.", labels=["vm"]),
            vm_guest_bytes=g("fusuma_vm_memory_guest_bytes", "Guest RAM the VM is "
                             "defined with.", labels=["vm"]),
            vm_cpu=c("fusuma_vm_cpu_seconds", "CPU time of the VM's QEMU: its vCPU threads "
                     "and all other threads.", labels=["vm", "partition", "qos", "thread"]),
            vm_vcpu_delay=c("fusuma_vm_vcpu_delay_seconds", "Time a vCPU thread was "
                            "runnable but waited for a CPU (schedstat run delay).",
                            labels=["vm", "vcpu"]),
            vm_pss=g("fusuma_vm_memory_pss_bytes", "Proportional set size of the VM's "
                     "QEMU by page kind.", labels=["vm", "kind"]),
            vm_rss=g("fusuma_vm_memory_rss_bytes", "Resident set size of the VM's QEMU.",
                     labels=["vm"]),
            vm_ksm=g("fusuma_vm_ksm_merging_pages", "Pages of the VM's QEMU merged by KSM.",
                     labels=["vm"]),
            segment_pss=g("fusuma_segment_pss_bytes", "The VM's proportional part of a "
                          "shared segment's resident pages.", labels=["segment", "vm"]),
            partition_cpus=g("fusuma_partition_cpus", "Cores of the partition.",
                             labels=["partition"]),
            partition_limit=g("fusuma_partition_memory_limit_bytes", "Memory limit of the "
                              "partition.", labels=["partition"]),
            partition_usage=g("fusuma_partition_memory_usage_bytes", "Memory charged to "
                              "the partition's cgroup.", labels=["partition"]),
            partition_pressure=c("fusuma_partition_cpu_pressure_seconds", "PSI cpu 'some' "
                                 "time of the partition's cgroup (cgroup v2 only).",
                                 labels=["partition"]),
            partition_supervisor=g("fusuma_partition_supervisor_up", "1 while the "
                                   "partition's supervisor is alive.", labels=["partition"]),
            host_ksm_sharing=g("fusuma_host_ksm_pages_sharing", "Pages KSM saves host-wide "
                               "(/sys/kernel/mm/ksm/pages_sharing)."),
            base_file=g("fusuma_base_image_file_bytes", "Size of the file of an imported "
                        "image that running VMs boot from (their shared base).",
                        labels=["image"]),
            base_cached=g("fusuma_base_image_cached_bytes", "Bytes of a shared base image "
                          "in the host's page cache (mincore).", labels=["image"]),
            base_vms=g("fusuma_base_image_vms", "Running VMs whose QEMU holds the base "
                       "image open.", labels=["image"]),
            base_saved=g("fusuma_base_image_saved_bytes", "Page cache saved by sharing the "
                         "base: (VMs - 1) x its cached bytes.", labels=["image"]),
        )

    def all(self) -> list[Metric]:
        return [getattr(self, f) for f in self.__dataclass_fields__]


def _parallel(fn: Callable[[_T], _R], items: Sequence[_T], threads: int) -> list[_R]:
    """``[fn(x) for x in items]`` on up to ``threads`` threads, in order; an item whose
    ``fn`` raised is logged and left out. Reading smaps_rollup makes the kernel walk the
    QEMU's page tables, a few ms per VM, and releases the GIL (see
    ``fusuma.vm.view.views_json``)."""
    out: list[_R | None] = [None] * len(items)

    def work(first: int, step: int) -> None:
        for i in range(first, len(items), step):
            try:
                out[i] = fn(items[i])
            except Exception:
                LOG.exception("metrics: reading %r failed", items[i])

    k = max(1, min(threads, len(items)))
    if k == 1:
        work(0, 1)
    else:
        pool = [threading.Thread(target=work, args=(i, k)) for i in range(k)]
        for t in pool:
            t.start()
        for t in pool:
            t.join()
    return [x for x in out if x is not None]


def _process_cpu_s(pid: int, procfs: Path) -> float:
    """utime + stime of the whole process in seconds; OSError if it is gone."""
    fields = (procfs / str(pid) / "stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / _CLK_TCK


def _read_int(path: Path) -> int | None:
    try:
        return int(path.read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return None


class HostCollector(Collector):
    """The scrape-time families. ``db`` and ``cgroups`` return the calling thread's
    Database and the cgroup driver: the daemon scrapes from worker threads and SQLite
    connections belong to one thread."""

    def __init__(self, paths: Paths, db: Callable[[], Database],
                 cgroups: Callable[[], CgroupDriver | None], *,
                 procfs: Path = Path("/proc"), ksm_root: Path = Path("/sys/kernel/mm/ksm"),
                 threads: int = 4) -> None:
        self.paths = paths
        self._db = db
        self._cgroups = cgroups
        self.procfs = procfs
        self.ksm_root = ksm_root
        self.threads = threads
        self._page_size = os.sysconf("SC_PAGE_SIZE")
        # Highest CPU seconds reported per (vm, pid, thread kind); see _cpu_counter.
        self._high: dict[tuple[str, int, str], float] = {}
        self._lock = threading.Lock()

    def describe(self) -> Iterator[Metric]:
        # Lets the registry check names at registration without a scrape.
        yield from _Families.new().all()

    def collect(self) -> Iterator[Metric]:
        f = _Families.new()
        try:
            self._fill(f)
        except Exception:  # a scrape answers with what it has, never a 500
            LOG.exception("metrics: a scrape failed part way")
        yield from f.all()

    def _fill(self, f: _Families) -> None:
        db = self._db()
        partitions = db.partitions()
        records = db.vms()
        try:
            driver = self._cgroups()
        except FusumaError as exc:
            LOG.debug("metrics: no cgroup driver: %s", exc)
            driver = None
        for p in partitions:
            self._partition(f, p, driver)
        samples = _parallel(self._read_vm, records, self.threads)
        seen: set[tuple[str, int, str]] = set()
        for s in samples:
            self._vm(f, s, seen)
        with self._lock:   # forget VMs and QEMUs that are gone
            for key in [k for k in self._high if k not in seen]:
                del self._high[key]
        sharing = _read_int(self.ksm_root / "pages_sharing")
        if sharing is not None:
            f.host_ksm_sharing.add_metric([], sharing)
        self._bases(f, db, samples)

    def _bases(self, f: _Families, db: Database, samples: list[_VmSample]) -> None:
        users = [BaseUser(s.record.name, s.process.pid, s.record.image) for s in samples
                 if s.process is not None and s.record.boot != "kernel"]
        if not users:
            return
        for use in bases_in_use(db.images(), users, self.procfs):
            f.base_file.add_metric([use.image], use.file_bytes)
            f.base_vms.add_metric([use.image], len(use.vms))
            if use.resident_bytes is not None:
                f.base_cached.add_metric([use.image], use.resident_bytes)
                f.base_saved.add_metric([use.image], use.saved_bytes)

    def _partition(self, f: _Families, p: PartitionRecord, driver: CgroupDriver | None) -> None:
        name = p.name
        f.partition_cpus.add_metric([name], len(p.cpus))
        f.partition_limit.add_metric([name], p.memory_mib * 2**20)
        up = supervisor_pid(self.paths, name, p.supervisor_pid) is not None
        f.partition_supervisor.add_metric([name], 1 if up else 0)
        if driver is None:
            return
        try:
            f.partition_usage.add_metric([name], driver.memory_current(name))
        except FusumaError as exc:    # no cgroup yet (never started) or unreadable
            LOG.debug("metrics: memory of partition %s: %s", name, exc)
        pressure = _cpu_pressure_us(driver, name)
        if pressure is not None:
            f.partition_pressure.add_metric([name], pressure / 1e6)

    def _read_vm(self, rec: VmRecord) -> _VmSample:
        try:
            state = VmView(rec, self.paths.segments_dir).state
            if state not in PROCESS_STATES or not rec.pid:
                return _VmSample(rec, state, None)
        except Exception:
            LOG.exception("metrics: cannot tell the state of VM %s", rec.name)
            return _VmSample(rec, rec.state.value, None)
        pid = rec.pid
        files = {seg: self.paths.segment_file(seg)
                 for seg in (item.partition(":")[0] for item in rec.segments)}
        try:
            threads = read_threads(pid, self.procfs)
            memory = vm_memory(pid, files, self.procfs, self._page_size)
            cpu_s = _process_cpu_s(pid, self.procfs)
        except (FusumaError, OSError, ValueError, IndexError) as exc:
            # The QEMU ended (or its pid was reused) between the state check and here.
            LOG.debug("metrics: VM %s (pid %s) not read: %s", rec.name, pid, exc)
            return _VmSample(rec, state, None)
        if not threads:        # its task dir is gone: ended meanwhile
            return _VmSample(rec, state, None)
        return _VmSample(rec, state, _Process(pid, threads, cpu_s, memory))

    def _cpu_counter(self, key: tuple[str, int, str], value: float) -> float:
        """``value``, or the highest value reported before for this QEMU if that is
        higher. A counter must never go down (Prometheus reads a decrease as a restart
        and ``rate()`` jumps); see ``_vm`` for why these can dip by a few ms."""
        with self._lock:
            high = max(value, self._high.get(key, 0.0))
            self._high[key] = high
        return high

    def _vm(self, f: _Families, s: _VmSample, seen: set[tuple[str, int, str]]) -> None:
        r = s.record
        f.vm_state.add_metric([r.name, r.partition, s.state], 1)
        f.vm_vcpus.add_metric([r.name], r.vcpus)
        f.vm_guest_bytes.add_metric([r.name], r.memory_mib * 2**20)
        p = s.process
        if p is None:
            return
        # vCPU time is summed over the live vCPU threads, which live as long as the VM.
        # "other" is the process total minus that, not a sum over the live other
        # threads: QEMU's worker threads come and go, and an exited thread's time is
        # lost from a per-thread sum (the counter would fall) but kept in the process's
        # utime + stime. That total has clock-tick (10 ms) resolution and is read just
        # after the threads, so total - vcpu can dip a little between scrapes: clamped
        # at 0 and at the highest value reported before for this pid.
        vcpu_ns = sum(t.run_ns for t in p.threads.values() if t.vcpu is not None)
        vcpu_s = vcpu_ns / 1e9
        other_s = max(0.0, p.cpu_s - vcpu_s)
        for kind, value in (("vcpu", vcpu_s), ("other", other_s)):
            key = (r.name, p.pid, kind)
            seen.add(key)
            f.vm_cpu.add_metric([r.name, r.partition, r.qos, kind],
                                self._cpu_counter(key, value))
        vcpus = sorted((t.vcpu, t.wait_ns) for t in p.threads.values() if t.vcpu is not None)
        for index, wait_ns in vcpus:
            f.vm_vcpu_delay.add_metric([r.name, str(index)], wait_ns / 1e9)
        sp = p.memory.split
        for kind, kib in (("anon", sp.anon_kib), ("file", sp.file_kib),
                          ("shmem", sp.shmem_kib)):
            f.vm_pss.add_metric([r.name, kind], kib * 1024)
        f.vm_rss.add_metric([r.name], sp.rss_kib * 1024)
        ksm = p.memory.ksm
        if ksm is not None and ksm.merging_pages is not None:
            f.vm_ksm.add_metric([r.name], ksm.merging_pages)
        for seg, use in p.memory.segments.items():
            f.segment_pss.add_metric([seg, r.name], use.pss_kib * 1024)


def _cpu_pressure_us(driver: CgroupDriver, group: str) -> int | None:
    """PSI cpu "some" total of a partition's cgroup in microseconds; None on cgroup v1
    (the v1 hierarchies have no per-group pressure files) or when it cannot be read."""
    if not isinstance(driver, CgroupV2Driver):
        return None
    try:
        text = (driver.mount / driver.prefix / group / "cpu.pressure").read_text()
    except OSError:
        return None
    return parse_pressure_total(text)


# -- derived from events ----------------------------------------------------------------

def _seconds(ms: object) -> float | None:
    if isinstance(ms, bool) or not isinstance(ms, int | float):
        return None
    return ms / 1000


def _label(value: object, default: str = "unknown") -> str:
    return str(value) if value not in (None, "") else default


class EventMetrics:
    """Counters and histograms fed one event at a time from the state file's event
    log (``Database.events_since``); registered in ``registry``."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.downtime = Histogram(
            "fusuma_vm_move_downtime_seconds", "Guest downtime of successful moves.",
            ["mode"], buckets=DOWNTIME_BUCKETS, registry=registry)
        self.duration = Histogram(
            "fusuma_vm_move_duration_seconds", "Total time of successful moves.",
            ["mode"], buckets=DURATION_BUCKETS, registry=registry)
        self.moves = Counter("fusuma_vm_moves", "Moves of VMs between partitions by "
                             "result (ok, failed, recovered after a crash).",
                             ["mode", "result"], registry=registry)
        self.governor = Counter("fusuma_governor_actions", "Changes the governor made.",
                                ["partition", "action"], registry=registry)
        self.events = Counter("fusuma_events", "Events in the state file's log, by type.",
                              ["type"], registry=registry)
        self.last_id = 0
        # Series that exist before the first event, so that rate() and the histograms'
        # _count have a zero to start from.
        for mode in MOVE_MODES:
            self.downtime.labels(mode)
            self.duration.labels(mode)
            for result in ("ok", "failed"):
                self.moves.labels(mode, result)
        for typ in EVENT_TYPES:
            self.events.labels(typ)

    def observe(self, event: dict[str, Any]) -> None:
        """Count one event. An event whose id is not above the last one seen was counted
        already and is ignored, so feeding the log twice does not double the counts."""
        eid = event.get("id")
        if isinstance(eid, int):
            if eid <= self.last_id:
                return
            self.last_id = eid
        typ = _label(event.get("type"))
        action = _label(event.get("action"))
        ctx = event.get("context")
        if not isinstance(ctx, dict):
            ctx = {}
        self.events.labels(typ).inc()
        mode = _label(ctx.get("mode"))
        if action == "vm-moved":
            self.moves.labels(mode, "ok").inc()
            downtime = _seconds(ctx.get("downtime_ms"))
            if downtime is not None:
                self.downtime.labels(mode).observe(downtime)
            total = _seconds(ctx.get("total_ms"))
            if total is not None:
                self.duration.labels(mode).observe(total)
        elif action == "vm-move-failed":
            self.moves.labels(mode, "failed").inc()
        elif action == "vm-move-recovered":
            self.moves.labels(mode, "recovered").inc()
        if typ == "governor":
            source = str(event.get("source") or "")
            fallback = source.rsplit("/", 1)[-1] if "/partitions/" in source else None
            self.governor.labels(_label(ctx.get("partition") or fallback), action).inc()


# -- the registry ------------------------------------------------------------------------

def build_registry(paths: Paths, db: Callable[[], Database],
                   cgroups: Callable[[], CgroupDriver | None], *,
                   procfs: Path = Path("/proc"), ksm_root: Path = Path("/sys/kernel/mm/ksm"),
                   threads: int = 4) -> tuple[CollectorRegistry, EventMetrics]:
    """A fresh registry (not prometheus_client's global one) with the host's families
    and the event-derived ones; feed events to the returned EventMetrics."""
    registry = CollectorRegistry()
    registry.register(HostCollector(paths, db, cgroups, procfs=procfs, ksm_root=ksm_root,
                                    threads=threads))
    return registry, EventMetrics(registry)


def render(registry: CollectorRegistry) -> tuple[bytes, str]:
    """The body and Content-Type of a ``GET /metrics`` answer."""
    return generate_latest(registry), CONTENT_TYPE_LATEST
