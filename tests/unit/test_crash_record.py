"""A crashed VM is never shown without its reason (`ps`, the API's VM view).

The CI run of 6fbfacf saw `ps` say vm0 "crashed" with error None: `ps` derives
"crashed" from /proc the moment the QEMU is gone, while the supervisor records the
end (how it ended) only after its cleanup (QMP, run files, RAM file, cgroup), so
under load `ps` showed the crash for a while before its reason existed. Here a real
process stands in for the QEMU, a real PartitionHost records its end, and a second
connection (the CLI's) reads throughout."""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

from fusuma.paths import Paths
from fusuma.qemu.instance import QemuInstance, Role
from fusuma.qemu.qmp import Qmp
from fusuma.state import Database, VmRecord, VmState
from fusuma.supervisor.host import PartitionHost
from fusuma.vm import VmView
from tests.unit.test_image_store import db, paths  # noqa: F401 (fixtures)


class SlowCgroups:
    """The cgroup side of a QEMU's exit, as slow as it can be on a loaded host."""

    def delete_leaf(self, group: str, leaf: str) -> None:
        time.sleep(0.3)


def test_ps_shows_a_crash_with_its_reason_at_every_moment(
        paths: Paths, db: Database, tmp_path: Path) -> None:  # noqa: F811
    # A process whose command line says it is VM v's QEMU, as ps checks.
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)",
                              "guest=v,debug-threads=on"])
    try:
        db.add_vm(VmRecord("v", "p0", 1, 256, state=VmState.RUNNING, pid=child.pid))
        h = PartitionHost(paths, "p0", db, SlowCgroups(),  # type: ignore[arg-type]
                          logging.getLogger("t"))
        cli = Database(paths.db)      # what `fusuma ps` reads, beside the supervisor
        deadline = time.monotonic() + 10
        while VmView(cli.vm("v")).state != "running":     # its interpreter is up
            assert time.monotonic() < deadline, "the stand-in QEMU did not start"
            time.sleep(0.01)
        seen: list[dict[str, Any]] = []
        done = threading.Event()

        def read() -> None:
            mine = Database(paths.db)     # a connection of this thread's own
            while not done.is_set():
                seen.append(VmView(mine.vm("v")).as_json())
                time.sleep(0.002)

        async def run() -> None:
            inst = QemuInstance("v", child.pid, Qmp("v", tmp_path / "q.sock",
                                                    logging.getLogger("q")),
                                run_dir=tmp_path / "run-v", ram_file=None,
                                role=Role.RUNNING, child=child)
            h.instances.add(inst)
            inst.watch(h._record_exit, h._forget)
            os.kill(child.pid, signal.SIGKILL)
            await asyncio.wait_for(inst.exited.wait(), 10)

        reader = threading.Thread(target=read)
        reader.start()
        try:
            asyncio.run(run())
            time.sleep(0.05)
        finally:
            done.set()
            reader.join()
        crashed = [v for v in seen if v["state"] == "crashed"]
        # The supervisor's cleanup took 0.3 s: ps saw the crash before its record.
        before = [v for v in crashed if "signal 9" not in (v["error"] or "")]
        assert before, "the reader never saw the crash before the supervisor recorded it"
        assert all(v["pid"] is None for v in crashed)
        assert all(v["error"] == f"QEMU pid {child.pid} is gone; the supervisor of "
                   "partition 'p0' has not recorded how it ended yet" for v in before)
        # Once recorded, the reason is how it ended, in one write with the state.
        assert "signal 9" in (seen[-1]["error"] or ""), seen[-1]
        rec = cli.vm("v")
        assert (rec.state, rec.pid) == (VmState.CRASHED, None)
        assert rec.error == "QEMU killed by signal 9 unexpectedly"
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()


def test_a_crashed_record_always_has_a_reason() -> None:
    gone = 2**22 + 7
    for rec, want in [
            (VmRecord("v", "a", 1, 256, state=VmState.CRASHED, error="QEMU killed by "
                      "signal 9 unexpectedly"), "QEMU killed by signal 9 unexpectedly"),
            # A record some older fusuma wrote without one.
            (VmRecord("v", "a", 1, 256, state=VmState.CRASHED),
             "its QEMU ended; no reason was recorded"),
            (VmRecord("v", "a", 1, 256, state=VmState.STOPPING, pid=gone),
             f"QEMU pid {gone} is gone; the supervisor of partition 'a' has not "
             "recorded how it ended yet"),
            (VmRecord("v", "a", 1, 256, state=VmState.STOPPED, error="stopped by force"),
             "stopped by force"),
            (VmRecord("v", "a", 1, 256), None)]:
        assert VmView(rec).as_json()["error"] == want, rec


def test_settling_a_vm_writes_no_step_on_the_way(paths: Paths, db: Database) -> None:  # noqa: F811
    """A stop that never happened (STOPPING, the QEMU still runs) goes back to running
    through crashed and starting: a reader sees neither step, only the end."""
    db.add_vm(VmRecord("v", "p0", 1, 256, state=VmState.STOPPING, pid=4242))
    h = PartitionHost(paths, "p0", db, None, logging.getLogger("t"))  # type: ignore[arg-type]
    cli = Database(paths.db)
    seen: list[tuple[VmState, str | None]] = []
    transition = db.transition

    def watched(name: str, to: VmState, **kw: Any) -> VmRecord:
        got = transition(name, to, **kw)
        rec = cli.vm(name)
        seen.append((rec.state, rec.error))
        return got
    db.transition = watched  # type: ignore[method-assign]
    h.settle_state("v", VmState.RUNNING, pid=4242)
    assert len(seen) == 3            # crashed, starting, running: one transaction
    assert set(seen) == {(VmState.STOPPING, None)}
    assert (cli.vm("v").state, cli.vm("v").pid) == (VmState.RUNNING, 4242)
