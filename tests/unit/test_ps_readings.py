"""`ps --json` reads each running VM's guest RAM once: its row and its partition's sums
come from that one reading (a guest touching its RAM between two readings would show a
VM holding more than its partition). A real SQLite state file in tmp_path; the reader
of the RAM's resident size is counted."""

from __future__ import annotations

from pathlib import Path

import pytest

from fusuma.memshare import reporting
from fusuma.ops.context import Ctx
from fusuma.paths import Paths
from fusuma.state import PartitionRecord, VmRecord, VmState
from fusuma.views.host import partitions_data, ps_data

MIB = 1 << 20


@pytest.fixture
def ctx(tmp_path: Path) -> Ctx:
    paths = Paths(home=tmp_path / "home", runtime=tmp_path / "run", shm=tmp_path / "shm",
                  cache=tmp_path / "cache", cgroup_prefix="fusuma-unit-ps")
    c = Ctx(paths)
    c.db.add_partition(PartitionRecord("p0", [0], 1024))
    c.db.add_partition(PartitionRecord("p1", [1], 1024))
    for name, part, state in (("a", "p0", VmState.RUNNING), ("b", "p0", VmState.PAUSED),
                              ("c", "p1", VmState.RUNNING), ("d", "p0", VmState.STOPPED)):
        c.db.add_vm(VmRecord(name, part, vcpus=1, memory_mib=256, state=state,
                             pid=None if state == VmState.STOPPED else 999_999_999,
                             ram_path=str(tmp_path / f"{name}.ram"),
                             memory_class="burstable", memory_min=64))
    return c


@pytest.fixture
def reads(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The VMs whose resident RAM was read, in order; each reading is 10 MiB more
    than the one before (a guest touching its RAM meanwhile)."""
    seen: list[str] = []

    def resident_bytes(vm: VmRecord, pid: int | None) -> int:
        seen.append(vm.name)
        return (100 + 10 * len(seen)) * MIB
    monkeypatch.setattr(reporting, "resident_bytes", resident_bytes)
    return seen


def test_ps_reads_each_running_vm_once_for_its_row_and_its_partition(
        ctx: Ctx, reads: list[str]) -> None:
    data = ps_data(ctx)
    assert sorted(reads) == ["a", "b", "c"]             # once each; "d" does not run
    rows = {v["name"]: v for v in data["vms"]}
    got = {n: rows[n]["ram"]["resident_mib"] for n in "abc"}
    assert sorted(got.values()) == [110.0, 120.0, 130.0]
    for n in "abc":
        assert rows[n]["memory"]["resident_mib"] == got[n]
        assert rows[n]["memory"]["reclaimable_mib"] == got[n] - 64
    assert rows["d"]["ram"]["resident_mib"] is None and rows["d"]["memory"]["resident_mib"] \
        is None
    adm = {p["name"]: p["memory_admission"] for p in data["partitions"]}
    assert (adm["p0"]["resident_mib"], adm["p0"]["reclaimable_mib"]) == \
        (got["a"] + got["b"], got["a"] + got["b"] - 2 * 64)
    assert (adm["p1"]["resident_mib"], adm["p1"]["reclaimable_mib"]) == \
        (got["c"], got["c"] - 64)
    assert adm["p0"]["ram_mib"] == 3 * 256


def test_partition_list_and_vm_list_read_each_running_vm_once(
        ctx: Ctx, reads: list[str]) -> None:
    parts = partitions_data(ctx)
    assert sorted(reads) == ["a", "b", "c"]
    mib = {n: 110.0 + 10 * i for i, n in enumerate(reads)}      # what each reading said
    assert [p["memory_admission"]["resident_mib"] for p in parts] == \
        [mib["a"] + mib["b"], mib["c"]]
    reads.clear()
    vms = ps_data(ctx, vms_only=True)["vms"]
    assert sorted(reads) == ["a", "b", "c"]
    assert sorted(v["ram"]["resident_mib"] for v in vms if v["name"] != "d") == \
        [110.0, 120.0, 130.0]
