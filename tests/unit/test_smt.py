"""SMT-aware partitions on a faked sysfs topology: 4 CPUs, 2 threads per core (these
machines have no SMT). Whole physical cores unless a partition asks for threads; a spec
that splits siblings between partitions gets a warning naming them."""

from __future__ import annotations

from pathlib import Path

import pytest

from fusuma.errors import ConflictError, HostError, SpecError
from fusuma.host.topology import HostInfo, host_info
from fusuma.partition.manager import PartitionManager
from fusuma.paths import Paths
from fusuma.state import Database, PartitionRecord


def fake_sysfs(root: Path, siblings: dict[int, str], unreadable: int | None = None) -> Path:
    sysfs = root / "sys"
    cpu = sysfs / "devices/system/cpu"
    cpu.mkdir(parents=True)
    (cpu / "online").write_text(f"0-{len(siblings) - 1}\n")
    for n, text in siblings.items():
        d = cpu / f"cpu{n}" / "topology"
        d.mkdir(parents=True)
        f = d / "thread_siblings_list"
        if n == unreadable:
            f.mkdir()          # exists, cannot be read as a file
        else:
            f.write_text(text + "\n")
    proc = root / "proc"
    proc.mkdir()
    (proc / "meminfo").write_text("MemTotal:       16384000 kB\n")
    return sysfs


SMT = {0: "0,2", 1: "1,3", 2: "0,2", 3: "1,3"}


def test_siblings_read_from_sysfs(tmp_path: Path) -> None:
    host = host_info(fake_sysfs(tmp_path, SMT), tmp_path / "proc")
    assert host.siblings == ((0, 2), (1, 3))
    assert host.core_of(2) == (0, 2) and host.whole_cores([0]) == [0, 2]
    assert host.split_cores([0, 1, 3]) == [(0, 2)]
    plain = host_info(fake_sysfs(tmp_path / "b", {0: "0", 1: "1"}), tmp_path / "b/proc")
    assert plain.siblings == () and plain.whole_cores([1]) == [1]


def test_an_unreadable_topology_file_is_one_sentence(tmp_path: Path) -> None:
    with pytest.raises(HostError, match=r"cannot read .*cpu1/topology/thread_siblings_list"):
        host_info(fake_sysfs(tmp_path, SMT, unreadable=1), tmp_path / "proc")


@pytest.fixture
def parts(tmp_path: Path) -> PartitionManager:
    host = HostInfo(cpus=[0, 1, 2, 3], mems=[0], memory_total_mib=16000,
                    memory_reserved_mib=1600, siblings=((0, 2), (1, 3)))
    paths = Paths(home=tmp_path, runtime=tmp_path / "run", shm=tmp_path / "shm",
                  cache=tmp_path, cgroup_prefix="unit-smt")
    pm = PartitionManager(paths, Database(tmp_path / "state.db"), host)
    return pm


def test_whole_cores_by_default_with_a_notice(parts: PartitionManager) -> None:
    said: list[str] = []
    parts.notice = said.append
    assert parts.smt_cpus("a", [0], "cores") == [0, 2]
    assert said == ["fusuma: notice: partition 'a' gets whole physical cores: CPUs 0,2 "
                    "(the physical core of threads 0,2); use --smt threads for single "
                    "threads."]
    said.clear()
    assert parts.smt_cpus("a", [0, 2], "cores") == [0, 2] and said == []


def test_threads_split_a_core_with_a_warning(parts: PartitionManager) -> None:
    said: list[str] = []
    parts.notice = said.append
    parts.db.add_partition(PartitionRecord("a", [0], 512, smt="threads"))
    assert parts.smt_cpus("b", [2], "threads") == [2]
    assert said == ["fusuma: warning: partition 'b' splits the physical core of threads "
                    "0,2 with partition(s) 'a': their vCPUs compete for that core's "
                    "execution units and caches."]
    # Whole cores: the sibling held by a is refused like any core another partition has.
    with pytest.raises(ConflictError, match=r"core\(s\) 0 belong to partition 'a'"):
        parts.check_cpus("c", parts.smt_cpus("c", [2], "cores"))
    assert parts.db.partition("a").smt == "threads"


def test_spec_splitting_siblings(tmp_path: Path) -> None:
    from fusuma.spec import check_host_fit, parse_spec, smt_warnings

    host = HostInfo(cpus=[0, 1, 2, 3], mems=[0], memory_total_mib=16000,
                    memory_reserved_mib=1600, siblings=((0, 2), (1, 3)))
    text = ('[[partition]]\nname="a"\ncpus="0"\nmemory_mib=512\n{a}'
            '[[partition]]\nname="b"\ncpus="2"\nmemory_mib=512\n{b}')
    both = parse_spec(text.format(a='smt="threads"\n', b='smt="threads"\n'), "s.toml")
    check_host_fit(both, host, "s.toml")
    assert smt_warnings(both, host) == [
        "partitions 'a' and 'b' split the physical core of threads 0,2 ('a' has thread 0, "
        "'b' has thread 2): their vCPUs compete for that core's execution units and "
        "caches."]
    whole = parse_spec(text.format(a="", b=""), "s.toml")
    with pytest.raises(SpecError) as info:
        check_host_fit(whole, host, "s.toml")
    assert str(info.value) == (
        "s.toml: partition[1].cpus: partitions 'a' and 'b' both need CPU 0: the physical "
        "core of threads 0,2 goes whole to one partition; give each partition other "
        "cores, or smt = \"threads\" to both to split the core's threads.")
    apart = parse_spec(text.format(a="", b="").replace('cpus="2"', 'cpus="1"'), "s.toml")
    check_host_fit(apart, host, "s.toml")
    assert smt_warnings(apart, host) == []
