"""smaps parsing, the by-mode table, segment accounting and the host report, on fake
/proc trees (and one look at this test process's real /proc)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from fusuma.errors import HostError, NotFoundError
from fusuma.memshare.report import host_report, vm_memory
from fusuma.memshare.smaps import (
    Mapping,
    analyze,
    by_mode,
    estimate_pss_split,
    parse_smaps,
    pss_split,
    read_smaps,
    segment_usage,
    shareable_fraction,
)
from tests.unit.memshare_fake import KSM_STAT, ROLLUP, make_ksm, make_process, qemu_smaps

SEG = Path("/var/lib/fusuma/segments/usr.erofs")
# Rss of every mapping of qemu_smaps() by mode, written out by hand.
MODES = {"rw-s": 65536, "rw-p": 400 + 20000 + 1500 + 132, "r--s": 8192,
         "r-xp": 6000 + 1300 + 8, "r--p": 1000 + 2000 + 160 + 4, "---p": 0}
TOTAL_RSS = sum(MODES.values())
TOTAL_PSS = 500 + 3000 + 2000 + 400 + 20000 + 65536 + 4096 + 1500 + 20 + 100 + 4 + 132


def test_parse_smaps_fields_paths_and_flags() -> None:
    maps = parse_smaps(qemu_smaps(SEG))
    assert len(maps) == 14
    text0 = maps[1]
    assert (text0.start, text0.end, text0.perms, text0.offset) == (
        0x55d0c0100000, 0x55d0c0900000, "r-xp", 0x100000)
    assert text0.path == "/usr/bin/qemu-system-x86_64"
    assert text0.rss_kib == 6000 and text0.pss_kib == 3000
    assert text0.kib["Shared_Clean"] == 6000 and text0.kib["Private_Dirty"] == 0
    assert "ex" in text0.vm_flags
    assert "THPeligible" not in text0.kib          # not a kB field
    paths = [m.path for m in maps]
    assert "[heap]" in paths and "[stack]" in paths and "[vdso]" in paths
    assert "/tmp/odd dir/lib x.so" in paths        # spaces in a path survive
    anon = [m for m in maps if m.path == ""]
    assert [m.perms for m in anon] == ["rw-p", "---p"]
    assert maps[5].shared and maps[5].writable and not maps[6].writable


def test_parse_smaps_deleted_suffix_and_empty() -> None:
    m = parse_smaps("7f00-7f01 r--s 00000000 00:01 3   /x/seg.erofs (deleted)\n"
                    "Rss:  4 kB\n")[0]
    assert m.path == "/x/seg.erofs (deleted)" and m.file_path == "/x/seg.erofs"
    assert parse_smaps("") == []


def test_by_mode_sums_rss_per_mode_largest_first() -> None:
    modes = by_mode(parse_smaps(qemu_smaps(SEG)))
    assert modes == MODES
    assert list(modes) == ["rw-s", "rw-p", "r--s", "r-xp", "r--p", "---p"]


def test_shareable_fraction_counts_only_mappings_that_are_not_writable() -> None:
    expected = (MODES["r--s"] + MODES["r-xp"] + MODES["r--p"]) / TOTAL_RSS
    assert shareable_fraction(MODES) == pytest.approx(expected)
    assert shareable_fraction({"r-xp": 30, "rw-p": 70}) == pytest.approx(0.3)
    assert shareable_fraction({"r--p": 5}) == 1.0
    assert shareable_fraction({"---p": 0}) == 0.0
    assert shareable_fraction({}) == 0.0


def test_analyze_json_shape_on_fake_proc(tmp_path: Path) -> None:
    make_process(tmp_path, 4242, qemu_smaps(SEG))
    a = analyze(4242, procfs=tmp_path)
    out = a.as_json()
    assert set(out) == {"pid", "comm", "by_mode", "total_rss_kib", "shareable_fraction"}
    assert out["pid"] == 4242 and out["comm"] == "qemu-system-x86"
    assert out["by_mode"] == MODES and out["total_rss_kib"] == TOTAL_RSS
    assert out["shareable_fraction"] == round(
        (MODES["r--s"] + MODES["r-xp"] + MODES["r--p"]) / TOTAL_RSS, 4)


def test_analyze_missing_pid_is_not_found(tmp_path: Path) -> None:
    with pytest.raises(NotFoundError, match="no process with pid 77") as exc:
        analyze(77, procfs=tmp_path)
    assert exc.value.exit_code == 3


def test_unreadable_smaps_is_a_host_error(tmp_path: Path,
                                          monkeypatch: pytest.MonkeyPatch) -> None:
    make_process(tmp_path, 5, qemu_smaps(SEG))

    def denied(self: Path, *a: object, **k: object) -> str:
        raise PermissionError(13, "Permission denied")

    monkeypatch.setattr(Path, "read_text", denied)
    with pytest.raises(HostError, match="permission denied; run fusuma as root"):
        read_smaps(5, procfs=tmp_path)


def test_analyze_real_process() -> None:
    a = analyze(os.getpid())
    assert a.comm
    assert sum(a.by_mode.values()) == a.total_rss_kib > 0
    assert 0.0 < a.shareable_fraction < 1.0
    assert a.by_mode.get("r-xp", 0) > 0            # the interpreter's own code
    writable = sum(k for m, k in a.by_mode.items() if m[1] == "w")
    assert a.shareable_fraction == pytest.approx(1 - writable / a.total_rss_kib)
    assert a.as_json()["shareable_fraction"] == round(a.shareable_fraction, 4)


def test_segment_usage_matches_file_deleted_and_symlink(tmp_path: Path) -> None:
    real = tmp_path / "real"
    real.mkdir()
    (real / "usr.erofs").write_bytes(b"x")
    (real / "lib.erofs").write_bytes(b"x")
    (tmp_path / "link").symlink_to(real)
    files = {"usr": tmp_path / "link" / "usr.erofs",      # kernel shows the real path
             "lib": real / "lib.erofs", "unused": real / "unused.erofs"}
    text = (qemu_smaps(real / "usr.erofs", seg_rss=8192, seg_pss=2048)
            + f"7f4000000000-7f4000100000 r--s 00000000 fe:00 9 {real}/lib.erofs (deleted)\n"
              "Rss:  1024 kB\nPss:  256 kB\n"
            + f"7f4000100000-7f4000200000 r--s 00100000 fe:00 9 {real}/lib.erofs\n"
              "Rss:  512 kB\nPss:  512 kB\n")
    use = segment_usage(parse_smaps(text), files)
    assert set(use) == {"usr", "lib"}
    assert (use["usr"].rss_kib, use["usr"].pss_kib, use["usr"].mappings) == (8192, 2048, 1)
    assert (use["lib"].rss_kib, use["lib"].pss_kib, use["lib"].mappings) == (1536, 768, 2)
    assert use["usr"].as_json() == {"rss_mib": 8.0, "pss_mib": 2.0, "mappings": 1}


def test_estimated_split_classifies_shmem_anon_and_file() -> None:
    sp = estimate_pss_split(parse_smaps(qemu_smaps(SEG)))
    assert sp.source == "smaps-estimate"
    assert sp.rss_kib == TOTAL_RSS and sp.pss_kib == TOTAL_PSS
    assert sp.shmem_kib == 65536                   # guest RAM in /dev/shm
    # private anon: the binary's relro copy, .data (300 of 400 kB anon), heap, arena, stack
    assert sp.anon_kib == 2000 + 300 + 20000 + 1500 + 132
    assert sp.anon_kib + sp.file_kib + sp.shmem_kib == sp.pss_kib


def test_shared_anonymous_and_memfd_are_shmem() -> None:
    maps = [Mapping(0, 1, "rw-s", 0, "/dev/zero (deleted)", {"Rss": 8, "Pss": 4}),
            Mapping(1, 2, "rw-s", 0, "/memfd:pc.ram (deleted)", {"Rss": 8, "Pss": 8}),
            Mapping(2, 3, "rw-p", 0, "/dev/zero", {"Rss": 8, "Pss": 8, "Anonymous": 8})]
    sp = estimate_pss_split(maps)
    assert (sp.shmem_kib, sp.anon_kib, sp.file_kib) == (12, 8, 0)


def test_pss_split_prefers_the_kernels_rollup(tmp_path: Path) -> None:
    rollup = ROLLUP.format(rss=1000, pss=900, anon=600, file=200, shmem=100)
    make_process(tmp_path, 10, qemu_smaps(SEG), rollup=rollup)
    sp = pss_split(10, procfs=tmp_path)
    assert sp.source == "smaps_rollup"
    assert (sp.rss_kib, sp.pss_kib, sp.anon_kib, sp.file_kib, sp.shmem_kib) == (
        1000, 900, 600, 200, 100)


def test_pss_split_estimates_on_old_kernels(tmp_path: Path) -> None:
    old_rollup = "\n".join(line for line in ROLLUP.splitlines() if "Pss_" not in line)
    make_process(tmp_path, 11, qemu_smaps(SEG), rollup=old_rollup.format(
        rss=1, pss=1, anon=1))
    make_process(tmp_path, 12, qemu_smaps(SEG))            # no smaps_rollup at all
    for pid in (11, 12):
        sp = pss_split(pid, procfs=tmp_path)
        assert sp.source == "smaps-estimate" and sp.pss_kib == TOTAL_PSS
    with pytest.raises(NotFoundError):
        pss_split(13, procfs=tmp_path)


def _two_vms(procfs: Path, seg: Path) -> None:
    # Two QEMUs map the same 8 MiB of the segment: each has Rss 8192, Pss 4096.
    for pid, merging, profit in ((100, 1000, 3_000_000), (101, 500, 1_000_000)):
        make_process(procfs, pid, qemu_smaps(seg, ram=f"/dev/shm/fusuma/vm{pid}.ram"),
                     rollup=ROLLUP.format(rss=TOTAL_RSS, pss=TOTAL_PSS, anon=23932,
                                          file=7820, shmem=65536),
                     ksm_stat=KSM_STAT.format(rmap=2000, merging=merging, profit=profit))


def test_vm_memory(tmp_path: Path) -> None:
    seg = tmp_path / "segments" / "usr.erofs"
    _two_vms(tmp_path / "proc", seg)
    vm = vm_memory(100, {"usr": seg}, procfs=tmp_path / "proc", page_size=4096)
    out = vm.as_json()
    assert out["pss_mib"] == round(TOTAL_PSS / 1024, 1)
    assert (out["pss_anon_mib"], out["pss_file_mib"], out["pss_shmem_mib"]) == (
        round(23932 / 1024, 1), round(7820 / 1024, 1), 64.0)
    assert out["split_source"] == "smaps_rollup"
    assert out["ksm_merged_mib"] == round(1000 * 4096 / 2**20, 1)
    assert out["ksm_profit_mib"] == round(3_000_000 / 2**20, 1)
    assert out["segments"] == {"usr": {"rss_mib": 8.0, "pss_mib": 4.0, "mappings": 1}}
    assert (out["segments_rss_mib"], out["segments_pss_mib"]) == (8.0, 4.0)


def test_vm_memory_without_ksm_stat(tmp_path: Path) -> None:
    make_process(tmp_path, 7, qemu_smaps(SEG))
    out = vm_memory(7, {}, procfs=tmp_path, page_size=4096).as_json()
    assert out["ksm_merged_mib"] is None and out["ksm_profit_mib"] is None
    assert out["segments"] == {} and out["split_source"] == "smaps-estimate"


def test_host_report_totals_and_savings(tmp_path: Path) -> None:
    seg = tmp_path / "segments" / "usr.erofs"
    _two_vms(tmp_path / "proc", seg)
    root = make_ksm(tmp_path / "ksm", run=1, pages_sharing=2560, pages_shared=100,
                    ksm_zero_pages=0)
    rep = host_report([("a", 100), ("b", 101), ("gone", 555)], {"usr": seg},
                      ksm_root=root, procfs=tmp_path / "proc", page_size=4096)
    assert [r.name for r in rep.vms] == ["a", "b"]
    assert rep.total_pss_kib == 2 * TOTAL_PSS and rep.total_rss_kib == 2 * TOTAL_RSS
    # two copies of 8 MiB resident, 8 MiB of PSS: one copy (8 MiB) saved
    assert rep.segments_saved_kib == 2 * 8192 - 2 * 4096
    out = rep.as_json()
    assert set(out) == {"vms", "totals", "savings_mib", "segments", "bases", "ksm",
                        "skipped"}
    assert out["totals"] == {"vms": 2, "pss_mib": round(2 * TOTAL_PSS / 1024, 1),
                             "rss_mib": round(2 * TOTAL_RSS / 1024, 1)}
    assert out["savings_mib"] == {"segments": 8.0, "ksm": 10.0, "templates": 0.0,
                                  "ksm_vm_profit": round(4_000_000 / 2**20, 1),
                                  "bases": 0.0}
    assert out["bases"] == {}
    assert out["segments"] == {"usr": {"vms": 2, "rss_mib": 16.0, "pss_mib": 8.0,
                                       "saved_mib": 8.0}}
    assert out["ksm"]["pages_sharing"] == 2560 and out["ksm"]["state"] == "running"
    assert [s["vm"] for s in out["skipped"]] == ["gone"]
    assert "pid 555" in out["skipped"][0]["reason"]
    assert out["vms"][0]["name"] == "a" and out["vms"][1]["pid"] == 101


def test_host_report_without_ksm_or_vms(tmp_path: Path) -> None:
    rep = host_report([], {}, ksm_root=tmp_path / "no-ksm", procfs=tmp_path,
                      page_size=4096)
    out = rep.as_json()
    assert out["ksm"] is None and out["vms"] == []
    assert out["savings_mib"] == {"segments": 0.0, "ksm": None, "ksm_vm_profit": None,
                                  "templates": 0.0, "bases": 0.0}
    assert out["totals"] == {"vms": 0, "pss_mib": 0.0, "rss_mib": 0.0}
