"""Snapshots without QEMU: the supervisor's handlers against a fake QMP peer and a fake
guest agent, the records, and the parsing of what QEMU and qemu-img say.

The fake QEMU keeps each drive's internal snapshots and the migration capabilities,
and writes a snapshot's RAM only when ``x-ignore-shared`` is off (as QEMU leaves RAM
in a shared file out of the stream when it is on)."""

from __future__ import annotations

import asyncio
import logging
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from fusuma.errors import (
    ConflictError,
    ImageError,
    NotFoundError,
    QemuError,
    SpecError,
    StateError,
)
from fusuma.paths import Paths
from fusuma.qemu import block, blocksnap
from fusuma.qemu.cmdline import BOOT_DRIVE
from fusuma.qemu.instance import Role
from fusuma.state import Database, Job, JobKind, JobOwner, VmRecord, VmState, vm_obj
from fusuma.state.records import PartitionRecord
from fusuma.state.snapdb import SnapshotRecord, SnapState
from fusuma.supervisor import rpc, snapshots
from fusuma.supervisor.host import PartitionHost

RAM = 256 * 2**20


class FakeQmp:
    """The QMP commands of internal snapshots, as QEMU answers them."""

    def __init__(self, vm: str = "v", *, fail: str | None = None) -> None:
        self.vm = vm
        self.drives: dict[str, list[dict[str, Any]]] = {BOOT_DRIVE: []}
        self.caps = {"x-ignore-shared": True, "multifd": False}
        self.mode = "normal"
        self.jobs: dict[str, dict[str, Any]] = {}
        self.log: list[str] = []
        self.fail = fail               # a command that fails
        self.status = "running"

    async def execute(self, command: str, arguments: dict[str, Any] | None = None,
                      timeout: float = 30.0) -> Any:
        args = arguments or {}
        self.log.append(command)
        if command == self.fail:
            raise QemuError(f"VM v: QMP {command} failed: injected")
        if command == "query-block":
            return [{"device": d, "inserted": {"node-name": f"#node-{d}", "drv": "qcow2",
                                               "image": {"format": "qcow2",
                                                         "virtual-size": 2**30,
                                                         "snapshots": list(s)}}}
                    for d, s in self.drives.items()]
        if command == "transaction":
            for a in args["actions"]:
                assert a["type"] == "blockdev-snapshot-internal-sync"
            for a in args["actions"]:
                self.drives[a["data"]["device"]].append(
                    {"name": a["data"]["name"], "vm-state-size": 0, "date-sec": 1})
            return {}
        if command == "blockdev-snapshot-delete-internal-sync":
            snaps = self.drives[args["device"]]
            snaps[:] = [s for s in snaps if s["name"] != args["name"]]
            return {}
        if command == "query-migrate-capabilities":
            return [{"capability": k, "state": v} for k, v in self.caps.items()]
        if command == "migrate-set-capabilities":
            for c in args["capabilities"]:
                self.caps[c["capability"]] = c["state"]
            return {}
        if command == "query-migrate-parameters":
            return {"mode": self.mode}
        if command == "migrate-set-parameters":
            self.mode = args["mode"]
            return {}
        if command in ("snapshot-save", "snapshot-load"):
            assert args["vmstate"] in args["devices"]
            err = None
            if command == "snapshot-save":
                # RAM in a shared file is left out while x-ignore-shared is on.
                size = 4096 if self.caps["x-ignore-shared"] or self.mode != "normal" \
                    else RAM
                self.drives[BOOT_DRIVE].append({"name": args["tag"], "vm-state-size": size,
                                                "date-sec": 1})
            elif not any(s["name"] == args["tag"] for s in self.drives[BOOT_DRIVE]):
                err = "Snapshot does not exist"
            self.jobs[args["job-id"]] = {"id": args["job-id"], "status": "concluded",
                                         "type": command, "current-progress": 1,
                                         "total-progress": 1,
                                         **({"error": err} if err else {})}
            return {}
        if command == "query-jobs":
            return list(self.jobs.values())
        if command == "job-dismiss":
            del self.jobs[args["id"]]
            return {}
        if command == "query-status":
            return {"status": self.status}
        raise AssertionError(f"unexpected QMP {command}")

    async def migrate_set_capabilities(self, caps: dict[str, bool]) -> None:
        await self.execute("migrate-set-capabilities", {"capabilities": [
            {"capability": k, "state": v} for k, v in caps.items()]})

    async def migrate_set_parameters(self, params: dict[str, Any]) -> None:
        await self.execute("migrate-set-parameters", params)

    async def query_status(self) -> str:
        return self.status

    async def cont(self) -> None:
        self.status = "running"

    def names(self) -> set[str]:
        return {s["name"] for s in self.drives[BOOT_DRIVE]}


@dataclass
class FakeInstance:
    vm: str
    qmp: FakeQmp
    pid: int = 4242
    version: str | None = "7.2.0"
    role: Role = Role.RUNNING
    exited: asyncio.Event = field(default_factory=asyncio.Event)


class FakeAgent:
    """A guest agent: records each command; ``fail`` makes one fail."""

    def __init__(self, calls: list[str], fail: str | None = None) -> None:
        self.calls = calls
        self.fail = fail

    async def __aenter__(self) -> FakeAgent:
        return self

    async def __aexit__(self, *exc: object) -> None:
        return None

    async def connect(self, timeout: float = 60.0) -> None:
        if self.fail == "connect":
            from fusuma.errors import GuestAgentError

            raise GuestAgentError("VM v: no guest agent", summary="no guest agent")

    async def execute(self, command: str, arguments: Any = None, timeout: float = 30) -> Any:
        self.calls.append(command)
        return 1


@pytest.fixture
def world(tmp_path: Path) -> tuple[PartitionHost, list[str]]:
    paths = Paths(home=tmp_path / "home", runtime=tmp_path / "run", shm=tmp_path / "shm",
                  cache=tmp_path / "cache", cgroup_prefix="t")
    db = Database(paths.db)
    db.add_partition(PartitionRecord(name="p0", cpus=[0], memory_mib=1024))
    db.add_vm(VmRecord(name="v", partition="p0", vcpus=1, memory_mib=256, image="deb",
                       boot="bios", state=VmState.RUNNING, pid=4242))
    db.set_vm("v", devices='{"d": 1}')      # recorded at boot
    h = PartitionHost(paths, "p0", db, None, logging.getLogger("t"))  # type: ignore[arg-type]
    agent_calls: list[str] = []
    h.agent = lambda inst: FakeAgent(agent_calls)  # type: ignore[method-assign,assignment,return-value]
    return h, agent_calls


def running(h: PartitionHost, qmp: FakeQmp) -> FakeInstance:
    inst = FakeInstance("v", qmp)
    h.instances.add(inst)  # type: ignore[arg-type]
    return inst


def test_a_running_disk_snapshot_is_frozen_then_thawed_and_recorded(
        world: tuple[PartitionHost, list[str]]) -> None:
    h, agent = world
    qmp = FakeQmp()
    running(h, qmp)
    res = asyncio.run(snapshots.create(h, rpc.SnapshotCreate("v", "s1")))
    assert (res.frozen, res.memory, res.running, res.disks) == (True, False, True,
                                                               [BOOT_DRIVE])
    assert agent == ["guest-fsfreeze-freeze", "guest-fsfreeze-thaw"]
    assert qmp.log.count("transaction") == 1 and qmp.names() == {"s1"}
    assert [s.name for s in h.db.snapshots("v")] == ["s1"]
    assert h.db.find_job(vm_obj("v")) is None
    # A duplicate: one sentence, nothing changed.
    with pytest.raises(ConflictError, match="already has a snapshot named 's1'"):
        asyncio.run(snapshots.create(h, rpc.SnapshotCreate("v", "s1")))
    assert qmp.names() == {"s1"} and len(h.db.snapshots("v", every=True)) == 1


def test_a_failed_transaction_still_thaws_and_leaves_no_record(
        world: tuple[PartitionHost, list[str]]) -> None:
    h, agent = world
    qmp = FakeQmp(fail="transaction")
    running(h, qmp)
    with pytest.raises(QemuError, match="injected"):
        asyncio.run(snapshots.create(h, rpc.SnapshotCreate("v", "s1")))
    assert agent == ["guest-fsfreeze-freeze", "guest-fsfreeze-thaw"]
    assert h.db.snapshots("v", every=True) == [] and qmp.names() == set()
    assert h.db.find_job(vm_obj("v")) is None


def test_a_guest_without_an_agent_is_snapshotted_unfrozen(
        world: tuple[PartitionHost, list[str]]) -> None:
    h, agent = world
    h.agent = lambda inst: FakeAgent(agent, fail="connect")  # type: ignore[method-assign,assignment,return-value]
    running(h, FakeQmp())
    assert asyncio.run(snapshots.create(h, rpc.SnapshotCreate("v", "s1"))).frozen is False


def test_a_memory_snapshot_turns_x_ignore_shared_off_and_back(
        world: tuple[PartitionHost, list[str]]) -> None:
    h, agent = world
    qmp = FakeQmp()
    running(h, qmp)
    res = asyncio.run(snapshots.create(h, rpc.SnapshotCreate("v", "m1", memory=True)))
    # The RAM is in it (the fake writes it only with x-ignore-shared off) ...
    assert res.memory and res.vmstate_bytes == RAM and not res.frozen
    # ... and the capability is back as a move set it; no freeze around a memory state.
    assert qmp.caps == {"x-ignore-shared": True, "multifd": False} and agent == []
    assert h.db.snapshot("v", "m1").devices == '{"d": 1}'
    done = asyncio.run(snapshots.restore(h, rpc.SnapshotRestore("v", "m1")))
    assert done.state == "running" and qmp.caps["x-ignore-shared"] is True
    assert qmp.log.count("snapshot-load") == 1
    assert asyncio.run(snapshots.delete(h, rpc.SnapshotDelete("v", "m1"))).name == "m1"
    assert qmp.names() == set() and h.db.snapshots("v", every=True) == []


def test_a_memory_snapshot_after_an_in_place_move_leaves_cpr_mode_meanwhile(
        world: tuple[PartitionHost, list[str]]) -> None:
    h, _ = world
    qmp = FakeQmp()
    qmp.mode = "cpr-transfer"
    running(h, qmp)
    res = asyncio.run(snapshots.create(h, rpc.SnapshotCreate("v", "m1", memory=True)))
    assert res.vmstate_bytes == RAM and qmp.mode == "cpr-transfer"


def test_a_qemu_that_keeps_x_ignore_shared_is_refused_a_memory_snapshot() -> None:
    class Stubborn(FakeQmp):
        async def migrate_set_capabilities(self, caps: dict[str, bool]) -> None:
            return None
    with pytest.raises(QemuError, match="would leave the RAM out"):
        qmp = Stubborn()
        asyncio.run(blocksnap.for_snapshot(
            qmp, asyncio.run(blocksnap.stream_settings(qmp))))  # type: ignore[arg-type]


def test_refusals_are_one_sentence_and_change_nothing(
        world: tuple[PartitionHost, list[str]]) -> None:
    h, _ = world
    db = h.db
    db.add_vm(VmRecord(name="k", partition="p0", vcpus=1, memory_mib=256))
    db.add_vm(VmRecord(name="r", partition="p0", vcpus=1, memory_mib=256, image="deb",
                       boot="bios", disks=["d0"]))
    db.add_vm(VmRecord(name="s", partition="p0", vcpus=1, memory_mib=256, image="deb",
                       boot="bios"))
    for req, kind, says in (
            (rpc.SnapshotCreate("k", "a"), StateError, "whose disks are raw"),
            (rpc.SnapshotCreate("r", "a"), StateError, "has raw disk.s. d0 attached"),
            (rpc.SnapshotCreate("s", "a", memory=True), SpecError, "no memory to snapshot"),
            (rpc.SnapshotCreate("s", "a/b"), SpecError, "not allowed")):
        with pytest.raises(kind, match=says):
            asyncio.run(snapshots.create(h, req))
    with pytest.raises(NotFoundError, match="has no snapshot named 'x'"):
        asyncio.run(snapshots.restore(h, rpc.SnapshotRestore("s", "x")))
    with pytest.raises(NotFoundError, match="has no snapshot named 'x'"):
        asyncio.run(snapshots.delete(h, rpc.SnapshotDelete("s", "x")))
    assert all(db.snapshots(v, every=True) == [] for v in ("k", "r", "s"))
    assert db.jobs() == []


def test_memory_on_an_old_qemu_is_refused(world: tuple[PartitionHost, list[str]]) -> None:
    h, _ = world
    inst = running(h, FakeQmp())
    inst.version = "5.2.0"
    with pytest.raises(SpecError, match=r"QEMU 5\.2\.0, which cannot snapshot memory"):
        asyncio.run(snapshots.create(h, rpc.SnapshotCreate("v", "m", memory=True)))
    assert h.db.snapshots("v", every=True) == []


def test_recovery_thaws_and_removes_a_half_made_snapshot(
        world: tuple[PartitionHost, list[str]]) -> None:
    """The supervisor died after QEMU wrote the snapshot, before it was recorded
    ready (and before the thaw)."""
    h, agent = world
    qmp = FakeQmp()
    running(h, qmp)
    h.db.add_snapshot(SnapshotRecord(vm="v", name="s1", memory=False, disks=[BOOT_DRIVE],
                                     running=True))
    qmp.drives[BOOT_DRIVE].append({"name": "s1", "vm-state-size": 0, "date-sec": 1})
    assert h.db.snapshots("v") == []                    # never listed while creating
    job = Job(vm_obj("v"), JobKind.SNAPSHOT, snapshots.SAVE, JobOwner.me(), source="p0",
              detail={"op": "create", "snapshot": "s1", "memory": False})
    asyncio.run(snapshots.recover(h, job))
    assert agent == ["guest-fsfreeze-thaw"]
    assert qmp.names() == set() and h.db.snapshots("v", every=True) == []


def test_recovery_of_a_memory_snapshot_puts_the_capabilities_back(
        world: tuple[PartitionHost, list[str]]) -> None:
    h, agent = world
    qmp = FakeQmp()
    qmp.caps["x-ignore-shared"] = False
    running(h, qmp)
    h.db.add_snapshot(SnapshotRecord(vm="v", name="m", memory=True, disks=[BOOT_DRIVE]))
    job = Job(vm_obj("v"), JobKind.SNAPSHOT, snapshots.SAVE, JobOwner.me(), source="p0",
              detail={"op": "create", "snapshot": "m", "memory": True,
                      "settings": {"caps": {"x-ignore-shared": True, "multifd": False},
                                   "mode": "cpr-transfer"}})
    asyncio.run(snapshots.recover(h, job))
    assert qmp.caps["x-ignore-shared"] is True and qmp.mode == "cpr-transfer"
    assert agent == []
    assert h.db.snapshots("v", every=True) == []


def test_records_list_only_whole_snapshots_and_go_with_their_vm(tmp_path: Path) -> None:
    db = Database(tmp_path / "state.db")
    db.add_partition(PartitionRecord(name="p0", cpus=[0], memory_mib=1024))
    db.add_vm(VmRecord(name="v", partition="p0", vcpus=1, memory_mib=256))
    db.add_snapshot(SnapshotRecord(vm="v", name="a", memory=False, disks=[BOOT_DRIVE]))
    db.add_snapshot(SnapshotRecord(vm="v", name="b", memory=True, disks=[BOOT_DRIVE]))
    db.set_snapshot("v", "b", state=SnapState.READY, vmstate_bytes=7)
    assert [s.name for s in db.snapshots("v")] == ["b"]
    assert db.snapshot("v", "b").vmstate_bytes == 7
    with pytest.raises(NotFoundError):
        db.snapshot("v", "a")
    with pytest.raises(ConflictError):
        db.add_snapshot(SnapshotRecord(vm="v", name="b", memory=False, disks=[]))
    db.remove_vm("v")
    assert db.snapshots("v", every=True) == []


@pytest.mark.parametrize("items", ["x", [{"vm-state-size": 1}],
                                   [{"name": "a", "vm-state-size": True}],
                                   [{"name": "a", "date-sec": "1"}]])
def test_a_snapshot_table_of_the_wrong_shape_is_refused(items: object) -> None:
    with pytest.raises(ImageError):
        block.parse_snapshots(items)


def test_run_job_reports_qemus_error_and_dismisses_it() -> None:
    qmp = FakeQmp()
    with pytest.raises(QemuError, match="snapshot-load failed: Snapshot does not exist"):
        asyncio.run(blocksnap.load(qmp, "nope", "#n", ["#n"], 5))  # type: ignore[arg-type]
    assert qmp.jobs == {} and "job-dismiss" in qmp.log


def test_the_api_lists_snapshots_and_refuses_unknown_ones_at_once(tmp_path: Path) -> None:
    from fusuma.api.app import create_app
    from fusuma.state.roles import Role
    from tests.unit.test_api_roles import client_as

    paths = Paths(home=tmp_path / "home", runtime=tmp_path / "run", shm=tmp_path / "shm",
                  cache=tmp_path / "cache", cgroup_prefix="t")
    db = Database(paths.db)
    db.add_partition(PartitionRecord(name="p0", cpus=[0], memory_mib=1024))
    db.add_vm(VmRecord(name="v", partition="p0", vcpus=1, memory_mib=256, image="deb",
                       boot="bios"))
    db.add_snapshot(SnapshotRecord(vm="v", name="a", memory=True, disks=[BOOT_DRIVE]))
    db.set_snapshot("v", "a", state=SnapState.READY, vmstate_bytes=9)
    db.add_snapshot(SnapshotRecord(vm="v", name="half", memory=False, disks=[BOOT_DRIVE]))
    with client_as(create_app(paths), Role.OPERATOR) as c:
        listed = c.get("/1.0/vms/v/snapshots").json()
        assert [(s["name"], s["memory"], s["vmstate_bytes"]) for s in listed] == \
            [("a", True, 9)]
        for r in (c.get("/1.0/vms/v/snapshots/half"),
                  c.post("/1.0/vms/v/snapshots/nope/restore"),
                  c.delete("/1.0/vms/v/snapshots/half")):
            assert r.status_code == 404 and "has no snapshot named" in r.json()["error"]
        r = c.post("/1.0/vms/v/snapshots", json={"name": "../x"})
        assert r.status_code in (400, 422), r.text
    with client_as(create_app(paths), Role.VIEWER) as c:
        assert c.post("/1.0/vms/v/snapshots", json={"name": "b"}).status_code == 403
    assert [s.name for s in db.snapshots("v", every=True)] == ["a", "half"]


@pytest.mark.parametrize(("found", "repair"), [(0, None), (3, "leaks"), (2, "all")])
def test_a_disk_is_repaired_only_as_far_as_its_check_says(
        monkeypatch: pytest.MonkeyPatch, found: int, repair: str | None) -> None:
    import subprocess

    from fusuma.images import snapshots as offline

    calls: list[list[str]] = []

    def run(path: Path, uid: int, args: list[str], *, write: bool,
            ok: tuple[int, ...] = (0,)) -> subprocess.CompletedProcess[str]:
        calls.append(args)
        assert write == ("-r" in args) and uid == 7
        code = found if args == ["check"] else 0
        assert code in ok
        return subprocess.CompletedProcess(args, code, "Leaked cluster 9 fixed\n", "")
    monkeypatch.setattr(offline, "run", run)
    said = offline.repair(Path("/nowhere"), 7)
    assert calls == [["check"]] + ([["check", "-r", repair]] if repair else [])
    assert (said is None) == (repair is None)


@pytest.mark.parametrize("was_running", [True, False])
def test_recovery_finishes_a_disk_restore_whose_supervisor_died_after_the_stop(
        world: tuple[PartitionHost, list[str]], monkeypatch: pytest.MonkeyPatch,
        was_running: bool) -> None:
    """Killed between the stop and the start: the disk is reverted again (the same
    result however often) and the VM started if it ran."""
    from fusuma.images import snapshots as offline
    from fusuma.supervisor import vms

    h, _ = world
    h.db.transition("v", VmState.STOPPING)
    h.db.add_snapshot(SnapshotRecord(vm="v", name="d", memory=False, disks=[BOOT_DRIVE]))
    h.db.set_snapshot("v", "d", state=SnapState.READY)
    done: list[str] = []
    monkeypatch.setattr(offline, "apply", lambda path, uid, name: done.append(f"apply {name}"))

    async def start_held(h_: PartitionHost, rec: VmRecord, requested: float) -> None:
        done.append(f"start {rec.state.value}")
    monkeypatch.setattr(vms, "start_held", start_held)
    job = Job(vm_obj("v"), JobKind.SNAPSHOT, snapshots.REVERT, JobOwner.me(), source="p0",
              detail={"op": "restore", "snapshot": "d", "memory": False,
                      "was_running": was_running})
    asyncio.run(snapshots.recover(h, job))
    assert done == ["apply d"] + (["start stopped"] if was_running else [])
    assert [s.name for s in h.db.snapshots("v")] == ["d"]


def test_a_uefi_vms_snapshots_keep_its_nvram(
        world: tuple[PartitionHost, list[str]]) -> None:
    """Each snapshot of a UEFI VM keeps a copy of its NVRAM (taken with the disks); a
    snapshot that fails keeps none, and a deleted one's goes with it."""
    from fusuma.images import snapshots as offline
    from fusuma.images.store import nvram_path, snapshot_nvram_path

    h, _ = world
    h.db.add_vm(VmRecord(name="u", partition="p0", vcpus=1, memory_mib=256, image="deb",
                         boot="uefi", state=VmState.RUNNING, pid=4243))
    nvram = nvram_path(h.paths, "u")
    nvram.parent.mkdir(parents=True)
    nvram.write_bytes(b"vars-at-s1" * 100)
    qmp = FakeQmp("u")
    h.instances.add(FakeInstance("u", qmp, pid=4243))  # type: ignore[arg-type]
    asyncio.run(snapshots.create(h, rpc.SnapshotCreate("u", "s1")))
    copy = snapshot_nvram_path(h.paths, "u", "s1")
    assert copy.read_bytes() == b"vars-at-s1" * 100
    assert copy.stat().st_mode & 0o777 == 0o600 and copy.parent.stat().st_mode & 0o777 == 0o700
    nvram.write_bytes(b"vars-later" * 100)
    qmp.fail = "transaction"
    with pytest.raises(QemuError, match="injected"):
        asyncio.run(snapshots.create(h, rpc.SnapshotCreate("u", "s2")))
    assert not snapshot_nvram_path(h.paths, "u", "s2").exists()
    # Put back in place of the VM's file (a stopped VM's), owned by its uid.
    assert offline.put_nvram(copy, nvram, os.getuid())
    assert nvram.read_bytes() == b"vars-at-s1" * 100 and nvram.stat().st_mode & 0o777 == 0o600
    assert not offline.put_nvram(snapshot_nvram_path(h.paths, "u", "none"), nvram, 0)
    qmp.fail = None
    asyncio.run(snapshots.delete(h, rpc.SnapshotDelete("u", "s1")))
    assert list(copy.parent.iterdir()) == []


def test_a_memory_state_loads_into_a_new_boots_devices_but_a_new_vmgenid() -> None:
    """A stopped VM's QEMU, started for a ``--memory`` restore, draws a new vmgenid
    guid: the state still loads (the guest is told a new generation); any other
    difference refuses it."""
    from fusuma.qemu.cmdline import Device, DeviceSet

    def ds(guid: str, extra: tuple[Device, ...] = ()) -> str:
        return DeviceSet(machine="pc-q35-7.2", machine_props=(), cpu="max", smp=1,
                         memory="256M", serial=None,
                         devices=(Device("virtio-blk-pci", (("drive", BOOT_DRIVE),)),
                                  Device("vmgenid", (("id", "vmgenid0"), ("guid", guid))),
                                  *extra)).dumps()

    def rec(devices: str) -> VmRecord:
        return VmRecord(name="v", partition="p0", vcpus=1, memory_mib=256, image="deb",
                        boot="bios", devices=devices)

    snap = SnapshotRecord(vm="v", name="m", memory=True, disks=[BOOT_DRIVE], running=True,
                          devices=ds("11111111-1111-1111-1111-111111111111"))
    snapshots._same_devices(rec(ds("22222222-2222-2222-2222-222222222222")), snap)
    other = ds("22222222-2222-2222-2222-222222222222",
               (Device("virtio-rng-pci", (("id", "rng0"),)),))
    with pytest.raises(StateError, match="devices changed since snapshot 'm'"):
        snapshots._same_devices(rec(other), snap)
