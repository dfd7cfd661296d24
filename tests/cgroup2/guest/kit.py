"""Helpers for the in-guest cgroup v2 tests: the real CLI, and what the kernel says.

Each CLI call is a process of its own, forked from a server that imported the CLI once
(guest/forkcli.py): a new interpreter costs ~3-5 s here under TCG. The calls whose
point is the entry point itself (test_1's, test_5's in a cgroup namespace) run
``python -m fusuma.cli.main``; so does every call with FUSUMA_CG2_FORK=0.
"""

from __future__ import annotations

import contextlib
import json
import os
import resource
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from forkcli import ForkServer

CGROUP = Path("/sys/fs/cgroup")
FUSUMA = [sys.executable, "-m", "fusuma.cli.main"]
# Each CLI call's command, seconds and CPU seconds, for the host's test-output (each call
# costs seconds under TCG: where the guest's time goes).
CALLS_FILE = Path("/run/fusuma-cg2/calls.json")
CALLS: list[dict[str, Any]] = []
# Where each call spends its wall time: a stack sampler beside it (guest/sampler.py),
# its top stacks in calls.json.
SAMPLER = Path(__file__).resolve().parent / "sampler.py"
SAMPLES = CALLS_FILE.parent / "samples"
# FUSUMA_CG2_FORK=0: every call in a new interpreter (no fork server).
FORK = os.environ.get("FUSUMA_CG2_FORK", "1") != "0"
_SERVERS: dict[tuple[str, ...], ForkServer] = {}


def server(wrap: list[str]) -> ForkServer:
    """The fork server for calls under ``wrap`` (started on first use)."""
    key = tuple(wrap)
    if key not in _SERVERS:
        _SERVERS[key] = ForkServer(wrap, CALLS_FILE.parent / f"fork-{len(_SERVERS)}.sock")
    return _SERVERS[key]


def close_servers(wrap: list[str] | None = None) -> None:
    """Stop the fork server for ``wrap`` (every one when None)."""
    for key in [k for k in _SERVERS if wrap is None or k == tuple(wrap)]:
        _SERVERS.pop(key).close()


def _children_cpu() -> float:
    r = resource.getrusage(resource.RUSAGE_CHILDREN)
    return r.ru_utime + r.ru_stime


@dataclass
class Result:
    code: int
    out: str
    err: str

    def json(self) -> Any:
        return json.loads(self.out)


@dataclass
class Fusuma:
    """The fusuma CLI with one namespace's environment (run under ``wrap``, e.g.
    ``nsenter --net=...``, when set)."""

    env: dict[str, str] = field(default_factory=dict)
    wrap: list[str] = field(default_factory=list)

    def run(self, *args: str, check: bool = True, timeout: float = 600) -> Result:
        t0, c0 = time.monotonic(), _children_cpu()
        SAMPLES.mkdir(parents=True, exist_ok=True)
        sample = SAMPLES / f"{len(CALLS)}.json"
        env = {**os.environ, **self.env}
        if FORK:
            code, out, err, cpu = server(self.wrap).run(
                [FUSUMA[2], *args], env, timeout, str(sample))
        else:
            argv = [sys.executable, str(SAMPLER), str(sample), *FUSUMA[1:]]
            p = subprocess.run([*self.wrap, *argv, *args], env=env, capture_output=True,
                               text=True, timeout=timeout)
            code, out, err, cpu = p.returncode, p.stdout, p.stderr, 0.0
        call: dict[str, Any] = {"args": " ".join(args[:3]),
                                "s": round(time.monotonic() - t0, 2),
                                "cpu_s": round(_children_cpu() - c0 + cpu, 2),
                                "forked": FORK}
        with contextlib.suppress(OSError, ValueError, KeyError):
            call["where"] = json.loads(sample.read_text())["top"][:6]
        CALLS.append(call)
        CALLS_FILE.parent.mkdir(parents=True, exist_ok=True)
        CALLS_FILE.write_text(json.dumps(CALLS, indent=0))
        res = Result(code, out, err)
        if check and code != 0:
            raise AssertionError(f"fusuma {' '.join(args)} exited {code}:\n"
                                 f"{out}\n{err}")
        return res

    def fail(self, *args: str) -> Result:
        res = self.run(*args, check=False)
        assert res.code != 0, f"fusuma {' '.join(args)} should have failed:\n{res.out}"
        return res

    def ps(self) -> dict[str, Any]:
        data: dict[str, Any] = self.run("ps", "--json").json()
        return data

    def part(self, name: str) -> dict[str, Any]:
        return next(p for p in self.ps()["partitions"] if p["name"] == name)


def threads_allowed(pid: int) -> dict[str, str]:
    """Each thread of ``pid``: its name -> Cpus_allowed_list, from /proc."""
    out: dict[str, str] = {}
    for task in sorted(Path(f"/proc/{pid}/task").iterdir()):
        try:
            comm = (task / "comm").read_text().strip()
            status = (task / "status").read_text()
        except OSError:
            continue
        allowed = next(ln.split(":", 1)[1].strip() for ln in status.splitlines()
                       if ln.startswith("Cpus_allowed_list:"))
        out[f"{task.name} {comm}"] = allowed
    return out


def cgroup_of(pid: int) -> Path:
    """The cgroup2 directory ``pid`` is in."""
    for line in Path(f"/proc/{pid}/cgroup").read_text().splitlines():
        if line.startswith("0::"):
            return CGROUP / line[3:].lstrip("/")
    raise AssertionError(f"pid {pid} has no cgroup2 membership")


def read(path: Path) -> str:
    return path.read_text().strip()


def systemctl(*args: str, check: bool = True) -> str:
    p = subprocess.run(["systemctl", *args], capture_output=True, text=True, timeout=120)
    if check and p.returncode != 0:
        raise AssertionError(f"systemctl {' '.join(args)}: {p.stdout}{p.stderr}")
    return p.stdout.strip()


def show(unit: str, prop: str) -> str:
    return systemctl("show", unit, f"--property={prop}", "--value")


def wait_for(what: str, check: Callable[[], bool], timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what}")
        time.sleep(0.2)


def alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


class Burner:
    """A CPU-bound process (a shell loop), to give a cgroup something to schedule."""

    def __init__(self) -> None:
        self.proc = subprocess.Popen(["/bin/sh", "-c", "while :; do :; done"],
                                     stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                     stderr=subprocess.DEVNULL)
        self.pid = self.proc.pid

    def stop(self) -> None:
        self.proc.kill()
        self.proc.wait()
