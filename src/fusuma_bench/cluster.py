"""`fusuma bench cluster`: fusuma on a real kube-apiserver, on this one machine.

A throwaway lab (``fusuma.cluster.lab``: etcd + kube-apiserver in a network namespace,
N fusuma hosts each in a network namespace of its own with its own home, runtime, shm
dir and cgroup prefix, an agent on each) and, measured from outside like a user:

  apply_to_running_s        `kubectl apply` of V FusumaVMs (128 MiB, restartable) to
                            every one Running and Ready in its status
  in_host_downtime_ms       zero-copy moves between partitions (spec.partition):
                            each move's downtime from status.lastMove; median, and
                            each step of the downtime (lastMove.steps); median
  cli_in_host_downtime_ms   as many moves between the same two partitions of the same
                            host of a VM the CLI made there, by `fusuma migrate`,
                            alternating with the agent's (each after IN_HOST_GAP_S of
                            quiet): its downtime and steps, the same way
  in_host_agent_cli_downtime_ratio  the agent's median downtime over the CLI's
  between_hosts_*_ms        live moves of a 256 MiB guest between hosts (spec.host),
                            copy mode over TCP under TLS: downtime, total (the stream
                            to the guest running) and the destination's prepare; median
  between_hosts_plain_*_ms  the same moves with the stream in the clear (the agents of
                            both hosts restarted with FUSUMA_BENCH_PLAIN_MOVES=1), in
                            blocks of 4 ordered clear, TLS, TLS, clear in the same run
                            (after 2 moves not counted)
  (before the moves, and after each restart of the agents, the lab settles: its QEMUs,
  supervisors and agents use less than half a core over 3 s, or steadily less than one;
  between_hosts_settle_s)
  tls_slowdown_pct          how much slower a move is under TLS: the median of its
                            wall time (lastMove.wallMs: the source agent's start, before
                            the destination's prepare, to the guest resuming there)
                            under TLS over the same in the clear, less 1
  parallel_*                every VM re-hosted at once, each to the next host, by one
                            `kubectl apply` (fusuma_bench.cluster_parallel): the whole
                            run, each move's downtime as fusuma records it and as an
                            ICMP echo from a client namespace sees it; median, p99
  failover_s                a host's agent, supervisors and QEMUs killed (SIGKILL) to
                            each of its restartable VMs Running on another host;
  failover_after_expiry_s   the same less the Lease duration (what the target bounds)

``cases`` picks which of in-host, between-hosts, parallel and failover run (all by
default; the VMs are applied in any case, on a FusumaNetwork when parallel runs).

Everything the lab made is removed at the end (processes by pid, namespaces, cgroups).
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import statistics
import subprocess
import tempfile
import time
import uuid
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import yaml

from fusuma.cluster.context import PLAIN_MOVES_ENV
from fusuma.cluster.crds import MOVE_STEPS
from fusuma.cluster.lab import Lab, LabHost
from fusuma.cluster.resources import parse_time
from fusuma.errors import FusumaError
from fusuma.paths import UID_SPAN
from fusuma_bench import cluster_parallel
from fusuma_bench.clusterwait import ready as _ready
from fusuma_bench.clusterwait import wait as _wait
from fusuma_bench.report import meta

# A move through the agent as fast as one from the CLI (issue 27): within a quarter.
TARGETS = {"in_host_downtime_ms_median": 10.0, "in_host_agent_cli_downtime_ratio": 1.25,
           "between_hosts_total_ms_median": 2000.0, "failover_after_expiry_s": 30.0,
           "tls_slowdown_pct": 10.0, **cluster_parallel.TARGETS}
CASES = ("in-host", "between-hosts", "parallel", "failover")
# In-host moves: the agent's and the CLI's alternate, each after this long without a
# move (the agents' writes after the one before have ended), between the same two
# partitions of one host; the CLI's VM is named so.
IN_HOST_MOVES = 5
IN_HOST_GAP_S = 2.0
CLI_VM = "cli-mover"
# Moves between hosts (the same guest, back and forth): after WARM_UP moves that are not
# counted (the VMs applied just before are still booting), blocks of PER_BLOCK moves in
# the clear (A) and under TLS (B) in the order ABBA, so that a load that drifts linearly
# during the run weighs on both alike.
WARM_UP = 2
PER_BLOCK = 4
# Before the moves and after each restart of the agents: the lab is settled when its
# processes use less than this many cores over SETTLE_WINDOW_S.
SETTLED_CORES = 0.5
STEADY_CORES = 0.1
SETTLE_WINDOW_S = 3.0
BLOCKS = ("plain", "tls", "tls", "plain")


def host_env(tag: str, i: int, base: Path) -> dict[str, str]:
    t = f"{tag}{i}"
    return {**os.environ, "FUSUMA_HOME": str(base / f"home{i}"),
            "FUSUMA_RUNTIME_DIR": f"/tmp/fzb-{t}", "FUSUMA_SHM_DIR": f"/dev/shm/fusuma-bench-{t}",
            "FUSUMA_CGROUP_PREFIX": f"fusuma-bench-{t}", "FUSUMA_CPU_EXCLUSIVE": "0",
            "FUSUMA_UID_BASE": str(0x7900_0000 + (int(tag, 16) % 512 + i) * UID_SPAN),
            "FUSUMA_CACHE": os.environ.get("FUSUMA_CACHE", "/var/cache/fusuma")}


def host_pids(env: dict[str, str]) -> list[int]:
    """Supervisors and QEMUs of one lab host (by its runtime dir)."""
    run = env["FUSUMA_RUNTIME_DIR"]
    out = []
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            cmd = (d / "cmdline").read_bytes().decode(errors="replace")
            penv = (d / "environ").read_bytes().decode(errors="replace")
        except OSError:
            continue
        if run in cmd or ("fusuma.supervisor" in cmd
                          and f"FUSUMA_RUNTIME_DIR={run}\0" in penv):
            out.append(int(d.name))
    return out


def _vm(name: str, **spec: Any) -> dict[str, Any]:
    return {"apiVersion": "fusuma.io/v1alpha1", "kind": "FusumaVM",
            "metadata": {"name": name, "namespace": "default"},
            "spec": {"memoryMiB": 128, "vcpus": 1, **spec}}


def _items(lab: Lab) -> dict[str, dict[str, Any]]:
    out = lab.get("fusumavm")["items"]
    return {o["metadata"]["name"]: o for o in out}


def run(hosts: int, vms: int, lease_seconds: int, qemu: str | None,
        progress: Callable[[str], None] = lambda s: None,
        in_host_moves: int = IN_HOST_MOVES, cases: tuple[str, ...] = CASES,
        moves_per_pair: int | None = None,
        echo_interval_ms: float = cluster_parallel.PING_INTERVAL_MS) -> dict[str, Any]:
    base = Path(tempfile.mkdtemp(prefix="fusuma-bench-cluster-"))
    tag = uuid.uuid4().hex[:5]
    envs = [host_env(tag, i, base) for i in range(hosts)]
    lab = Lab(base / "lab", envs, lease_seconds=lease_seconds)
    results: dict[str, Any] = {}
    parallel = "parallel" in cases
    agent_args = ("--moves-per-pair", str(moves_per_pair)) if moves_per_pair else ()
    try:
        progress("starting etcd, kube-apiserver and the agents")
        t = time.monotonic()
        lab.start()
        for h in lab.hosts:
            lab.start_agent(h, *agent_args)
        results["lab_start_s"] = round(time.monotonic() - t, 2)
        per_part = -(-(vms + 2) // (2 * hosts))
        # Re-hosted all at once, a partition holds its own VMs and those coming in.
        mem = max(1024, 64 + (per_part * (2 if parallel else 1) + 2) * 160)
        q = {"qemu": qemu} if qemu else {}
        parts = [{"apiVersion": "fusuma.io/v1alpha1", "kind": "FusumaPartition",
                  "metadata": {"name": f"{h.name}-p{j}"},
                  "spec": {"host": h.name, "name": f"p{j}", "cpus": [j], "memoryMiB": mem,
                           **q}} for h in lab.hosts for j in (0, 1)]
        lab.kubectl("apply", "-f", "-", input=yaml.safe_dump_all(parts))
        _wait(lambda: all(len((o.get("status") or {}).get("partitions") or []) == 2
                          for o in lab.get("fusumahost", namespace=None)["items"])
              and len(lab.get("fusumahost", namespace=None)["items"]) == hosts, 120,
              "the hosts' partitions")
        if parallel:
            cluster_parallel.network(lab, progress)
        results.update(_apply(lab, vms, progress,
                              cluster_parallel.nics() if parallel else None))
        if "in-host" in cases:
            results.update(_in_host(lab, envs, in_host_moves, progress))
        if "between-hosts" in cases:
            results.update(_between_hosts(lab, envs, progress, agent_args))
        if parallel:
            results.update(cluster_parallel.run(
                lab, [f"b{i:02d}" for i in range(vms)],
                lambda h, *args: _cli(lab, h, *args), base, progress, echo_interval_ms,
                settle=lambda: _settle(lab, envs, progress)))
        if "failover" in cases:
            results.update(_failover(lab, envs, lease_seconds, progress))
    finally:
        progress("removing the lab")
        with contextlib.suppress(Exception):
            lab.kubectl("delete", "fusumavm", "--all", "--wait=false", timeout=60)
            _wait(lambda: not lab.get("fusumavm")["items"], 180, "the VMs' deletion", 1)
        if parallel:
            with contextlib.suppress(Exception):
                lab.kubectl("delete", "fusumanetwork", "--all", "--wait=true",
                            timeout=120)
        for h, env in zip(lab.hosts, envs, strict=False):
            lab.stop_agent(h)
            from fusuma import spawn

            subprocess.run(spawn.module_argv("fusuma.cli.main", "down"),
                           env=spawn.child_env(env), cwd=spawn.CWD,
                           capture_output=True, timeout=300)
            for pid in host_pids(env):
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
        lab.close()
    left = lab.leftovers()
    summary = {k: v for k, v in results.items() if not isinstance(v, list)}
    targets = [{"metric": k, "target": v, "value": summary.get(k),
                "met": summary.get(k) is not None and summary[k] <= v}
               for k, v in TARGETS.items() if case_of(k) in cases]
    from fusuma.host.accel import probe_accel

    return {"meta": meta(probe_accel("auto").name, hosts=hosts, vms=vms,
                         lease_seconds=lease_seconds, qemu=qemu or "system",
                         in_host_moves=f"{in_host_moves} by the agent and as many by the "
                         f"CLI, alternating, each after {IN_HOST_GAP_S} s without a move",
                         between_hosts_blocks=f"{WARM_UP} moves not counted, then blocks "
                         f"of {PER_BLOCK}: {', '.join(BLOCKS)}", cases=list(cases),
                         moves_per_pair=moves_per_pair or "the agent's default",
                         parallel_echo=f"an ICMP echo to every VM every "
                         f"{echo_interval_ms} ms from a client namespace on the last "
                         f"host's bridge" if parallel else None),
            "summary": summary, "targets": targets,
            "samples": {k: v for k, v in results.items() if isinstance(v, list)},
            "leftovers": left}


def case_of(metric: str) -> str:
    """The case that measures ``metric`` (a target's)."""
    for prefix, case in (("in_host", "in-host"), ("between_hosts", "between-hosts"),
                         ("tls", "between-hosts"), ("parallel", "parallel"),
                         ("failover", "failover")):
        if metric.startswith(prefix):
            return case
    raise ValueError(f"no case measures {metric}")


def _apply(lab: Lab, vms: int, progress: Callable[[str], None],
           nics: list[dict[str, str]] | None = None) -> dict[str, Any]:
    progress(f"kubectl apply of {vms} VMs")
    docs = [_vm(f"b{i:02d}", restartable=True, **({"nics": nics} if nics else {}))
            for i in range(vms)]
    t0 = time.monotonic()
    lab.kubectl("apply", "-f", "-", input=yaml.safe_dump_all(docs))
    seen: dict[str, float] = {}

    def all_running() -> bool:
        items = _items(lab)
        for name, o in items.items():
            if name not in seen and _ready(o):
                seen[name] = time.monotonic() - t0
        return len([n for n in seen if n.startswith("b")]) == vms

    _wait(all_running, 900, f"{vms} VMs running", every=1.0)
    total = time.monotonic() - t0
    per_host: dict[str, int] = {}
    for o in _items(lab).values():
        h = str((o.get("status") or {}).get("host"))
        per_host[h] = per_host.get(h, 0) + 1
    return {"apply_to_running_s": round(total, 2),
            "first_running_s": round(min(seen.values()), 2),
            "vms_per_host": json.dumps(per_host, sort_keys=True)}


def _patch(lab: Lab, name: str, spec: dict[str, Any]) -> None:
    lab.kubectl("patch", "fusumavm", name, "--type=merge", "-p", json.dumps({"spec": spec}))


def _moved(lab: Lab, name: str, before: dict[str, Any]) -> dict[str, Any] | None:
    """The VM once a move newer than ``before`` (its lastMove then) has ended."""
    o = lab.get("fusumavm", name)
    st = o.get("status") or {}
    last = st.get("lastMove") or {}
    if st.get("move") or not last or last == before:
        return None
    return o if _ready(o) else None


def _arrived(lab: Lab, name: str, before: dict[str, Any], field: str,
             value: str) -> Callable[[], dict[str, Any] | None]:
    def check() -> dict[str, Any] | None:
        m = _moved(lab, name, before)
        return m if m and m["status"].get(field) == value else None
    return check


@dataclass(frozen=True)
class InHostMove:
    """One zero-copy move between partitions: its figures and its downtime's steps by
    the CLI's names (``fusuma.migration.DOWNTIME_STEPS``), from the agent's
    status.lastMove or from `fusuma migrate --json`."""

    downtime_ms: float
    total_ms: float
    prepare_ms: float | None
    steps: dict[str, float]

    @classmethod
    def from_last_move(cls, lm: dict[str, Any]) -> InHostMove:
        # In the order of the steps (the API server gives the fields sorted by name).
        got = lm.get("steps") or {}
        return cls(float(lm["downtimeMs"]), float(lm["totalMs"]), lm.get("prepareMs"),
                   {step: float(got[field]) for step, (field, _) in MOVE_STEPS.items()
                    if field in got})

    @classmethod
    def from_cli(cls, out: dict[str, Any]) -> InHostMove:
        return cls(float(out["downtime_ms"]), float(out["total_ms"]), out.get("prepare_ms"),
                   {k: float(ms) for k, ms in (out.get("steps_ms") or {}).items()})


def step_medians(moves: list[InHostMove]) -> dict[str, float]:
    """Each step's median over the moves that report it, in the order of the steps."""
    order = list(MOVE_STEPS)
    seen = {k for m in moves for k in m.steps}
    return {k: round(statistics.median([m.steps[k] for m in moves if k in m.steps]), 2)
            for k in sorted(seen, key=lambda k: (order.index(k) if k in order
                                                 else len(order), k))}


def in_host_summary(agent: list[InHostMove], cli: list[InHostMove]) -> dict[str, Any]:
    """The in-host figures of a result: for the agent's moves (in_host_*) and the CLI's
    (cli_in_host_*) the medians of downtime, total, prepare and each step of the
    downtime, and the moves themselves; the agent's median downtime over the CLI's."""
    out: dict[str, Any] = {}
    for prefix, moves in (("in_host", agent), ("cli_in_host", cli)):
        if not moves:
            continue
        prepares = [m.prepare_ms for m in moves if m.prepare_ms is not None]
        for what, values in (("downtime", [m.downtime_ms for m in moves]),
                             ("total", [m.total_ms for m in moves]),
                             ("prepare", prepares)):
            if values:
                out[f"{prefix}_{what}_ms_median"] = round(statistics.median(values), 2)
                out[f"{prefix}_{what}_ms"] = values
        for step, ms in step_medians(moves).items():
            out[f"{prefix}_step_{step}_ms_median"] = ms
        out[f"{prefix}_moves"] = [asdict(m) for m in moves]
    cli_down = out.get("cli_in_host_downtime_ms_median")
    if agent and cli_down:
        out["in_host_agent_cli_downtime_ratio"] = round(
            out["in_host_downtime_ms_median"] / cli_down, 2)
    return out


def _cli(lab: Lab, h: LabHost, *args: str, timeout: float = 240) -> str:
    """`fusuma ARGS` on lab host ``h`` (its namespace and home), as its admin would."""
    p = lab.fusuma(h.netns, list(args), env=h.env, timeout=timeout)
    if p.returncode:
        raise FusumaError(f"`fusuma {' '.join(args)}` on host {h.name} failed: "
                          f"{p.stderr.strip()}")
    return p.stdout


def _in_host(lab: Lab, envs: list[dict[str, str]], moves: int,
             progress: Callable[[str], None]) -> dict[str, Any]:
    """b00's moves between its host's partitions by the agent, and as many of a VM the
    CLI made on that host by `fusuma migrate`, alternating."""
    st = lab.get("fusumavm", "b00")["status"]
    host = next(h for h in lab.hosts if h.name == st["host"])
    part = st["partition"]
    progress(f"a VM made by the CLI on host {host.name} in {part}")
    _cli(lab, host, "vm", "create", CLI_VM, "-p", part, "--memory", "128")
    agent: list[InHostMove] = []
    cli: list[InHostMove] = []
    try:
        _cli(lab, host, "vm", "start", CLI_VM, "--wait", "--timeout", "180")
        _settle(lab, envs, progress)
        for i in range(moves):
            part = "p1" if part == "p0" else "p0"
            time.sleep(IN_HOST_GAP_S)
            before = ((lab.get("fusumavm", "b00").get("status") or {}).get("lastMove")
                      or {})
            progress(f"in-host move {i + 1}/{moves} of b00 to {part} (the agent)")
            _patch(lab, "b00", {"partition": part})
            o = _wait(_arrived(lab, "b00", before, "partition", part), 120,
                      "the in-host move")
            agent.append(InHostMove.from_last_move(o["status"]["lastMove"]))
            time.sleep(IN_HOST_GAP_S)
            progress(f"in-host move {i + 1}/{moves} of {CLI_VM} to {part} (the CLI)")
            out = _cli(lab, host, "migrate", CLI_VM, "--to", part, "--json")
            cli.append(InHostMove.from_cli(json.loads(out)))
    finally:
        with contextlib.suppress(FusumaError, OSError, subprocess.SubprocessError):
            _cli(lab, host, "vm", "delete", CLI_VM, "--force")
    return in_host_summary(agent, cli)


def _cpu_s(pids: list[int]) -> float:
    """CPU seconds (user + system) the processes ``pids`` have used so far."""
    total = 0
    for pid in pids:
        try:
            fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        total += int(fields[11]) + int(fields[12])
    return total / os.sysconf("SC_CLK_TCK")


def _settle(lab: Lab, envs: list[dict[str, str]], progress: Callable[[str], None],
            busy: float = SETTLED_CORES, timeout: float = 300) -> float:
    """Wait until the lab's QEMUs, supervisors and agents together use less than
    ``busy`` cores over a few seconds, or no longer less and less (idle guests under
    TCG cost something): the guests applied have booted, the agents restarted have
    synced. How long it took."""
    t0 = time.monotonic()
    last: float | None = None
    while True:
        pids = [p for env in envs for p in host_pids(env)]
        pids += [h.agent.pid for h in lab.hosts if h.agent is not None]
        before = _cpu_s(pids)
        time.sleep(SETTLE_WINDOW_S)
        used = (_cpu_s(pids) - before) / SETTLE_WINDOW_S
        steady = last is not None and abs(used - last) < STEADY_CORES and used < 1.0
        if used < busy or steady or time.monotonic() - t0 > timeout:
            return round(time.monotonic() - t0, 1)
        progress(f"waiting for the lab to settle ({used:.2f} cores busy)")
        last = used


def _agents(lab: Lab, hosts: list[LabHost], plain: bool,
            args: tuple[str, ...] = ()) -> None:
    """Restart ``hosts``' agents, with moves in the clear or (as usual) under TLS."""
    since = time.time()
    for h in hosts:
        lab.stop_agent(h)
        lab.start_agent(h, *args, env={PLAIN_MOVES_ENV: "1"} if plain else {})

    def back() -> bool:
        for h in hosts:
            st = lab.get("fusumahost", h.name, None).get("status") or {}
            t = parse_time(st.get("heartbeat"))
            if t is None or t < since:
                return False
        return True

    _wait(back, 120, "the agents to register again")


def _between_hosts(lab: Lab, envs: list[dict[str, str]],
                   progress: Callable[[str], None],
                   agent_args: tuple[str, ...] = ()) -> dict[str, Any]:
    pair = lab.hosts[:2]
    hosts = [h.name for h in pair]
    lab.kubectl("apply", "-f", "-", input=yaml.safe_dump(
        _vm("traveller", memoryMiB=256, host=hosts[0], partition="p0")))
    _wait(lambda: _ready(lab.get("fusumavm", "traveller")), 300, "traveller running")
    settled = [_settle(lab, envs, progress)]     # every guest has booted
    runs: dict[str, dict[str, list[Any]]] = {
        mode: {"downtime": [], "total": [], "prepare": [], "wall": [], "sent": [],
               "paused": []}
        for mode in ("plain", "tls")}
    n = 0
    for b, mode in enumerate(("warm-up", *BLOCKS)):
        if mode != "warm-up":
            _agents(lab, pair, plain=mode == "plain", args=agent_args)
            settled.append(_settle(lab, envs, progress))
        count = WARM_UP if mode == "warm-up" else PER_BLOCK
        for i in range(count):
            n += 1
            to = hosts[n % 2]
            before = ((lab.get("fusumavm", "traveller").get("status") or {})
                      .get("lastMove") or {})
            progress(f"between-host move {i + 1}/{count} ({mode}, block {b}/"
                     f"{len(BLOCKS)}) of traveller to {to}")
            _patch(lab, "traveller", {"host": to})
            o = _wait(_arrived(lab, "traveller", before, "host", to), 300,
                      "the move between hosts")
            lm = o["status"]["lastMove"]
            if lm.get("result") != "ok" or \
                    (mode != "warm-up" and bool(lm.get("tls")) != (mode == "tls")):
                raise FusumaError(f"a move between hosts ({mode}) failed or went "
                                  f"otherwise: {lm.get('message') or lm}")
            if mode != "warm-up":
                got = runs[mode]
                for what, field in (("downtime", "downtimeMs"), ("total", "totalMs"),
                                    ("prepare", "prepareMs"), ("wall", "wallMs"),
                                    ("sent", "bytesSent")):
                    got[what].append(lm[field])
                got["paused"].append(bool(lm.get("paused")))
    _agents(lab, pair, plain=False, args=agent_args)
    out: dict[str, Any] = {"between_hosts_settle_s": settled}
    for mode, got in runs.items():
        name = "between_hosts" if mode == "tls" else "between_hosts_plain"
        for what in ("downtime", "total", "prepare", "wall"):
            out[f"{name}_{what}_ms_median"] = round(statistics.median(got[what]), 2)
            out[f"{name}_{what}_ms"] = got[what]
        out[f"{name}_mib_sent_median"] = round(statistics.median(got["sent"]) / 2**20, 1)
        out[f"{name}_paused"] = any(got["paused"])

    def slowdown(what: str) -> float:
        tls, plain = (float(out[f"{n}_{what}_ms_median"])
                      for n in ("between_hosts", "between_hosts_plain"))
        return round((tls / plain - 1) * 100, 1)

    out["tls_slowdown_pct"] = slowdown("wall")
    out["tls_total_slowdown_pct"] = slowdown("total")
    out["tls_downtime_slowdown_pct"] = slowdown("downtime")
    return out


def _failover(lab: Lab, envs: list[dict[str, str]], lease_seconds: int,
              progress: Callable[[str], None]) -> dict[str, Any]:
    items = _items(lab)
    victim: LabHost = lab.hosts[-1]
    mine = [n for n, o in items.items() if (o.get("status") or {}).get("host") == victim.name
            and (o.get("spec") or {}).get("restartable")]
    progress(f"killing host {victim.name} ({len(mine)} restartable VMs)")
    lab.stop_agent(victim, signal.SIGKILL)
    t0 = time.monotonic()
    for pid in host_pids(envs[lab.hosts.index(victim)]):
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)

    def moved() -> bool:
        now = _items(lab)
        return all(_ready(now[n]) and now[n]["status"].get("host") != victim.name
                   for n in mine)

    _wait(moved, 300, "the lost host's VMs running elsewhere")
    total = time.monotonic() - t0
    return {"failover_vms": len(mine), "failover_s": round(total, 2),
            "failover_after_expiry_s": round(max(0.0, total - lease_seconds), 2)}
