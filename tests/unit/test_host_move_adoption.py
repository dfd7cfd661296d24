"""A supervisor killed during a move between hosts and started again finds the move's
QEMUs as QEMU shows them (fusuma.supervisor.adopt), with a fake QMP peer:

- at the destination, the incoming QEMU (the agent may have recorded "forward": it then
  holds the only copy of the guest) is taken back, its NBD export and TLS objects
  included, and the commit stops serving the disk before the guest runs;
- at the source, a move that went back leaves no mirror job, NBD node or TLS object
  in the QEMU (``source.clear_leftovers``), so that the next move starts clean.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from fusuma.errors import QemuError
from fusuma.paths import Paths
from fusuma.qemu import block, process, tlscreds
from fusuma.qemu.instance import Instances, QemuInstance, Role
from fusuma.state import Database, Decision, Job, JobKind, JobOwner, VmRecord, VmState, vm_obj
from fusuma.supervisor import adopt
from fusuma.supervisor.moves import dest, source
from tests.unit.test_image_store import db, paths  # noqa: F401 (fixtures)

VM = "fw"
PID = 4242
TAG = "0a1b2c3d"


class Peer:
    """A QEMU that a killed supervisor prepared for a move: it answers what it holds
    (an NBD export of the guest's disk, the move's TLS objects, a mirror job) and
    records every command it is asked."""

    def __init__(self, exports: list[str], objects: list[str],
                 jobs: list[dict[str, Any]] | None = None) -> None:
        self.vm = VM
        self.exports = exports
        self.objects = objects
        self.jobs = jobs or []
        self.asked: list[str] = []
        self.args: list[tuple[str, dict[str, Any]]] = []
        self.status = "paused"
        self.disconnected = False

    async def execute(self, command: str, arguments: dict[str, Any] | None = None,
                      timeout: float = 30.0) -> Any:
        self.asked.append(command)
        self.args.append((command, arguments or {}))
        if command == "query-block-exports":
            return [{"type": "nbd", "id": e, "node-name": "#block1", "shutting-down": False}
                    for e in self.exports]
        if command == "block-export-del":
            self.exports.remove(str((arguments or {})["id"]))
        if command == "qom-list":
            return [{"name": "type", "type": "string"}] + [
                {"name": o, "type": "child<x>"} for o in self.objects]
        if command == "object-del":
            self.objects.remove(str((arguments or {})["id"]))
        if command == "query-jobs":
            return self.jobs
        if command == "block-job-cancel":
            for j in self.jobs:
                j["status"] = "concluded"
        if command == "job-dismiss":
            self.jobs = [j for j in self.jobs if j["id"] != (arguments or {})["id"]]
        return {}

    async def migrate_set_parameters(self, params: dict[str, Any]) -> None:
        await self.execute("migrate-set-parameters", params)

    async def object_del(self, obj_id: str) -> None:
        await self.execute("object-del", {"id": obj_id})

    async def query_status(self) -> str:
        self.asked.append("query-status")
        return self.status

    def listener(self, *names: str) -> object:
        return object()

    def drop_listener(self, listener: object) -> None:
        pass

    async def cont(self) -> None:
        self.asked.append("cont")
        self.status = "running"

    async def wait_event(self, listener: object, timeout: float) -> Any:
        raise QemuError("no event in a fake")

    async def disconnect(self) -> None:
        self.disconnected = True


class Host:
    """The parts of a partition's supervisor that adoption and the commit use."""

    def __init__(self, paths: Paths, db: Database) -> None:  # noqa: F811
        self.partition = "p0"
        self.paths = paths
        self.db = db
        self.instances = Instances()
        self.log = logging.getLogger("test")
        self.watched: list[QemuInstance] = []
        self.arrived: dict[str, Any] = {}
        # Its cgroups hold no other QEMU.
        self.cg = type("Cg", (), {"exists": lambda self, partition: False})()

    def vm_logger(self, name: str) -> logging.Logger:
        return self.log

    def console_log(self, name: str) -> None:
        return None

    def watch(self, inst: QemuInstance) -> None:
        self.watched.append(inst)

    def follow_runstate(self, inst: QemuInstance) -> None:
        pass

    async def repin_all(self) -> dict[str, Any]:
        return {}

    def qemu(self) -> Any:
        return type("Q", (), {"binary": Path("/usr/bin/qemu-system-x86_64"),
                              "version": "10.0.0"})()

    def apply_class(self, rec: VmRecord, pid: int) -> None:
        pass

    def class_cpu(self, vm: str, pid: int) -> None:
        pass


def incoming_here(paths: Paths, db: Database, peer: Peer,  # noqa: F811
                  monkeypatch: pytest.MonkeyPatch) -> tuple[Host, list[int]]:
    """A destination host's partition p0 after its supervisor was killed: the VM defined
    here (STARTING, no pid recorded), the agent's host-move-in job, and the incoming
    QEMU ``peer`` left running; adopted by a new supervisor. Returns the host and the
    pids adoption ended."""
    db.add_vm(VmRecord(VM, "p0", 1, 256, image="deb", boot="uefi",
                       state=VmState.STARTING))
    assert db.begin_job(Job(vm_obj(VM), JobKind.HOST_MOVE_IN, "prepared",
                            JobOwner.me(), source="p0")) is None
    h = Host(paths, db)
    ended: list[int] = []

    async def adopted(vm: str, pid: int, run: Path, ram: Path | None, *a: Any
                      ) -> tuple[QemuInstance, str]:
        qmp: Any = peer
        return QemuInstance(vm, pid, qmp, run_dir=run, ram_file=ram), "inmigrate"

    monkeypatch.setattr(QemuInstance, "adopt", adopted)
    monkeypatch.setattr(adopt, "end_unmanaged", lambda pid, *a, **k: ended.append(pid))
    monkeypatch.setattr(process, "cmdline", lambda pid: [])
    asyncio.run(adopt._adopt_one(h, VM, PID))  # type: ignore[arg-type]
    return h, ended


def test_a_destination_supervisor_started_again_takes_back_the_incoming_qemu_and_its_export(
        paths: Paths, db: Database, monkeypatch: pytest.MonkeyPatch) -> None:  # noqa: F811
    peer = Peer([block.EXPORT], [f"fz-tls-{TAG}", f"fz-authz-{TAG}", "rng0"])
    h, ended = incoming_here(paths, db, peer, monkeypatch)
    # Not ended: after "forward" it holds the only copy of the guest.
    assert ended == [] and not peer.disconnected
    inst = h.instances.get(VM, Role.INCOMING)
    assert inst is not None and inst.pid == PID and h.watched == [inst]
    move = inst.move
    assert isinstance(move, dest.MoveIn) and move.nbd
    assert move.tls == tlscreds.MoveTls(f"fz-tls-{TAG}", f"fz-authz-{TAG}")
    # The VM is not taken for crashed (it has no running QEMU yet: a move's is coming).
    asyncio.run(adopt.adopt(h))  # type: ignore[arg-type]
    assert db.vm(VM).state == VmState.STARTING

    # The agent recorded "forward": the commit runs the guest here, the disk no longer
    # served to anyone before the guest runs, the TLS objects dropped after.
    assert db.decide(vm_obj(VM), Decision.FORWARD) == Decision.FORWARD
    res = asyncio.run(dest.commit(h, VM))  # type: ignore[arg-type]
    assert res.pid == PID and h.instances.get(VM) is inst and inst.move is None
    assert peer.asked.index("block-export-del") < peer.asked.index("nbd-server-stop") \
        < peer.asked.index("cont"), peer.asked
    assert peer.exports == [] and peer.objects == ["rng0"], peer.objects
    assert db.vm(VM).pid == PID


def test_a_caller_that_asks_after_the_commit_gets_its_resume_time_not_its_own(
        paths: Paths, db: Database, monkeypatch: pytest.MonkeyPatch) -> None:  # noqa: F811
    """A caller late to ``finish`` (a busy agent, a CLI descheduled under load) found
    the guest running and took the moment it asked for its resume (bench cluster with
    24 VMs: one CLI move of 32 ms "downtime" without steps, the others 7.5-9.2 ms)."""
    peer = Peer([], [])
    h, _ = incoming_here(paths, db, peer, monkeypatch)
    inst = h.instances.get(VM, Role.INCOMING)
    assert inst is not None
    inst.move.steps.update({"loaded": 50.0, "seen": 50.001})
    db.decide(vm_obj(VM), Decision.FORWARD)
    done = asyncio.run(dest.commit(h, VM))  # type: ignore[arg-type]
    assert done.steps["loaded"] == 50.0 and "decided" in done.steps
    late = asyncio.run(dest.finish(h, VM))  # type: ignore[arg-type]
    assert (late.pid, late.resume_ts, late.steps) == (done.pid, done.resume_ts, done.steps)
    assert late.already and not done.already
    # Asked again of commit (a recovery): the same.
    again = asyncio.run(dest.commit(h, VM))  # type: ignore[arg-type]
    assert again.resume_ts == done.resume_ts
    # Another QEMU runs the guest here now (it moved out and back in another way): what
    # this partition recorded is not its, so the answer says only "now".
    h.arrived[VM] = replace(done, pid=PID + 1)
    other = asyncio.run(dest.finish(h, VM))  # type: ignore[arg-type]
    assert other.pid == PID and other.steps == {} and other.resume_ts > done.resume_ts


def test_an_incoming_qemu_without_an_export_is_committed_without_asking_to_stop_one(
        paths: Paths, db: Database, monkeypatch: pytest.MonkeyPatch) -> None:  # noqa: F811
    # The supervisor was killed after the commit stopped serving, before `cont`.
    peer = Peer([], [])
    h, ended = incoming_here(paths, db, peer, monkeypatch)
    inst = h.instances.get(VM, Role.INCOMING)
    assert ended == [] and inst is not None and not inst.move.nbd and inst.move.tls is None
    db.decide(vm_obj(VM), Decision.FORWARD)
    asyncio.run(dest.commit(h, VM))  # type: ignore[arg-type]
    assert "block-export-del" not in peer.asked and "cont" in peer.asked


def test_a_qemu_that_cannot_say_what_it_serves_is_still_taken_back(
        paths: Paths, db: Database, monkeypatch: pytest.MonkeyPatch) -> None:  # noqa: F811
    peer = Peer([], [])

    async def broken(command: str, arguments: dict[str, Any] | None = None,
                     timeout: float = 30.0) -> Any:
        return {"not": "a list"}

    peer.execute = broken  # type: ignore[method-assign]
    h, ended = incoming_here(paths, db, peer, monkeypatch)
    inst = h.instances.get(VM, Role.INCOMING)
    assert ended == [] and inst is not None and isinstance(inst.move, dest.MoveIn)


def test_what_a_killed_supervisor_left_in_a_source_qemu_is_removed_when_it_goes_back(
        paths: Paths, db: Database) -> None:  # noqa: F811
    peer = Peer([], [f"fz-tls-{TAG}", "rng0"],
                [{"id": block.MIRROR_JOB, "type": "mirror", "status": "ready",
                  "current-progress": 5, "total-progress": 9}])
    inst = QemuInstance(VM, PID, peer, run_dir=paths.vm_run_dir(VM),  # type: ignore[arg-type]
                        ram_file=None)
    asyncio.run(source.clear_leftovers(Host(paths, db), inst))  # type: ignore[arg-type]
    assert ("block-job-cancel", {"device": block.MIRROR_JOB, "force": True}) in peer.args
    assert ("blockdev-del", {"node-name": block.NBD_NODE}) in peer.args
    assert peer.jobs == [] and peer.objects == ["rng0"]
    assert ("migrate-set-parameters", tlscreds.TLS_OFF) in peer.args
    # A QEMU with nothing left: nothing cancelled, nothing deleted.
    peer.asked.clear()
    asyncio.run(source.clear_leftovers(Host(paths, db), inst))  # type: ignore[arg-type]
    assert peer.asked == ["query-jobs", "qom-list"]


@pytest.mark.parametrize("reply, says", [
    ({"a": 1}, "not a list"),
    ([{"type": "x"}], "a property has no name"),
])
def test_a_malformed_object_list_is_one_sentence(reply: object, says: str) -> None:
    with pytest.raises(QemuError, match=f"^QEMU's answer to qom-list is malformed: {says}"):
        tlscreds.parse_armed(reply)


def test_the_moves_tls_objects_are_paired_by_their_tag() -> None:
    got = tlscreds.parse_armed([{"name": n} for n in (
        "fz-tls-aa", "fz-authz-aa", "fz-tls-bb", "fz-authz-cc", "fz-tlsx", "rng0")])
    assert got == [tlscreds.MoveTls("fz-tls-aa", "fz-authz-aa"),
                   tlscreds.MoveTls("fz-tls-bb", None), tlscreds.MoveTls("", "fz-authz-cc")]


@pytest.mark.parametrize("reply", [{"a": 1}, [{"type": "nbd"}], [{"id": 3}]])
def test_a_malformed_export_list_is_one_sentence(reply: object) -> None:
    with pytest.raises(QemuError, match=r"^QEMU's answer to query-block-exports is "
                       r"malformed: (not a list|an export has no id)\.$"):
        block.parse_exports(reply)


def test_two_processes_finding_a_supervisor_dead_start_one(
        paths: Paths, db: Database, monkeypatch: pytest.MonkeyPatch) -> None:  # noqa: F811
    """An agent's pass over its partitions and a move's next step both find the
    supervisor killed, and both start one: the second waits for the first's start
    (until its socket answers, its pidfile written) and takes that one; two would adopt
    the same QEMUs, and the second, refused by QEMU's monitor, would serve the
    partition with none of them."""
    import threading
    import time

    from fusuma.partition.manager import PartitionManager

    parts = PartitionManager(paths, db, host=object())  # type: ignore[arg-type]
    alive: list[int] = []
    started: list[int] = []
    entered = threading.Event()

    def start(name: str, pdir: Path, timeout: float) -> int:
        entered.set()
        started.append(len(started) + 100)
        time.sleep(0.3)        # adopting its QEMUs before its socket answers
        alive.append(started[-1])
        return started[-1]

    monkeypatch.setattr(parts, "supervisor_pid", lambda name: alive[-1] if alive else None)
    monkeypatch.setattr(parts, "_start", start)
    got: list[int] = []
    first = threading.Thread(target=lambda: got.append(parts.start_supervisor("p0")))
    first.start()
    assert entered.wait(5)
    # The second looked before the first's socket answered: none alive then.
    looks = iter([None])
    monkeypatch.setattr(parts, "supervisor_pid",
                        lambda name: next(looks, alive[-1] if alive else None))
    got.append(parts.start_supervisor("p0"))
    first.join()
    assert started == [100] and sorted(got) == [100, 100]
