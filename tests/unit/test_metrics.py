"""``GET /metrics``: the scrape-time families against a fake /proc, sysfs and cgroup
tree, and the event-derived counters fed from a real state file's event log."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from fusuma.api.metrics import EventMetrics, HostCollector, build_registry, render
from fusuma.governor.measure import read_threads
from fusuma.host.cgroups import CgroupDriver
from fusuma.host.cgroups.v1 import CgroupV1Driver
from fusuma.host.cgroups.v2 import CgroupV2Driver
from fusuma.paths import Paths
from fusuma.qemu import process
from fusuma.state import Database, PartitionRecord, VmRecord, VmState
from tests.unit.memshare_fake import KSM_STAT, ROLLUP, qemu_smaps

TCK = os.sysconf("SC_CLK_TCK")
Samples = dict[tuple[str, frozenset[tuple[str, str]]], float]


# -- a fake host -------------------------------------------------------------------------

def fake_qemu(procfs: Path, pid: int, vm: str, *, threads: list[tuple[int, str, int, int]],
              utime: int, stime: int, rollup: dict[str, int] | None = None,
              ksm_merging: int | None = None, smaps: str | None = None) -> Path:
    """A QEMU of ``vm`` as /proc shows it: stat, cmdline, task/TID/{comm,schedstat},
    smaps_rollup, and optionally ksm_stat and smaps. ``threads``: (tid, comm, run_ns,
    wait_ns)."""
    d = procfs / str(pid)
    d.mkdir(parents=True)
    # pid (comm) state ppid ... field 14/15 (utime, stime) counted from 1
    rest = ["S", "1", *["0"] * 9, str(utime), str(stime), *["0"] * 10]
    (d / "stat").write_text(f"{pid} (qemu-system-x86) {' '.join(rest)}\n")
    argv = ["/usr/bin/qemu-system-x86_64", "-name", f"guest={vm},debug-threads=on"]
    (d / "cmdline").write_bytes(b"\0".join(a.encode() for a in argv) + b"\0")
    (d / "comm").write_text("qemu-system-x86\n")
    for tid, comm, run_ns, wait_ns in threads:
        t = d / "task" / str(tid)
        t.mkdir(parents=True)
        (t / "comm").write_text(comm + "\n")
        (t / "schedstat").write_text(f"{run_ns} {wait_ns} 42\n")
    r = rollup or {"rss": 0, "pss": 0, "anon": 0, "file": 0, "shmem": 0}
    (d / "smaps_rollup").write_text(ROLLUP.format(**r))
    if ksm_merging is not None:
        (d / "ksm_stat").write_text(KSM_STAT.format(rmap=10, merging=ksm_merging, profit=0))
    if smaps is not None:
        (d / "smaps").write_text(smaps)
    return d


@pytest.fixture
def procfs(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A fake /proc; liveness checks (VmView, supervisor_pid) read it too."""
    root = tmp_path / "proc"
    root.mkdir()

    def pid_alive(pid: int) -> bool:
        try:
            stat = (root / str(pid) / "stat").read_text()
        except OSError:
            return False
        return stat.rsplit(")", 1)[1].split()[0] not in ("Z", "X")

    def cmdline(pid: int) -> list[str]:
        try:
            raw = (root / str(pid) / "cmdline").read_bytes()
        except OSError:
            return []
        return [a.decode() for a in raw.split(b"\0") if a]

    monkeypatch.setattr(process, "pid_alive", pid_alive)
    monkeypatch.setattr(process, "cmdline", cmdline)
    return root


@pytest.fixture
def paths(tmp_path: Path) -> Paths:
    return Paths(home=tmp_path / "home", runtime=tmp_path / "run", shm=tmp_path / "shm",
                 cache=tmp_path / "cache", cgroup_prefix="fusuma")


@pytest.fixture
def db(paths: Paths) -> Iterator[Database]:
    d = Database(paths.db)
    d.add_partition(PartitionRecord(name="p0", cpus=[2, 3, 4], memory_mib=1024))
    yield d
    d.close()


def v1_driver(tmp_path: Path, usage: dict[str, int]) -> CgroupV1Driver:
    mounts = {c: tmp_path / "cg1" / c for c in ("cpuset", "memory", "cpu")}
    for group, value in usage.items():
        for m in mounts.values():
            (m / "fusuma" / group).mkdir(parents=True)
        (mounts["memory"] / "fusuma" / group / "memory.usage_in_bytes").write_text(f"{value}\n")
    return CgroupV1Driver(mounts, "fusuma")


def scrape(collector: HostCollector) -> Samples:
    registry = CollectorRegistry()
    registry.register(collector)
    return parse(generate_latest(registry))


def parse(body: bytes) -> Samples:
    out: Samples = {}
    for fam in text_string_to_metric_families(body.decode()):
        for s in fam.samples:
            out[(s.name, frozenset(s.labels.items()))] = s.value
    return out


def get(samples: Samples, name: str, **labels: str) -> float:
    return samples[(name, frozenset(labels.items()))]


def names(samples: Samples, name: str) -> list[dict[str, str]]:
    return [dict(lbl) for n, lbl in samples if n == name]


def collector(paths: Paths, db: Database, procfs: Path, *,
              driver: CgroupDriver | None = None, ksm_root: Path | None = None,
              ) -> HostCollector:
    return HostCollector(paths, lambda: db, lambda: driver, procfs=procfs,
                         ksm_root=ksm_root or procfs.parent / "no-ksm")


VM1_THREADS = [(4242, "qemu-system-x86", 3_000_000_000, 100_000_000),
               (4243, "CPU 0/TCG", 5_000_000_000, 250_000_000),
               (4244, "CPU 1/TCG", 2_500_000_000, 0),
               (4245, "worker", 1_000_000_000, 5_000_000)]


def add_running(db: Database, name: str, pid: int, **kw: Any) -> None:
    db.add_vm(VmRecord(name=name, partition="p0", vcpus=2, memory_mib=512,
                       state=VmState.RUNNING, pid=pid, **kw))


# -- per-VM families ---------------------------------------------------------------------

def test_running_vm_cpu_memory_and_ksm(paths: Paths, db: Database, procfs: Path) -> None:
    fake_qemu(procfs, 4242, "vm1", threads=VM1_THREADS, utime=1000, stime=300,
              rollup={"rss": 300000, "pss": 200000, "anon": 150000, "file": 30000,
                      "shmem": 20000}, ksm_merging=77)
    add_running(db, "vm1", 4242, qos="guaranteed")
    s = scrape(collector(paths, db, procfs))

    vm = {"vm": "vm1", "partition": "p0", "qos": "guaranteed"}
    vcpu_s = (5_000_000_000 + 2_500_000_000) / 1e9
    assert get(s, "fusuma_vm_cpu_seconds_total", **vm, thread="vcpu") == vcpu_s
    assert get(s, "fusuma_vm_cpu_seconds_total", **vm, thread="other") == pytest.approx(
        1300 / TCK - vcpu_s)
    assert get(s, "fusuma_vm_vcpu_delay_seconds_total", vm="vm1", vcpu="0") == 0.25
    assert get(s, "fusuma_vm_vcpu_delay_seconds_total", vm="vm1", vcpu="1") == 0.0
    assert len(names(s, "fusuma_vm_vcpu_delay_seconds_total")) == 2   # vCPUs only
    assert get(s, "fusuma_vm_memory_pss_bytes", vm="vm1", kind="anon") == 150000 * 1024
    assert get(s, "fusuma_vm_memory_pss_bytes", vm="vm1", kind="file") == 30000 * 1024
    assert get(s, "fusuma_vm_memory_pss_bytes", vm="vm1", kind="shmem") == 20000 * 1024
    assert get(s, "fusuma_vm_memory_rss_bytes", vm="vm1") == 300000 * 1024
    assert get(s, "fusuma_vm_ksm_merging_pages", vm="vm1") == 77
    assert get(s, "fusuma_vm_state", vm="vm1", partition="p0", state="running") == 1
    assert get(s, "fusuma_vm_vcpus", vm="vm1") == 2
    assert get(s, "fusuma_vm_memory_guest_bytes", vm="vm1") == 512 * 2**20
    assert names(s, "fusuma_segment_pss_bytes") == []


def test_other_cpu_never_goes_down_and_clamps_at_zero(paths: Paths, db: Database,
                                                      procfs: Path) -> None:
    d = fake_qemu(procfs, 4242, "vm1", threads=VM1_THREADS, utime=1000, stime=300)
    add_running(db, "vm1", 4242)
    c = collector(paths, db, procfs)
    key = {"vm": "vm1", "partition": "p0", "qos": "burstable", "thread": "other"}
    first = get(scrape(c), "fusuma_vm_cpu_seconds_total", **key)
    assert first == pytest.approx(1300 / TCK - 7.5)
    # The tick-resolution total dips below the last reading: the counter holds.
    (d / "stat").write_text((d / "stat").read_text().replace(" 1000 300 ", " 999 300 "))
    assert get(scrape(c), "fusuma_vm_cpu_seconds_total", **key) == first
    # A total below the vCPU time (read skew) is clamped at 0 for a new QEMU.
    db.set_vm("vm1", pid=5000)
    fake_qemu(procfs, 5000, "vm1", threads=VM1_THREADS, utime=1, stime=0)
    assert get(scrape(c), "fusuma_vm_cpu_seconds_total", **key) == 0.0


def test_segment_pss(paths: Paths, db: Database, procfs: Path) -> None:
    seg = paths.segment_file("tools")
    seg.parent.mkdir(parents=True)
    seg.write_bytes(b"erofs")
    fake_qemu(procfs, 4300, "vm2", threads=VM1_THREADS[1:2], utime=1, stime=1,
              smaps=qemu_smaps(seg, seg_rss=8192, seg_pss=4096))
    add_running(db, "vm2", 4300, segments=["tools:/opt/tools"])
    s = scrape(collector(paths, db, procfs))
    assert get(s, "fusuma_segment_pss_bytes", segment="tools", vm="vm2") == 4096 * 1024


def test_vanished_and_stopped_vms_have_no_process_samples(paths: Paths, db: Database,
                                                          procfs: Path) -> None:
    fake_qemu(procfs, 4242, "vm1", threads=VM1_THREADS, utime=1000, stime=300)
    add_running(db, "vm1", 4242)
    add_running(db, "gone", 9999)                     # no /proc/9999: crashed
    # Alive by stat and cmdline, then gone before its threads and memory were read.
    half = fake_qemu(procfs, 7000, "half", threads=[], utime=1, stime=1)
    (half / "smaps_rollup").unlink()
    add_running(db, "half", 7000)
    db.add_vm(VmRecord(name="off", partition="p0", vcpus=1, memory_mib=256))
    s = scrape(collector(paths, db, procfs))

    assert get(s, "fusuma_vm_state", vm="gone", partition="p0", state="crashed") == 1
    assert get(s, "fusuma_vm_state", vm="half", partition="p0", state="running") == 1
    assert get(s, "fusuma_vm_state", vm="off", partition="p0", state="stopped") == 1
    for family in ("fusuma_vm_cpu_seconds_total", "fusuma_vm_memory_rss_bytes",
                   "fusuma_vm_memory_pss_bytes", "fusuma_vm_vcpu_delay_seconds_total"):
        assert {lbl["vm"] for lbl in names(s, family)} == {"vm1"}, family


def test_process_gone_mid_read_is_skipped(paths: Paths, db: Database, procfs: Path,
                                          monkeypatch: pytest.MonkeyPatch) -> None:
    fake_qemu(procfs, 4242, "vm1", threads=VM1_THREADS, utime=1000, stime=300)
    add_running(db, "vm1", 4242)
    real = read_threads

    def then_exit(pid: int, proc: Path) -> Any:
        out = real(pid, proc)
        (procfs / str(pid) / "smaps_rollup").unlink()   # the QEMU exits right here
        (procfs / str(pid) / "stat").unlink()
        return out

    monkeypatch.setattr("fusuma.api.metrics.read_threads", then_exit)
    s = scrape(collector(paths, db, procfs))
    assert get(s, "fusuma_vm_state", vm="vm1", partition="p0", state="running") == 1
    assert names(s, "fusuma_vm_cpu_seconds_total") == []
    assert names(s, "fusuma_vm_memory_rss_bytes") == []


# -- partitions and host -----------------------------------------------------------------

def test_partitions_on_cgroup_v1(tmp_path: Path, paths: Paths, db: Database,
                                 procfs: Path) -> None:
    db.add_partition(PartitionRecord(name="p1", cpus=[5], memory_mib=256))   # no cgroup
    driver = v1_driver(tmp_path, {"p0": 123456789})
    s = scrape(collector(paths, db, procfs, driver=driver))
    assert get(s, "fusuma_partition_cpus", partition="p0") == 3
    assert get(s, "fusuma_partition_memory_limit_bytes", partition="p0") == 1024 * 2**20
    assert get(s, "fusuma_partition_memory_usage_bytes", partition="p0") == 123456789
    assert names(s, "fusuma_partition_memory_usage_bytes") == [{"partition": "p0"}]
    assert names(s, "fusuma_partition_cpu_pressure_seconds_total") == []
    assert get(s, "fusuma_partition_supervisor_up", partition="p0") == 0


def test_partition_pressure_on_cgroup_v2(tmp_path: Path, paths: Paths, db: Database,
                                         procfs: Path) -> None:
    group = tmp_path / "cg2" / "fusuma" / "p0"
    group.mkdir(parents=True)
    (group / "memory.current").write_text("4096\n")
    (group / "cpu.pressure").write_text("some avg10=0.00 avg60=0.00 avg300=0.00 "
                                        "total=2500000\nfull avg10=0.00 avg60=0.00 "
                                        "avg300=0.00 total=999\n")
    driver = CgroupV2Driver(tmp_path / "cg2", "fusuma")
    s = scrape(collector(paths, db, procfs, driver=driver))
    assert get(s, "fusuma_partition_cpu_pressure_seconds_total", partition="p0") == 2.5
    assert get(s, "fusuma_partition_memory_usage_bytes", partition="p0") == 4096


def test_supervisor_up(paths: Paths, db: Database, procfs: Path) -> None:
    d = procfs / "5555"
    d.mkdir()
    (d / "stat").write_text("5555 (python3) S 1 0\n")
    (d / "cmdline").write_bytes(b"python3\0-m\0fusuma.supervisor\0p0\0")
    db.set_supervisor_pid("p0", 5555)
    s = scrape(collector(paths, db, procfs))
    assert get(s, "fusuma_partition_supervisor_up", partition="p0") == 1


def test_host_ksm_pages_sharing(tmp_path: Path, paths: Paths, db: Database,
                                procfs: Path) -> None:
    ksm = tmp_path / "ksm"
    ksm.mkdir()
    (ksm / "pages_sharing").write_text("321\n")
    assert get(scrape(collector(paths, db, procfs, ksm_root=ksm)),
               "fusuma_host_ksm_pages_sharing") == 321
    assert names(scrape(collector(paths, db, procfs)), "fusuma_host_ksm_pages_sharing") == []


def test_collect_never_raises(paths: Paths, procfs: Path) -> None:
    def broken() -> Database:
        raise RuntimeError("state file replaced")

    c = HostCollector(paths, broken, lambda: None, procfs=procfs)
    s = scrape(c)              # empty families, no exception
    assert names(s, "fusuma_vm_state") == []


# -- events ------------------------------------------------------------------------------

def moved(mode: str, downtime_ms: float | None, total_ms: float) -> dict[str, Any]:
    return {"vm": "vm1", "from": "p0", "to": "p1", "mode": mode, "total_ms": total_ms,
            "downtime_ms": downtime_ms, "bytes_sent": 4096, "prepare_ms": 1.0,
            "cpu_s": 0.1, "qemu_total_ms": None, "qemu_downtime_ms": None,
            "paused": False, "result": "ok"}


def test_event_metrics_from_the_event_log(db: Database) -> None:
    registry = CollectorRegistry()
    ev = EventMetrics(registry)
    before = parse(generate_latest(registry))
    assert get(before, "fusuma_vm_moves_total", mode="copy", result="failed") == 0
    assert get(before, "fusuma_vm_move_downtime_seconds_count", mode="zero-copy") == 0

    start = db.last_event_id()
    db.emit_context("lifecycle", "vm-moved", "/1.0/vms/vm1", moved("zero-copy", 3.5, 120))
    db.emit_context("lifecycle", "vm-moved", "/1.0/vms/vm1", moved("zero-copy", None, 80))
    db.emit("lifecycle", "vm-move-failed", "/1.0/vms/vm1", vm="vm1", mode="copy",
            result="failed", error="boom")
    db.emit_context("lifecycle", "vm-move-recovered", "/1.0/vms/vm1",
                    {"vm": "vm1", "mode": None, "result": "recovered"})
    db.emit_context("governor", "throttle", "/1.0/partitions/p0",
                    {"partition": "p0", "vm": "vm1", "action": "throttle"})
    events = db.events_since(start)
    for e in events:
        ev.observe(e)
    ev.observe(events[0])                      # seen already: not counted twice
    s = parse(render(registry)[0])

    assert get(s, "fusuma_vm_move_downtime_seconds_count", mode="zero-copy") == 1
    assert get(s, "fusuma_vm_move_downtime_seconds_sum", mode="zero-copy") == 0.0035
    assert get(s, "fusuma_vm_move_downtime_seconds_bucket", mode="zero-copy",
               le="0.005") == 1
    assert get(s, "fusuma_vm_move_downtime_seconds_bucket", mode="zero-copy",
               le="0.0025") == 0
    assert get(s, "fusuma_vm_move_duration_seconds_count", mode="zero-copy") == 2
    assert get(s, "fusuma_vm_move_duration_seconds_sum", mode="zero-copy") == 0.2
    assert get(s, "fusuma_vm_moves_total", mode="zero-copy", result="ok") == 2
    assert get(s, "fusuma_vm_moves_total", mode="copy", result="failed") == 1
    assert get(s, "fusuma_vm_moves_total", mode="copy", result="ok") == 0
    assert get(s, "fusuma_vm_moves_total", mode="unknown", result="recovered") == 1
    assert get(s, "fusuma_governor_actions_total", partition="p0", action="throttle") == 1
    assert get(s, "fusuma_events_total", type="lifecycle") == 4
    assert get(s, "fusuma_events_total", type="governor") == 1


def test_build_registry_and_render(paths: Paths, db: Database, procfs: Path) -> None:
    fake_qemu(procfs, 4242, "vm1", threads=VM1_THREADS, utime=1000, stime=300)
    add_running(db, "vm1", 4242)
    registry, ev = build_registry(paths, lambda: db, lambda: None, procfs=procfs,
                                  ksm_root=procfs / "none")
    ev.observe({"id": 1, "ts": 0.0, "type": "governor", "action": "boost",
                "source": "/1.0/partitions/p0", "context": {"vm": "vm1"}})
    body, ctype = render(registry)
    assert ctype == CONTENT_TYPE_LATEST and ctype.startswith("text/plain; version=")
    s = parse(body)
    assert get(s, "fusuma_vm_cpu_seconds_total", vm="vm1", partition="p0",
               qos="burstable", thread="vcpu") == 7.5
    # The partition comes from the source when the context lacks it.
    assert get(s, "fusuma_governor_actions_total", partition="p0", action="boost") == 1
    assert b"# TYPE fusuma_vm_cpu_seconds_total counter" in body


def test_shared_base_images(tmp_path: Path, paths: Paths, db: Database,
                            procfs: Path) -> None:
    """Two running VMs on one imported image, their QEMUs holding its file (a link in
    their fake fd tables, which os.stat follows to the real file): its size, cached
    bytes (mincore on the real file), VMs and saving."""
    from fusuma.state.records import ImageRecord

    base = tmp_path / "deb.raw"
    base.write_bytes(os.urandom(2**20))
    base.chmod(0o444)
    base.read_bytes()
    db.add_image(ImageRecord(name="deb", path=str(base), format="raw",
                             virtual_size=2**20, file_size=2**20, sha256="0" * 64,
                             source="t"))
    for pid, vm in ((4400, "f1"), (4401, "f2"), (4402, "f3")):
        d = fake_qemu(procfs, pid, vm, threads=VM1_THREADS[1:2], utime=1, stime=1)
        (d / "fd").mkdir()
        if vm != "f3":                       # f3's QEMU does not hold the base
            (d / "fd" / "7").symlink_to(base)
        add_running(db, vm, pid, image="deb", boot="bios")
    s = scrape(collector(paths, db, procfs))
    cached = get(s, "fusuma_base_image_cached_bytes", image="deb")
    assert 0 < cached <= 2**20
    assert get(s, "fusuma_base_image_file_bytes", image="deb") == 2**20
    assert get(s, "fusuma_base_image_vms", image="deb") == 2
    assert get(s, "fusuma_base_image_saved_bytes", image="deb") == cached
    # A base that is not the file imported has its size and VMs, not its cache.
    base.chmod(0o644)
    s = scrape(collector(paths, db, procfs))
    assert names(s, "fusuma_base_image_cached_bytes") == []
    assert names(s, "fusuma_base_image_saved_bytes") == []
    assert get(s, "fusuma_base_image_vms", image="deb") == 2
