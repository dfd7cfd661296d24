"""Shared fixtures.

``host`` gives an integration test its own fusuma namespace: temporary FUSUMA_HOME,
runtime dir, /dev/shm dir and cgroup prefix (the guest image cache is shared). At
teardown it runs `fusuma down` and then *proves* that nothing is left: no QEMU or
supervisor process of the namespace, no cgroup, no socket, no /dev/shm file. Whatever
is found is removed by pid (only processes of this namespace) and the test fails.
On failure, each VM's console, QMP and QEMU logs are copied to test-output/<test>/.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from tests import clifork

REPO = Path(__file__).resolve().parent.parent
FUSUMA = [sys.executable, "-m", "fusuma.cli.main"]
CGROUP_ROOT = Path("/sys/fs/cgroup")
# The limit on a full Debian booted by firmware under TCG (`vm start --wait`): 2-3 min
# on a quiet 2-core host, up to 7 min beside the rest of a suite run (CI logs). It
# catches a guest that hangs; how fast one boots is `fusuma bench images`'s to say.
FULL_OS_BOOT_S = 900


# -- running on several workers (make test: pytest -n 2) -------------------------------
# Each worker takes a whole test module at a time, so that a module's shared guest or
# cluster lab is set up once, in one worker. The longest modules go first (by
# tests/suite_costs.json, written by tools/suite_costs.py) so that the workers finish
# together. What cannot share the machine is marked `serial` and runs after, alone.
COSTS = REPO / "tests" / "suite_costs.json"
DEFAULT_S = 20
# A test that asks for one of these cannot share the machine: kernel-exclusive cpusets
# (no other namespace may hold a core meanwhile) and the host's KSM settings (a test
# beside it could turn KSM off, or put back what it found, mid-way).
SERIAL_FIXTURES = {"exclusive_host", "ksm_restored"}


def scope_of(nodeid: str) -> str:
    """The unit of work a worker takes: the test module, except that the cluster modules
    are one unit (a kube-apiserver, etcd and three hosts each; two at once would starve
    the leases on two cores)."""
    path = nodeid.split("::", 1)[0]
    return "tests/cluster" if path.startswith("tests/cluster/") else path


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        if SERIAL_FIXTURES & set(getattr(item, "fixturenames", ())):
            item.add_marker(pytest.mark.serial)
    try:
        costs: dict[str, float] = json.loads(COSTS.read_text())
    except (OSError, ValueError):
        costs = {}
    weight: dict[str, float] = {}
    seen: set[str] = set()
    for item in items:
        path = item.nodeid.split("::", 1)[0]
        if path not in seen:
            seen.add(path)
            scope = scope_of(path)
            weight[scope] = weight.get(scope, 0) + costs.get(path, DEFAULT_S)
    order = {id(item): n for n, item in enumerate(items)}
    items.sort(key=lambda it: (-weight[scope_of(it.nodeid)], scope_of(it.nodeid),
                               order[id(it)]))


def pytest_xdist_make_scheduler(config: pytest.Config, log: Any) -> Any:
    """Whole modules (cluster: the whole directory) per worker, in collection order."""
    if config.getoption("dist") not in ("loadscope", "loadfile"):
        return None
    from xdist.scheduler import LoadScopeScheduling

    class ByModule(LoadScopeScheduling):  # type: ignore[misc]
        def _split_scope(self, nodeid: str) -> str:
            return scope_of(nodeid)

    config.option.loadscopereorder = False
    return ByModule(config, log)


@pytest.hookimpl(wrapper=True, tryfirst=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Any:
    rep = yield
    setattr(item, "rep_" + rep.when, rep)
    return rep


# -- where a run's time goes ------------------------------------------------------------
# Each test's start and end (wall clock) and the machine's busy and idle CPU seconds
# meanwhile, one line per test in test-output/timeline-WORKER.jsonl: beside the other
# worker's lines, it shows when the two cores idle and which tests were running then.
TIMELINE = REPO / "test-output"


def _cpu_split() -> tuple[float, float]:
    """The machine's busy and idle CPU seconds since boot (/proc/stat, all cores)."""
    f = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    hz = os.sysconf("SC_CLK_TCK")
    return (sum(f) - f[3] - f[4]) / hz, (f[3] + f[4]) / hz


@pytest.hookimpl(wrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None) -> Any:
    t0, (busy0, idle0) = time.time(), _cpu_split()
    try:
        return (yield)
    finally:
        busy1, idle1 = _cpu_split()
        worker = os.environ.get("PYTEST_XDIST_WORKER", "main")
        with contextlib.suppress(OSError):
            TIMELINE.mkdir(exist_ok=True)
            with open(TIMELINE / f"timeline-{worker}.jsonl", "a") as f:
                f.write(json.dumps({"test": item.nodeid, "start": round(t0, 2),
                                    "end": round(time.time(), 2),
                                    "busy_s": round(busy1 - busy0, 2),
                                    "idle_s": round(idle1 - idle0, 2)}) + "\n")


# Tests of two workers run side by side and their namespaces may share cores
# (FUSUMA_CPU_EXCLUSIVE=0): if both put their guests on core 0, the other core idles.
# So each worker numbers the cores from its own end (`Host.core`).
CORES = len(os.sched_getaffinity(0))
CORE_OFFSET = 1 if os.environ.get("PYTEST_XDIST_WORKER") == "gw1" and CORES > 1 else 0


def core(i: int) -> str:
    """Host core ``i`` of this worker's map."""
    return str((i + CORE_OFFSET) % CORES)


@dataclass
class Result:
    code: int
    out: str
    err: str

    def json(self) -> Any:
        return json.loads(self.out)


class Host:
    """One isolated fusuma namespace and a way to run the real CLI in it."""

    def __init__(self, tmp: Path, exclusive: bool = False) -> None:
        tag = uuid.uuid4().hex[:8]
        self.tag = tag
        self.home = tmp / "home"
        # Short: UNIX socket paths are limited to 107 bytes.
        self.runtime = Path(f"/tmp/fz-{tag}")
        self.shm = Path(f"/dev/shm/fusuma-test-{tag}")
        self.prefix = f"fusuma-test-{tag}"
        self.env = {**os.environ,
                    "FUSUMA_HOME": str(self.home), "FUSUMA_RUNTIME_DIR": str(self.runtime),
                    "FUSUMA_SHM_DIR": str(self.shm), "FUSUMA_CGROUP_PREFIX": self.prefix,
                    # Kernel-exclusive cpusets would let only one namespace hold cores;
                    # tests that check them ask for `exclusive_host`.
                    "FUSUMA_CPU_EXCLUSIVE": "1" if exclusive else "0",
                    # Id ranges of its own (fusuma.paths.UID_SPAN each), apart from the
                    # default's: two namespaces never share a QEMU uid.
                    "FUSUMA_UID_BASE": str(0x7100_0000 + (int(tag, 16) % 1024) * 131072),
                    "PYTHONPATH": str(REPO / "src")}
        self.env.setdefault("FUSUMA_CACHE", "/var/cache/fusuma")
        # What the CLI runs under: e.g. ``nsenter --net=...`` for a network namespace
        # of the test's own (tests/integration/test_networks.py).
        self.wrap: list[str] = []

    def core(self, i: int) -> str:
        """Host core ``i`` of this worker's map: the other worker counts from the other
        end, so that the tests' guests (most on "core 0") load both cores, not one."""
        return core(i)

    def run(self, *args: str, check: bool = True, timeout: float = 300,
            input: str | None = None) -> Result:
        netns = clifork.netns_of(self.wrap)
        if clifork.enabled() and netns is not None:
            # The same CLI in a process of its own, forked from one that imported it
            # (tests/clifork.py): a sixth of the suite's CPU was Python's start-up.
            p = clifork.run(list(args), self.env, timeout=timeout, input=input,
                            netns=netns)
        else:
            p = subprocess.run([*self.wrap, *FUSUMA, *args], env=self.env,
                               capture_output=True, text=True, timeout=timeout, input=input)
        res = Result(p.returncode, p.stdout, p.stderr)
        if check and p.returncode != 0:
            raise AssertionError(f"fusuma {' '.join(args)} exited {p.returncode}:\n"
                                 f"{p.stdout}\n{p.stderr}")
        return res

    def fail(self, *args: str) -> Result:
        """Run a command that must fail; returns its result."""
        res = self.run(*args, check=False)
        assert res.code != 0, f"fusuma {' '.join(args)} should have failed:\n{res.out}"
        return res

    def ps(self) -> dict[str, Any]:
        data: dict[str, Any] = self.run("ps", "--json").json()
        return data

    def vm(self, name: str) -> dict[str, Any]:
        return next(v for v in self.ps()["vms"] if v["name"] == name)

    def part(self, name: str) -> dict[str, Any]:
        return next(p for p in self.ps()["partitions"] if p["name"] == name)

    # -- leftovers -----------------------------------------------------------------
    def our_pids(self) -> list[int]:
        """QEMU, supervisor, network keeper and dnsmasq processes that belong to this
        namespace (dnsmasq's configuration lies in its runtime dir)."""
        found = []
        for d in Path("/proc").iterdir():
            if not d.name.isdigit():
                continue
            try:
                cmd = (d / "cmdline").read_bytes().decode(errors="replace")
                env = (d / "environ").read_bytes().decode(errors="replace")
            except OSError:
                continue
            if str(self.runtime) in cmd or (
                    ("fusuma.supervisor" in cmd or "fusuma.network.keeper" in cmd)
                    and f"FUSUMA_RUNTIME_DIR={self.runtime}\0" in env):
                found.append(int(d.name))
        return found

    def our_cgroups(self) -> list[Path]:
        return [p for p in CGROUP_ROOT.glob(f"*/{self.prefix}") if p.is_dir()] + [
            p for p in CGROUP_ROOT.glob(self.prefix) if p.is_dir()]

    def leftovers(self) -> list[str]:
        out = [f"process {pid}" for pid in self.our_pids()]
        out += [f"cgroup {p}" for p in self.our_cgroups()]
        if self.runtime.exists():
            out += [f"socket {p}" for p in self.runtime.rglob("*.sock")]
        if self.shm.exists():
            out += [f"shm file {p}" for p in self.shm.iterdir()]
        # Anything else of this namespace in /dev/shm (a mount point, a re-created dir).
        out += [f"shm entry {p}" for p in Path("/dev/shm").glob(f"fusuma-test-{self.tag}*")
                if p != self.shm]
        return out

    def force_clean(self) -> None:
        for pid in self.our_pids():
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, 9)
        time.sleep(0.3)
        for cg in sorted(self.our_cgroups(), key=lambda p: -len(p.parts)):
            for sub in sorted((p for p in cg.rglob("*") if p.is_dir()),
                              key=lambda p: -len(p.parts)):
                with contextlib.suppress(OSError):
                    sub.rmdir()
            with contextlib.suppress(OSError):
                cg.rmdir()
        shutil.rmtree(self.runtime, ignore_errors=True)
        shutil.rmtree(self.shm, ignore_errors=True)

    def save_logs(self, dest: Path) -> None:
        vms = self.home / "vms"
        parts = self.home / "partitions"
        for root in (vms, parts):
            if root.exists():
                shutil.copytree(root, dest / root.name, dirs_exist_ok=True)


def _host(tmp_path: Path, request: pytest.FixtureRequest, exclusive: bool) -> Iterator[Host]:
    h = Host(tmp_path, exclusive)
    yield h
    rep = getattr(request.node, "rep_call", None)
    if rep is not None and rep.failed:
        h.save_logs(REPO / "test-output" / request.node.name)
    _tear_down(h)


def _tear_down(h: Host) -> None:
    """`fusuma down`, then prove nothing of the namespace is left (and remove it)."""
    h.run("down", check=False, timeout=120)
    left = h.leftovers()
    h.force_clean()
    shutil.rmtree(h.runtime, ignore_errors=True)
    if h.shm.exists():
        shutil.rmtree(h.shm, ignore_errors=True)
    assert not left, f"left behind after the test: {left}"


@pytest.fixture
def host(tmp_path: Path, request: pytest.FixtureRequest) -> Iterator[Host]:
    yield from _host(tmp_path, request, exclusive=False)


@pytest.fixture
def exclusive_host(tmp_path: Path, request: pytest.FixtureRequest) -> Iterator[Host]:
    """A namespace with kernel-exclusive cpusets (the production default)."""
    yield from _host(tmp_path, request, exclusive=True)


@pytest.fixture(scope="module")
def module_host(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Host]:
    """One namespace shared by the tests of a module that each leave it as the next
    expects (a kill matrix whose guest survives its cases): what a case breaks, the next
    case's set-up makes again, so a guest is booted once per module, not once per case.
    The leftover check runs once, when the module is done. Use it through a function
    fixture of the module that saves the logs of a failed case (``shared_logs``)."""
    h = Host(tmp_path_factory.mktemp("shared"))
    yield h
    _tear_down(h)


@pytest.fixture
def shared_logs(module_host: Host, request: pytest.FixtureRequest) -> Iterator[Host]:
    """``module_host`` for one test, whose logs are saved if it fails."""
    yield module_host
    rep = getattr(request.node, "rep_call", None)
    if rep is not None and rep.failed:
        module_host.save_logs(REPO / "test-output" / request.node.name)
