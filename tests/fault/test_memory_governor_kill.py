"""The memory governor's supervisor killed mid-reclaim (SIGKILL of the real process):
the balloon target it wrote down (``balloons.json``, with the QEMU's pid) and had not yet
given QEMU is found by its successor, which asks QEMU for it and goes on to the floor;
the guest is never ballooned below its floor and stays alive. The supervisor's and the
QEMU's OOM scores are set, or their refusal said. One busybox guest."""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path

import pytest

from tests.conftest import Host

pytestmark = [pytest.mark.fault, pytest.mark.timeout(240)]


def memory_status(host: Host) -> dict:  # type: ignore[type-arg]
    st: dict = host.run("governor", "status", "a", "--json").json()  # type: ignore[type-arg]
    return st["partitions"][0]["memory"]  # type: ignore[no-any-return]


def test_a_successor_finds_the_balloon_target_and_goes_on_to_the_floor(host: Host) -> None:
    # A target no host reaches: the governor sees the host short at every tick. Each
    # target waits 30 s between being written down and QEMU being asked for it: the
    # kill lands in that window, so QEMU never hears of the first target.
    host.env["FUSUMA_MEMORY_TARGET_FREE_MIB"] = str(10**9)
    host.env["FUSUMA_FAULT_BALLOON_DELAY"] = "30"
    host.run("partition", "create", "a", "--cpus", host.core(0), "--memory", "320",
             "--memory-overcommit", "2")
    host.run("vm", "create", "b", "-p", "a", "--memory", "256", "--memory-class",
             "burstable", "--memory-min", "160", "--start")
    qemu = host.vm("b")["pid"]
    sup = host.part("a")["supervisor_pid"]
    store = host.home / "partitions" / "a" / "balloons.json"
    deadline = time.monotonic() + 60
    while not store.exists():
        assert time.monotonic() < deadline, "the governor never wrote a balloon target"
        time.sleep(0.05)
    os.kill(sup, signal.SIGSTOP)
    kept = json.loads(store.read_text())
    os.kill(sup, signal.SIGKILL)
    assert kept == {"version": 1, "vms": {"b": {"pid": qemu, "target_mib": 192}}}
    # The successor, without the delay: it finds 192 although QEMU's balloon stands
    # at 256 (the predecessor died before asking), asks QEMU for it and goes on.
    del host.env["FUSUMA_FAULT_BALLOON_DELAY"]
    host.run("partition", "restart", "a")
    seen: list[int | None] = []
    deadline = time.monotonic() + 60
    while True:
        st = memory_status(host)
        mem = {v["name"]: v for v in st["vms"]}
        seen.append(mem.get("b", {}).get("balloon_actual_mib"))
        if seen[-1] == 160 or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    assert mem["b"]["balloon_mib"] == 160 and seen[-1] == 160, json.dumps(st, indent=1)
    assert all(s is None or s >= 160 for s in seen), seen
    acts = [(d["action"], d["reason"]) for d in st["decisions"] if d["vm"] == "b"]
    assert acts[0][0] == "resume" and f"to 192 MiB (QEMU pid {qemu})" in acts[0][1], acts
    inflates = [r for a, r in acts if a == "inflate"]
    assert len(inflates) == 1 and "b 192 -> 160 MiB (floor 160 MiB)" in inflates[0], acts
    assert json.loads(store.read_text())["vms"] == {"b": {"pid": qemu, "target_mib": 160}}
    # Still the same guest, alive and answering.
    assert host.vm("b")["pid"] == qemu and host.vm("b")["state"] == "running"
    host.run("vm", "exec", "b", "--", "true")
    # The OOM scores: set, or refused (no CAP_SYS_RESOURCE, as in this lab) and said
    # once by each supervisor, the killed one and its successor.
    scores = {p: Path(f"/proc/{p}/oom_score_adj").read_text().strip()
              for p in (host.part("a")["supervisor_pid"], qemu)}
    said = (host.home / "partitions" / "a" / "supervisor.log").read_text().count(
        "needs CAP_SYS_RESOURCE")
    assert sorted(scores.values()) in (["-400", "-900"], ["0", "0"]), scores
    assert said == (0 if "-900" in scores.values() else 2), said
    # Nothing of the partition's state outlives it.
    host.run("vm", "delete", "b", "--force")
    host.run("partition", "delete", "a")
    assert not Path(store).parent.exists()
