"""fusuma.capacity: the one memory arithmetic, its rendered sums, and the shm checks."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest

from fusuma import capacity
from fusuma.capacity import SUPERVISOR_MIB, Need, Term
from fusuma.errors import ResourceError
from fusuma.host.topology import HostInfo
from fusuma.paths import Paths
from fusuma.qemu.cmdline import overhead_mib
from fusuma.state import Database, PartitionRecord, VmRecord

MIB = 2**20


@pytest.fixture(autouse=True)
def _fixed_tb(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FUSUMA_TCG_TB_MIB", "32")    # overhead_mib("tcg") == 128


@pytest.fixture
def db(tmp_path: Path) -> Database:
    d = Database(tmp_path / "state.db")
    d.add_partition(PartitionRecord("p0", [0], 768))
    d.add_partition(PartitionRecord("p1", [1], 512))
    return d


@pytest.fixture
def paths(tmp_path: Path) -> Paths:
    return Paths(home=tmp_path / "home", runtime=tmp_path / "run", shm=tmp_path / "shm",
                 cache=tmp_path / "cache", cgroup_prefix="t")


def vm(name: str, part: str = "p0", mib: int = 256, overhead: int | None = 128,
       **kw: Any) -> VmRecord:
    return VmRecord(name=name, partition=part, vcpus=1, memory_mib=mib, overhead_mib=overhead,
                    **kw)


def test_footprint_is_fixed_at_definition_with_fallback_for_old_records() -> None:
    assert capacity.vm_footprint(vm("a", overhead=100)) == 356
    # A record from an older state file: no overhead recorded, computed from the
    # accelerator it ran with, else the one it asked for, else TCG's (the larger).
    assert overhead_mib("tcg") == 128 and overhead_mib("kvm") == 96
    assert capacity.vm_footprint(vm("a", overhead=None)) == 256 + 128
    assert capacity.vm_footprint(vm("a", overhead=None, accel_used="kvm")) == 256 + 96
    assert capacity.vm_footprint(vm("a", overhead=None, accel="kvm")) == 256 + 96
    assert capacity.definition_overhead("kvm") == 96
    assert capacity.definition_overhead("tcg") == 128
    assert capacity.definition_overhead("auto") in (96, 128)


def test_recorded_overhead_survives_the_state_file(db: Database) -> None:
    db.add_vm(vm("a", overhead=111))
    db.add_vm(vm("old", overhead=None))
    assert db.vm("a").overhead_mib == 111 and db.vm("old").overhead_mib is None
    assert capacity.vm_footprint(db.vm("a")) == 367
    assert capacity.vm_footprint(db.vm("old")) == 384


def test_need_renders_the_sum() -> None:
    need = Need((Term("", 64), Term("vm0", 384), Term("web0", 384)))
    assert need.total == 832
    assert str(need) == "64 + vm0 384 + web0 384 = 832"
    assert need.against(768) == "64 + vm0 384 + web0 384 = 832 > 768 MiB"
    assert need.against(900) == "64 + vm0 384 + web0 384 = 832 <= 900 MiB"
    assert str(Need((Term("", 64),))) == "64"


def test_partition_counts_qemus_and_private_ram_only(db: Database) -> None:
    db.add_vm(vm("vm0"))
    db.add_vm(vm("web0"))
    db.add_vm(vm("x", part="p1"))
    # Guest RAM in a shared file is admitted host-wide: a partition counts the QEMUs.
    assert str(capacity.partition_need(db, "p0")) == "64 + vm0 128 + web0 128 = 320"
    assert capacity.partition_need(db, "p0", removing=["vm0"]).total == 64 + 128
    got = capacity.partition_need(db, "p0", adding=[vm("web1", mib=128)])
    assert str(got) == "64 + vm0 128 + web0 128 + web1 128 = 448"
    # A VM already counted is not counted twice.
    assert capacity.partition_need(db, "p0", adding=[vm("vm0")]).total == 320
    assert capacity.partition_need(db, "p1").total == SUPERVISOR_MIB + 128
    # Private RAM is its QEMU's anonymous memory: it counts in the partition.
    got = capacity.partition_need(db, "p1", adding=[vm("k", mib=256, shared_ram=False)])
    assert str(got) == "64 + x 128 + k 384 = 576"
    assert capacity.guest_ram(vm("k", shared_ram=False)) == 0
    assert capacity.guest_ram(vm("s", mib=300)) == 300


def test_create_refused_with_the_sum_and_the_fix(db: Database) -> None:
    db.add_vm(vm("vm0"))
    got = capacity.check_partition_room(db, "p0", [vm("web0", overhead=300)], "create")
    assert str(got) == "64 + vm0 128 + web0 300 = 492"
    db.add_vm(vm("web0", overhead=300))
    with pytest.raises(ResourceError) as info:
        capacity.check_partition_room(db, "p0", [vm("web1", overhead=300)], "create")
    assert str(info.value) == (
        "partition 'p0' has no room for 'web1': 64 + vm0 128 + web0 300 + web1 300 = 792 "
        "> 768 MiB; grow it with `fusuma partition resize p0 --memory 792` or give the VM "
        "less memory.")


def test_create_refused_when_the_host_cannot_hold_the_guest_ram(db: Database) -> None:
    host = HostInfo(cpus=[0, 1], mems=[0], memory_total_mib=3072, memory_reserved_mib=1024)
    db.add_vm(vm("vm0", mib=512))
    capacity.check_host_ram(db, host, [vm("a", mib=256)], "VM 'a'", "x")  # 768+512+512+256
    with pytest.raises(ResourceError) as info:
        capacity.check_host_ram(db, host, [vm("a", mib=300)], "VM 'a'",
                                "give it less memory")
    assert str(info.value) == (
        "VM 'a': the host would need p0 768 + p1 512 + vm0 RAM 512 + a RAM 300 = 2092 > "
        "2048 MiB (partitions' budgets plus guest RAM; 1024 MiB is kept for the host "
        "itself); give it less memory.")


def test_zero_copy_move_needs_room_for_the_new_qemu_only(db: Database, paths: Paths) -> None:
    db.add_vm(vm("a", mib=4096))
    db.add_vm(vm("b", mib=4096))
    # p1 has 512 MiB: a 4 GiB guest moves in, its RAM stays where it is (host-wide).
    capacity.check_move(paths, db, db.vm("a"), "p1", "zero-copy")    # 64 + 128 <= 512
    db.add_vm(vm("c", part="p1", mib=64, overhead=350))
    with pytest.raises(ResourceError) as info:
        capacity.check_move(paths, db, db.vm("a"), "p1", "zero-copy")
    msg = str(info.value)
    assert msg.startswith("partition 'p1' has no room for 'a': 64 + c 350 + a 128 = 542 > "
                          "512 MiB; grow it with `fusuma partition resize p1 --memory 542`")
    assert msg.endswith("or move a VM out of it first.")
    with pytest.raises(ResourceError, match=r"no room for the VMs 'a', 'b': 64 \+ c 350 \+ a "
                                            r"128 \+ b 128 = 670 > 512 MiB"):
        capacity.check_many(paths, db, [db.vm("a"), db.vm("b")], "p1")


def test_resize_refused_below_need(db: Database) -> None:
    db.add_vm(vm("va"))
    capacity.check_resize(db, "p0", 192)
    with pytest.raises(ResourceError) as info:
        capacity.check_resize(db, "p0", 150)
    assert str(info.value) == (
        "partition 'p0' needs at least 192 MiB for its supervisor and VMs (64 + va 128 = 192 "
        "> 150 MiB); give it at least 192 MiB or move or delete a VM first.")


def test_host_room(db: Database) -> None:
    host = HostInfo(cpus=[0, 1], mems=[0], memory_total_mib=3072, memory_reserved_mib=1024)
    capacity.check_host_room(db, host, "p0", 1536)     # 1536 + 512 = 2048
    db.add_vm(vm("g", part="p1", mib=200))
    with pytest.raises(ResourceError) as info:
        capacity.check_host_room(db, host, "p2", 1000)
    assert str(info.value) == (
        "partition 'p2' asks for 1000 MiB but only 568 MiB is left on this host "
        "(p0 768 + p1 512 + p2 1000 + g RAM 200 = 2480 > 2048 MiB: partitions' budgets plus "
        "guest RAM; 1024 MiB is kept for the host itself); shrink another partition, delete "
        "a VM or ask for less.")


def test_the_full_host_case_of_issue_18(tmp_path: Path) -> None:
    """24 GiB host, 21695 MiB for partitions; a (14000 MiB, as an older fusuma sized it)
    runs a 12 GiB VM; b has 4000 MiB. Taken over, a keeps 14000 - 12288 as its budget,
    and the VM can move to b and back zero-copy, which needs no second 12 GiB."""
    host = HostInfo(cpus=[0, 1], mems=[0], memory_total_mib=24105, memory_reserved_mib=2410)
    db = Database(tmp_path / "old.db")
    db.add_partition(PartitionRecord("a", [0], 14000))
    db.add_partition(PartitionRecord("b", [1], 4000))
    db.add_vm(vm("big", part="a", mib=12288, overhead=192))
    notices = capacity.take_over(db)
    assert notices == ["fusuma: notice: partition 'a': memory 14000 MiB included its VMs' "
                       "guest RAM (12288 MiB), which is now admitted host-wide; its budget "
                       "for QEMUs and its supervisor is 1712 MiB."]
    assert db.partition("a").memory_mib == 1712
    assert capacity.take_over(db) == []                # once per state file
    paths = Paths(home=tmp_path, runtime=tmp_path, shm=tmp_path / "shm", cache=tmp_path,
                  cgroup_prefix="t")
    capacity.check_move(paths, db, db.vm("big"), "b", "zero-copy", host=host)
    capacity.check_many(paths, db, [db.vm("big")], "b", host=host)
    # A copy move would hold a second 12 GiB file: refused before anything starts.
    with pytest.raises(ResourceError) as info:
        capacity.check_move(paths, db, db.vm("big"), "b", "copy", host=host)
    assert str(info.value).startswith(
        "a copy move of 'big' holds a second RAM file until it ends: the host would need "
        "a 1712 + b 4000 + big RAM 12288 + big RAM (second copy) 12288 = 30288 > 21695 MiB")


# -- shm ----------------------------------------------------------------------------------
class FakeVfs:
    def __init__(self, free_mib: int) -> None:
        self.f_frsize = 4096
        self.f_bavail = free_mib * MIB // 4096


def fake_statvfs(monkeypatch: pytest.MonkeyPatch, free_mib: int) -> list[str]:
    seen: list[str] = []

    def statvfs(path: Any) -> FakeVfs:
        seen.append(str(path))
        return FakeVfs(free_mib)

    monkeypatch.setattr(capacity.os, "statvfs", statvfs)
    return seen


def sparse(path: Path, size_mib: int, filled_mib: int = 0) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "wb") as f:
        f.truncate(size_mib * MIB)
        f.write(b"\1" * filled_mib * MIB)
        f.flush()
        os.fsync(f.fileno())


def test_start_fits_a_fake_fs_and_looks_at_the_parent_when_shm_is_missing(
        monkeypatch: pytest.MonkeyPatch, paths: Paths) -> None:
    seen = fake_statvfs(monkeypatch, 300)
    capacity.check_start(paths, vm("v", mib=256))
    assert seen == [str(paths.shm.parent)]      # shm does not exist yet
    # Private RAM needs no room there.
    fake_statvfs(monkeypatch, 0)
    capacity.check_start(paths, vm("p", shared_ram=False))


def test_start_refused_with_the_sum(monkeypatch: pytest.MonkeyPatch, paths: Paths) -> None:
    sparse(paths.shm / "other.ram", 128, filled_mib=28)     # 100 MiB still to fill
    fake_statvfs(monkeypatch, 300)
    with pytest.raises(ResourceError) as info:
        capacity.check_start(paths, vm("v", mib=256))
    msg = str(info.value)
    assert msg.startswith(f"starting 'v' needs 356 MiB in {paths.shm} (")
    assert "but 300 MiB is free there (v 256 + unfilled other 100 = 356 > 300 MiB free); " \
           "free memory there" in msg
    assert msg.endswith("or give the VM less memory.")


def test_start_counts_what_the_old_ram_file_already_holds(
        monkeypatch: pytest.MonkeyPatch, paths: Paths) -> None:
    # The start replaces v's RAM file: the 200 MiB it holds are freed for the new file.
    sparse(paths.ram_file("v"), 256, filled_mib=200)
    fake_statvfs(monkeypatch, 60)
    capacity.check_start(paths, vm("v", mib=256))
    need = capacity.shm_need(paths, "v", 256, replacing=[paths.ram_file("v")])
    assert str(need) == "v 56"
    fake_statvfs(monkeypatch, 50)
    with pytest.raises(ResourceError, match=r"\(v 56 > 50 MiB free\)"):
        capacity.check_start(paths, vm("v", mib=256))


def test_real_sparse_files_and_real_statvfs(paths: Paths) -> None:
    sparse(paths.shm / "a.ram", 64, filled_mib=4)
    sparse(paths.shm / "b.1234abcd.ram", 32, filled_mib=32)
    need = capacity.shm_need(paths, "c", 16)
    assert str(need) == "c 16 + unfilled a 60 = 76"
    space = capacity.shm_space(paths)
    st = os.statvfs(paths.shm)
    assert space.free_mib == st.f_bavail * st.f_frsize // MIB
    assert space.fstype != "?" and space.path == paths.shm
    # A file far larger than the filesystem is refused, naming the directory.
    huge = space.free_mib + 1
    with pytest.raises(ResourceError, match=f"needs {huge + 60} MiB in {paths.shm}"):
        capacity.check_start(paths, vm("c", mib=huge))


def test_copy_move_needs_a_second_ram_file(monkeypatch: pytest.MonkeyPatch, db: Database,
                                           paths: Paths) -> None:
    db.add_vm(vm("a", mib=128, overhead=0))
    rec = db.vm("a")
    sparse(paths.ram_file("a"), 128, filled_mib=128)
    fake_statvfs(monkeypatch, 100)
    capacity.check_move(paths, db, rec, "p1", "zero-copy")     # the file changes owner
    capacity.check_move(paths, db, vm("priv", mib=128, overhead=0, shared_ram=False),
                        "p1", "copy")                          # private RAM: no file
    with pytest.raises(ResourceError) as info:
        capacity.check_move(paths, db, rec, "p1", "copy")
    msg = str(info.value)
    assert msg.startswith(f"a copy move of 'a' needs 128 MiB in {paths.shm} (")
    assert "(a (second copy) 128 > 100 MiB free); use --mode zero-copy" in msg
    # maintain: the moves run one by one, so the largest second file is what counts.
    db.add_vm(vm("b", mib=96, overhead=0))
    with pytest.raises(ResourceError, match="a copy move of 'a' needs 128 MiB"):
        capacity.check_many(paths, db, [db.vm("a"), db.vm("b")], "p1",
                            {"a": "copy", "b": "copy"})
    capacity.check_many(paths, db, [db.vm("a"), db.vm("b")], "p1")   # zero-copy both


def test_fstype_of_a_tmpfs() -> None:
    if not Path("/dev/shm").is_dir():
        pytest.skip("no /dev/shm")
    assert capacity._fstype(Path("/dev/shm/does-not-matter")) in ("tmpfs", "?")


def test_spec_partition_too_small_for_its_vms() -> None:
    from fusuma.errors import SpecError
    from fusuma.spec import check_host_fit, parse_spec

    host = HostInfo(cpus=[0, 1], mems=[0], memory_total_mib=24000, memory_reserved_mib=2400)
    text = ('[[partition]]\nname="web"\ncpus="0"\nmemory_mib={mib}\n'
            '[[vm]]\nname="w1"\npartition="web"\nmemory_mib=192\naccel="tcg"\n'
            '[[vm]]\nname="w2"\npartition="web"\nmemory_mib=192\naccel="kvm"\n')
    check_host_fit(parse_spec(text.format(mib=288), "s.toml"), host)   # 64 + 128 + 96
    with pytest.raises(SpecError) as info:
        check_host_fit(parse_spec(text.format(mib=256), "s.toml"), host, "s.toml")
    assert str(info.value) == (
        "s.toml: partition[0].memory_mib: partition 'web' has no room for its VMs "
        "(64 + w1 128 + w2 96 = 288 > 256 MiB); set memory_mib = 288 or give its VMs less "
        "memory.")
    # Guest RAM counts host-wide: two 10 GiB guests do not fit beside the partition.
    big = text.replace("memory_mib=192", "memory_mib=10240")
    with pytest.raises(SpecError) as info:
        check_host_fit(parse_spec(big.format(mib=2048), "s.toml"), host, "s.toml")
    assert str(info.value) == (
        "s.toml: partitions and guest RAM ask for 22528 MiB of memory but this host can "
        "give at most 21600 MiB (web 2048 + w1 RAM 10240 + w2 RAM 10240 = 22528 > 21600 "
        "MiB; 2400 MiB is kept for the host itself).")
