"""`fusuma bench mint`: the Mint + KVM evaluation (papers README §1) on fusuma.

The paper's probe (``fusuma/guest/probe.c``: register, copy and O_DIRECT io loops,
timed with the TSC) runs in nine configurations, the paper's Table 2 with fusuma's
parts plus two with a CPU hog. Each configuration runs the three tests one after the
other; where two probes run "concurrently" they start each test together.

Order (chosen so that as few VMs as possible are booted: three, each once; a VM that
changes partition moves there zero-copy, running):

- disks d0 and d1 (raw files) are written with a pattern the probe checks;
- 1: the probe on the host, outside any partition (d0);
- 2, 3: partitions mint-a (core 0, d0) and mint-b (core 1, d1); the host probe in a
  leaf cgroup of mint-a, then one in each partition at once;
- 5: VM mint-1 in mint-a (d0) alone;
- 8: a CPU-hog VM in mint-b beside it; 9: the hog moved into mint-a, then removed;
- 6: VM mint-2 in mint-b (d1) beside mint-1;
- 7, 4: mint-2 (and its disk) moved into mint-a, mint-b removed and mint-a resized to
  every core (the "unpartitioned" host: fusuma needs a partition): mint-1 with mint-2
  beside it, then mint-2 removed and mint-1 alone.

Before every io run the host page cache of the disk files is dropped (QEMU opens them
with its default cache mode, so a guest's O_DIRECT read can still be served from the
host's cache), and the probe never reads a block twice in one run when the disk is
large enough (``fresh``). It needs every core, so it refuses to run beside any
partition, and it removes everything it made afterwards, also on failure or Ctrl-C.
"""

from __future__ import annotations

import base64
import contextlib
import logging
import os
import random
import shutil
import struct
import subprocess
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from fusuma import guest
from fusuma.capacity import SUPERVISOR_MIB, vm_footprint
from fusuma.errors import FusumaError, HostError, ResourceError
from fusuma.frozen import frozen
from fusuma.host.accel import probe_accel
from fusuma.host.cgroups import CgroupDriver
from fusuma.host.storage import default_dir
from fusuma.images import find_image, probe_path
from fusuma.migration import migrate
from fusuma.partition.manager import PartitionManager
from fusuma.spec import DiskSpec, PartitionSpec, VmSpec
from fusuma.state import VmRecord
from fusuma.supervisor import rpc
from fusuma.supervisor.client import SupervisorClient
from fusuma.vm import VmManager
from fusuma_bench.mint_probe import (
    GUEST_DISK,
    GUEST_PROBE,
    TESTS,
    ProbeError,
    ProbeParams,
    TscMismatch,
    parse_output,
    probe_argv,
)
from fusuma_bench.report import meta

LOG = logging.getLogger(__name__)

# A run whose TSC time disagrees with CLOCK_MONOTONIC's (its calibration disturbed by a
# preemption on a loaded host) is run again, up to this many times in all.
TSC_ATTEMPTS = 3

PART_A, PART_B = "mint-a", "mint-b"
VM_1, VM_2, HOG = "mint-1", "mint-2", "mint-hog"
DISK_0, DISK_1 = "mint-d0", "mint-d1"
PROBE_LEAF = "bench.probe"
MARGIN_MIB = 64
BLOCK = 4096
# The hog keeps its vCPU busy forever; setsid + closed stdio so guest-exec returns.
HOG_LOOP = ("setsid sh -c 'while :; do :; done' </dev/null >/dev/null 2>&1 & "
            "echo started")

FULL = ProbeParams(reps=10, m=200_000_000, n=200, l=20, sizes_kib=(256, 512, 1024))
QUICK = ProbeParams(reps=10, m=10_000_000, n=25, l=4, sizes_kib=(256, 512, 1024))
FULL_MEMORY_MIB, QUICK_MEMORY_MIB = 512, 256
FULL_TIMEOUT_S, QUICK_TIMEOUT_S = 1800.0, 300.0

# Short labels (plots) and what each configuration is (report).
CONFIGS: dict[int, tuple[str, str]] = {
    1: ("host", "probe on the host, no partition (any core)"),
    2: ("partition", "probe in partition mint-a (1 core)"),
    3: ("2 partitions", "probes in mint-a and mint-b (1 core each) at once, each its own "
                        "disk"),
    4: ("VM, 1 part. all cores", "one VM in one partition holding every core "
                                 "(\"unpartitioned\")"),
    5: ("VM, 1-core part.", "one VM in partition mint-a (1 core)"),
    6: ("2 VMs, 2 parts.", "one VM in each of mint-a and mint-b at once, each its own disk"),
    7: ("2 VMs, 1 part.", "two VMs at once in one partition holding every core, both disks"),
    8: ("VM + hog, other part.", "config 5's VM while a CPU-hog VM runs in mint-b"),
    9: ("VM + hog, same part.", "config 5's VM while a CPU-hog VM runs beside it in mint-a"),
}

Progress = Callable[[str], None]


@frozen
class Instance:
    """One probe of a configuration: on the host (vm None) or in a VM."""

    partition: str | None
    vm: str | None
    disk: Path                   # host path of the disk file it reads

    @property
    def where(self) -> str:
        if self.vm:
            return f"VM {self.vm}"
        return f"partition {self.partition}" if self.partition else "the host"


def disk_mib(params: ProbeParams) -> int:
    """Disk size: enough largest-size slots that an io run never reads a block twice."""
    largest_mib = max(params.sizes_kib) / 1024
    return max(64, int(params.io_slots() * largest_mib * 1.1) + 1)


def vm_mib(memory_mib: int, accel: str) -> int:
    return vm_footprint(VmRecord(name=VM_1, partition=PART_A, vcpus=1, memory_mib=memory_mib,
                                 accel_used=accel))


def run(parts: PartitionManager, vms: VmManager, quick: bool = False,
        disk_dir: Path | None = None, progress: Progress = lambda s: None) -> dict[str, Any]:
    accel = probe_accel("auto").name
    params = QUICK if quick else FULL
    memory = QUICK_MEMORY_MIB if quick else FULL_MEMORY_MIB
    cores = _check_host(parts, memory, accel)
    binary = probe_path(parts.paths.cache)   # refuses an image without the current probe
    bench = Bench(parts, vms, params, binary, accel, memory, cores,
                  disk_dir or default_dir(parts.paths) / "bench-mint",
                  QUICK_TIMEOUT_S if quick else FULL_TIMEOUT_S, progress)
    started = time.monotonic()
    try:
        bench.run_all()
    finally:
        progress("removing the scratch partitions, VMs and disks")
        bench.cleanup()
    image = find_image(parts.paths.cache)
    return {"meta": meta(accel, benchmark="mint", quick=quick, **params.as_json(),
                         guest_memory_mib=memory, vcpus=1, cores=cores,
                         disk_mib=disk_mib(params), disk_dir=str(bench.disk_dir),
                         disk_fs=_fs_type(bench.disk_dir), image_digest=image.digest,
                         probe_sha256=guest.source_sha256(),
                         duration_s=round(time.monotonic() - started, 1),
                         configs={str(k): {"label": v[0], "description": v[1]}
                                  for k, v in CONFIGS.items()}),
            "results": bench.rows}


def _check_host(parts: PartitionManager, memory: int, accel: str) -> list[int]:
    """Refuse before anything is made; return the two cores the partitions get."""
    existing = [p.name for p in parts.db.partitions()]
    if existing:
        raise ResourceError(f"the mint benchmark needs every core of this host but "
                            f"partition(s) {', '.join(existing)} exist; remove them first "
                            "(`fusuma down`).")
    if len(parts.host.cpus) < 2:
        raise ResourceError("the mint benchmark needs two cores (one per partition); "
                            f"this host has {len(parts.host.cpus)}.")
    need = _part_a_mib(memory, accel) + _part_b_mib(memory, accel)
    avail = parts.host.memory_available_for_partitions_mib
    if need > avail:
        raise ResourceError(f"the mint benchmark needs {need} MiB for its partitions but "
                            f"only {avail} MiB is available for partitions on this host.")
    return list(parts.host.cpus[:2])


def _part_a_mib(memory: int, accel: str) -> int:
    # two VMs at a time: mint-1 with mint-2 (config 7) or with the hog (config 9)
    return SUPERVISOR_MIB + 2 * vm_mib(memory, accel) + MARGIN_MIB


def _part_b_mib(memory: int, accel: str) -> int:
    return SUPERVISOR_MIB + vm_mib(memory, accel) + MARGIN_MIB


def _fs_type(path: Path) -> str:
    """Filesystem type of the mount holding ``path`` (from /proc/self/mounts)."""
    best, fs = "", "unknown"
    with contextlib.suppress(OSError):
        target = str(path.resolve())
        for line in Path("/proc/self/mounts").read_text().splitlines():
            fields = line.split()
            if len(fields) < 3:
                continue
            mnt = fields[1]
            if (target == mnt or target.startswith(mnt.rstrip("/") + "/")) and \
                    len(mnt) >= len(best):
                best, fs = mnt, fields[2]
    return fs


def fill_disk(path: Path, size_mib: int) -> None:
    """Write ``path`` so that every 4 KiB block starts with its own byte offset (what
    the probe's --verify checks) followed by random bytes, sync it, and drop it from
    the page cache."""
    filler = bytearray(os.urandom(1 << 20))
    with open(path, "xb") as f:
        for mib in range(size_mib):
            base = mib << 20
            for off in range(0, 1 << 20, BLOCK):
                struct.pack_into("<Q", filler, off, base + off)
            f.write(filler)
        f.flush()
        os.fsync(f.fileno())
    drop_cache(path)


def drop_cache(path: Path) -> None:
    """Evict the file's clean pages from the host page cache."""
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def qemu_cpu_s(pid: int) -> float:
    """utime + stime of a process, in seconds."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


class Bench:
    """The state of one run: what exists, and the result rows so far."""

    def __init__(self, parts: PartitionManager, vms: VmManager, params: ProbeParams,
                 binary: Path, accel: str, memory: int, cores: list[int], disk_dir: Path,
                 timeout: float, progress: Progress) -> None:
        self.parts, self.vms, self.params = parts, vms, params
        self.binary, self.accel, self.memory, self.cores = binary, accel, memory, cores
        self.disk_dir, self.timeout, self.say = disk_dir, timeout, progress
        self.disks = {DISK_0: disk_dir / f"{DISK_0}.img", DISK_1: disk_dir / f"{DISK_1}.img"}
        self.rows: list[dict[str, Any]] = []
        self._made_dir = False
        self._made_files: list[Path] = []
        self._procs: list[subprocess.Popen[bytes]] = []

    # -- the configurations ------------------------------------------------------------
    def run_all(self) -> None:
        self.make_disks()
        d0, d1 = self.disks[DISK_0], self.disks[DISK_1]
        self.measure(1, [Instance(None, None, d0)])

        a, b = self.cores
        self.parts.create(PartitionSpec(name=PART_A, cpus=[a],
                                        memory_mib=_part_a_mib(self.memory, self.accel)))
        self.parts.create(PartitionSpec(name=PART_B, cpus=[b],
                                        memory_mib=_part_b_mib(self.memory, self.accel)))
        self.add_disk(DISK_0, PART_A)
        self.add_disk(DISK_1, PART_B)
        self.measure(2, [Instance(PART_A, None, d0)])
        self.measure(3, [Instance(PART_A, None, d0), Instance(PART_B, None, d1)])

        self.boot(VM_1, PART_A, DISK_0)
        self.measure(5, [Instance(PART_A, VM_1, d0)])
        self.boot(HOG, PART_B, None)
        self.start_hog()
        self.measure(8, [Instance(PART_A, VM_1, d0)], hog=HOG)
        self.move(HOG, PART_A)
        self.measure(9, [Instance(PART_A, VM_1, d0)], hog=HOG)
        self.vms.delete(HOG, force=True)

        self.boot(VM_2, PART_B, DISK_1)
        self.measure(6, [Instance(PART_A, VM_1, d0), Instance(PART_B, VM_2, d1)])
        self.move(VM_2, PART_A)           # its disk d1 goes with it
        self.say(f"removing {PART_B}; {PART_A} takes every core")
        self.parts.delete(PART_B, force=True)
        self.parts.resize(PART_A, cpus=list(self.cores))
        self.measure(7, [Instance(PART_A, VM_1, d0), Instance(PART_A, VM_2, d1)])
        self.vms.delete(VM_2, force=True)
        self.measure(4, [Instance(PART_A, VM_1, d0)])
        self.rows.sort(key=lambda r: (r["config"], TESTS.index(r["test"]),
                                      r["size_kib"] or 0, r["partition"] or "",
                                      r["vm"] or ""))

    # -- set-up steps ------------------------------------------------------------------
    def make_disks(self) -> None:
        size = disk_mib(self.params)
        if not self.disk_dir.exists():
            self.disk_dir.mkdir(parents=True)
            self._made_dir = True
        for name, path in self.disks.items():
            if path.exists():
                raise HostError(f"{path} already exists (left by an earlier run?); remove "
                                "it and run the benchmark again.")
            self.say(f"writing disk {name}: {size} MiB at {path}")
            self._made_files.append(path)
            fill_disk(path, size)

    def add_disk(self, name: str, partition: str) -> None:
        # The file exists, so fusuma registers it without owning it: removing the
        # partition keeps the file, and cleanup() deletes it at the end.
        self.parts.add_disk(DiskSpec(name=name, path=str(self.disks[name]),
                                     partition=partition, size_mib=disk_mib(self.params)))

    def boot(self, vm: str, partition: str, disk: str | None) -> None:
        self.say(f"booting {vm} in {partition}")
        self.vms.create(VmSpec(name=vm, partition=partition, memory_mib=self.memory,
                               disks=[disk] if disk else []))
        self.vms.start(vm, wait_agent=120)

    def move(self, vm: str, partition: str) -> None:
        """Move running ``vm`` (and its disks) to ``partition``, zero-copy: the same
        guest, without a new boot."""
        self.say(f"moving {vm} to {partition}")
        migrate(self.parts, vm, partition, "zero-copy")

    def start_hog(self) -> None:
        out = self.vms.exec(HOG, ["/bin/sh", "-c", HOG_LOOP], timeout=60)
        if out.exit_code != 0 or b"started" not in out.stdout:
            raise ProbeError(f"the CPU hog did not start in VM {HOG}: "
                             f"{out.stderr.decode(errors='replace').strip()}")

    # -- measuring ---------------------------------------------------------------------
    def measure(self, config: int, instances: list[Instance], hog: str | None = None) -> None:
        hog_pid = self.parts.db.vm(hog).pid if hog else None
        for test in TESTS:
            where = ", ".join(i.where for i in instances)
            self.say(f"config {config} ({CONFIGS[config][0]}): {test} in {where}")
            if test == "io":
                for i in instances:
                    drop_cache(i.disk)
            for attempt in range(1, TSC_ATTEMPTS + 1):
                cpu0, t0 = (qemu_cpu_s(hog_pid), time.monotonic()) if hog_pid else (0.0, 0.0)
                if instances[0].vm is None:
                    outputs = self.run_host(instances, test)
                else:
                    outputs = self.run_guests(instances, test)
                hog_pct = None
                if hog_pid:
                    hog_pct = round(100 * (qemu_cpu_s(hog_pid) - cpu0)
                                    / (time.monotonic() - t0), 1)
                try:
                    parsed = [parse_output(text, test, self.params, inst.where)
                              for inst, text in zip(instances, outputs, strict=True)]
                    break
                except TscMismatch as exc:
                    if attempt == TSC_ATTEMPTS:
                        raise
                    self.say(f"  {exc} Running it again ({attempt + 1} of "
                             f"{TSC_ATTEMPTS}).")
            for inst, lines in zip(instances, parsed, strict=True):
                for line in lines:
                    s = line.summary()
                    self.rows.append({"config": config, "test": s.pop("test"),
                                      "size_kib": s.pop("size_kib"), "vm": inst.vm,
                                      "partition": inst.partition, **s,
                                      "hog": hog, "hog_cpu_pct": hog_pct})
                    ms = s["median_ns"] / 1e6
                    self.say(f"  {inst.where}: {test} "
                             f"{'' if line.size_kib is None else f'{line.size_kib} KiB '}"
                             f"median {ms:.3f} ms"
                             + (f" (hog at {hog_pct}% of a core)" if hog_pct is not None
                                else ""))

    def _argv(self, binary: str, test: str, disk: str) -> list[str]:
        return probe_argv(binary, test, self.params, disk, seed=random.getrandbits(62))

    def run_host(self, instances: list[Instance], test: str) -> list[str]:
        """Run the host probe for each instance at once (in its partition's leaf
        cgroup, or where this process is) and return their outputs."""
        cg = self.parts.cg
        procs: list[subprocess.Popen[bytes]] = []
        with tempfile.TemporaryDirectory(prefix="fusuma-mint-") as tmp:
            outs = [Path(tmp) / f"{n}.out" for n in range(len(instances))]
            errs = [Path(tmp) / f"{n}.err" for n in range(len(instances))]
            try:
                for inst, out, err in zip(instances, outs, errs, strict=True):
                    argv = self._argv(str(self.binary), test, str(inst.disk))
                    preexec = None
                    if inst.partition is not None:
                        cg.create_leaf(inst.partition, PROBE_LEAF)
                        preexec = _into(cg, inst.partition)
                    with out.open("wb") as fo, err.open("wb") as fe:
                        try:
                            # Only this thread runs now: preexec_fn is safe.
                            p = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=fo,
                                                 stderr=fe, close_fds=True,
                                                 preexec_fn=preexec)
                        except (OSError, subprocess.SubprocessError) as exc:
                            raise ProbeError(f"cannot start the probe in {inst.where}: "
                                             f"{exc}.") from exc
                    procs.append(p)
                    self._procs.append(p)
                deadline = time.monotonic() + self.timeout
                for inst, p, err in zip(instances, procs, errs, strict=True):
                    try:
                        code = p.wait(timeout=max(0.1, deadline - time.monotonic()))
                    except subprocess.TimeoutExpired as exc:
                        raise ProbeError(f"the probe in {inst.where} did not finish within "
                                         f"{self.timeout:.0f} s.") from exc
                    if code != 0:
                        raise ProbeError(f"the probe in {inst.where} exited {code}: "
                                         f"{err.read_text(errors='replace').strip()}")
                return [o.read_text() for o in outs]
            finally:
                self._end(procs)
                for inst in instances:
                    if inst.partition is not None:
                        cg.delete_leaf(inst.partition, PROBE_LEAF)

    def run_guests(self, instances: list[Instance], test: str) -> list[str]:
        """Run the probe in each instance's VM at once (guest-exec) and return their
        outputs. Threads: each talks to its supervisor over its own socket."""
        gate = threading.Barrier(len(instances))
        results: list[str | BaseException] = [ProbeError("not run")] * len(instances)
        argvs = [self._argv(GUEST_PROBE, test, GUEST_DISK) for _ in instances]

        def one(n: int, inst: Instance) -> None:
            try:
                client = SupervisorClient(self.parts.paths, inst.partition or "")
                gate.wait(timeout=30)
                res = client.send(rpc.Exec(str(inst.vm), argvs[n],
                                           timeout=self.timeout),
                                  timeout=self.timeout + 30)
                out = base64.b64decode(res.stdout).decode(errors="replace")
                err = base64.b64decode(res.stderr).decode(errors="replace").strip()
                if res.exit_code != 0:
                    raise ProbeError(f"the probe in {inst.where} exited "
                                     f"{res.exit_code}: {err}")
                results[n] = out
            except BaseException as exc:
                results[n] = exc

        threads = [threading.Thread(target=one, args=(n, i), daemon=True)
                   for n, i in enumerate(instances)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        for r in results:
            if isinstance(r, BaseException):
                raise r
        return [str(r) for r in results]

    # -- cleanup -----------------------------------------------------------------------
    def _end(self, procs: list[subprocess.Popen[bytes]]) -> None:
        """Kill and reap the host probes we started that still run."""
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
            if p in self._procs:
                self._procs.remove(p)

    def cleanup(self) -> None:
        self._end(list(self._procs))
        for name in (PART_A, PART_B):
            if self.parts.db.find_partition(name) is None:
                continue
            try:
                self.parts.delete(name, force=True)
            except FusumaError as exc:
                self.say(f"cleanup of partition {name} failed: {exc}")
                LOG.warning("cleanup of partition %s failed: %s", name, exc)
        for path in self._made_files:
            with contextlib.suppress(FileNotFoundError):
                path.unlink()
        if self._made_dir:
            shutil.rmtree(self.disk_dir, ignore_errors=True)


def _into(cg: CgroupDriver, partition: str) -> Callable[[], None]:
    """preexec_fn: move the child into the partition's probe leaf before it execs."""
    def attach() -> None:
        cg.attach(partition, PROBE_LEAF, os.getpid())
    return attach
