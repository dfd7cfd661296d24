"""The SQLite state file: records round-trip, conflicts are refused, two connections
(the CLI and a supervisor) see each other's writes."""

from __future__ import annotations

from pathlib import Path

import pytest

from fusuma.errors import ConflictError, NotFoundError
from fusuma.state import Database, DiskRecord, PartitionRecord, VmRecord, VmState

# The partitions and vms tables as the first fusuma wrote them (a state file from then).
FIRST_TABLES = """
    CREATE TABLE partitions (name TEXT PRIMARY KEY, cpus TEXT NOT NULL,
        memory_mib INTEGER NOT NULL, io_weight INTEGER, qemu TEXT,
        supervisor_pid INTEGER, created_at REAL NOT NULL);
    CREATE TABLE vms (name TEXT PRIMARY KEY, partition TEXT NOT NULL, vcpus INTEGER
        NOT NULL, memory_mib INTEGER NOT NULL, image TEXT NOT NULL, disks TEXT NOT NULL,
        accel TEXT NOT NULL, autostart INTEGER NOT NULL, state TEXT NOT NULL,
        pid INTEGER, accel_used TEXT, qemu_binary TEXT, started_at REAL, error TEXT,
        created_at REAL NOT NULL);
"""


def test_roundtrip_and_conflicts(tmp_path: Path) -> None:
    db = Database(tmp_path / "state.db")
    db.add_partition(PartitionRecord("p0", [0, 1], 1024, io_weight=50))
    with pytest.raises(ConflictError, match="already exists"):
        db.add_partition(PartitionRecord("p0", [2], 64))
    db.add_disk(DiskRecord("d0", "/x.img", "p0", created_file=True))
    with pytest.raises(ConflictError):
        db.add_disk(DiskRecord("d1", "/x.img", "p0"))
    vm = VmRecord("vm0", "p0", vcpus=2, memory_mib=256, disks=["d0"])
    db.add_vm(vm)
    assert db.vm("vm0") == vm
    db.transition("vm0", VmState.STARTING)
    db.transition("vm0", VmState.RUNNING, pid=42, accel_used="tcg")
    other = Database(tmp_path / "state.db")
    got = other.vm("vm0")
    assert (got.state, got.pid, got.accel_used, got.disks) == (VmState.RUNNING, 42, "tcg",
                                                               ["d0"])
    assert other.partition("p0").cpus == [0, 1] and other.disk("d0").created_file
    with pytest.raises(NotFoundError, match="known: p0"):
        other.partition("nope")


def test_transaction_rolls_back(tmp_path: Path) -> None:
    db = Database(tmp_path / "state.db")
    with pytest.raises(RuntimeError), db.transaction():
        db.add_partition(PartitionRecord("p0", [0], 64))
        raise RuntimeError("boom")
    assert db.partitions() == []


def test_older_state_file_gets_new_columns(tmp_path: Path) -> None:
    import sqlite3

    path = tmp_path / "state.db"
    old = sqlite3.connect(path)
    old.executescript(FIRST_TABLES + """
        CREATE TABLE disks (name TEXT PRIMARY KEY, path TEXT NOT NULL UNIQUE,
            partition TEXT NOT NULL REFERENCES partitions(name),
            created_file INTEGER NOT NULL DEFAULT 0);
        INSERT INTO partitions VALUES ('p0', '[0]', 512, NULL, NULL, NULL, 0);
        INSERT INTO vms VALUES ('v', 'p0', 1, 256, 'minimal', '[]', 'auto', 1, 'stopped',
            NULL, NULL, NULL, NULL, NULL, 0);
        INSERT INTO disks VALUES ('d0', '/old/d0.img', 'p0', 1);
    """)
    old.close()
    db = Database(path)
    v = db.vm("v")
    assert (v.shared_ram, v.ram_path, v.qos) == (True, None, "burstable")
    db.add_vm(VmRecord("w", "p0", 1, 128))
    assert db.vm("w").memory_mib == 128
    # Disks registered without their file's identity: taken over once (first writer).
    assert db.disk("d0") == DiskRecord("d0", "/old/d0.img", "p0", True, None, None)
    assert db.storage_dirs() == []
    assert db.set_disk_identity("d0", 5, 6) and not db.set_disk_identity("d0", 7, 8)
    assert (db.disk("d0").dev, db.disk("d0").ino) == (5, 6)
