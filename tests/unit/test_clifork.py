"""The tests' CLI fork server (tests/clifork.py) gives what a fresh `python -m
fusuma.cli.main` gives: the same output, exit codes and program name, a timeout that
kills the call, and the caller's environment, not the server's."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

from tests import clifork
from tests.conftest import FUSUMA


@pytest.fixture()
def env(tmp_path: Path) -> dict[str, str]:
    return {**os.environ, "FUSUMA_HOME": str(tmp_path / "home"),
            "FUSUMA_RUNTIME_DIR": str(tmp_path / "run"), "FUSUMA_SHM_DIR": str(tmp_path / "shm")}


@pytest.mark.parametrize("argv", [["ps", "--json"], ["vm", "create"], ["nosuch"],
                                  ["vm", "--help"], ["--version"], ["token", "list"]])
def test_a_forked_call_says_what_a_fresh_process_says(env: dict[str, str],
                                                      argv: list[str]) -> None:
    fresh = subprocess.run([*FUSUMA, *argv], env=env, capture_output=True, text=True,
                           timeout=60)
    forked = clifork.run(argv, env, timeout=60)
    assert (forked.returncode, forked.stdout, forked.stderr) == \
        (fresh.returncode, fresh.stdout, fresh.stderr)


def test_the_callers_environment_reaches_the_command(tmp_path: Path,
                                                             env: dict[str, str]) -> None:
    clifork.run(["ps"], env, timeout=60)              # the server is up, its env set
    other = {**env, "FUSUMA_HOME": str(tmp_path / "other")}
    made = clifork.run(["token", "create", "t", "--role", "viewer"], other, timeout=60)
    assert made.returncode == 0, made.stderr
    assert "t" in clifork.run(["token", "list"], other, timeout=60).stdout
    assert "viewer" not in clifork.run(["token", "list"], env, timeout=60).stdout


def test_a_timeout_kills_the_call_and_says_so(env: dict[str, str]) -> None:
    with pytest.raises(subprocess.TimeoutExpired):
        clifork.run(["top"], env, timeout=1.5)


def test_only_a_plain_network_namespace_wrap_is_served() -> None:
    assert clifork.netns_of([]) == ""
    assert clifork.netns_of(["nsenter", "--net=/run/netns/a", "--"]) == "/run/netns/a"
    assert clifork.netns_of(["nsenter", "--net=/run/netns/a", "--mount=/x", "--"]) is None
    assert clifork.netns_of(["ip", "netns", "exec", "a"]) is None
