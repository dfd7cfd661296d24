"""Per-process memory as the kernel accounts it to the process, not to a cgroup.

cgroups charge a page to whoever touched it first and never move the charge, so after
a zero-copy migration the source partition's cgroup still holds the charge for guest
RAM that the destination QEMU now uses. ``/proc/PID/smaps_rollup`` follows the
process instead: PSS splits shared pages fairly among the processes mapping them.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class ProcessMemory:
    rss_kib: int
    pss_kib: int
    pss_anon_kib: int
    pss_file_kib: int
    pss_shmem_kib: int

    def as_json(self) -> dict[str, float]:
        return {"rss_mib": round(self.rss_kib / 1024, 1),
                "pss_mib": round(self.pss_kib / 1024, 1),
                "pss_anon_mib": round(self.pss_anon_kib / 1024, 1),
                "pss_file_mib": round(self.pss_file_kib / 1024, 1),
                "pss_shmem_mib": round(self.pss_shmem_kib / 1024, 1)}


def parse_smaps_rollup(text: str) -> ProcessMemory:
    vals: dict[str, int] = {}
    for line in text.splitlines():
        parts = line.split()
        if len(parts) >= 2 and parts[0].endswith(":") and parts[1].isdigit():
            vals[parts[0][:-1]] = int(parts[1])
    return ProcessMemory(rss_kib=vals.get("Rss", 0), pss_kib=vals.get("Pss", 0),
                         pss_anon_kib=vals.get("Pss_Anon", 0),
                         pss_file_kib=vals.get("Pss_File", 0),
                         pss_shmem_kib=vals.get("Pss_Shmem", 0))


def process_memory(pid: int, procfs: Path = Path("/proc")) -> ProcessMemory | None:
    try:
        return parse_smaps_rollup((procfs / str(pid) / "smaps_rollup").read_text())
    except OSError:
        return None
