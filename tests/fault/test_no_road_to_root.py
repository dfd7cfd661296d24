"""No road to root, even for the API's admin: the attacks of issue 24 against a real
`fusuma serve` and real guests. A binary's path as a partition's QEMU (never run), a
host block device or a file outside the storage directories as a disk (refused, never
opened), a disk image swapped for a symlink after registration (the start refused,
nothing opened), `delete_file` of a file fusuma did not make (kept), a segment from a
host directory (refused), and a disk an older fusuma registered (taken over)."""

from __future__ import annotations

import contextlib
import sqlite3
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.apikit import Api
from tests.conftest import Host
from tests.fault.test_bad_input import assert_one_sentence
from tests.opens import watch_opens

pytestmark = [pytest.mark.fault, pytest.mark.timeout(300)]


@pytest.fixture
def api(host: Host) -> Iterator[Api]:
    daemon = Api(host)
    try:
        yield daemon
    finally:
        daemon.stop()


def refused(r: httpx.Response, code: int) -> str:
    """The one sentence of a refusal with status ``code``."""
    assert r.status_code == code, r.text
    body = r.json()
    assert body["type"] == "error" and body["error_code"] == code, body
    said = str(body["error"])
    assert said.endswith(".") and ". " not in said.rstrip(".") and "\n" not in said, said
    return said


def fake_qemu(tmp_path: Path) -> tuple[Path, Path]:
    """A script that answers `--version` and `-machine help` like QEMU 7.2 and leaves a
    marker file each time it runs."""
    marker = tmp_path / "ran-as-root"
    script = tmp_path / "x"
    script.write_text(f"""#!/bin/sh
touch {marker}
case "$1" in
  --version) echo "QEMU emulator version 7.2.0";;
  -machine) echo "Supported machines are:"; echo "pc-q35-7.2  Standard PC";;
esac
""")
    script.chmod(0o755)
    return script, marker


@contextlib.contextmanager
def loop_device(tmp_path: Path) -> Iterator[Path]:
    """A loop device on a small file of the test's, detached at the end."""
    img = tmp_path / "blk.img"
    img.write_bytes(b"\0" * 2**20)
    dev = subprocess.run(["losetup", "--find", "--show", str(img)], check=True,
                         capture_output=True, text=True).stdout.strip()
    try:
        yield Path(dev)
    finally:
        subprocess.run(["losetup", "-d", dev], check=True)
        left = subprocess.run(["losetup", "-j", str(img)], check=True,
                              capture_output=True, text=True).stdout
        assert not left.strip(), left


def make_partition(c: httpx.Client, name: str = "p0", core: str = "0") -> None:
    Api.ok(c, c.post("/1.0/partitions", json={"name": name, "cpus": core,
                                              "memory_mib": 768}))


def cli_error(res: Any) -> str:
    assert_one_sentence(res.err)
    return str(next(x for x in res.err.splitlines() if x.startswith("fusuma: error: ")))


# -- a binary's path as a partition's QEMU -----------------------------------------------
def test_api_never_runs_a_qemu_path(host: Host, tmp_path: Path) -> None:
    script, marker = fake_qemu(tmp_path)
    # No guest boots here: a cache of its own keeps the probe of the script out of the
    # shared one.
    host.env["FUSUMA_CACHE"] = str(tmp_path / "cache")
    api = Api(host)
    try:
        run_qemu_attacks(host, api, script, marker)
    finally:
        api.stop()


def run_qemu_attacks(host: Host, api: Api, script: Path, marker: Path) -> None:
    with api.unix() as c:
        r = c.post("/1.0/partitions", json={"name": "x", "cpus": "0", "memory_mib": 256,
                                            "qemu": str(script)})
        said = refused(r, 400)
        assert f"qemu {str(script)!r} is not a QEMU version" in said
        assert "`fusuma qemu list`" in said and "root's CLI or spec file" in said
        assert c.get("/1.0/partitions").json() == [] and c.get("/1.0/operations").json() == []
        make_partition(c, "p0", "0")
        make_partition(c, "p1", "1")
        r = c.post("/1.0/partitions/p0/maintain", json={"via": "p1", "qemu": str(script)})
        assert "is not a QEMU version" in refused(r, 400)
        assert not marker.exists(), "the API ran the binary it was given, as root"
        assert [p["qemu"] for p in c.get("/1.0/partitions").json()] == [None, None]

        # Root's CLI may name a binary (it probes it once, at create); the dashboard
        # and the API's reads then run it never again.
        host.run("partition", "delete", "p1")
        host.run("partition", "create", "q", "--cpus", "1", "--memory", "256",
                 "--qemu", str(script))
        assert marker.exists(), "root's CLI probes the binary it names"
        marker.unlink()
        for path in ("/1.0/ui/state", "/1.0/partitions", "/1.0/ps", "/"):
            assert c.get(path).status_code == 200, path
        q = next(p for p in c.get("/1.0/partitions").json() if p["name"] == "q")
        assert (q["qemu"], q["qemu_version"]) == (str(script), "7.2.0")
        assert not marker.exists(), "a page load ran the partition's QEMU binary"
    host.run("partition", "delete", "q")
    host.run("partition", "delete", "p0")


# -- disks: where they may be, and which file each is ------------------------------------
def test_a_host_block_device_is_never_a_disk(host: Host, api: Api, tmp_path: Path) -> None:
    default = host.home / "disks"
    with api.unix() as c, loop_device(tmp_path) as dev:
        make_partition(c)
        default.mkdir()
        (default / "node").symlink_to(dev)
        with watch_opens(dev) as opens:
            r = c.post("/1.0/disks", json={"name": "d", "path": str(dev), "partition": "p0"})
            said = refused(r, 400)
            assert f"{dev} is outside the storage directories ({default})" in said, said
            r = c.post("/1.0/disks", json={"name": "d", "path": str(default / "node"),
                                           "partition": "p0"})
            assert "is a symbolic link" in refused(r, 400)
            # Root's CLI cannot either: a disk is a regular file in a storage directory.
            assert "outside the storage directories" in cli_error(
                host.fail("disk", "add", "d", str(dev), "-p", "p0"))
            assert opens.count() == 0, "registering opened the host's block device"
            with dev.open("rb"):        # the watch sees an open: it could have failed
                pass
            assert opens.count() == 1
        assert c.get("/1.0/disks").json() == []


def test_a_disk_swapped_for_a_symlink_is_never_opened(host: Host, api: Api,
                                                      tmp_path: Path) -> None:
    img = host.home / "disks" / "d0.img"
    secret = tmp_path / "host-secret"
    secret.write_bytes(b"root's" * 1024)
    with api.unix() as c, loop_device(tmp_path) as dev:
        make_partition(c)
        r = c.post("/1.0/disks", json={"name": "d0", "path": str(img), "partition": "p0",
                                       "size_mib": 8})
        assert r.status_code == 201, r.text
        Api.ok(c, c.post("/1.0/vms", json={"name": "v", "partition": "p0",
                                           "memory_mib": 128, "disks": ["d0"],
                                           "start": True}))
        Api.ok(c, c.put("/1.0/vms/v/state", json={"action": "stop"}))
        img.rename(img.with_suffix(".orig"))
        for target in (dev, secret):
            img.symlink_to(target)
            with watch_opens(target) as opens:
                done = Api.wait(c, c.put("/1.0/vms/v/state", json={"action": "start"}))
                assert done["status"] == "Failure", done
                assert opens.count() == 0, f"the start opened {target}"
            said = done["err"]
            assert f"disk 'd0': {img} is a symbolic link" in said and \
                ". " not in said.rstrip("."), said
            err = host.fail("vm", "start", "v")
            assert "is a symbolic link" in cli_error(err)
            v = c.get("/1.0/vms/v").json()
            assert (v["state"], v["pid"]) == ("stopped", None), v
            img.unlink()
        # Another regular file in its place: refused by device and inode.
        img.write_bytes(b"\0" * 2**20)
        assert "is another file than the one registered" in cli_error(
            host.fail("vm", "start", "v"))
        img.unlink()
        img.with_suffix(".orig").rename(img)
        host.run("vm", "start", "v")
        host.run("vm", "delete", "v", "--force")
    assert secret.read_bytes() == b"root's" * 1024


def test_delete_file_keeps_a_file_fusuma_did_not_make(host: Host, api: Api) -> None:
    default = host.home / "disks"
    default.mkdir(parents=True)
    theirs = default / "theirs.img"
    theirs.write_bytes(b"precious" * 512)
    with api.unix() as c:
        make_partition(c)
        r = c.post("/1.0/disks", json={"name": "t", "path": str(theirs), "partition": "p0"})
        assert r.status_code == 201, r.text
        r = c.delete("/1.0/disks/t", params={"delete_file": "true"})
        assert "fusuma did not create" in refused(r, 409)
        assert "fusuma did not create" in cli_error(
            host.fail("disk", "remove", "t", "--delete-file"))
        assert theirs.read_bytes() == b"precious" * 512
        assert [d["name"] for d in c.get("/1.0/disks").json()] == ["t"], "nothing changed"
        # Without delete_file: unregistered, the file stays; `down` keeps it as well.
        assert c.delete("/1.0/disks/t").status_code == 200
        assert theirs.read_bytes() == b"precious" * 512
    host.run("down")
    assert theirs.read_bytes() == b"precious" * 512


def test_a_segment_from_a_host_directory_is_root_cli_only(host: Host, api: Api) -> None:
    with api.unix() as c:
        r = c.post("/1.0/segments", json={"name": "s", "from_dir": "/root"})
        said = refused(r, 400)
        assert said.startswith("from_dir is refused here") and "root's CLI" in said
        assert c.get("/1.0/segments").json() == [] and c.get("/1.0/operations").json() == []
    assert not (host.home / "segments").exists() or \
        not any((host.home / "segments").iterdir())


# -- a state file from an older fusuma ---------------------------------------------------
def test_disks_of_an_older_fusuma_are_taken_over(host: Host, tmp_path: Path) -> None:
    """Disks registered without device and inode: one in the default storage directory
    gets them at its VM's first start; one outside every storage directory is refused
    with the sentence naming them, until root declares its directory."""
    srv = tmp_path / "srv"
    host.run("partition", "create", "p0", "--cpus", host.core(0), "--memory", "768")
    host.run("storage", "add", str(srv))
    host.run("disk", "add", "a", "-p", "p0", "--size-mib", "4")
    host.run("disk", "add", "b", str(srv / "b.img"), "-p", "p0", "--size-mib", "4")
    host.run("vm", "create", "v", "-p", "p0", "--memory", "128", "--disk", "a",
             "--disk", "b")
    with sqlite3.connect(host.home / "state.db") as db:   # what an older fusuma wrote
        db.execute("UPDATE disks SET dev=NULL, ino=NULL")
        db.execute("DELETE FROM storage")
    said = cli_error(host.fail("vm", "start", "v"))
    assert "disk 'b' was registered by an older fusuma" in said
    assert f"outside the storage directories ({host.home / 'disks'})" in said
    host.run("storage", "add", str(srv))
    host.run("vm", "start", "v")
    with sqlite3.connect(host.home / "state.db") as db:
        got = dict(db.execute("SELECT name, ino FROM disks").fetchall())
    assert got == {"a": (host.home / "disks" / "a.img").stat().st_ino,
                   "b": (srv / "b.img").stat().st_ino}
    host.run("vm", "delete", "v", "--force")
    host.run("down")
    assert not (srv / "b.img").exists(), "a file fusuma made, taken over, goes with down"
