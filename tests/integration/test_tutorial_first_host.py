"""The first-host tutorial's shell session runs as printed (docs/tutorials/first-host.md):
every command of the page against a real host (one partition, one busybox VM of 128
MiB), each one's output compared with the page's for structure and words, not for pids,
sizes or times (tests/docs_session.py). So the tutorial cannot rot: a command that
changes its name, its options or what it prints fails here. About 10 s under TCG.

FUSUMA_DOCS_RECORD=1 writes the real output into the page instead of comparing."""

from __future__ import annotations

import os

import pytest

from tests import docs_session
from tests.conftest import REPO, Host

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]

PAGE = REPO / "docs" / "tutorials" / "first-host.md"


def test_first_host_tutorial_runs_as_printed(host: Host) -> None:
    steps = docs_session.parse(PAGE.read_text())
    assert len(steps) >= 8, "the tutorial's session is missing"
    outputs: list[str] = []
    mismatches: list[str] = []
    for step in steps:
        argv = step.argv
        assert argv[0] == "fusuma", f"the tutorial runs only fusuma commands: {step.command}"
        res = host.run(*argv[1:], check=False, timeout=180)
        assert res.code == 0, (f"`{step.command}` exited {res.code} in the tutorial:\n"
                               f"{res.out}\n{res.err}")
        outputs.append(res.out)
        if not docs_session.matches(step.expected, res.out.splitlines()):
            mismatches.append(f"`{step.command}` printed:\n{res.out}\n"
                              f"the page shows:\n" + "\n".join(step.expected))
    if os.environ.get("FUSUMA_DOCS_RECORD") == "1":
        docs_session.record(PAGE, outputs)
        return
    assert not mismatches, (
        "the tutorial's output differs from what the commands print now (rerun with "
        "FUSUMA_DOCS_RECORD=1 to write it into the page if the change is meant):\n\n"
        + "\n\n".join(mismatches))
