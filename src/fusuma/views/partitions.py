"""Partitions as `fusuma partition list --json` (and `ps --json`) show them."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

from fusuma.ops.context import Ctx
from fusuma.views.jobs import job_json

if TYPE_CHECKING:
    from fusuma.state import VmRecord


def partitions_data(c: Ctx, jobs: dict[str, dict[str, Any]] | None = None
                    ) -> list[dict[str, Any]]:
    """What `partition list --json` prints (and `ps --json` under "partitions")."""
    from fusuma.partition.liveness import supervisor_pid
    from fusuma.qemu.versions import known_version

    if jobs is None:
        jobs = {j.obj: job_json(j) for j in c.db.jobs()}
    parts = []
    vms = c.db.vms()
    for p in c.db.partitions():
        pid = supervisor_pid(c.paths, p.name, p.supervisor_pid)
        parts.append({"name": p.name, "cpus": p.cpus, "memory_mib": p.memory_mib,
                      "supervisor_pid": pid,
                      "state": "running" if pid is not None else "supervisor-down",
                      "qemu": p.qemu, "qemu_version": known_version(c.paths, p.qemu),
                      "io_weight": p.io_weight,
                      "disks": [d.name for d in c.db.disks(p.name)],
                      "memory_use": memory_use(c, p.name, [v for v in vms
                                                           if v.partition == p.name]),
                      "cores_held_by": cores_held_by(c, p.name),
                      "job": jobs.get(f"partition:{p.name}")})
    return parts


def cores_held_by(c: Ctx, partition: str) -> str | None:
    """What keeps the partition's cores to itself, read from the kernel: "cpuset
    partition root" (or "isolated"), "exclusive cpuset" or "shared"; None when its
    cgroup is not there (e.g. its systemd unit is stopped and it has no VM)."""
    from fusuma.errors import FusumaError
    from fusuma.host import cgroups

    try:
        return cgroups.for_paths(c.paths).cores_held_by(partition)
    except FusumaError:
        return None


def memory_use(c: Ctx, partition: str, vms: list[VmRecord]) -> dict[str, Any]:
    """What the kernel counts, in MiB: the guest RAM of the partition's VMs (the shmem
    charged to each RAM file's own memory cgroup) and the partition's other use (its
    cgroup: supervisor, QEMUs, private guest RAM; on cgroup v1 QEMUs sit in their RAM
    file's group, and their part of it is counted here). None where the kernel has no
    counter."""
    from fusuma.errors import FusumaError
    from fusuma.host import cgroups

    try:
        cg = cgroups.for_paths(c.paths)
        other_b = cg.memory_current(partition)
    except FusumaError:
        return {"guest_ram_mib": None, "other_mib": None}
    ram = 0
    for v in vms:
        if v.ram_path and v.shared_ram:
            stem = Path(v.ram_path).name.removesuffix(".ram")
            total = cg.ram_charged(stem) or 0
            shmem = cg.ram_shmem(stem)
            shmem = total if shmem is None else min(shmem, total)
            ram += shmem
            other_b += total - shmem
    return {"guest_ram_mib": round(ram / 2**20, 1), "other_mib": round(other_b / 2**20, 1)}
