"""A move's destination (fusuma.supervisor.moves.dest.prepare) starts its QEMU at the
control weight, given before the QEMU exists (``launch(control=True)``: at its class's
weight beside a VM busy at the top weight its start took 22-29 s in the lab); and a QMP
command its QEMU broke off says how that QEMU ended (``PartitionHost.end_note``), not
only "Disconnected". Fakes for the host; a real PartitionHost for the note."""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path
from typing import Any

import pytest

from fusuma.errors import QemuError
from fusuma.paths import Paths
from fusuma.qemu.instance import QemuInstance, Role
from fusuma.qemu.qmp import Qmp
from fusuma.state import Database, JobKind
from fusuma.supervisor.host import PartitionHost
from fusuma.supervisor.moves import dest
from tests.unit.test_image_store import db, paths  # noqa: F401 (fixtures)


class BrokenQmp:
    """The QMP of a QEMU that ended while a command waited."""

    async def migrate_set_capabilities(self, caps: dict[str, bool]) -> None:
        raise QemuError("VM mover: QMP migrate-set-capabilities failed: Disconnected")


def fake_host(tmp_path: Path, launched: list[dict[str, Any]]) -> Any:
    rec = type("Rec", (), {"partition": "p1", "shared_ram": True, "accel_used": "tcg",
                           "accel": "tcg", "ram_path": str(tmp_path / "mover.ram"),
                           "memory_mib": 128})()
    job = type("Job", (), {"kind": JobKind.MIGRATE, "peer": "p0"})()
    inst = type("Inst", (), {"qmp": BrokenQmp(), "status": -9})()

    async def launch(self: Any, *args: Any, **kw: Any) -> Any:
        launched.append(kw)
        return inst

    async def end_note(self: Any, i: Any, wait: float = 2.0) -> str:
        return " (its QEMU, pid 4242, killed by signal 9)"

    return type("Host", (), {
        "partition": "p0",
        "paths": type("P", (), {"vm_run_dir": lambda self, vm: tmp_path / vm})(),
        "db": type("Db", (), {"vm": lambda self, n: rec,
                              "find_job": lambda self, o: job})(),
        "instances": type("I", (), {"get": lambda self, *a: None})(),
        "launch": launch, "end_note": end_note})()


def test_the_destination_starts_at_the_control_weight_and_says_how_its_qemu_ended(
        tmp_path: Path) -> None:
    launched: list[dict[str, Any]] = []
    with pytest.raises(QemuError, match=r"^VM mover: QMP migrate-set-capabilities "
                       r"failed: Disconnected \(its QEMU, pid 4242, killed by signal "
                       r"9\)$") as err:
        asyncio.run(dest.prepare(fake_host(tmp_path, launched), "mover", "zero-copy"))
    assert err.value.exit_status == -9
    assert [(k["role"], k["control"]) for k in launched] == [(Role.INCOMING, True)]


def test_how_a_qemu_ended_with_what_it_said_last(paths: Paths, db: Database,  # noqa: F811
                                                 tmp_path: Path) -> None:
    h = PartitionHost(paths, "p0", db, cg=None, log=logging.getLogger("t"))  # type: ignore[arg-type]
    log = paths.vm_dir("mover") / "qemu.log"
    log.parent.mkdir(parents=True)
    log.write_text("--- started\n")

    async def run() -> tuple[str, str]:
        inst = QemuInstance("mover", 4242, Qmp("mover", tmp_path / "q.sock",
                                               logging.getLogger("q")),
                            run_dir=tmp_path, ram_file=None, role=Role.INCOMING,
                            started_log="--- started")
        running = await h.end_note(inst, wait=0.05)
        inst.status = -9
        log.write_text("--- started\nqemu-system-x86_64: terminating on signal 9\n")
        inst.exited.set()
        return running, await h.end_note(inst, wait=0.05)
    running, ended = asyncio.run(run())
    assert running == ""       # still running: nothing to add
    assert ended == (" (its QEMU, pid 4242, killed by signal 9: qemu-system-x86_64: "
                     "terminating on signal 9)")


def test_an_in_place_moves_new_qemu_starts_at_the_control_weight(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """cpr.prepare: the new QEMU shares the VM's leaf with the running one; beside 15
    busy guests on one core, at its class's weight its start and its machine's build
    took about 1 s each (bench maintain --busy). It starts at the control weight."""
    from fusuma.supervisor.moves import cpr

    launched: list[dict[str, Any]] = []
    rec = type("Rec", (), {"partition": "p0", "shared_ram": True, "accel_used": "tcg",
                           "accel": "tcg", "ram_path": str(tmp_path / "v.ram")})()
    job = type("Job", (), {"kind": JobKind.MIGRATE, "peer": "p0", "source": "p0"})()
    old = type("Old", (), {"pid": 4141})()
    new = type("New", (), {"pid": 4242, "move": None})()

    async def launch(self: Any, *args: Any, **kw: Any) -> Any:
        launched.append(kw)
        return new
    q = type("Q", (), {"version": "10.0.2", "binary": "/q"})()
    h = type("Host", (), {
        "partition": "p0", "log": logging.getLogger("t"), "launch": launch,
        "qemu": lambda self: q,
        "db": type("Db", (), {"vm": lambda self, n: rec,
                              "find_job": lambda self, o: job})(),
        "instances": type("I", (), {
            "get": lambda self, vm, role=None: old if role is None else None})()})()
    monkeypatch.setattr(cpr, "has_cpr", lambda q: True)
    monkeypatch.setattr(cpr, "incoming_run_dir", lambda h, vm: tmp_path / "in-1")
    monkeypatch.setattr(cpr, "planned_handover", lambda h, vm, inst: None)
    monkeypatch.setattr(cpr, "probe_accel", lambda a: type("A", (), {"name": "tcg"})())

    async def run() -> Any:
        return await cpr.prepare(h, "v")
    got = asyncio.run(run())
    assert got.pid == 4242
    assert [(k["role"], k["control"], k["join_taps"]) for k in launched] == [
        (Role.INCOMING, True, True)]
