"""`fusuma bench boot`: time from `vm start` to the guest agent answering.

N VMs are started together in a scratch partition made of the cores no other
partition holds; each VM's time is measured from just before its start request to
the moment its guest agent answers a ping. Everything the benchmark made is removed
afterwards, also when it fails.
"""

from __future__ import annotations

import contextlib
import statistics
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

from fusuma.capacity import SUPERVISOR_MIB
from fusuma.errors import FusumaError, ResourceError
from fusuma.host.accel import probe_accel
from fusuma.partition.manager import PartitionManager
from fusuma.qemu.cmdline import overhead_mib
from fusuma.spec import PartitionSpec, VmSpec
from fusuma.supervisor import rpc
from fusuma.vm import VmManager
from fusuma_bench.report import meta

PARTITION = "bench-boot"


def free_cores(parts: PartitionManager, who: str) -> list[int]:
    """The cores no partition holds; one sentence naming ``who`` if there are none."""
    used = {c for p in parts.db.partitions() for c in p.cpus}
    free = [c for c in parts.host.cpus if c not in used]
    if not free:
        raise ResourceError(f"every core belongs to a partition; {who} needs a free core "
                            "(run `fusuma down` first).")
    return free


@contextlib.contextmanager
def scratch_partition(parts: PartitionManager, name: str, vms: int, memory_mib: int,
                      who: str, progress: Callable[[str], None]) -> Iterator[list[int]]:
    """A partition ``name`` on the free cores, sized for ``vms`` VMs of ``memory_mib``;
    its cores. Deleted with its VMs when the block ends, also on failure."""
    free = free_cores(parts, who)
    accel = probe_accel("auto").name
    mem = SUPERVISOR_MIB + vms * (memory_mib + overhead_mib(accel)) + 64
    parts.create(PartitionSpec(name=name, cpus=free, memory_mib=mem))
    try:
        yield free
    finally:
        try:
            parts.delete(name, force=True)
        except FusumaError as exc:
            progress(f"cleanup failed: {exc}")


def run(parts: PartitionManager, vms: VmManager, n: int, runs: int = 3,
        memory_mib: int = 256, timeout: float = 180.0,
        progress: Callable[[str], None] = lambda s: None) -> dict[str, Any]:
    accel = probe_accel("auto").name
    names = [f"bench-boot-{i}" for i in range(n)]
    results: list[dict[str, Any]] = []
    with scratch_partition(parts, PARTITION, n, memory_mib, "the boot benchmark",
                           progress) as free:
        for name in names:
            vms.create(VmSpec(name=name, partition=PARTITION, memory_mib=memory_mib))
        for r in range(runs):
            progress(f"run {r + 1}/{runs}: starting {n} VM(s) on cores {free}")
            results += one_run(vms, PARTITION, names, r, timeout)
            for name in names:
                vms.stop(name, timeout=5)
    times = [x["boot_ms"] for x in results]
    return {"meta": meta(accel, benchmark="boot", vms=n, runs=runs,
                         guest_memory_mib=memory_mib, cores=free),
            "results": results,
            "summary": {"median_boot_ms": round(statistics.median(times), 1),
                        "min_boot_ms": round(min(times), 1),
                        "max_boot_ms": round(max(times), 1)}}


def one_run(vms: VmManager, partition: str, names: list[str], run: int,
            timeout: float) -> list[dict[str, Any]]:
    """Start the VMs ``names`` of ``partition`` together; each one's time from its start
    request to its guest agent answering."""
    t0: dict[str, float] = {}
    done: dict[str, float] = {}
    errors: list[BaseException] = []

    client = vms.parts.client(partition)   # threads must not share the DB connection

    def wait(name: str) -> None:
        try:
            client.send(rpc.WaitAgent(name, timeout=timeout), timeout=timeout + 10)
            done[name] = time.monotonic()
        except BaseException as exc:
            errors.append(exc)

    threads = []
    for name in names:
        t0[name] = time.monotonic()
        vms.start(name)
        th = threading.Thread(target=wait, args=(name,))
        th.start()
        threads.append(th)
    for th in threads:
        th.join()
    if errors:
        raise errors[0]
    return [{"vm": n, "run": run, "boot_ms": round((done[n] - t0[n]) * 1000, 1)}
            for n in names]
