"""`fusuma bench cli`: wall time of whole `fusuma` processes (the CLI's start-up).

Each measurement starts a new process of the `fusuma` console script next to this
interpreter (what a user or a script runs), waits for it to exit and takes the wall time
from just before the start to just after the exit. The commands are run round-robin
(one of each, then the next round), so a slow moment of the host spreads over all of
them instead of spoiling one; the summary of each is the median of ``runs`` rounds,
after one warm-up round that is not counted.

- ``ps --json``, ``vm list --json``, ``--help``, ``migrate --help``: in an *empty*
  namespace (FUSUMA_HOME, FUSUMA_RUNTIME_DIR and FUSUMA_SHM_DIR in a scratch directory).
- migrate's own start-up: a whole ``fusuma migrate VM --to P`` process that is refused
  before its first supervisor call (an unknown VM in the empty namespace). It pays for
  everything a real move pays besides the move itself: the interpreter, every import of
  the CLI and of fusuma.migration, the state DB, the host lock and the recovery check,
  and the process exit. A move's ``total_ms`` (`fusuma migrate --json`) starts after
  all of that, so a move's wall time is this plus ``total_ms``.
- with ``vms > 0``, after all of the above: ``ps --json`` in the caller's namespace with
  that many VMs running (their PSS is read from /proc/PID/smaps_rollup by every `ps`),
  and the click floor again while they run (idle guests still take CPU, under TCG a
  lot). The VMs (256 MiB, the minimal image) run in up to two scratch partitions on the
  cores no partition holds, each booted to its guest agent (one at a time per
  partition, the partitions side by side), then left to settle until their QEMUs use
  less than QUIET_CORES_PER_VM each (at most SETTLE_MAX_S) before the measurement;
  everything is removed afterwards, also when the benchmark fails.
- for scale: a bare interpreter (``python -c pass``) and one that imports click, the
  floor of any click CLI on this host.

Python's bytecode cache is on for the children, as after a normal installation; it
lives in a scratch directory (PYTHONPYCACHEPREFIX), so the source tree is not written
and the cache is filled by the warm-up round. Without any cache (PYTHONDONTWRITEBYTECODE
with no ``__pycache__`` next to the sources) every run compiles fusuma's modules again,
which costs far more than importing them.
"""

from __future__ import annotations

import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from fusuma.errors import FusumaError, NotFoundError, ResourceError, SpecError
from fusuma.frozen import frozen
from fusuma_bench.agents import wait_agents
from fusuma_bench.report import meta
from fusuma_bench.steady import qemu_cpu_s, wait_quiet

if TYPE_CHECKING:
    from fusuma.partition.manager import PartitionManager
    from fusuma.vm.manager import VmManager

DEFAULT_RUNS = 10
# The running VMs are measured once they are idle: a window of SETTLE_WINDOW_S in which
# their QEMUs used less than QUIET_CORES_PER_VM cores each (an idle guest of the
# minimal image uses about 0.02 under TCG), waiting at most SETTLE_MAX_S.
QUIET_CORES_PER_VM = 0.1
SETTLE_WINDOW_S = 1.0
SETTLE_MAX_S = 20.0
PARTITION = "bench-cli"
# Targets of issue 17, in ms (medians).
TARGETS = {"ps_json_empty_ms": 100.0, "vm_list_json_empty_ms": 100.0, "help_ms": 100.0,
           "ps_json_vms_ms": 150.0, "migrate_startup_ms": 50.0}


@frozen
class Probe:
    metric: str
    argv: list[str]
    namespace: str            # "empty", "host" (the caller's) or "none"
    shown: str                # the command as a user would type it
    what: str
    expect_rc: int = 0


def fusuma_argv() -> list[str]:
    """How a user runs fusuma from this installation: the console script next to this
    interpreter, else ``python -m fusuma.cli.main``."""
    script = Path(sys.executable).parent / "fusuma"
    if script.is_file() and os.access(script, os.X_OK):
        return [str(script)]
    return [sys.executable, "-m", "fusuma.cli.main"]


def probes(vms: int) -> list[Probe]:
    f = fusuma_argv()

    def fu(metric: str, args: list[str], what: str, namespace: str = "empty",
           expect_rc: int = 0) -> Probe:
        return Probe(metric, [*f, *args], namespace, " ".join(["fusuma", *args]), what,
                     expect_rc)

    py = sys.executable
    out = [
        Probe("python_bare_ms", [py, "-c", "pass"], "none", "python -c pass",
              "the interpreter alone"),
        Probe("python_click_ms", [py, "-c", "import click"], "none",
              "python -c 'import click'", "the floor of any click CLI"),
        fu("ps_json_empty_ms", ["ps", "--json"], "empty host"),
        fu("vm_list_json_empty_ms", ["vm", "list", "--json"], "empty host"),
        fu("help_ms", ["--help"], "the command list"),
        fu("migrate_help_ms", ["migrate", "--help"], "migrate's help"),
        fu("migrate_startup_ms", ["migrate", "bench-cli-no-such-vm", "--to",
                                  "bench-cli-no-such-partition"],
           "migrate's own start-up: a migrate refused before its first supervisor call "
           "(unknown VM): interpreter, imports, DB, host lock, recovery check, exit",
           expect_rc=NotFoundError.exit_code),
    ]
    if vms:
        out += [Probe(f"python_click_{vms}vms_ms", [py, "-c", "import click"], "none",
                      "python -c 'import click'",
                      f"the floor again, while the {vms} VMs run (their CPU use shows)"),
                fu(f"ps_json_{vms}vms_ms", ["ps", "--json"],
                   f"{vms} VMs running (PSS of each read from /proc)", "host")]
    return out


def revision_src(revision: str, dest: Path) -> tuple[str, Path]:
    """Extract ``src/`` of git ``revision`` of this checkout into ``dest``; returns the
    full commit id and the directory to put first on PYTHONPATH."""
    repo = Path(__file__).resolve().parents[2]
    try:
        sha = subprocess.run(["git", "-C", str(repo), "rev-parse", "--verify",
                              f"{revision}^{{commit}}"], capture_output=True, text=True,
                             timeout=10, check=True).stdout.strip()
        tar = subprocess.run(["git", "-C", str(repo), "archive", "--format=tar", sha, "src"],
                             capture_output=True, timeout=60, check=True).stdout
    except (OSError, subprocess.SubprocessError) as exc:
        why = exc.stderr if isinstance(exc, subprocess.CalledProcessError) else str(exc)
        if isinstance(why, bytes):
            why = why.decode(errors="replace")
        raise NotFoundError(f"cannot get revision {revision!r} from the git checkout at "
                            f"{repo}: {str(why).strip() or exc}") from exc
    import io
    import tarfile

    with tarfile.open(fileobj=io.BytesIO(tar)) as tf:
        tf.extractall(dest, filter="data")
    return sha, dest / "src"


def child_env(base: dict[str, str], pycache: Path, src: Path | None) -> dict[str, str]:
    env = {k: v for k, v in base.items() if k != "PYTHONDONTWRITEBYTECODE"}
    env["PYTHONPYCACHEPREFIX"] = str(pycache)
    if src is not None:
        env["PYTHONPATH"] = os.pathsep.join(
            [str(src), *([env["PYTHONPATH"]] if env.get("PYTHONPATH") else [])])
    return env


def empty_namespace(env: dict[str, str], root: Path) -> dict[str, str]:
    return {**env, "FUSUMA_HOME": str(root / "home"),
            "FUSUMA_RUNTIME_DIR": str(root / "run"), "FUSUMA_SHM_DIR": str(root / "shm"),
            "FUSUMA_CGROUP_PREFIX": f"fusuma-bench-cli-{uuid.uuid4().hex[:8]}"}


def time_once(argv: list[str], env: dict[str, str], expect_rc: int) -> tuple[float, str]:
    t0 = time.perf_counter()
    p = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=60)
    ms = (time.perf_counter() - t0) * 1000
    if p.returncode != expect_rc:
        raise FusumaError(f"`{' '.join(argv)}` exited {p.returncode} (expected "
                          f"{expect_rc}): {p.stderr.strip()[-400:]}")
    return ms, p.stdout


def measure(plan: list[Probe], envs: dict[str, dict[str, str]], runs: int,
            check: Callable[[Probe, str], None] = lambda p, out: None,
            progress: Callable[[str], None] = lambda s: None) -> dict[str, list[float]]:
    """Wall times in ms per metric: one uncounted warm-up round, then ``runs`` rounds."""
    times: dict[str, list[float]] = {p.metric: [] for p in plan}
    for r in range(runs + 1):
        if r == 0:
            progress("warm-up round (fills the bytecode cache; not counted)")
        elif r == 1 or r % 5 == 0:
            progress(f"round {r}/{runs}")
        for p in plan:
            ms, out = time_once(p.argv, envs[p.namespace], p.expect_rc)
            if r == 0:
                check(p, out)
            else:
                times[p.metric].append(round(ms, 1))
    return times


def summary(times: dict[str, list[float]]) -> dict[str, float]:
    """Each metric's median; plus ``migrate_startup_over_click_ms``, the part of
    migrate's start-up that is fusuma's own: its median minus that of an interpreter
    that imports click (which any click CLI pays)."""
    out = {k: round(statistics.median(v), 1) for k, v in times.items()}
    if "migrate_startup_ms" in out and "python_click_ms" in out:
        out["migrate_startup_over_click_ms"] = round(
            out["migrate_startup_ms"] - out["python_click_ms"], 1)
    return out


def targets(summ: dict[str, float], vms: int) -> list[dict[str, Any]]:
    out = []
    for metric, limit in TARGETS.items():
        key = f"ps_json_{vms}vms_ms" if metric == "ps_json_vms_ms" else metric
        if key not in summ:
            continue
        out.append({"metric": key, "target_ms": limit, "median_ms": summ[key],
                    "met": summ[key] <= limit})
    return out


def run(parts: PartitionManager, vms_mgr: VmManager, runs: int = DEFAULT_RUNS, vms: int = 0,
        memory_mib: int = 256, revision: str | None = None,
        progress: Callable[[str], None] = lambda s: None) -> dict[str, Any]:
    """Measure; with ``vms`` > 0, first start that many VMs in scratch partitions of
    ``parts`` (a PartitionManager) through ``vms_mgr`` (a VmManager)."""
    from fusuma.host.accel import probe_accel

    accel = probe_accel("auto").name
    if revision and vms:
        raise SpecError("--revision times the empty-host commands only: an older fusuma "
                        "may not read this host's state DB; leave out --vms.")
    plan = probes(vms)
    made: list[str] = []
    cores: list[list[int]] = []

    def check(p: Probe, out: str) -> None:
        if p.namespace == "host" and vms:
            import json

            states = [v["state"] for v in json.loads(out)["vms"]
                      if v["partition"].startswith(PARTITION)]
            if states.count("running") != vms:
                raise FusumaError(f"expected {vms} running VMs in `ps`, saw {states}")

    # The empty-host commands first, on a host without the benchmark's VMs; then, with
    # the VMs running, `ps` and the floor again.
    before = [p for p in plan if not p.metric.endswith("vms_ms")]
    during = [p for p in plan if p.metric.endswith("vms_ms")]
    loads: dict[str, float] = {}
    settled: dict[str, Any] = {"settle_s": None}
    scratch = Path(tempfile.mkdtemp(prefix="fusuma-bench-cli-"))
    try:
        sha, src = revision_src(revision, scratch / "rev") if revision else (None, None)
        base = child_env(dict(os.environ), scratch / "pycache", src)
        envs = {"none": base, "host": {**base, **parts.paths.as_env()},
                "empty": empty_namespace(base, scratch)}
        progress(f"timing {len(before)} commands x {runs} runs, round-robin")
        loads["loadavg_1m_before"] = os.getloadavg()[0]
        times = measure(before, envs, runs, check, progress)
        loads["loadavg_1m_after"] = os.getloadavg()[0]
        if vms:
            made, cores = _start_vms(parts, vms_mgr, vms, memory_mib, accel, progress)
            # A guest keeps busy for a while after its agent first answers (under TCG
            # that is host CPU): measure the steady state of N running VMs.
            pids = [v.pid for v in parts.db.vms() if v.partition in made and v.pid]
            busy, waited, quiet = wait_quiet(lambda: qemu_cpu_s(pids),
                                             QUIET_CORES_PER_VM * vms, SETTLE_MAX_S,
                                             SETTLE_WINDOW_S)
            settled = {"settle_s": waited, "settle_busy_cores": round(busy, 3),
                       "settle_quiet": quiet}
            progress(f"the guests use {busy:.2f} core(s) after {waited:.1f} s of settling"
                     + ("" if quiet else f" (not below {QUIET_CORES_PER_VM * vms:g} in "
                        f"{SETTLE_MAX_S:g} s)"))
            progress(f"timing {len(during)} commands x {runs} runs with {vms} VMs running")
            loads["loadavg_1m_before_vms_timing"] = os.getloadavg()[0]
            times.update(measure(during, envs, runs, check, progress))
            loads["loadavg_1m_after_vms_timing"] = os.getloadavg()[0]
    finally:
        for name in made:
            try:
                parts.delete(name, force=True)
            except FusumaError as exc:
                progress(f"cleanup of {name} failed: {exc}")
        shutil.rmtree(scratch, ignore_errors=True)
    summ = summary(times)
    results = [{"metric": p.metric, "command": p.shown, "what": p.what,
                "namespace": p.namespace,
                "median_ms": summ[p.metric], "min_ms": min(times[p.metric]),
                "max_ms": max(times[p.metric]), "runs_ms": times[p.metric]}
               for p in plan]
    return {"meta": meta(accel, benchmark="cli", runs=runs, vms=vms,
                         guest_memory_mib=memory_mib if vms else None,
                         vm_partition_cores=cores or None,
                         settle_quiet_cores_per_vm=QUIET_CORES_PER_VM if vms else None,
                         settle_max_s=SETTLE_MAX_S if vms else None,
                         **settled,
                         fusuma_command=" ".join(fusuma_argv()),
                         python=sys.version.split()[0],
                         bytecode_cache="on (PYTHONPYCACHEPREFIX in a scratch dir, "
                                        "filled by the warm-up round)",
                         # With --revision: the code timed is that commit's, not the
                         # one git_revision names (the code that measured).
                         measured_revision=sha,
                         # The host's 1-minute load average before and after the timed
                         # rounds: other work on the host shows in the wall times.
                         **{k: round(v, 2) for k, v in loads.items()}),
            "results": results, "summary": summ, "targets": targets(summ, vms)}


def _start_vms(parts: PartitionManager, vms_mgr: VmManager, n: int, memory_mib: int, accel: str,
               progress: Callable[[str], None]) -> tuple[list[str], list[list[int]]]:
    """Up to two scratch partitions on the free cores, ``n`` VMs spread over them,
    started and booted to their guest agent. Returns the partitions made (for cleanup,
    also when this fails half-way: the caller deletes them) and their cores."""
    from fusuma.capacity import SUPERVISOR_MIB
    from fusuma.qemu.cmdline import overhead_mib
    from fusuma.spec import PartitionSpec, VmSpec

    used = {c for p in parts.db.partitions() for c in p.cpus}
    free = [c for c in parts.host.cpus if c not in used]
    if not free:
        raise ResourceError("every core belongs to a partition; `bench cli --vms` needs a "
                            "free core (run `fusuma down` first).")
    k = min(2, len(free))
    groups = [free[i::k] for i in range(k)]
    per = [n // k + (1 if i < n % k else 0) for i in range(k)]
    made: list[str] = []
    names: list[tuple[str, str]] = []
    try:
        for i, (cpus, count) in enumerate(zip(groups, per, strict=True)):
            pname = f"{PARTITION}-{i}"
            mem = SUPERVISOR_MIB + count * (memory_mib + overhead_mib(accel)) + 64
            progress(f"partition {pname}: cores {cpus}, {mem} MiB, {count} VMs")
            parts.create(PartitionSpec(name=pname, cpus=sorted(cpus), memory_mib=mem))
            made.append(pname)
            for j in range(count):
                vname = f"{PARTITION}-{i}-{j}"
                vms_mgr.create(VmSpec(name=vname, partition=pname, memory_mib=memory_mib))
                names.append((vname, pname))
        # One at a time per partition, each booted to its guest agent before the next
        # starts: a gentler load on its core than booting them all at once (TCG boots
        # are CPU-bound). The partitions hold different cores, so they boot side by side.
        _boot_side_by_side(parts, vms_mgr, names, progress)
    except BaseException:
        for pname in made:
            try:
                parts.delete(pname, force=True)
            except FusumaError as exc:
                progress(f"cleanup of {pname} failed: {exc}")
        raise
    return made, groups


def _boot_side_by_side(parts: PartitionManager, vms_mgr: VmManager,
                       names: list[tuple[str, str]], progress: Callable[[str], None]) -> None:
    """Start the (VM, partition) pairs and wait for their guest agents in rounds: each
    round starts the next VM of every partition and waits for them side by side."""
    by_part: dict[str, list[str]] = {}
    for vname, pname in names:
        by_part.setdefault(pname, []).append(vname)
    rounds = max(len(v) for v in by_part.values())
    for r in range(rounds):
        batch = [(mine[r], pname) for pname, mine in by_part.items() if r < len(mine)]
        progress(f"starting {', '.join(v for v, _ in batch)} (round {r + 1}/{rounds})")
        for vname, _ in batch:
            vms_mgr.start(vname)
        wait_agents(parts, batch, timeout=300)
