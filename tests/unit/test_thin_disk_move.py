"""What a move between hosts carries of a VM that boots by firmware (fusuma.vm.boot):
its seed byte for byte and what its thin disk is made on, checked at the destination
(the source host's word), and the destination's base found by checksum."""

from __future__ import annotations

import asyncio
import base64
import os
import zlib
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from fusuma.errors import StateError
from fusuma.images import seed, store
from fusuma.paths import Paths
from fusuma.qemu import block
from fusuma.state import Database, VmRecord
from fusuma.supervisor.moves.source import capabilities
from fusuma.vm import boot
from tests.unit.test_image_store import db, paths, raw_image  # noqa: F401 (fixtures)


def made(tmp_path: Path, paths: Paths, db: Database) -> tuple[VmRecord, Any]:  # noqa: F811
    base = store.import_image(paths, db, "deb", str(raw_image(tmp_path / "a.raw")),
                              anywhere=True)
    rec = VmRecord("f", "p0", 1, 256, image="deb", boot="bios", uid=os.getuid())
    boot.prepare(paths, rec, base, store.parse_size("16M"), [], "#!/bin/sh\necho hi\n",
                 [])
    return rec, base


def test_a_firmware_vm_carries_its_seed_byte_for_byte_and_its_disk_size(
        tmp_path: Path, paths: Paths, db: Database) -> None:  # noqa: F811
    rec, base = made(tmp_path, paths, db)
    carried = boot.carry(paths, db, rec)
    assert (carried.image, carried.sha256, carried.virtual_size) == \
        ("deb", base.sha256, 16 * 2**20)
    text = carried.as_record()
    assert len(text["seed"]) < 64 * 2**10        # a MiB of ISO, mostly zeros
    back = boot.check_carried(text)
    assert back == carried
    # At the destination: a fresh VM's files (another instance id), then the seed the
    # guest read at its source, the same bytes and inputs.
    there = replace(rec, name="g")
    boot.prepare(paths, there, base, carried.virtual_size, [], None, [])
    assert boot.seed_path(paths, "g").read_bytes() != carried.seed_iso
    boot.adopt_carried(paths, there, back)
    assert boot.seed_path(paths, "g").read_bytes() == carried.seed_iso
    assert seed.load_inputs(paths.vm_dir("g") / boot.SEED_INPUTS) == carried.seed_inputs
    small = replace(back, virtual_size=32 * 2**20)
    with pytest.raises(StateError, match="thin disk here has 16777216 bytes, at its "
                       "source 33554432"):
        boot.adopt_carried(paths, there, small)


def test_the_destination_needs_an_image_of_the_same_checksum(
        tmp_path: Path, paths: Paths, db: Database) -> None:  # noqa: F811
    rec, _ = made(tmp_path, paths, db)
    carried = boot.carry(paths, db, rec)
    assert boot.base_for(db, carried, "h1").name == "deb"
    # Another name, the same bytes: that one.
    other = replace(carried, image="bookworm")
    assert boot.base_for(db, other, "h1").name == "deb"
    none = replace(carried, sha256="0" * 64)
    with pytest.raises(StateError, match=f"^host h1 has no image with checksum sha256:"
                       f"{'0' * 64} \\(image 'deb' of the VM's host\\); import the same "
                       "image there first.$"):
        boot.base_for(db, none, "h1")


@pytest.mark.parametrize("change, says", [
    ({"image": ""}, "no image name"),
    ({"sha256": "md5:abc"}, "no sha256 checksum"),
    ({"virtualSize": -1}, "no size"),
    ({"virtualSize": True}, "no size"),
    ({"seed": "x" * (boot.MAX_CARRIED_SEED + 1)}, "no seed, or one too large"),
    ({"seed": "not base64!"}, "a malformed seed"),
    ({"seed": base64.b64encode(zlib.compress(bytes(boot.MAX_SEED + 1))).decode()},
     "a malformed seed \\(too large\\)"),
    ({"seedInputs": ["x"]}, "a malformed seed"),
    ({"seedInputs": {"hostname": "x"}}, "a malformed seed"),
])
def test_a_carried_thin_disk_is_checked(change: dict[str, Any], says: str) -> None:
    good = {"image": "deb", "sha256": "a" * 64, "virtualSize": 2**30,
            "seed": base64.b64encode(zlib.compress(b"iso")).decode(),
            "seedInputs": {"instance_id": "i", "hostname": "f"}}
    assert boot.check_carried(good).seed_iso == b"iso"
    with pytest.raises(StateError, match=f"carries a thin disk with {says}"):
        boot.check_carried({**good, **change})
    with pytest.raises(StateError, match="no fields"):
        boot.check_carried("x")


def test_a_mirrored_move_pauses_before_the_switch() -> None:
    assert capabilities("copy", 1, mirror=True)["pause-before-switchover"] is True
    # Named off otherwise: a QEMU's earlier move leaves nothing behind.
    assert capabilities("copy", 1)["pause-before-switchover"] is False


class FakeMirrorPeer:
    """A QMP peer that records what it is asked; its mirror job goes through
    ``states`` (one per ``query-jobs``; an error with the last)."""

    def __init__(self, states: list[str], error: str | None = None) -> None:
        self.vm = "fw"
        self.states = states
        self.error = error
        self.asked: list[tuple[str, dict[str, Any]]] = []
        self.fds: list[str] = []
        self.mirroring = False

    async def get_fd(self, fd: int, name: str) -> None:
        assert os.fstat(fd)       # a live descriptor: the listening socket
        self.fds.append(name)

    async def execute(self, command: str, arguments: dict[str, Any] | None = None,
                      timeout: float = 30.0) -> Any:
        self.asked.append((command, arguments or {}))
        if command == "blockdev-mirror":
            self.mirroring = True
        if command == "job-dismiss":
            self.mirroring = False
        if command == "query-jobs":
            if not self.mirroring:
                return []
            status = self.states.pop(0) if len(self.states) > 1 else self.states[0]
            err = self.error if status == "concluded" else None
            return [{"id": block.MIRROR_JOB, "type": "mirror", "status": status,
                     "current-progress": 1, "total-progress": 1,
                     **({"error": err} if err else {})}]
        return {}

    def args(self, command: str) -> dict[str, Any]:
        """The arguments it was last given ``command`` with."""
        return [a for c, a in self.asked if c == command][-1]


def test_the_destination_serves_the_disk_writable_under_the_moves_tls() -> None:
    qmp = FakeMirrorPeer(["ready"])
    port = asyncio.run(block.serve(qmp, "127.0.0.1", "#block123",  # type: ignore[arg-type]
                                   "fz-tls-1", "fz-authz-1"))
    assert 0 < port < 65536 and qmp.fds == ["fusuma-nbd-listen"]
    assert qmp.args("nbd-server-start") == {
        "addr": {"type": "fd", "data": {"str": "fusuma-nbd-listen"}},
        "max-connections": 1, "tls-creds": "fz-tls-1", "tls-authz": "fz-authz-1"}
    assert qmp.args("block-export-add") == {
        "type": "nbd", "id": block.EXPORT, "node-name": "#block123",
        "name": block.EXPORT, "writable": True}
    asyncio.run(block.stop_serving(qmp))  # type: ignore[arg-type]
    assert [c for c, _ in qmp.asked][-2:] == ["block-export-del", "nbd-server-stop"]


def test_the_source_mirrors_the_top_layer_and_ends_it_without_switching() -> None:
    qmp = FakeMirrorPeer(["running", "running", "ready", "concluded"])
    asyncio.run(block.mirror_start(qmp, "#block7", "10.0.0.2", 4242,  # type: ignore[arg-type]
                                   "fz-tls-2", "h1"))
    # A stale mirror of an earlier move (its supervisor killed) is cleared first.
    assert [c for c, _ in qmp.asked][:3] == ["block-job-cancel", "query-jobs",
                                            "blockdev-del"]
    assert qmp.args("blockdev-add") == {
        "driver": "nbd", "node-name": block.NBD_NODE, "export": block.EXPORT,
        "server": {"type": "inet", "host": "10.0.0.2", "port": "4242"},
        "tls-creds": "fz-tls-2", "tls-hostname": "h1"}
    assert qmp.args("blockdev-mirror") == {
        "job-id": block.MIRROR_JOB, "device": "#block7", "target": block.NBD_NODE,
        "sync": "top", "auto-dismiss": False}
    asyncio.run(block.mirror_ready(qmp, 10))  # type: ignore[arg-type]
    asyncio.run(block.mirror_finish(qmp, 10))  # type: ignore[arg-type]
    assert qmp.args("block-job-cancel") == {"device": block.MIRROR_JOB}   # not force
    assert [c for c, _ in qmp.asked][-2:] == ["job-dismiss", "blockdev-del"]


def test_a_mirror_whose_destination_went_away_fails_in_one_sentence() -> None:
    qmp = FakeMirrorPeer(["running", "concluded"], error="Connection reset by peer")
    qmp.mirroring = True
    with pytest.raises(block.JobFailed, match=r"^VM 'fw': the mirror of its disk failed: "
                       r"Connection reset by peer\.$"):
        asyncio.run(block.mirror_ready(qmp, 10))  # type: ignore[arg-type]
    asyncio.run(block.mirror_abort(qmp))  # type: ignore[arg-type]
    assert ("block-job-cancel", {"device": block.MIRROR_JOB, "force": True}) in qmp.asked
    assert qmp.asked[-1] == ("blockdev-del", {"node-name": block.NBD_NODE})


def test_a_disk_is_never_served_for_a_mirror_in_the_clear() -> None:
    """The destination's NBD export takes writes to the guest's disk: only under TLS to
    the source host's certificate, so a move in the clear (the benchmark's before) that
    asks for a mirror is refused before anything starts."""
    import asyncio

    from fusuma.errors import StateError
    from fusuma.state import JobKind
    from fusuma.supervisor.moves.remote import remote_incoming

    rec = type("Rec", (), {"partition": "p0"})()
    job = type("Job", (), {"kind": JobKind.HOST_MOVE_IN})()
    launched: list[str] = []
    h: Any = type("Host", (), {
        "partition": "p0",
        "db": type("Db", (), {"vm": lambda self, n: rec, "find_job": lambda self, o: job})(),
        "instances": type("I", (), {"get": lambda self, *a: None})(),
        "launch": lambda self, *a, **k: launched.append("launch")})()
    with pytest.raises(StateError, match="only under TLS"):
        asyncio.run(remote_incoming(h, "vm0", "10.0.0.2", "h0", tls=False, nbd=True))
    assert launched == []
