"""Memory shared between VMs: the share report, a process's mapping analysis, and the
host's KSM.

``FUSUMA_KSM_ROOT`` moves the KSM sysfs directory (default /sys/kernel/mm/ksm); it
exists for tests, which point it at a fake tree instead of the host's real settings.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from fusuma.errors import SpecError, StateError
from fusuma.memshare.bases import BaseUse, BaseUser, bases_in_use
from fusuma.memshare.ksm import DEFAULT_ROOT, Ksm
from fusuma.memshare.report import HostReport, host_report
from fusuma.memshare.smaps import ModeAnalysis, analyze
from fusuma.ops.context import Ctx
from fusuma.vm import VmView

# VM states in which its QEMU process exists.
LIVE = ("running", "migrating", "stopping")


def ksm_root() -> Path:
    """The KSM sysfs directory (FUSUMA_KSM_ROOT for tests)."""
    return Path(os.environ.get("FUSUMA_KSM_ROOT", str(DEFAULT_ROOT)))


def host_ksm() -> Ksm:
    """The host's KSM settings and counters, to read or to change."""
    return Ksm(ksm_root())


def running_vms(c: Ctx) -> list[tuple[str, int]]:
    """(name, QEMU pid) of every VM whose QEMU process is alive."""
    out = []
    for rec in c.db.vms():
        if rec.pid is not None and VmView(rec).state in LIVE:
            out.append((rec.name, rec.pid))
    return out


def base_users(c: Ctx) -> list[BaseUser]:
    """Every running VM that boots from a thin disk on an imported image."""
    return [BaseUser(rec.name, rec.pid, rec.image) for rec in c.db.vms()
            if rec.pid is not None and rec.boot != "kernel" and VmView(rec).state in LIVE]


def bases(c: Ctx) -> tuple[BaseUse, ...]:
    """The page-cache sharing of each imported image that running VMs boot from."""
    return tuple(bases_in_use(c.db.images(), base_users(c)))


def segment_files(c: Ctx) -> dict[str, Path]:
    """Each segment's erofs file, by name."""
    d = c.paths.segments_dir
    return {p.stem: p for p in sorted(d.glob("*.erofs"))} if d.is_dir() else {}


def report_data(c: Ctx) -> dict[str, Any]:
    """What `share report --json` prints."""
    rep: HostReport = host_report(running_vms(c), segment_files(c), ksm_root=ksm_root(),
                                  bases=bases(c))
    return rep.as_json()


def analysis(c: Ctx, pid: int | None, vm_name: str | None) -> ModeAnalysis:
    """Resident memory by mapping mode of process PID, or of VM ``vm_name``'s QEMU."""
    if (pid is None) == (vm_name is None):
        raise SpecError("give either a PID or --vm VM (one of them), e.g. "
                        "`fusuma share analyze --vm web1`.")
    if vm_name is not None:
        rec = c.db.vm(vm_name)
        state = VmView(rec).state
        if rec.pid is None or state not in LIVE:
            raise StateError(f"VM {vm_name!r} is {state}, so it has no QEMU process to "
                             f"analyze; start it with `fusuma vm start {vm_name}`.")
        pid = rec.pid
    assert pid is not None
    return analyze(pid)


def analyze_data(c: Ctx, pid: int | None, vm_name: str | None) -> dict[str, Any]:
    """What `share analyze --json` prints."""
    return analysis(c, pid, vm_name).as_json()
