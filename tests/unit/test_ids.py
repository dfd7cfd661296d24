"""The ids the state file hands out: VMs' QEMU uids and templates' gids come from two
ranges that never meet, a deleted record's id is used again (the records host moves
make cannot use a range up), a full range is refused with one sentence and nothing
stored, and a state file from before ids were kept keeps the ids its VMs and
templates had. The default range lies where systemd's UIDS-GIDS.md says no one
allocates. A real SQLite file in tmp_path."""

from __future__ import annotations

import sqlite3
import threading
from pathlib import Path

import pytest

from fusuma.errors import ResourceError
from fusuma.paths import (
    DEFAULT_UID_BASE,
    LEGACY_UID_BASE,
    UID_SPAN,
    Paths,
    template_gids,
    vm_uids,
)
from fusuma.state import Database, PartitionRecord, VmRecord
from fusuma.state.records import TemplateRecord
from tests.unit.test_state import FIRST_TABLES

# systemd's docs/UIDS-GIDS.md: its container range (nspawn --private-users=pick,
# machined), its foreign range (mountfsd), and 2^31, above which ids are trouble.
CONTAINERS = range(524288, 1879048191 + 1)
FOREIGN = range(0x7FFE0000, 0x7FFEFFFF + 1)


def vm(name: str) -> VmRecord:
    return VmRecord(name=name, partition="p0", vcpus=1, memory_mib=64)


def template(name: str) -> TemplateRecord:
    return TemplateRecord(name=name, ram_path=f"/shm/{name}.tram",
                          state_path=f"/h/{name}/state", size_bytes=1, memory_mib=64,
                          vcpus=1, machine="pc-q35-10.0", qemu_version="10.0.2",
                          devices="{}", image="minimal", state_sha256="0", source_vm="x")


@pytest.fixture
def db(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Database:
    monkeypatch.delenv("FUSUMA_UID_BASE", raising=False)
    d = Database(tmp_path / "state.db")
    d.add_partition(PartitionRecord("p0", [0], 1 << 20))
    return d


def test_the_default_ranges_are_where_no_one_else_allocates() -> None:
    p = Paths(home=Path("/h"), runtime=Path("/r"), shm=Path("/s"), cache=Path("/c"),
              cgroup_prefix="t")
    ids = range(p.uid_base, p.uid_base + UID_SPAN)
    assert p.uid_base == DEFAULT_UID_BASE == 0x7000_0000 and p.uid_base & 0xFFFF == 0
    for other in (CONTAINERS, FOREIGN):
        assert ids.stop <= other.start or ids.start >= other.stop, other
    assert ids.stop <= 2**31
    # The two ranges of one base: side by side, never overlapping, 65535 VMs.
    assert p.vm_uids.stop == p.template_gids.start and len(p.vm_uids) == 65535
    assert not set(p.vm_uids) & set(p.template_gids)
    # The default of before lay in the container range.
    assert LEGACY_UID_BASE in CONTAINERS


def test_ids_come_from_their_own_range_and_are_used_again(db: Database) -> None:
    uids, gids = vm_uids(1000_000), template_gids(1000_000)
    a = db.add_vm(vm("a"), uids)
    t = db.add_template(template("t"), gids)
    b = db.add_vm(vm("b"), uids)
    assert (a.uid, b.uid, t.gid) == (1000_001, 1000_002, 1065_536)
    assert db.vm("a").uid == a.uid and db.template("t").gid == t.gid
    # A host move's coming and going, far more often than the range is long, while one
    # VM (b) stays: the uid the leaver held is the next arrival's.
    small = range(uids.start, uids.start + 4)
    for i in range(40):
        got = db.add_vm(vm(f"mover{i}"), small)
        assert got.uid == 1000_003, got
        db.remove_vm(f"mover{i}")
    db.remove_vm("a")
    assert db.add_vm(vm("c"), small).uid == a.uid       # the lowest free one


def test_a_full_range_is_refused_and_nothing_is_stored(db: Database) -> None:
    small = range(500, 503)
    for name in "abc":
        db.add_vm(vm(name), small)
    events = db.last_event_id()
    with pytest.raises(ResourceError) as err:
        db.add_vm(vm("d"), small)
    assert str(err.value) == ("all 3 uids fusuma keeps for VMs' QEMUs (500-502) are held "
                              "by defined VMs; delete a VM you no longer need, and its uid "
                              "is free again.")
    assert db.find_vm("d") is None and db.last_event_id() == events
    db.add_template(template("t1"), range(900, 901))
    with pytest.raises(ResourceError, match=r"^all 1 groups fusuma keeps for templates "
                                            r"\(900-900\) are held by templates; delete"):
        db.add_template(template("t2"), range(900, 901))
    assert db.find_template("t2") is None


def test_concurrent_writers_never_share_an_id(tmp_path: Path, db: Database) -> None:
    got: list[int] = []
    lock = threading.Lock()

    def define(prefix: str) -> None:
        mine = Database(tmp_path / "state.db")        # a connection of its own
        for i in range(25):
            uid = mine.add_vm(vm(f"{prefix}{i}"), vm_uids(DEFAULT_UID_BASE)).uid
            with lock:
                got.append(uid)
    threads = [threading.Thread(target=define, args=(p,)) for p in "xyz"]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(got) == 75 and len(set(got)) == 75
    assert sorted(got) == list(range(DEFAULT_UID_BASE + 1, DEFAULT_UID_BASE + 76))


def old_state_file(path: Path) -> None:
    """The vms and templates tables as fusuma wrote them before ids were kept, with
    gaps in the rowids (deleted records)."""
    con = sqlite3.connect(path)
    con.executescript(FIRST_TABLES + """
        INSERT INTO partitions VALUES ('p0', '[0]', 1048576, NULL, NULL, NULL, 0);
        CREATE TABLE templates (name TEXT PRIMARY KEY, ram_path TEXT NOT NULL UNIQUE,
            state_path TEXT NOT NULL UNIQUE, size_bytes INTEGER NOT NULL,
            memory_mib INTEGER NOT NULL, vcpus INTEGER NOT NULL, machine TEXT NOT NULL,
            qemu_version TEXT NOT NULL, devices TEXT NOT NULL, image TEXT NOT NULL,
            segments TEXT NOT NULL DEFAULT '[]', accel TEXT NOT NULL,
            state_sha256 TEXT NOT NULL, source_vm TEXT NOT NULL, created_at REAL NOT NULL);
    """)
    for rowid, name in ((1, "old1"), (4, "old4"), (7, "old7")):
        con.execute("INSERT INTO vms (rowid, name, partition, vcpus, memory_mib, image, "
                    "disks, accel, autostart, state, created_at) VALUES "
                    "(?, ?, 'p0', 1, 64, 'minimal', '[]', 'tcg', 0, 'stopped', 0)",
                    (rowid, name))
    for rowid, name in ((1, "tp1"), (3, "tp3")):
        con.execute("INSERT INTO templates (rowid, name, ram_path, state_path, size_bytes, "
                    "memory_mib, vcpus, machine, qemu_version, devices, image, accel, "
                    "state_sha256, source_vm, created_at) VALUES "
                    "(?, ?, ?, ?, 1, 64, 1, 'm', '10.0.2', '{}', 'minimal', 'tcg', '0', "
                    "'x', 0)", (rowid, name, f"/r{rowid}", f"/s{rowid}"))
    con.commit()
    con.close()


@pytest.mark.parametrize("env_base", [None, 1_600_000_000])
def test_an_old_state_file_keeps_its_ids(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                         env_base: int | None) -> None:
    if env_base is None:
        monkeypatch.delenv("FUSUMA_UID_BASE", raising=False)
    else:
        monkeypatch.setenv("FUSUMA_UID_BASE", str(env_base))
    old_state_file(tmp_path / "state.db")
    db = Database(tmp_path / "state.db")
    base = env_base or LEGACY_UID_BASE        # what the records were made with
    assert {v.name: v.uid for v in db.vms()} == {
        "old1": base + 1, "old4": base + 4, "old7": base + 7}
    assert {t.name: t.gid for t in db.templates()} == {
        "tp1": base + 65535, "tp3": base + 65533}
    again = Database(tmp_path / "state.db")            # once: nothing changes on reopen
    assert [v.uid for v in again.vms()] == [v.uid for v in db.vms()]
    p = Paths.from_env()
    assert p.uid_base == (env_base or DEFAULT_UID_BASE)
    # New records step around every id an old one holds: with the same base, the old
    # VMs' uids and the old templates' gids (which lay inside what is now the VMs'
    # range) are skipped.
    new = [db.add_vm(vm(f"new{i}"), p.vm_uids).uid for i in range(5)]
    if env_base is None:
        assert new == [DEFAULT_UID_BASE + i for i in range(1, 6)]
    else:
        assert new == [base + 2, base + 3, base + 5, base + 6, base + 8]
        top = range(base + 65533, base + 65536)           # the old templates' gids
        assert db.add_vm(vm("top"), top).uid == base + 65534
    assert db.add_template(template("t9"), p.template_gids).gid == p.template_gids.start
    # The old QEMUs' uids still count as this namespace's (fusuma.qemu.process).
    assert any(base + 7 in r for r in p.qemu_uids)
