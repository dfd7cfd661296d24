"""What a move between hosts carries of a VM that boots by firmware (fusuma.vm.boot):
its seed byte for byte and what its thin disk is made on, checked at the destination
(the source host's word), and the destination's base found by checksum."""

from __future__ import annotations

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
