"""cgroup v2 on a real kernel, in CI: the tests in ``guest/`` run inside a guest that
has what these machines cannot give the host itself.

The guest is fusuma's own ``debian-host`` image (Debian 12, systemd as PID 1, the
unified cgroup2 hierarchy with cpuset, cpu, memory and io; 2 vCPUs, 2 GiB), started by
fusuma here like any VM, with fusuma installed on a disk of its own (guestkit). Inside,
pytest drives fusuma's cgroup v2 driver, cpuset partitions, a partition's supervisor as
a systemd unit, real VMs under nested TCG (the minimal image, 128 MiB), resize, QoS
classes and the governor's caps, the per-RAM-file memory groups, a managed network
(its dnsmasq's keeper as a unit, in a network namespace) and the failure cases; the
results come back through the guest agent, one host test per guest test. ``-k`` picks
guest tests: the guest runs only those.

Takes several minutes (nested TCG); the images are built once and cached.
"""

from __future__ import annotations

import ast
import contextlib
import json
import shutil
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.cgroup2 import guestkit
from tests.conftest import REPO, Host

OUT = REPO / "test-output" / "cgroup2"
GUEST_MIB = 2048
# The outer guest runs Python and a nested QEMU: a larger TCG translation cache makes
# its CLI calls ~40% quicker (the partition's budget holds it).
TB_MIB = 512


def guest_tests() -> list[str]:
    """The guest's test ids (``file::function``), read from the files without importing
    them (they import guest-only helpers)."""
    ids = []
    for path in sorted(guestkit.GUEST_TESTS.glob("test_*.py")):
        tree = ast.parse(path.read_text())
        ids += [f"{path.name}::{node.name}" for node in tree.body
                if isinstance(node, ast.FunctionDef) and node.name.startswith("test_")]
    return ids


def chosen(session: pytest.Session) -> list[str]:
    """The guest tests this session runs, when ``-k`` (or node ids) picked some: the
    guest's pytest gets them, so that a targeted run runs only those; [] for all."""
    picked = [str(item.callspec.params["test"]) for item in session.items
              if isinstance(item, pytest.Function) and item.originalname == "test_in_guest"]
    return [] if set(picked) == set(guest_tests()) else picked


@pytest.fixture(scope="module")
def guest_run(request: pytest.FixtureRequest,
              tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    tmp = tmp_path_factory.mktemp("cg2")
    h = Host(tmp)
    h.env["FUSUMA_TCG_TB_MIB"] = str(TB_MIB)
    cache = Path(h.env["FUSUMA_CACHE"])
    OUT.mkdir(parents=True, exist_ok=True)
    t0 = time.monotonic()
    timings: dict[str, float] = {}
    try:
        h.run("image", "build", "--kind", "debian-host", timeout=1200)
        minimal = Path(json.loads(h.run("image", "build", "--json").out)["kernel"]).parent
        # A disk is a file in a storage directory that root declared.
        h.run("storage", "add", str(tmp / "disks"))
        disk = guestkit.build_disk(cache, minimal, tmp / "disks" / "cg2.img")
        timings["images_and_disk_s"] = time.monotonic() - t0
        h.run("partition", "create", "cg2", "--cpus", "0-1", "--memory", "1600")
        h.run("disk", "add", "cg2", str(disk), "-p", "cg2")
        h.run("vm", "create", "g", "-p", "cg2", "--image", "debian-host", "--vcpus", "2",
              "--memory", str(GUEST_MIB), "--disk", "cg2", "--start")
        h.run("vm", "exec", "g", "--timeout", "300", "--", "/bin/sh", "-c",
              f"mkdir -p {guestkit.MOUNT} && mount LABEL={guestkit.LABEL} {guestkit.MOUNT}",
              timeout=330)
        timings["guest_boot_s"] = time.monotonic() - t0 - timings["images_and_disk_s"]
        run = h.run("vm", "exec", "g", "--timeout", "1500", "--", f"{guestkit.MOUNT}/run.sh",
                    *chosen(request.session), check=False, timeout=1560)
        timings["guest_tests_s"] = time.monotonic() - t0 - sum(timings.values())
        (OUT / "guest-pytest.txt").write_text(run.out + run.err)
        got = h.run("vm", "exec", "g", "--", "cat", guestkit.RESULTS, check=False)
        results: dict[str, Any] = json.loads(got.out) if got.code == 0 else {}
        calls = h.run("vm", "exec", "g", "--", "cat", str(guestkit.CALLS), check=False)
        if calls.code == 0:
            (OUT / "calls.json").write_text(calls.out)
        (OUT / "results.json").write_text(json.dumps(
            {"timings": {k: round(v, 1) for k, v in timings.items()}, "results": results},
            indent=1))
        yield {"results": results, "output": run.out + run.err}
    finally:
        with contextlib.suppress(Exception):
            h.save_logs(OUT)
        h.run("down", check=False, timeout=180)
        left = h.leftovers()
        h.force_clean()
        shutil.rmtree(h.runtime, ignore_errors=True)
        shutil.rmtree(h.shm, ignore_errors=True)
        assert not left, f"left behind after the cgroup v2 run: {left}"


@pytest.mark.integration
@pytest.mark.timeout(2400)
@pytest.mark.parametrize("test", guest_tests())
def test_in_guest(guest_run: dict[str, Any], test: str) -> None:
    got = guest_run["results"].get(test)
    if got is None:
        tail = "\n".join(guest_run["output"].splitlines()[-30:])
        pytest.fail(f"{test} did not run in the guest; its pytest said:\n{tail}")
    assert got["outcome"] == "passed", f"{test} {got['outcome']} in the guest:\n{got['detail']}"
