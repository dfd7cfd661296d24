"""`ps` tells the truth at once, and `bench cli` measures the CLI's start-up (issue 17)."""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path

import pytest

from tests.conftest import Host
from tests.integration.test_partitions import wait_for

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]


def _dead(pid: int) -> bool:
    """The kernel is done with a SIGKILLed process: gone or a zombie."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return True
    return stat.rsplit(")", 1)[1].split()[0] in ("Z", "X")


def test_kill9_shows_crashed_in_the_very_next_ps(host: Host) -> None:
    host.run("partition", "create", "p0", "--cpus", host.core(0), "--memory", "768")
    host.run("vm", "create", "v0", "-p", "p0", "--start")
    wait_for(lambda: host.vm("v0")["state"] == "running", what="v0 running")
    pid = host.vm("v0")["pid"]
    sup = host.part("p0")["supervisor_pid"]
    # Freeze the supervisor: it can neither reap QEMU nor record the crash, so the DB
    # still says "running" and only a fresh look at /proc can tell.
    os.kill(sup, signal.SIGSTOP)
    try:
        os.kill(pid, signal.SIGKILL)
        wait_for(lambda: _dead(pid), timeout=10, what="QEMU gone")
        # The very next ps (no retry, no wait) shows it.
        v = host.vm("v0")
        assert v["state"] == "crashed" and v["pid"] is None, v
        listed = next(x for x in host.run("vm", "list", "--json").json()
                      if x["name"] == "v0")
        assert listed["state"] == "crashed"
    finally:
        os.kill(sup, signal.SIGCONT)
    # The supervisor, running again, records it; the partition is unharmed.
    wait_for(lambda: "signal 9" in (host.vm("v0")["error"] or ""), what="crash recorded")
    assert host.part("p0")["state"] == "running"


def test_bench_cli_writes_result_file(host: Host, tmp_path: Path) -> None:
    out = tmp_path / "cli.json"
    t0 = time.monotonic()
    host.run("bench", "cli", "--runs", "2", "--vms", "2", "--json", str(out))
    data = json.loads(out.read_text())
    meta = data["meta"]
    for key in ("git_revision", "date", "host", "accel", "qemu", "host_cpu",
                "fusuma_command", "bytecode_cache"):
        assert meta[key], key
    assert meta["benchmark"] == "cli" and meta["runs"] == 2 and meta["vms"] == 2
    metrics = {r["metric"]: r for r in data["results"]}
    assert set(metrics) == {"python_bare_ms", "python_click_ms", "ps_json_empty_ms",
                            "vm_list_json_empty_ms", "help_ms", "migrate_help_ms",
                            "migrate_startup_ms", "ps_json_2vms_ms", "python_click_2vms_ms"}
    elapsed_ms = (time.monotonic() - t0) * 1000
    for r in metrics.values():
        assert len(r["runs_ms"]) == 2
        assert 0 < r["min_ms"] <= r["median_ms"] <= r["max_ms"] < elapsed_ms
        assert data["summary"][r["metric"]] == r["median_ms"]
    assert {t["metric"] for t in data["targets"]} == {
        "ps_json_empty_ms", "vm_list_json_empty_ms", "help_ms", "ps_json_2vms_ms",
        "migrate_startup_ms"}
    # The scratch partitions and VMs are gone.
    assert host.ps() == {"partitions": [], "vms": [], "networks": []}
