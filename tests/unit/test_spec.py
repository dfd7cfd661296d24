"""Spec parsing and validation: every error names the file and the key."""

from __future__ import annotations

import pytest

from fusuma.errors import SpecError
from fusuma.host.topology import HostInfo
from fusuma.spec import (
    PartitionSpec,
    build,
    check_host_fit,
    default_spec,
    dump_spec,
    parse_spec,
)

GOOD = """
[[partition]]
name = "p0"
cpus = "0-1"
memory_mib = 1024

[[disk]]
name = "d0"
path = "/tmp/d0.img"
partition = "p0"
size_mib = 8

[[vm]]
name = "vm0"
partition = "p0"
vcpus = 2
disks = ["d0"]
"""


def host(cpus: int = 2, mem: int = 24000) -> HostInfo:
    return HostInfo(cpus=list(range(cpus)), mems=[0], memory_total_mib=mem,
                    memory_reserved_mib=max(1024, mem // 10))


def test_good_spec_parses_with_defaults() -> None:
    spec = parse_spec(GOOD, "s.toml")
    assert spec.partition[0].cpus == [0, 1]
    vm = spec.vm[0]
    assert (vm.vcpus, vm.memory_mib, vm.image, vm.accel, vm.autostart) == (
        2, 256, "minimal", "auto", True)


@pytest.mark.parametrize(("text", "expect"), [
    ("[[partition]]\nname=1", "s.toml: partition[0].name"),
    ('[[partition]]\nname="p"\ncpus=[0]\nmemory_mib=0', "s.toml: partition[0].memory_mib"),
    ('[[partition]]\nname="p"\ncpus=[]\nmemory_mib=64', "at least one core"),
    ('[[partition]]\nname="p"\ncpus=[0,0]\nmemory_mib=64', "listed twice"),
    ('[[partition]]\nname="../x"\ncpus=[0]\nmemory_mib=64', "is not allowed"),
    ('[[vm]]\nname="v"\npartition="p"\nfoo=1', "s.toml: vm[0].foo: unknown key"),
    ('[[vm]]\nname="v"\npartition="p"', "vm[0].partition: no partition named 'p'"),
    ('[[partition]]\nname="p"\ncpus=[0]\nmemory_mib=64\n[[disk]]\nname="d"\npath="rel"\n'
     'partition="p"', "must be absolute"),
    ('[[partition]]\nname="a"\ncpus=[0]\nmemory_mib=64\n[[partition]]\nname="b"\n'
     'cpus=[0]\nmemory_mib=64', "core 0 is already given to partition 'a'"),
    ('[[partition]]\nname="a"\ncpus=[0]\nmemory_mib=64\n[[partition]]\nname="b"\n'
     'cpus=[1]\nmemory_mib=64\n[[disk]]\nname="d"\npath="/d"\npartition="a"\n'
     '[[vm]]\nname="v"\npartition="b"\ndisks=["d"]', "belongs to partition 'a'"),
    ('[[partition]]\nname="a"\ncpus=[0]\nmemory_mib=64\n[[disk]]\nname="d"\npath="/d"\n'
     'partition="a"\n[[vm]]\nname="v"\npartition="a"\ndisks=["d"]\n[[vm]]\nname="w"\n'
     'partition="a"\ndisks=["d"]', "already used by vm 'v'"),
    ("not toml [", "not valid TOML"),
])
def test_bad_specs(text: str, expect: str) -> None:
    with pytest.raises(SpecError) as info:
        parse_spec(text, "s.toml")
    assert expect in str(info.value)
    assert str(info.value).startswith("s.toml")


def test_host_fit_refuses_missing_cores_and_too_much_memory() -> None:
    spec = parse_spec('[[partition]]\nname="a"\ncpus=[3]\nmemory_mib=64', "s")
    with pytest.raises(SpecError, match=r"core\(s\) 3 do not exist; this host has cores 0-1"):
        check_host_fit(spec, host())
    spec = parse_spec('[[partition]]\nname="a"\ncpus=[0]\nmemory_mib=4000', "s")
    with pytest.raises(SpecError, match="can give at most 3072 MiB"):
        check_host_fit(spec, host(mem=4096))


def test_default_spec_two_cores_two_partitions() -> None:
    spec = default_spec(host(2))
    assert [p.cpus for p in spec.partition] == [[0], [1]]
    assert [(v.name, v.partition) for v in spec.vm] == [("vm0", "p0"), ("vm1", "p1")]
    check_host_fit(spec, host(2))
    assert [p.cpus for p in default_spec(host(8)).partition] == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert len(default_spec(host(1)).partition) == 1


def test_dump_roundtrips() -> None:
    spec = parse_spec(GOOD, "s")
    assert parse_spec(dump_spec(spec), "again") == spec
    odd = parse_spec(GOOD.replace('vcpus = 2', 'vcpus = 2\naccel = "tcg"\nautostart = false\n'
                                  'shared_ram = false\nimage = "min\\"imal"'), "s")
    assert odd.vm[0].image == 'min"imal' and not odd.vm[0].autostart
    assert parse_spec(dump_spec(odd), "again") == odd


def test_build_from_cli_arguments() -> None:
    assert build(PartitionSpec, "partition", name="a", cpus="0", memory_mib=64).cpus == [0]
    with pytest.raises(SpecError, match="partition memory_mib"):
        build(PartitionSpec, "partition", name="a", cpus=[0], memory_mib=-1)
