"""The memory governor's loop (fusuma.governor.memloop) against a fake host: what it
reads, what it asks of QEMU and the guest agents, what it says in its status."""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path
from typing import Any

import pytest

from fusuma.governor import balloons, memloop
from fusuma.governor.memloop import Actions, MemoryGovernor
from fusuma.state import Database, PartitionRecord, VmRecord, VmState

MIB = 2**20


class FakeCg:
    def __init__(self) -> None:
        self.fails = 0.0

    def ram_pressure(self, stem: str) -> dict[str, float | None]:
        return {"usage": 300.0 * MIB, "limit": 1100.0 * MIB, "fails": self.fails,
                "psi": None}


class Fake:
    """QEMUs and guest agents: balloon sizes, and what was asked."""

    def __init__(self, balloons: dict[str, int]) -> None:
        self.balloons = dict(balloons)
        self.asked: list[tuple[str, Any]] = []

    def actions(self) -> Actions:
        async def balloon(vm: str, mib: int) -> None:
            self.balloons[vm] = mib
            self.asked.append(("balloon", (vm, mib)))

        async def balloon_now(vm: str) -> int | None:
            return self.balloons.get(vm)

        async def guest(vm: str, argv: list[str]) -> None:
            self.asked.append(("guest", (vm, argv[-1])))

        return Actions(balloon, balloon_now, guest, lambda rec, pid: 700 * MIB,
                       lambda rec: True)


def _db(tmp_path: Path) -> Database:
    tmp_path.mkdir(exist_ok=True)
    db = Database(tmp_path / "state.db")
    db.add_partition(PartitionRecord("p0", [0], 512))
    for name, cls, floor in (("g", "guaranteed", None), ("b", "burstable", 256)):
        db.add_vm(VmRecord(name=name, partition="p0", vcpus=1, memory_mib=1024,
                           state=VmState.RUNNING, memory_class=cls, memory_min=floor,
                           ram_path=f"/dev/shm/x/{name}.ram"))
    return db


def _gov(db: Database, fake: Fake) -> MemoryGovernor:
    return MemoryGovernor("p0", FakeCg(), db,  # type: ignore[arg-type]
                          pids=lambda: {"g": 1, "b": 2}, actions=fake.actions(),
                          reserved_mib=2048, log=logging.getLogger("test"))


async def _ticks(gov: MemoryGovernor, n: int) -> list[str]:
    out = []
    for _ in range(n):
        out += [f"{d.vm} {d.action}" for d in await gov.tick()]
        await asyncio.sleep(0)       # let the spawned actions run
        await asyncio.sleep(0)
    return out


def test_a_short_host_takes_from_the_burstable_vm_only(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(memloop, "mem_available_mib", lambda: 500.0)   # target 1024
    monkeypatch.setattr(memloop, "memory_psi", lambda: 2.0)
    fake = Fake({"g": 1024, "b": 1024})
    gov = _gov(_db(tmp_path), fake)
    said = asyncio.run(_ticks(gov, 3))
    assert said == ["b trim", "b inflate", "b inflate"]
    assert fake.asked == [("guest", ("b", memloop.COMPACT_ARGV[-1])),
                          ("balloon", ("b", 768)), ("balloon", ("b", 512))]
    assert fake.balloons["g"] == 1024
    st = gov.status()
    assert st["target_free_mib"] == 1024 and st["host_free_mib"] == 500.0
    assert [(v["name"], v["class"], v["balloon_mib"]) for v in st["vms"]] == \
        [("b", "burstable", 512), ("g", "guaranteed", 1024)]
    assert [d["action"] for d in st["decisions"]] == ["trim", "inflate", "inflate"]
    assert st["decisions"][1]["numbers"]["host_free_mib"] == 500.0


def test_a_successor_finds_the_balloons_and_puts_back_what_breaks_a_rule(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A governor that starts after another was killed mid-reclaim: it takes the
    balloons QEMU reports as its own (no reset, no second inflate), and puts a
    guaranteed VM's balloon and one below a floor back at its first tick."""
    monkeypatch.setattr(memloop, "mem_available_mib", lambda: 1500.0)  # not short
    monkeypatch.setattr(memloop, "memory_psi", lambda: None)
    fake = Fake({"g": 600, "b": 100})
    gov = _gov(_db(tmp_path), fake)
    said = asyncio.run(_ticks(gov, 1))
    assert said == ["b deflate", "g deflate"]
    assert fake.balloons == {"g": 1024, "b": 256}
    fake2 = Fake({"g": 1024, "b": 512})
    gov2 = _gov(_db(tmp_path / "2"), fake2)
    assert asyncio.run(_ticks(gov2, 1)) == []
    assert gov2.controls["b"].balloon_mib == 512 and fake2.asked == []


def _stored_gov(db: Database, fake: Fake, store: Path, pids: dict[str, int]
                ) -> MemoryGovernor:
    return MemoryGovernor("p0", FakeCg(), db,  # type: ignore[arg-type]
                          pids=lambda: pids, actions=fake.actions(), reserved_mib=2048,
                          log=logging.getLogger("test"), store=store)


def test_targets_are_written_before_qemu_is_asked_and_a_successor_goes_on_from_them(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Killed after writing a target down and before QEMU got it: the successor takes
    the target (not the balloon QEMU reports), asks QEMU for it again and goes on."""
    monkeypatch.setattr(memloop, "mem_available_mib", lambda: 500.0)   # target 1024
    monkeypatch.setattr(memloop, "memory_psi", lambda: None)
    store = tmp_path / "balloons.json"
    db = _db(tmp_path / "db")
    fake = Fake({"g": 1024, "b": 1024})
    gov = _stored_gov(db, fake, store, {"g": 1, "b": 2})
    written: list[str] = []

    async def balloon(vm: str, mib: int) -> None:     # what the file held when QEMU
        written.append(store.read_text())             # was asked
        fake.balloons[vm] = mib
    gov.actions.balloon = balloon
    assert asyncio.run(_ticks(gov, 2)) == ["b trim", "b inflate"]
    assert balloons.parse(written[-1]) == {"b": balloons.Target(2, 768)}
    assert balloons.parse(store.read_text()) == {"b": balloons.Target(2, 768)}
    # QEMU never got 768 (the kill came first): it still reports 1024.
    fake2 = Fake({"g": 1024, "b": 1024})
    gov2 = _stored_gov(db, fake2, store, {"g": 1, "b": 2})
    said = asyncio.run(_ticks(gov2, 2))
    # Its first step is the cheapest again (it cannot know whether the guest trimmed).
    assert said == ["b resume", "b trim", "b inflate"]
    assert [a for a in fake2.asked if a[0] == "balloon"] == [
        ("balloon", ("b", 768)), ("balloon", ("b", 512))]
    d = gov2.status()["decisions"]
    assert "set the balloon of b to 768 MiB (QEMU pid 2)" in d[0]["reason"]
    assert "balloon of burstable b 768 -> 512 MiB (floor 256 MiB)" in d[2]["reason"]
    assert balloons.parse(store.read_text()) == {"b": balloons.Target(2, 512)}


def test_a_stale_target_is_ignored_and_one_below_the_floor_is_put_back(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(memloop, "mem_available_mib", lambda: 1500.0)  # not short
    monkeypatch.setattr(memloop, "memory_psi", lambda: None)
    store = tmp_path / "balloons.json"
    db = _db(tmp_path / "db")
    # b's QEMU was restarted (pid 7 now): its old target is another QEMU's.
    balloons.save(store, {"b": balloons.Target(2, 300), "g": balloons.Target(9, 100)})
    fake = Fake({"g": 1024, "b": 1024})
    gov = _stored_gov(db, fake, store, {"g": 1, "b": 7})
    assert asyncio.run(_ticks(gov, 1)) == []
    assert gov.controls["b"].balloon_mib == 1024 and fake.asked == []
    assert not store.exists()          # nothing ballooned: nothing kept
    # A target below the floor (the floor was raised since): back to the floor at once.
    balloons.save(store, {"b": balloons.Target(7, 100)})
    fake2 = Fake({"g": 1024, "b": 100})
    gov2 = _stored_gov(db, fake2, store, {"g": 1, "b": 7})
    assert asyncio.run(_ticks(gov2, 1)) == ["b resume", "b deflate"]
    assert fake2.balloons["b"] == 256
    assert balloons.parse(store.read_text()) == {"b": balloons.Target(7, 256)}


@pytest.mark.parametrize("text", [
    "", "[]", '{"version": 2, "vms": {}}', '{"version": 1, "vms": {"b": {"pid": 0, '
    '"target_mib": 5}}}', '{"version": 1, "vms": {"b": {"pid": 3, "target_mib": "5"}}}'])
def test_a_file_that_is_not_a_balloon_file_is_ignored(tmp_path: Path, text: str) -> None:
    store = tmp_path / "balloons.json"
    store.write_text(text)
    assert balloons.load(store, {"b": 3}) == {}
    with pytest.raises(ValueError):
        balloons.parse(text)


def test_the_file_round_trips_and_an_empty_set_removes_it(tmp_path: Path) -> None:
    store = tmp_path / "balloons.json"
    want = {"b": balloons.Target(3, 200), "a": balloons.Target(4, 64)}
    balloons.save(store, want)
    assert balloons.load(store, {"a": 4, "b": 3}) == want
    assert balloons.load(store, {"a": 4}) == {"a": balloons.Target(4, 64)}
    assert [p.name for p in tmp_path.iterdir()] == ["balloons.json"]   # no temp file
    balloons.save(store, {})
    assert not store.exists()
