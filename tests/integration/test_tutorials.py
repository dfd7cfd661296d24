"""The tutorials' shell sessions run as printed on one host (docs/tutorials/): every
command of the page against a real host, each one's output compared with the page's
for structure and words, not for pids, sizes or times (tests/docs_session.py). So a
tutorial cannot rot: a command that changes its name, its options or what it prints
fails here.

- first-host.md: one partition, one busybox VM of 128 MiB (about 7 s under TCG);
- first-template.md: a partition on QEMU 10.0, a busybox VM made a template, two
  clones (about 7 s).

FUSUMA_DOCS_RECORD=1 writes the real output into the pages instead of comparing."""

from __future__ import annotations

import pytest

from tests import docs_session
from tests.conftest import REPO, Host

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]

TUTORIALS = REPO / "docs" / "tutorials"


def runner(host: Host) -> docs_session.Run:
    def run(step: docs_session.Step) -> tuple[int, str, str]:
        argv = step.argv
        assert argv[0] == "fusuma", f"the tutorial runs only fusuma commands: {step.command}"
        res = host.run(*argv[1:], check=False, timeout=180)
        return res.code, res.out, res.err
    return run


def test_first_host_tutorial_runs_as_printed(host: Host) -> None:
    docs_session.check_page(TUTORIALS / "first-host.md", runner(host), min_steps=8)


def test_first_template_tutorial_runs_as_printed(host: Host) -> None:
    docs_session.check_page(TUTORIALS / "first-template.md", runner(host), min_steps=10)
