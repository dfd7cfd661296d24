"""Host memory of each VM and of the host, and what each sharing mechanism saves.

Per VM (its QEMU process): PSS split into anon/file/shmem, pages merged by KSM, and its
part of each shared segment. For the host: the VMs' total PSS and RSS and the saving of
each mechanism:

- ``segments``: sum over VMs of segment RSS minus sum of segment PSS, i.e. what the
  VMs' separate copies of the segment pages would cost beyond what they cost now;
- ``ksm``: (pages_sharing + ksm_zero_pages) * page size from sysfs. Host-wide: it also
  counts any non-VM process with mergeable memory;
- ``ksm_vm_profit``: the sum of the VMs' ``ksm_process_profit`` (saving minus KSM's
  metadata), when the kernel reports it;
- ``templates``: sum over clones of template-file RSS minus PSS (what separate copies
  of the pages they share would cost);
- ``bases``: sum over the imported images that running VMs boot from of (n - 1) x the
  base file's bytes in the host's page cache, for n VMs whose QEMU holds it
  (fusuma.memshare.bases says exactly what this counts).

Each VM's PSS is also split by where its pages come from (``split_mib``): ``template``
(its part of its template's file), ``segments`` (its part of the segments), ``ksm``
(its part of the pages KSM merged: their size divided by the mean number of pages
sharing a KSM page, host-wide, at least 2) and ``private`` (the rest: its own pages).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from fusuma.errors import NotFoundError
from fusuma.frozen import frozen
from fusuma.memshare.bases import BaseUse, bases_json, bases_saved_bytes
from fusuma.memshare.ksm import DEFAULT_ROOT, Ksm, KsmSettings, ProcessKsm, process_ksm
from fusuma.memshare.smaps import (
    PssSplit,
    SegmentUse,
    TemplateUse,
    pss_split,
    read_smaps,
    segment_usage,
    template_usage,
)


def _mib_kib(kib: int) -> float:
    return round(kib / 1024, 1)


def _mib_b(nbytes: int | None) -> float | None:
    return None if nbytes is None else round(nbytes / 2**20, 1)


@frozen
class VmMemory:
    """Host memory of one QEMU process."""

    pid: int
    split: PssSplit
    ksm: ProcessKsm | None
    segments: dict[str, SegmentUse]
    page_size: int
    template: TemplateUse | None = None
    # Mean number of pages that share one KSM page, host-wide (None: unknown, take 2).
    ksm_sharers: float | None = None

    @property
    def segments_rss_kib(self) -> int:
        return sum(s.rss_kib for s in self.segments.values())

    @property
    def segments_pss_kib(self) -> int:
        return sum(s.pss_kib for s in self.segments.values())

    @property
    def ksm_merged_bytes(self) -> int | None:
        if self.ksm is None or self.ksm.merging_pages is None:
            return None
        return self.ksm.merging_pages * self.page_size

    def split_kib(self) -> dict[str, int]:
        """PSS by where the pages come from: private, template, segments, ksm."""
        template = self.template.pss_kib if self.template else 0
        merged = (self.ksm_merged_bytes or 0) // 1024
        ksm = int(merged / max(2.0, self.ksm_sharers or 2.0))
        rest = self.split.pss_kib - template - self.segments_pss_kib
        ksm = max(0, min(ksm, rest))
        return {"private": max(0, rest - ksm), "template": template,
                "segments": self.segments_pss_kib, "ksm": ksm}

    def as_json(self) -> dict[str, Any]:
        sp = self.split
        return {"pid": self.pid, "rss_mib": _mib_kib(sp.rss_kib),
                "pss_mib": _mib_kib(sp.pss_kib), "pss_anon_mib": _mib_kib(sp.anon_kib),
                "pss_file_mib": _mib_kib(sp.file_kib),
                "pss_shmem_mib": _mib_kib(sp.shmem_kib), "split_source": sp.source,
                "ksm_merged_mib": _mib_b(self.ksm_merged_bytes),
                "ksm_profit_mib": _mib_b(self.ksm.process_profit if self.ksm else None),
                "segments": {n: s.as_json() for n, s in self.segments.items()},
                "segments_rss_mib": _mib_kib(self.segments_rss_kib),
                "segments_pss_mib": _mib_kib(self.segments_pss_kib),
                "template": None if self.template is None else self.template.as_json(),
                "split_mib": {k: _mib_kib(v) for k, v in self.split_kib().items()}}


def vm_memory(pid: int, segment_files: dict[str, Path], procfs: Path = Path("/proc"),
              page_size: int | None = None, *, clone: bool = False,
              ksm_sharers: float | None = None) -> VmMemory:
    """Host memory of the QEMU process ``pid``; NotFoundError if it is gone.

    The full smaps (hundreds of mappings to parse: ~10 ms for a QEMU) is read only when
    the VM has segments or (``clone``) a template's file to find in it; otherwise
    smaps_rollup has everything (`fusuma ps` reads this for every running VM)."""
    mappings = read_smaps(pid, procfs) if segment_files or clone else None
    return VmMemory(pid=pid, split=pss_split(pid, mappings, procfs),
                    ksm=process_ksm(pid, procfs),
                    segments=segment_usage(mappings, segment_files) if mappings else {},
                    page_size=page_size or os.sysconf("SC_PAGE_SIZE"),
                    template=template_usage(mappings) if mappings else None,
                    ksm_sharers=ksm_sharers)


@frozen
class VmRow:
    name: str
    memory: VmMemory


@frozen
class Skipped:
    """A VM listed as running whose process could not be read (it ended meanwhile)."""

    name: str
    reason: str


@frozen
class HostReport:
    vms: list[VmRow]
    skipped: list[Skipped]
    ksm: KsmSettings | None      # None: no KSM on this host
    bases: tuple[BaseUse, ...] = ()

    @property
    def total_pss_kib(self) -> int:
        return sum(r.memory.split.pss_kib for r in self.vms)

    @property
    def total_rss_kib(self) -> int:
        return sum(r.memory.split.rss_kib for r in self.vms)

    @property
    def segments_saved_kib(self) -> int:
        return sum(r.memory.segments_rss_kib - r.memory.segments_pss_kib for r in self.vms)

    @property
    def ksm_saved_bytes(self) -> int | None:
        return None if self.ksm is None else self.ksm.saved_bytes

    @property
    def templates_saved_kib(self) -> int:
        return sum(r.memory.template.rss_kib - r.memory.template.pss_kib for r in self.vms
                   if r.memory.template is not None)

    @property
    def ksm_vm_profit_bytes(self) -> int | None:
        profits = [r.memory.ksm.process_profit for r in self.vms
                   if r.memory.ksm is not None and r.memory.ksm.process_profit is not None]
        return sum(profits) if profits else None

    def segment_totals(self) -> dict[str, dict[str, Any]]:
        """Per segment over all VMs: how many map it, RSS, PSS, and the saving."""
        acc: dict[str, list[int]] = {}
        for r in self.vms:
            for name, s in r.memory.segments.items():
                a = acc.setdefault(name, [0, 0, 0])
                a[0] += 1
                a[1] += s.rss_kib
                a[2] += s.pss_kib
        return {name: {"vms": n, "rss_mib": _mib_kib(rss), "pss_mib": _mib_kib(pss),
                       "saved_mib": _mib_kib(rss - pss)}
                for name, (n, rss, pss) in sorted(acc.items())}

    def as_json(self) -> dict[str, Any]:
        return {"vms": [{"name": r.name, **r.memory.as_json()} for r in self.vms],
                "totals": {"vms": len(self.vms), "pss_mib": _mib_kib(self.total_pss_kib),
                           "rss_mib": _mib_kib(self.total_rss_kib)},
                "savings_mib": {"segments": _mib_kib(self.segments_saved_kib),
                                "templates": _mib_kib(self.templates_saved_kib),
                                "ksm": _mib_b(self.ksm_saved_bytes),
                                "ksm_vm_profit": _mib_b(self.ksm_vm_profit_bytes),
                                "bases": _mib_b(bases_saved_bytes(self.bases))},
                "segments": self.segment_totals(),
                "bases": bases_json(self.bases),
                "ksm": None if self.ksm is None else self.ksm.as_json(),
                "skipped": [{"vm": s.name, "reason": s.reason} for s in self.skipped]}


def host_report(vms: list[tuple[str, int]], segment_files: dict[str, Path],
                ksm_root: Path = DEFAULT_ROOT, procfs: Path = Path("/proc"),
                page_size: int | None = None, bases: tuple[BaseUse, ...] = ()
                ) -> HostReport:
    """The report for ``vms`` (name, QEMU pid). A VM whose process ended meanwhile is
    listed under ``skipped``; a host without KSM has ``ksm`` None; ``bases``: the
    imported images in use (fusuma.memshare.bases.bases_in_use)."""
    size = page_size or os.sysconf("SC_PAGE_SIZE")
    ksm = Ksm(ksm_root, page_size=size)
    settings = ksm.read_settings() if ksm.available() else None
    sharers = None
    if settings is not None and settings.pages_shared:
        sharers = (settings.pages_shared + settings.pages_sharing) / settings.pages_shared
    rows: list[VmRow] = []
    skipped: list[Skipped] = []
    for name, pid in vms:
        try:
            # Every VM's full smaps: a clone's template file is found in it.
            rows.append(VmRow(name, vm_memory(pid, segment_files, procfs, size,
                                              clone=True, ksm_sharers=sharers)))
        except NotFoundError as exc:
            skipped.append(Skipped(name, str(exc)))
    return HostReport(vms=rows, skipped=skipped, ksm=settings, bases=bases)
