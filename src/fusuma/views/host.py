"""The whole host at once: the `ps` view (every partition and VM with its state, jobs
and memory), the partitions as `partition list --json` shows them, and the operation
holding an object (a job). One module: `fusuma ps` imports only this one."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from fusuma.ops.context import Ctx

if TYPE_CHECKING:
    from fusuma.state import Job, VmRecord


def job_json(j: Job) -> dict[str, Any]:
    """The operation holding an object: what it does, its phase, since when, by which
    pid, and whether that pid still lives (a dead one is being recovered)."""
    return {"kind": j.kind, "phase": j.phase, "peer": j.peer, "since": j.started_at,
            "owner_pid": j.owner.pid, "owner_alive": j.owner.alive()}


def partitions_data(c: Ctx, jobs: dict[str, dict[str, Any]] | None = None,
                    vms: list[VmRecord] | None = None,
                    resident: dict[str, float | None] | None = None
                    ) -> list[dict[str, Any]]:
    """What `partition list --json` prints (and `ps --json` under "partitions").
    ``vms`` and ``resident``: the VM records and their guest RAM (read_resident_mib())
    when the caller shows them too, so that a partition's sums are those of the rows
    shown; read here otherwise."""
    records = c.db.partitions()
    if not records:
        return []       # an empty host: nothing more to read, or to import
    from fusuma.partition.liveness import supervisor_pid
    from fusuma.qemu.versions import known_version

    if jobs is None:
        jobs = {j.obj: job_json(j) for j in c.db.jobs()}
    parts = []
    if vms is None:
        vms = c.db.vms()
    if resident is None:
        resident = read_resident_mib(vms)
    from fusuma import capacity

    ocs = capacity.overcommits(c.db)
    for p in records:
        pid = supervisor_pid(c.paths, p.name, p.supervisor_pid)
        parts.append({"name": p.name, "cpus": p.cpus, "memory_mib": p.memory_mib,
                      "supervisor_pid": pid,
                      "state": "running" if pid is not None else "supervisor-down",
                      "qemu": p.qemu, "qemu_version": known_version(c.paths, p.qemu),
                      "io_weight": p.io_weight,
                      "disks": [d.name for d in c.db.disks(p.name)],
                      "memory_use": memory_use(c, p.name, [v for v in vms
                                                           if v.partition == p.name]),
                      "memory_overcommit": ocs[p.name],
                      "memory_admission": partition_admission(
                          [v for v in vms if v.partition == p.name], ocs[p.name],
                          resident),
                      "cores_held_by": cores_held_by(c, p.name),
                      "job": jobs.get(f"partition:{p.name}")})
    return parts


def read_resident_mib(vms: list[VmRecord]) -> dict[str, float | None]:
    """The guest RAM each running VM holds on the host now, in MiB, by name; None for a
    VM that does not run (fusuma.memshare.reporting: its RAM file's allocated blocks,
    or its QEMU's anonymous memory for private RAM). Read once per view: a guest that
    touches its RAM between two readings would show a VM holding more than its
    partition."""
    if not vms:
        return {}       # nothing to read, or to import
    from fusuma.memshare import reporting

    out: dict[str, float | None] = {}
    for v in vms:
        got = (reporting.resident_bytes(v, v.pid)
               if v.state.value in ("running", "paused", "migrating", "stopping") else None)
        out[v.name] = None if got is None else round(got / 2**20, 1)
    return out


def vm_admission(v: VmRecord, overcommit: float,
                 resident_mib: float | None) -> dict[str, Any]:
    """A VM's memory as admitted (fusuma.capacity), in MiB: its class and floor, what
    was admitted for it at its partition's overcommit, what it holds now (None when it
    does not run) and how much of that the memory governor may take back."""
    from fusuma import capacity

    return {"class": v.memory_class, "floor_mib": capacity.memory_floor(v),
            "admitted_mib": capacity.admitted_ram(v, overcommit),
            "resident_mib": resident_mib,
            "reclaimable_mib": (capacity.reclaimable_mib(v, resident_mib)
                                if resident_mib is not None else None)}


def partition_admission(vms: list[VmRecord], overcommit: float,
                        resident: dict[str, float | None]) -> dict[str, Any]:
    """A partition's VMs' guest RAM, summed: RAM asked for, admitted, resident now and
    reclaimable now (MiB, from ``resident``: read_resident_mib(); VMs that do not run
    hold and give nothing)."""
    rows = [vm_admission(v, overcommit, resident[v.name]) for v in vms]
    return {"ram_mib": sum(v.memory_mib for v in vms),
            "admitted_mib": sum(r["admitted_mib"] for r in rows),
            "resident_mib": round(sum(r["resident_mib"] or 0.0 for r in rows), 1),
            "reclaimable_mib": round(sum(r["reclaimable_mib"] or 0.0 for r in rows), 1)}


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


def ram_use(cg: Any, v: VmRecord, resident: float | None) -> dict[str, Any]:
    """A VM's guest RAM on the host, in MiB: resident (``resident``: its
    read_resident_mib()) and, with page reporting, what it handed back since its peak
    (its RAM group's high-water mark less its usage now)."""
    from fusuma.memshare import reporting

    # A clone carries its template's balloon (devices must match), driver unbound.
    on = False if v.template is not None else (
        reporting.recorded(v) if v.devices else bool(v.page_reporting))
    out: dict[str, Any] = {"page_reporting": on,
                           "resident_mib": None, "returned_mib": None}
    if v.state.value not in ("running", "paused", "migrating", "stopping"):
        return out
    out["resident_mib"] = resident
    if out["page_reporting"] and v.ram_path and v.shared_ram and cg is not None:
        stem = Path(v.ram_path).name.removesuffix(".ram")
        peak, now = cg.ram_peak(stem), cg.ram_charged(stem)
        if peak is not None and now is not None:
            out["returned_mib"] = round(max(0, peak - now) / 2**20, 1)
    return out


def ps_data(c: Ctx, vms_only: bool = False,
            memory: Callable[[str, int], dict[str, Any] | None] | None = None
            ) -> dict[str, Any]:
    """What `ps --json` prints, read fresh from the DB and /proc every time (no cache:
    a QEMU killed a moment ago shows as crashed). ``memory``: a recent reading of each
    QEMU's host memory (the API daemon's sampler) instead of reading it now."""
    jobs = {j.obj: job_json(j) for j in c.db.jobs()}
    records = c.db.vms()
    # Each VM's guest RAM read once, for its row and its partition's sums alike.
    resident = read_resident_mib(records)
    parts = [] if vms_only else partitions_data(c, jobs, records, resident)
    from fusuma.views.networks import networks_data, nics_by_vm, present_taps

    # The kernel's taps, read once for the networks and the VMs (when any NIC exists).
    taps = present_taps() if c.db.nics() else set()
    nets = [] if vms_only else networks_data(c, taps)
    if not records:
        return {"partitions": parts, "vms": [], "networks": nets}
    from fusuma.errors import FusumaError
    from fusuma.host import cgroups
    from fusuma.vm.view import views_json

    vms = views_json(records, c.paths.segments_dir, memory=memory)
    try:
        cg: Any = cgroups.for_paths(c.paths)
    except FusumaError:
        cg = None
    by_name = {r.name: r for r in records}
    nics = nics_by_vm(c.db, records, taps)
    from fusuma import capacity

    ocs = capacity.overcommits(c.db)
    for v in vms:
        rec = by_name[v["name"]]
        v["job"] = jobs.get(f"vm:{v['name']}")
        v["ram"] = ram_use(cg, rec, resident[rec.name])
        v["memory"] = vm_admission(rec, ocs.get(rec.partition, 1.0), resident[rec.name])
        v["nics"] = nics[v["name"]]
    return {"partitions": parts, "vms": vms, "networks": nets}
