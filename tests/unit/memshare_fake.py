"""Fake /proc and /sys/kernel/mm/ksm trees for the memshare tests."""

from __future__ import annotations

from pathlib import Path


def smap(head: str, rss: int, pss: int, anon: int = 0, shared_clean: int = 0,
         private_dirty: int = 0, flags: str = "rd mr mw me") -> str:
    """One smaps record as Linux 6.x prints it (sizes in kB)."""
    size = max(rss, 4)
    return f"""{head}
Size:               {size:>6} kB
KernelPageSize:        4 kB
MMUPageSize:           4 kB
Rss:                {rss:>6} kB
Pss:                {pss:>6} kB
Pss_Dirty:          {private_dirty:>6} kB
Shared_Clean:       {shared_clean:>6} kB
Shared_Dirty:          0 kB
Private_Clean:      {max(rss - shared_clean - private_dirty, 0):>6} kB
Private_Dirty:      {private_dirty:>6} kB
Referenced:         {rss:>6} kB
Anonymous:          {anon:>6} kB
KSM:                   0 kB
LazyFree:              0 kB
AnonHugePages:         0 kB
ShmemPmdMapped:        0 kB
FilePmdMapped:         0 kB
Shared_Hugetlb:        0 kB
Private_Hugetlb:       0 kB
Swap:                  0 kB
SwapPss:               0 kB
Locked:                0 kB
THPeligible:           0
VmFlags: {flags}
"""


def qemu_smaps(segment: Path, ram: str = "/dev/shm/fusuma/vm1.ram",
               seg_rss: int = 8192, seg_pss: int = 4096) -> str:
    """A QEMU with guest RAM in a shared file and one read-only segment (virtio-pmem),
    its binary, libc, heap, stack, an anonymous arena, a guard page and the vdso."""
    q = "/usr/bin/qemu-system-x86_64"
    libc = "/usr/lib/x86_64-linux-gnu/libc.so.6"
    return "".join([
        smap(f"55d0c0000000-55d0c0100000 r--p 00000000 fe:00 1001 {q}", 1000, 500,
             shared_clean=1000),
        smap(f"55d0c0100000-55d0c0900000 r-xp 00100000 fe:00 1001 {q}", 6000, 3000,
             shared_clean=6000, flags="rd ex mr mw me"),
        smap(f"55d0c0900000-55d0c0c00000 r--p 00900000 fe:00 1001 {q}", 2000, 2000,
             anon=2000, private_dirty=2000),
        smap(f"55d0c0c00000-55d0c0d00000 rw-p 00c00000 fe:00 1001 {q}", 400, 400,
             anon=300, private_dirty=400),
        smap("55d0c2000000-55d0c4000000 rw-p 00000000 00:00 0 [heap]", 20000, 20000,
             anon=20000, private_dirty=20000),
        smap(f"7f0000000000-7f0010000000 rw-s 00000000 00:1a 77 {ram}", 65536, 65536,
             private_dirty=65536),
        smap(f"7f0010000000-7f0018000000 r--s 00000000 fe:00 88 {segment}", seg_rss,
             seg_pss, shared_clean=seg_rss),
        smap("7f0018000000-7f0018200000 rw-p 00000000 00:00 0 ", 1500, 1500, anon=1500,
             private_dirty=1500),
        smap("7f0018200000-7f0018201000 ---p 00000000 00:00 0 ", 0, 0, flags="mr mw me"),
        smap(f"7f0020000000-7f0020028000 r--p 00000000 fe:00 99 {libc}", 160, 20,
             shared_clean=160),
        smap(f"7f0020028000-7f00201bd000 r-xp 00028000 fe:00 99 {libc}", 1300, 100,
             shared_clean=1300, flags="rd ex mr mw me"),
        smap("7f0030000000-7f0030001000 r--p 00000000 fe:00 123 /tmp/odd dir/lib x.so",
             4, 4),
        smap("7ffd00000000-7ffd00021000 rw-p 00000000 00:00 0 [stack]", 132, 132,
             anon=132, private_dirty=132, flags="rd wr mr mw me gd ac"),
        smap("7ffd00100000-7ffd00102000 r-xp 00000000 00:00 0 [vdso]", 8, 0,
             shared_clean=8, flags="rd ex mr mw me de"),
    ])


ROLLUP = """55d0c0000000-7ffd00102000 ---p 00000000 00:00 0                          [rollup]
Rss:               {rss} kB
Pss:               {pss} kB
Pss_Dirty:          100 kB
Pss_Anon:          {anon} kB
Pss_File:          {file} kB
Pss_Shmem:         {shmem} kB
Shared_Clean:       100 kB
Private_Dirty:      100 kB
Anonymous:         {anon} kB
"""

KSM_STAT = """ksm_rmap_items {rmap}
ksm_zero_pages 0
ksm_merging_pages {merging}
ksm_process_profit {profit}
ksm_merge_any: no
ksm_mergeable: yes
"""


def make_process(procfs: Path, pid: int, smaps: str, comm: str = "qemu-system-x86",
                 rollup: str | None = None, ksm_stat: str | None = None) -> Path:
    d = procfs / str(pid)
    d.mkdir(parents=True)
    (d / "comm").write_text(comm + "\n")
    (d / "smaps").write_text(smaps)
    if rollup is not None:
        (d / "smaps_rollup").write_text(rollup)
    if ksm_stat is not None:
        (d / "ksm_stat").write_text(ksm_stat)
    return d


KSM_FILES = {"run": 0, "pages_to_scan": 100, "sleep_millisecs": 20, "pages_shared": 0,
             "pages_sharing": 0, "pages_unshared": 0, "pages_volatile": 0,
             "full_scans": 0, "general_profit": 0, "ksm_zero_pages": 0,
             "use_zero_pages": 0, "max_page_sharing": 256, "merge_across_nodes": 1}


def make_ksm(root: Path, **values: int) -> Path:
    root.mkdir(parents=True, exist_ok=True)
    for name, value in {**KSM_FILES, **values}.items():
        (root / name).write_text(f"{value}\n")
    return root
