"""`fusuma bench boot`: time from `vm start` to the guest agent answering.

N VMs are started together in a scratch partition made of the cores no other
partition holds; each VM's time is measured from just before its start request to
the moment its guest agent answers a ping. Everything the benchmark made is removed
afterwards, also when it fails.
"""

from __future__ import annotations

import statistics
import threading
import time
from collections.abc import Callable
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


def run(parts: PartitionManager, vms: VmManager, n: int, runs: int = 3,
        memory_mib: int = 256, timeout: float = 180.0,
        progress: Callable[[str], None] = lambda s: None) -> dict[str, Any]:
    accel = probe_accel("auto").name
    used = {c for p in parts.db.partitions() for c in p.cpus}
    free = [c for c in parts.host.cpus if c not in used]
    if not free:
        raise ResourceError("every core belongs to a partition; the boot benchmark needs a "
                            "free core (run `fusuma down` first).")
    mem = SUPERVISOR_MIB + n * (memory_mib + overhead_mib(accel)) + 64
    names = [f"bench-boot-{i}" for i in range(n)]
    results: list[dict[str, Any]] = []
    parts.create(PartitionSpec(name=PARTITION, cpus=free, memory_mib=mem))
    try:
        for name in names:
            vms.create(VmSpec(name=name, partition=PARTITION, memory_mib=memory_mib))
        for r in range(runs):
            progress(f"run {r + 1}/{runs}: starting {n} VM(s) on cores {free}")
            results += _one_run(vms, names, r, timeout)
            for name in names:
                vms.stop(name, timeout=5)
    finally:
        try:
            parts.delete(PARTITION, force=True)
        except FusumaError as exc:
            progress(f"cleanup failed: {exc}")
    times = [x["boot_ms"] for x in results]
    return {"meta": meta(accel, benchmark="boot", vms=n, runs=runs,
                         guest_memory_mib=memory_mib, cores=free),
            "results": results,
            "summary": {"median_boot_ms": round(statistics.median(times), 1),
                        "min_boot_ms": round(min(times), 1),
                        "max_boot_ms": round(max(times), 1)}}


def _one_run(vms: VmManager, names: list[str], run: int,
             timeout: float) -> list[dict[str, Any]]:
    t0: dict[str, float] = {}
    done: dict[str, float] = {}
    errors: list[BaseException] = []

    client = vms.parts.client(PARTITION)   # threads must not share the DB connection

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
