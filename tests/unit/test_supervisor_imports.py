"""A partition's supervisor starts without the machinery most never use.

Every partition create, up and restart starts one (~300 in a suite run); a move, a
backup, a snapshot or a template save loads its modules with its first request
(``fusuma.supervisor.daemon.LAZY``), a clone's start the template and disk layer code,
a kernel boot's the image builder. Each probe runs in a fresh interpreter and reports
what it left in ``sys.modules``.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from tests.unit.test_cli_imports import offenders

REPO = Path(__file__).resolve().parents[2]

# Imported by the request, the recovery or the VM start that needs them, never by a
# supervisor's start.
LAZY_MODULES = (
    "fusuma.supervisor.moves", "fusuma.supervisor.backups", "fusuma.supervisor.snapshots",
    "fusuma.supervisor.templates", "fusuma.supervisor.freeze",
    "fusuma.images.backup", "fusuma.images.snapshots", "fusuma.images.builder",
    "fusuma.images.layers", "fusuma.images.seed", "fusuma.memshare.templates",
    "fusuma.qemu.block", "fusuma.qemu.blocksnap", "fusuma.qemu.tlscreds",
)

# What `python -m fusuma.supervisor.daemon P` runs before it answers on its socket, in
# a scratch namespace: the daemon built (its governors, its handler table, the
# recoverers it registers) and the adoption of a partition with no QEMU left.
START = """
import asyncio, json, sys
from fusuma.paths import Paths
from fusuma.supervisor import adopt
from fusuma.supervisor.daemon import Supervisor

paths = Paths.from_env()
paths.ensure_parents()
sup = Supervisor(paths, "p0")
asyncio.run(adopt.adopt(sup.host))
print(json.dumps(sorted(sys.modules)))
"""


def modules_after(code: str, tmp_path: Path) -> set[str]:
    env = {**os.environ, "PYTHONPATH": str(REPO / "src"),
           "FUSUMA_HOME": str(tmp_path / "home"), "FUSUMA_RUNTIME_DIR": str(tmp_path / "run"),
           "FUSUMA_SHM_DIR": str(tmp_path / "shm"),
           "FUSUMA_CGROUP_PREFIX": f"fusuma-test-supimports-{os.getpid()}"}
    p = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True,
                       text=True, timeout=60)
    assert p.returncode == 0, p.stderr
    return set(json.loads(p.stdout))


def test_importing_the_daemon_leaves_out_what_few_requests_need(tmp_path: Path) -> None:
    mods = modules_after("import json, sys\nimport fusuma.supervisor.daemon\n"
                         "print(json.dumps(sorted(sys.modules)))", tmp_path)
    # It did import the supervisor: its partition, its VM operations, its protocol.
    assert {"fusuma.supervisor.host", "fusuma.supervisor.vms", "fusuma.supervisor.adopt",
            "fusuma.supervisor.rpc", "fusuma.memshare.clones", "asyncio"} <= mods
    assert not offenders(mods, LAZY_MODULES)


def test_a_supervisor_starts_without_them(tmp_path: Path) -> None:
    mods = modules_after(START, tmp_path)
    assert "fusuma.governor.loop" in mods and "fusuma.supervisor.config" in mods
    assert not offenders(mods, LAZY_MODULES)


def test_a_request_loads_its_group() -> None:
    """The first request of a group imports the group's modules (the table's rows are
    those of tests/unit/test_rpc.py)."""
    code = ("import json, sys\n"
            "from fusuma.supervisor import rpc\n"
            "from fusuma.supervisor.daemon import Supervisor\n"
            "from fusuma.supervisor.host import PartitionHost\n"
            "sup = object.__new__(Supervisor)\n"
            "sup.host = object.__new__(PartitionHost)\n"
            "sup._handlers = sup.handlers()\n"
            "before = set(sys.modules)\n"
            "sup.handler(rpc.SnapshotDelete)\n"
            "print(json.dumps(sorted(set(sys.modules) - before)))")
    p = subprocess.run([sys.executable, "-c", code],
                       env={**os.environ, "PYTHONPATH": str(REPO / "src")},
                       capture_output=True, text=True, timeout=60, check=True)
    loaded = set(json.loads(p.stdout))
    assert "fusuma.supervisor.snapshots" in loaded
    assert not offenders(loaded, ("fusuma.supervisor.moves", "fusuma.supervisor.backups"))
