"""`fusuma serve` killed with -9 in the middle of a move it runs.

The daemon's operations hold the same jobs as the CLI (owned by the daemon's pid and
start time), so its death is recovered like the CLI's: by the supervisors' sweep,
within seconds, without anyone running a command. Afterwards at most one QEMU runs the
guest, its data is intact, `ps` says where, no job is left, and a new daemon starts on
the dead one's socket and drives the VM again.
"""

from __future__ import annotations

import os
import signal
import time

import pytest

from tests.apikit import Api
from tests.conftest import Host
from tests.fault.movekit import PHASES, check_truth, job, qemu_pids, two_partitions

pytestmark = [pytest.mark.integration, pytest.mark.fault]


@pytest.mark.timeout(240)
@pytest.mark.parametrize("phase", ["prepared", "streamed"])
def test_daemon_killed_mid_move(host: Host, phase: str) -> None:
    two_partitions(host)
    env, job_phase, mode = PHASES[phase]
    api = Api(host, env=env)
    try:
        with api.unix() as c:
            r = c.post("/1.0/vms/vm0/move", json={"partition": "p1", "mode": mode})
            assert r.status_code == 202, r.text
            deadline = time.monotonic() + 30
            while time.monotonic() < deadline:
                j = job(host, "vm0")
                if j is not None and j["phase"] == job_phase:
                    break
                time.sleep(0.01)
            else:
                raise AssertionError(f"the move never reached phase {job_phase}")
            assert j["owner_pid"] == api.proc.pid      # the daemon holds the job
        os.kill(api.proc.pid, signal.SIGKILL)
        api.proc.wait(10)
        # Nobody runs a command: the supervisors' sweep recovers the job.
        deadline = time.monotonic() + 30
        while job(host, "vm0") is not None and time.monotonic() < deadline:
            time.sleep(0.1)
        assert job(host, "vm0") is None, f"the job was not recovered: {job(host, 'vm0')}"
        truth = check_truth(host)
        assert truth["checksum"] == "intact", truth
        assert len(qemu_pids(host, "vm0")) == 1
        # The move's outcome was recorded in the event log, for any later daemon.
        assert host.run("ps", "--json").json()["vms"][0]["job"] is None
    finally:
        api._logf.close()
    # The dead daemon's socket is left behind; a new daemon takes it over and works.
    assert api.socket.exists()
    api2 = Api(host)
    try:
        with api2.unix() as c:
            v = c.get("/1.0/vms/vm0").json()
            assert v["state"] == "running"
            to = "p0" if v["partition"] == "p1" else "p1"
            res = Api.ok(c, c.post("/1.0/vms/vm0/move", json={"partition": to}))
            assert res["to"] == to and res["downtime_ms"] is not None
    finally:
        api2.stop()
