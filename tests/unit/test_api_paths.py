"""No road to root over the API, without QEMU: what the API refuses that root's CLI
may name (a QEMU binary's path, a segment's host directory) and where its disks may
be. The real daemon does the same attacks in tests/integration/test_api_paths.py."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient

from fusuma.api.app import create_app
from fusuma.api.http import Limits
from fusuma.api.server import LocalAuth
from fusuma.errors import SpecError
from fusuma.ops import segments
from fusuma.ops.context import Ctx
from fusuma.paths import Paths
from fusuma.state import PartitionRecord


@pytest.fixture
def ctx(tmp_path: Path) -> Ctx:
    paths = Paths(home=tmp_path / "home", runtime=tmp_path / "run", shm=tmp_path / "shm",
                  cache=tmp_path / "cache", cgroup_prefix="fusuma-unit-paths")
    c = Ctx(paths)
    for name, core in (("p0", 0), ("p1", 1)):
        c.db.add_partition(PartitionRecord(name, [core], 512))
    return c


@pytest.fixture
def client(ctx: Ctx) -> TestClient:
    # The UNIX socket's identity (admin): what is refused here is refused to everyone.
    return TestClient(LocalAuth(Limits(create_app(ctx.paths)), "fusuma"),
                      raise_server_exceptions=False)


def error(r: Any, code: int) -> str:
    assert r.status_code == code, r.text
    said = str(r.json()["error"])
    assert said.endswith(".") and ". " not in said.rstrip("."), said
    return said


def fake_qemu(tmp_path: Path) -> tuple[Path, Path]:
    """A script that answers like QEMU and leaves a marker when it runs."""
    marker = tmp_path / "ran"
    script = tmp_path / "qemu"
    script.write_text(f"#!/bin/sh\ntouch {marker}\necho 'QEMU emulator version 7.2.0'\n")
    script.chmod(0o755)
    return script, marker


def test_a_binary_path_is_never_a_partitions_qemu(client: TestClient, ctx: Ctx,
                                                  tmp_path: Path) -> None:
    script, marker = fake_qemu(tmp_path)
    for qemu in (str(script), "qemu-system-x86_64", "../qemu"):
        r = client.post("/1.0/partitions", json={"name": "x", "cpus": "0",
                                                 "memory_mib": 256, "qemu": qemu})
        said = error(r, 400)
        assert f"qemu {qemu!r} is not a QEMU version" in said and "installed: " in said
        r = client.post("/1.0/partitions/p0/maintain", json={"via": "p1", "qemu": qemu})
        assert error(r, 400) == said
    assert not marker.exists(), "the API ran the binary it was given"
    assert [p.name for p in ctx.db.partitions()] == ["p0", "p1"]
    assert client.get("/1.0/operations").json() == [], "refused before any operation"
    # Root's CLI names a path (it must exist and answer like QEMU): no refusal of that
    # kind there.
    root = Ctx(ctx.paths, host_paths=True)
    with pytest.raises(SpecError, match="not a QEMU version"):
        ctx.parts.check_qemu(str(script))
    root.parts.check_qemu("/usr/bin/qemu-system-x86_64")


def test_a_segment_from_a_host_directory_is_root_cli_only(client: TestClient, ctx: Ctx,
                                                          tmp_path: Path) -> None:
    r = client.post("/1.0/segments", json={"name": "s", "from_dir": "/root"})
    assert error(r, 400) == segments.FROM_DIR_REFUSED
    r = client.post("/1.0/segments", json={"name": "s", "from_dir": "/root",
                                           "from_image": "debian"})
    assert error(r, 400) == segments.FROM_DIR_REFUSED
    assert ctx.db.segments() == [] and not ctx.paths.segments_dir.exists()
    with pytest.raises(SpecError, match="root's CLI"):
        segments.create(ctx, "s", from_dir=tmp_path)


def test_disks_only_in_storage_directories(client: TestClient, ctx: Ctx,
                                           tmp_path: Path) -> None:
    default = ctx.paths.home / "disks"
    for path in ("/dev/loop0", "/etc/shadow", str(tmp_path / "new.img")):
        r = client.post("/1.0/disks", json={"name": "d", "path": path, "partition": "p0",
                                            "size_mib": 1})
        assert f"outside the storage directories ({default})" in error(r, 400)
    assert ctx.db.disks() == [] and not (tmp_path / "new.img").exists()
    r = client.post("/1.0/disks", json={"name": "d", "path": str(default / "d.img"),
                                        "partition": "p0", "size_mib": 1})
    assert r.status_code == 201, r.text
    assert (default / "d.img").stat().st_size == 2**20

    # A file fusuma did not make is never deleted.
    (default / "user.img").write_bytes(b"precious")
    r = client.post("/1.0/disks", json={"name": "u", "path": str(default / "user.img"),
                                        "partition": "p0"})
    assert r.status_code == 201, r.text
    r = client.delete("/1.0/disks/u", params={"delete_file": "true"})
    assert "fusuma did not create" in error(r, 409)
    assert (default / "user.img").read_bytes() == b"precious"
    assert [d.name for d in ctx.db.disks()] == ["d", "u"]
    r = client.delete("/1.0/disks/d", params={"delete_file": "true"})
    assert r.status_code == 200, r.text
    assert not (default / "d.img").exists()
