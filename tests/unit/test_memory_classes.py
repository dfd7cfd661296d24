"""Overcommit by policy (fusuma.capacity): memory classes, floors, the admitted figure in
every budget it enters, the refusals' sums, and the settings' validation."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from fusuma import capacity
from fusuma.errors import ResourceError, SpecError
from fusuma.host.topology import HostInfo
from fusuma.paths import Paths
from fusuma.spec import parse_spec
from fusuma.state import Database, PartitionRecord, VmRecord

MIB = 2**20
# 3072 - 1024: 2048 MiB for partitions' budgets and guest RAM.
HOST = HostInfo(cpus=[0, 1], mems=[0], memory_total_mib=3072, memory_reserved_mib=1024)


@pytest.fixture
def db(tmp_path: Path) -> Database:
    d = Database(tmp_path / "state.db")
    d.add_partition(PartitionRecord("p0", [0], 256))
    d.add_partition(PartitionRecord("p1", [1], 256))
    return d


def vm(name: str, part: str = "p0", mib: int = 256, floor: int | None = None,
       **kw: Any) -> VmRecord:
    cls = "guaranteed" if floor is None else "burstable"
    return VmRecord(name=name, partition=part, vcpus=1, memory_mib=mib, overhead_mib=128,
                    memory_class=cls, memory_min=floor, **kw)


# (RAM, floor, overcommit) -> admitted MiB: floor + ceil((RAM - floor) / overcommit)
ADMITTED = [
    (256, None, 2.0, 256),      # guaranteed: whole, whatever the overcommit
    (256, 64, 1.0, 256),        # overcommit 1.0: whole, as before overcommit existed
    (256, 64, 2.0, 64 + 96),
    (256, 64, 1.5, 64 + 128),
    (1000, 1, 3.0, 1 + 333),    # 999 / 3 = 333 exactly: no float residue rounds it up
    (1000, 100, 7.0, 100 + 129),   # 900 / 7 = 128.57 -> 129 (rounded up)
    (256, 256, 4.0, 256),       # a floor at the RAM: nothing above it to overcommit
]


@pytest.mark.parametrize(("ram", "floor", "oc", "want"), ADMITTED)
def test_admitted_ram(ram: int, floor: int | None, oc: float, want: int) -> None:
    assert capacity.admitted_ram(vm("v", mib=ram, floor=floor), oc) == want


def test_private_ram_is_never_overcommitted() -> None:
    # Its RAM lives under the partition's hard limit beside other VMs' QEMUs.
    v = vm("k", mib=512, floor=64, shared_ram=False)
    assert capacity.admitted_ram(v, 4.0) == 512
    assert capacity.guest_ram(v, 4.0) == 0
    assert capacity.partition_share(v) == 512 + 128


# (class floor, resident) -> reclaimable: resident above the floor, 0 when guaranteed
RECLAIMABLE = [
    (None, 200.0, 0.0),
    (64, 200.0, 136.0),
    (64, 50.0, 0.0),
    (64, None, None),
    (None, None, 0.0),
]


@pytest.mark.parametrize(("floor", "resident", "want"), RECLAIMABLE)
def test_reclaimable(floor: int | None, resident: float | None, want: float | None) -> None:
    assert capacity.reclaimable_mib(vm("v", floor=floor), resident) == want


def test_host_budget_counts_burstable_vms_at_their_partitions_overcommit(
        db: Database) -> None:
    db.update_partition(PartitionRecord("p1", [1], 256, memory_overcommit=2.0))
    db.add_vm(vm("g", mib=512))
    db.add_vm(vm("b", part="p1", mib=1024, floor=128))       # 128 + 896 / 2 = 576
    need = capacity.host_now(db)
    assert str(need) == "p0 256 + p1 256 + b burstable RAM 576 + g RAM 512 = 1600"
    # The same VM in p0 (the host's 1.0) counts whole; a host setting changes that.
    db.add_vm(vm("c", mib=1024, floor=128))
    assert capacity.host_now(db).total == 1600 + 1024
    db.set_setting(capacity.OVERCOMMIT_KEY, "4.0")
    assert capacity.host_overcommit(db) == 4.0
    assert capacity.overcommits(db) == {"p0": 4.0, "p1": 2.0}   # p1's own wins
    assert capacity.host_now(db).total == 1600 + 128 + 224


def test_a_guaranteed_vm_that_does_not_fit_is_refused_with_its_sum(db: Database) -> None:
    db.update_partition(PartitionRecord("p0", [0], 256, memory_overcommit=2.0))
    db.add_vm(vm("b", mib=2048, floor=64))                   # 64 + 1984 / 2 = 1056
    capacity.check_host_ram(db, HOST, [vm("b2", mib=800, floor=64)], "VM 'b2'", "x")
    with pytest.raises(ResourceError) as info:
        capacity.check_host_ram(db, HOST, [vm("g", mib=600)], "VM 'g'", "give it less")
    assert str(info.value) == (
        "VM 'g': the host would need p0 256 + p1 256 + b burstable RAM 1056 + g RAM 600 = "
        "2168 > 2048 MiB (partitions' budgets plus guest RAM (a burstable VM's at its "
        "floor plus its RAM above it divided by its partition's overcommit); 1024 MiB is "
        "kept for the host itself); give it less.")


def test_lowering_an_overcommit_is_refused_while_the_vms_would_not_fit(
        db: Database) -> None:
    db.update_partition(PartitionRecord("p0", [0], 256, memory_overcommit=2.0))
    db.add_vm(vm("b", mib=2048, floor=64))
    capacity.check_host_room(db, HOST, "p0", 256, 1.9)     # 64 + 1045 fits
    with pytest.raises(ResourceError) as info:
        capacity.check_host_room(db, HOST, "p0", 256, 1.0)
    assert str(info.value) == (
        "partition 'p0' at memory overcommit 1: the host would need p0 256 + p1 256 + b "
        "burstable RAM 2048 = 2560 > 2048 MiB (partitions' budgets plus guest RAM (a "
        "burstable VM's at its floor plus its RAM above it divided by its partition's "
        "overcommit); 1024 MiB is kept for the host itself); keep a higher overcommit, or "
        "delete a VM or shrink a partition first.")
    with pytest.raises(ResourceError, match=r"^the host at memory overcommit 1\.2: the host "
                                            r"would need p0 256 \+ p1 256 \+ b burstable"):
        # p0 takes the host's when it sets none
        db.update_partition(PartitionRecord("p0", [0], 256))
        db.set_setting(capacity.OVERCOMMIT_KEY, "2.0")
        capacity.check_host_overcommit(db, HOST, 1.2)


@pytest.mark.parametrize("bad", [0.5, 0.999, float("nan"), 17.0])
def test_an_overcommit_outside_1_to_16_is_one_sentence(bad: float) -> None:
    with pytest.raises(ResourceError) as info:
        capacity.check_overcommit(bad, "partition 'p0'")
    msg = str(info.value)
    assert msg.startswith("partition 'p0': memory overcommit ") and msg.count(". ") == 0


CLASS_ERRORS = [
    (128, "burstable", 256, "VM 'v': memory floor 256 MiB is above its RAM (128 MiB); "
                            "give --memory-min 128 or less, or more --memory."),
    (128, "burstable", None, "VM 'v': a burstable VM needs a floor, the RAM it is never "
                             "reclaimed below: give --memory-min MiB (at most its 128 MiB)."),
    (128, "guaranteed", 64, "VM 'v': a guaranteed VM's RAM is never reclaimed, so it has no "
                            "floor; drop --memory-min or make it --memory-class burstable."),
    (128, "burstable", 0, "VM 'v': memory floor 0 MiB is not positive; give --memory-min 1 "
                          "MiB or more."),
    (128, "elastic", None, "VM 'v': unknown memory class 'elastic'; use guaranteed or "
                           "burstable."),
]


@pytest.mark.parametrize(("ram", "cls", "floor", "want"), CLASS_ERRORS)
def test_memory_class_errors(ram: int, cls: str, floor: int | None, want: str) -> None:
    with pytest.raises(ResourceError) as info:
        capacity.check_memory_class("v", ram, cls, floor)
    assert str(info.value) == want


def test_the_spec_carries_classes_and_overcommits() -> None:
    spec = parse_spec('[host]\nmemory_overcommit = 1.5\n'
                      '[[partition]]\nname="p"\ncpus=0\nmemory_mib=256\nmemory_overcommit=2\n'
                      '[[vm]]\nname="v"\npartition="p"\nmemory_mib=1024\n'
                      'memory_class="burstable"\nmemory_min=128\n')
    assert spec.host.memory_overcommit == 1.5
    assert spec.partition[0].memory_overcommit == 2.0
    assert (spec.vm[0].memory_class, spec.vm[0].memory_min) == ("burstable", 128)
    assert parse_spec("").host.memory_overcommit == 1.0
    assert parse_spec('[[partition]]\nname="p"\ncpus=0\nmemory_mib=256\n'
                      ).partition[0].memory_overcommit is None


SPEC_ERRORS = [
    ('[host]\nmemory_overcommit = 0.5\n',
     "s.toml: host.memory_overcommit: memory overcommit 0.5 is below 1.0"),
    ('[[partition]]\nname="p"\ncpus=0\nmemory_mib=256\nmemory_overcommit=0.9\n',
     "s.toml: partition[0].memory_overcommit: memory overcommit 0.9 is below 1.0"),
    ('[[partition]]\nname="p"\ncpus=0\nmemory_mib=256\n[[vm]]\nname="v"\npartition="p"\n'
     'memory_class="burstable"\nmemory_min=512\n',
     "s.toml: vm[0]: memory floor 512 MiB is above its RAM (256 MiB); give memory_min 256 "
     "or less, or more memory_mib."),
]


@pytest.mark.parametrize(("text", "want"), SPEC_ERRORS)
def test_spec_errors(text: str, want: str) -> None:
    with pytest.raises(SpecError) as info:
        parse_spec(text, "s.toml")
    assert str(info.value).startswith(want)


def test_spec_host_fit_uses_the_overcommit() -> None:
    from fusuma.spec import check_host_fit

    text = ('[[partition]]\nname="p"\ncpus=0\nmemory_mib=256\nmemory_overcommit=2\n'
            '[[vm]]\nname="v"\npartition="p"\nmemory_mib=2048\nmemory_class="burstable"\n'
            'memory_min=64\n')
    check_host_fit(parse_spec(text), HOST)       # 256 + 64 + 992 = 1312 <= 2048
    with pytest.raises(SpecError, match=r"p 256 \+ v burstable RAM 2048 = 2304 > 2048"):
        check_host_fit(parse_spec(text.replace("memory_overcommit=2\n", "")), HOST)


def test_shm_room_counts_a_burstable_file_up_to_its_admitted_size(
        db: Database, tmp_path: Path) -> None:
    paths = Paths(home=tmp_path / "home", runtime=tmp_path / "run", shm=tmp_path / "shm",
                  cache=tmp_path / "cache", cgroup_prefix="t")
    paths.shm.mkdir()
    for stem in ("b", "g"):
        with open(paths.shm / f"{stem}.ram", "wb") as f:
            f.truncate(512 * MIB)       # sparse: nothing filled yet
    need = capacity.shm_need(paths, "n", 100, admitted={"b": 160})
    assert str(need) == "n 100 + unfilled b 160 + unfilled g 512 = 772"
    db.update_partition(PartitionRecord("p0", [0], 256, memory_overcommit=2.0))
    db.add_vm(vm("b", mib=512, floor=64, ram_path=str(paths.shm / "b.ram")))
    assert capacity.burstable_files(db) == {"b": 64 + 224}


def test_old_state_files_get_the_columns(tmp_path: Path) -> None:
    db = Database(tmp_path / "state.db")
    db.add_partition(PartitionRecord("p0", [0], 256))
    db.add_vm(vm("g"))
    got = Database(tmp_path / "state.db")
    assert got.vm("g").memory_class == "guaranteed" and got.vm("g").memory_min is None
    assert got.partition("p0").memory_overcommit is None


def test_a_move_into_a_lower_overcommit_is_refused_when_the_host_cannot_hold_it(
        db: Database, tmp_path: Path) -> None:
    paths = Paths(home=tmp_path / "home", runtime=tmp_path / "run", shm=tmp_path / "shm",
                  cache=tmp_path / "cache", cgroup_prefix="t")
    db.update_partition(PartitionRecord("p0", [0], 256, memory_overcommit=4.0))
    db.add_vm(vm("b", mib=2048, floor=64))            # 64 + 496 at 4.0; 2048 at 1.0
    db.add_vm(vm("g", mib=256))
    capacity.check_move(paths, db, db.vm("g"), "p1", "zero-copy", HOST)
    with pytest.raises(ResourceError) as info:
        capacity.check_move(paths, db, db.vm("b"), "p1", "zero-copy", HOST)
    assert str(info.value).startswith(
        "moving 'b' into partition 'p1' admits burstable RAM at that partition's memory "
        "overcommit (1): the host would need p0 256 + p1 256 + g RAM 256 + b burstable RAM "
        "2048 = 2816 > 2048 MiB")
    with pytest.raises(ResourceError, match="moving 'b' into partition 'p1'"):
        capacity.check_many(paths, db, [db.vm("b")], "p1", host=HOST)
