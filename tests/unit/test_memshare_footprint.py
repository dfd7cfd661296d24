"""Host memory of a set of processes with shared tmpfs files counted once, on a fake
procfs and real files."""

from __future__ import annotations

import os
from pathlib import Path

from fusuma.memshare import footprint

ROLLUP = """\
00400000-7ffd00000000 ---p 00000000 00:00 0 [rollup]
Rss:              {rss} kB
Pss:              {pss} kB
Pss_Anon:         {anon} kB
Pss_File:         {file} kB
Pss_Shmem:        {shmem} kB
"""


def mapping(start: int, perms: str, path: str, rss: int, pss: int, anon: int = 0,
            private: int = 0) -> str:
    return (f"{start:x}-{start + 0x10000000:x} {perms} 00000000 00:1a 5 {path}\n"
            f"Rss: {rss} kB\nPss: {pss} kB\nAnonymous: {anon} kB\n"
            f"Private_Clean: 0 kB\nPrivate_Dirty: {private} kB\n")


def proc(procfs: Path, pid: int, maps: list[str], anon: int, file: int, shmem: int) -> None:
    d = procfs / str(pid)
    d.mkdir(parents=True)
    (d / "smaps").write_text("".join(maps))
    (d / "smaps_rollup").write_text(ROLLUP.format(rss=0, pss=anon + file + shmem,
                                                  anon=anon, file=file, shmem=shmem))


def test_shared_ram_and_template_count_once_copies_and_memfd_per_process(
        tmp_path: Path) -> None:
    shm = tmp_path / "shm"
    shm.mkdir()
    ram = shm / "a.ram"
    with ram.open("wb") as f:
        f.write(b"x" * 2**20)                  # 1 MiB allocated
    template = shm / "t.template"
    template.write_bytes(b"y" * 3 * 2**20)     # 3 MiB
    (shm / "unmapped.ram").write_bytes(b"z" * 2**20)
    tmpfs = {ram.stat().st_dev}
    procfs = tmp_path / "proc"
    # A VM with shared RAM: the RAM file's pages are shmem; a memfd of QEMU's own.
    proc(procfs, 10, [mapping(0x10000000, "rw-s", str(ram), 1024, 1024),
                      mapping(0x30000000, "rw-s", "/memfd:pc.bios (deleted)", 256, 256),
                      mapping(0x50000000, "rwxp", "", 32768, 32768, 32768, 32768)],
         anon=40000, file=8000, shmem=1024 + 256)
    # A clone: the template mapped privately; 500 KiB copied (anonymous), the rest the
    # template's pages it shares with another clone.
    proc(procfs, 11, [mapping(0x10000000, "rw-p", str(template), 2000, 1250, 500, 500)],
         anon=30000, file=7000, shmem=750)
    fp = footprint.measure([10, 11], [shm], procfs=procfs, tmpfs=tmpfs)
    own = {p.pid: p.own_kib for p in fp.processes}
    assert own == {10: 40000 + 8000 + 256, 11: 30000 + 7000}
    assert {f.path: f.kib for f in fp.files} == {str(ram): 1024, str(template): 3072,
                                                 str(shm / "unmapped.ram"): 1024}
    assert fp.total_kib == 48256 + 37000 + 1024 + 3072 + 1024
    vm = next(p for p in fp.processes if p.pid == 10)
    assert vm.exec_anon_kib == 32768 and vm.private_kib == 32768


def test_a_file_seen_under_two_names_counts_once(tmp_path: Path) -> None:
    shm = tmp_path / "shm"
    shm.mkdir()
    ram = shm / "a.ram"
    ram.write_bytes(b"x" * 2**20)
    os.link(ram, shm / "b.ram")
    procfs = tmp_path / "proc"
    proc(procfs, 10, [mapping(0x10000000, "rw-s", str(shm / "b.ram"), 1024, 1024)],
         anon=100, file=0, shmem=1024)
    fp = footprint.measure([10], [shm], procfs=procfs, tmpfs={ram.stat().st_dev})
    assert len(fp.files) == 1 and fp.total_kib == 100 + 1024


def test_disk_files_page_cache_is_reported_not_counted(tmp_path: Path) -> None:
    disk = tmp_path / "root.erofs"
    disk.write_bytes(b"r" * 2**20)
    disk.read_bytes()
    fp = footprint.measure([], disk_files=[disk], tmpfs=set())
    assert fp.total_kib == 0
    assert fp.cached[0].path == str(disk) and 0 <= fp.cached[0].kib <= 1024
    footprint.drop_cache(disk)            # never fails, whatever the kernel keeps
    assert footprint.resident_bytes(disk) <= 2**20


def test_tmpfs_devices_from_mountinfo(tmp_path: Path) -> None:
    info = tmp_path / "mountinfo"
    info.write_text("36 35 0:26 / /dev/shm rw,nosuid - tmpfs tmpfs rw\n"
                    "25 1 254:0 / / rw,relatime - ext4 /dev/vda rw\n")
    assert footprint.tmpfs_devices(info) == {os.makedev(0, 26)}
