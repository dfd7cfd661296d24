"""The fault matrix of a move: kill -9 each of the five processes at each phase
boundary (25 cases, real processes, real QEMU). After each: at most one QEMU runs the
guest; if it runs, data written before the move is intact; `ps` is true; the next move
works. The cases share one host and guest (``module_host``): each starts from the guest
running in p0 with its data, made again only where the case before lost it. Each
case's outcome and time to recover is written to test-output/move-matrix.jsonl (the
table of docs/results/move-fault-matrix.md comes from there)."""

from __future__ import annotations

import json
import time

import pytest

from tests.conftest import REPO, Host
from tests.fault.movekit import (
    PHASES,
    TARGETS,
    check_truth,
    hold_move,
    kill,
    next_move_works,
    ready,
    wait_resolved,
)
from tests.fault.test_bad_input import assert_one_sentence

pytestmark = [pytest.mark.fault, pytest.mark.timeout(240)]


@pytest.mark.parametrize("target", TARGETS)
@pytest.mark.parametrize("phase", list(PHASES))
def test_kill_during_move(shared_logs: Host, phase: str, target: str) -> None:
    host = shared_logs
    ready(host)
    # Seen within tens of ms and killed there: what was not killed goes on sooner.
    held = hold_move(host, phase, hold="2")
    t0 = time.monotonic()
    killed = kill(held.pids[target])
    recover_s = wait_resolved(host, held)
    _out, err = held.proc.communicate()
    if target != "cli" and held.proc.returncode != 0:
        # A failure is one clear sentence saying where the guest is, never a trace.
        assert_one_sentence(err)
        assert "partition" in err, err
    truth = check_truth(host)
    next_move_works(host)
    row = {"phase": phase, "killed": target if killed else f"{target} (already gone)",
           "mode": held.mode, "cli_exit": held.proc.returncode, **truth,
           "recovered_s": round(recover_s, 2), "total_s": round(time.monotonic() - t0, 2)}
    (REPO / "test-output").mkdir(exist_ok=True)
    with open(REPO / "test-output" / "move-matrix.jsonl", "a") as f:
        f.write(json.dumps(row) + "\n")
