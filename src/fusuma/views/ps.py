"""The `ps` view: every partition and VM with its state, jobs and memory."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from fusuma.ops.context import Ctx
from fusuma.views.jobs import job_json
from fusuma.views.partitions import partitions_data

if TYPE_CHECKING:
    from fusuma.state import VmRecord


def ram_use(cg: Any, v: VmRecord) -> dict[str, Any]:
    """A VM's guest RAM on the host, in MiB: resident (the RAM file's allocated blocks,
    or QEMU's anonymous memory for private RAM) and, with page reporting, what it handed
    back since its peak (its RAM group's high-water mark less its usage now)."""
    from fusuma.memshare import reporting

    # A clone carries its template's balloon (devices must match), driver unbound.
    on = False if v.template is not None else (
        reporting.recorded(v) if v.devices else bool(v.page_reporting))
    out: dict[str, Any] = {"page_reporting": on,
                           "resident_mib": None, "returned_mib": None}
    if v.state.value not in ("running", "paused", "migrating", "stopping"):
        return out
    got = reporting.resident_bytes(v, v.pid)
    out["resident_mib"] = None if got is None else round(got / 2**20, 1)
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
    from fusuma.vm.view import views_json

    jobs = {j.obj: job_json(j) for j in c.db.jobs()}
    parts = [] if vms_only else partitions_data(c, jobs)
    from fusuma.errors import FusumaError
    from fusuma.host import cgroups

    records = c.db.vms()
    vms = views_json(records, c.paths.segments_dir, memory=memory)
    try:
        cg: Any = cgroups.for_paths(c.paths)
    except FusumaError:
        cg = None
    by_name = {r.name: r for r in records}
    for v in vms:
        v["job"] = jobs.get(f"vm:{v['name']}")
        v["ram"] = ram_use(cg, by_name[v["name"]])
    return {"partitions": parts, "vms": vms}
