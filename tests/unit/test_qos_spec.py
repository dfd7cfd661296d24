"""The QoS class in the spec, the CLI argument and the state file."""

from __future__ import annotations

import sqlite3
from pathlib import Path

import pytest

from fusuma.errors import SpecError
from fusuma.spec import VmSpec, build, dump_spec, parse_spec
from fusuma.state import Database, PartitionRecord, VmRecord

SPEC = """
[[partition]]
name = "p0"
cpus = "0"
memory_mib = 1024

[[vm]]
name = "a"
partition = "p0"
qos = "guaranteed"

[[vm]]
name = "b"
partition = "p0"
qos = "%s"
"""


def test_spec_qos_default_and_roundtrip() -> None:
    spec = parse_spec(SPEC % "best-effort", "host.toml")
    assert [v.qos for v in spec.vm] == ["guaranteed", "best-effort"]
    assert parse_spec(dump_spec(spec)) == spec
    assert build(VmSpec, "vm", name="c", partition="p0").qos == "burstable"


def test_spec_refuses_an_unknown_class() -> None:
    with pytest.raises(SpecError, match=r"host.toml: vm\[1\].qos"):
        parse_spec(SPEC % "platinum", "host.toml")


def test_spec_refuses_guaranteed_vcpus_beyond_the_cores() -> None:
    with pytest.raises(SpecError, match=r"host.toml: vm\[1\].qos: partition 'p0' has 1 "
                       r"core\(s\) but its guaranteed VMs would have 2 vCPUs"):
        parse_spec(SPEC % "guaranteed", "host.toml")


def test_qos_roundtrips_in_the_state_file(tmp_path: Path) -> None:
    db = Database(tmp_path / "state.db")
    db.add_partition(PartitionRecord("p0", [0], 1024))
    db.add_vm(VmRecord("a", "p0", vcpus=1, memory_mib=128, qos="best-effort"))
    assert db.vm("a").qos == "best-effort"
    db.set_vm("a", qos="guaranteed")
    assert Database(tmp_path / "state.db").vm("a").qos == "guaranteed"


def test_an_older_state_file_gets_the_qos_column(tmp_path: Path) -> None:
    path = tmp_path / "state.db"
    Database(path).close()
    conn = sqlite3.connect(path)
    conn.execute("ALTER TABLE vms DROP COLUMN qos")
    conn.execute("INSERT INTO partitions (name, cpus, memory_mib, created_at) "
                 "VALUES ('p0', '[0]', 1024, 0)")
    conn.execute("INSERT INTO vms (name, partition, vcpus, memory_mib, image, disks, accel, "
                 "autostart, state, created_at) VALUES ('old', 'p0', 1, 128, 'minimal', "
                 "'[]', 'auto', 1, 'stopped', 0)")
    conn.commit()
    conn.close()
    assert Database(path).vm("old").qos == "burstable"
