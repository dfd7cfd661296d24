"""Unit tests for fusuma.host.topology: cpulists and host sizing from fake sysfs/procfs."""

from __future__ import annotations

from pathlib import Path

import pytest

from fusuma.errors import HostError, SpecError
from fusuma.host.topology import (
    HostInfo,
    format_cpulist,
    host_info,
    host_reserve_mib,
    parse_cpulist,
)


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("0-3,5", [0, 1, 2, 3, 5]),
        ("0", [0]),
        ("5,0-1,1\n", [0, 1, 5]),
        (" 2 , 7-8 ", [2, 7, 8]),
        ("", []),
        ("\n", []),
        ("3-3", [3]),
    ],
)
def test_parse_cpulist(text: str, expected: list[int]) -> None:
    assert parse_cpulist(text) == expected


@pytest.mark.parametrize("text", ["a", "0-", "-1", "1,,2", "0-3:2", "3-1", "1 2", "0x1"])
def test_parse_cpulist_rejects_garbage(text: str) -> None:
    with pytest.raises(SpecError):
        parse_cpulist(text)


@pytest.mark.parametrize(
    ("numbers", "expected"),
    [
        ([0, 1, 2, 5], "0-2,5"),
        ([5, 2, 1, 0, 1], "0-2,5"),
        ([3], "3"),
        ([], ""),
        ([0, 2, 4], "0,2,4"),
        ([0, 1, 3, 4, 6, 7, 8], "0-1,3-4,6-8"),
    ],
)
def test_format_cpulist(numbers: list[int], expected: str) -> None:
    assert format_cpulist(numbers) == expected


def test_format_parse_round_trip() -> None:
    numbers = [0, 1, 2, 9, 10, 31, 63, 64]
    assert parse_cpulist(format_cpulist(numbers)) == numbers


def test_format_cpulist_rejects_negative() -> None:
    with pytest.raises(SpecError):
        format_cpulist([-1, 0])


def _fake_host(tmp_path: Path, *, cpus: str, nodes: str | None, memtotal_kb: int) -> tuple[
    Path, Path
]:
    sysfs = tmp_path / "sys"
    procfs = tmp_path / "proc"
    (sysfs / "devices/system/cpu").mkdir(parents=True)
    (sysfs / "devices/system/cpu/online").write_text(cpus + "\n")
    if nodes is not None:
        (sysfs / "devices/system/node").mkdir(parents=True)
        (sysfs / "devices/system/node/online").write_text(nodes + "\n")
    procfs.mkdir()
    (procfs / "meminfo").write_text(
        f"MemTotal:       {memtotal_kb} kB\nMemFree:         1000 kB\n"
    )
    return sysfs, procfs


def test_host_info_reads_sysfs_and_meminfo(tmp_path: Path) -> None:
    sysfs, procfs = _fake_host(tmp_path, cpus="0-1", nodes="0", memtotal_kb=24684092)
    info = host_info(sysfs, procfs)
    assert info.cpus == [0, 1]
    assert info.mems == [0]
    assert info.memory_total_mib == 24105
    assert info.memory_reserved_mib == 2410
    assert info.memory_available_for_partitions_mib == 24105 - 2410


def test_host_info_without_numa_dir_has_node_zero(tmp_path: Path) -> None:
    sysfs, procfs = _fake_host(tmp_path, cpus="0-7", nodes=None, memtotal_kb=4 * 1024 * 1024)
    info = host_info(sysfs, procfs)
    assert info.mems == [0]
    assert info.cpus == list(range(8))
    # 10% of 4 GiB is below the 1 GiB floor.
    assert info.memory_reserved_mib == 1024
    assert info.memory_available_for_partitions_mib == 3072


def test_host_info_two_nodes(tmp_path: Path) -> None:
    sysfs, procfs = _fake_host(tmp_path, cpus="0-3", nodes="0-1", memtotal_kb=2048 * 1024)
    assert host_info(sysfs, procfs).mems == [0, 1]


def test_host_reserve() -> None:
    assert host_reserve_mib(512) == 1024
    assert host_reserve_mib(10240) == 1024
    assert host_reserve_mib(20480) == 2048


def test_available_never_negative() -> None:
    info = HostInfo(cpus=[0], mems=[0], memory_total_mib=512, memory_reserved_mib=1024)
    assert info.memory_available_for_partitions_mib == 0


def test_host_info_missing_meminfo_is_host_error(tmp_path: Path) -> None:
    sysfs, procfs = _fake_host(tmp_path, cpus="0", nodes="0", memtotal_kb=1)
    (procfs / "meminfo").write_text("MemFree: 1 kB\n")
    with pytest.raises(HostError, match="MemTotal"):
        host_info(sysfs, procfs)


def test_host_info_garbage_cpu_online_is_host_error(tmp_path: Path) -> None:
    sysfs, procfs = _fake_host(tmp_path, cpus="zero", nodes="0", memtotal_kb=1024)
    with pytest.raises(HostError, match="cpu/online"):
        host_info(sysfs, procfs)


def test_host_info_on_this_machine() -> None:
    info = host_info()
    assert info.cpus
    assert info.memory_total_mib > 0
