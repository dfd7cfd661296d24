"""`fusuma bench cluster`: fusuma on a real kube-apiserver, on this one machine.

A throwaway lab (``fusuma.cluster.lab``: etcd + kube-apiserver in a network namespace,
N fusuma hosts each in a network namespace of its own with its own home, runtime, shm
dir and cgroup prefix, an agent on each) and, measured from outside like a user:

  apply_to_running_s        `kubectl apply` of V FusumaVMs (128 MiB, restartable) to
                            every one Running and Ready in its status
  in_host_downtime_ms       5 zero-copy moves between partitions (spec.partition):
                            each move's downtime from status.lastMove; median
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
  failover_s                a host's agent, supervisors and QEMUs killed (SIGKILL) to
                            each of its restartable VMs Running on another host;
  failover_after_expiry_s   the same less the Lease duration (what the target bounds)

Everything the lab made is removed at the end (processes by pid, namespaces, cgroups).
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import statistics
import tempfile
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import yaml

from fusuma.cluster.context import PLAIN_MOVES_ENV
from fusuma.cluster.lab import Lab, LabHost
from fusuma.cluster.resources import parse_time
from fusuma.errors import FusumaError
from fusuma.paths import UID_SPAN
from fusuma_bench.report import meta

TARGETS = {"in_host_downtime_ms_median": 10.0, "between_hosts_total_ms_median": 2000.0,
           "failover_after_expiry_s": 30.0, "tls_slowdown_pct": 10.0}
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


def _ready(o: dict[str, Any]) -> bool:
    st = o.get("status") or {}
    conds = {c["type"]: c["status"] for c in st.get("conditions") or []}
    return st.get("state") == "Running" and conds.get("Ready") == "True"


def _wait(fn: Callable[[], Any], timeout: float, what: str, every: float = 0.5) -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        got = fn()
        if got:
            return got
        time.sleep(every)
    raise FusumaError(f"timed out after {timeout:.0f} s waiting for {what}.")


def run(hosts: int, vms: int, lease_seconds: int, qemu: str | None,
        progress: Callable[[str], None] = lambda s: None) -> dict[str, Any]:
    base = Path(tempfile.mkdtemp(prefix="fusuma-bench-cluster-"))
    tag = uuid.uuid4().hex[:5]
    envs = [host_env(tag, i, base) for i in range(hosts)]
    lab = Lab(base / "lab", envs, lease_seconds=lease_seconds)
    results: dict[str, Any] = {}
    try:
        progress("starting etcd, kube-apiserver and the agents")
        t = time.monotonic()
        lab.start()
        for h in lab.hosts:
            lab.start_agent(h)
        results["lab_start_s"] = round(time.monotonic() - t, 2)
        per_part = -(-(vms + 2) // (2 * hosts))
        mem = max(1024, 64 + (per_part + 2) * 160)
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
        results.update(_apply(lab, vms, progress))
        results.update(_in_host(lab, progress))
        results.update(_between_hosts(lab, envs, progress))
        results.update(_failover(lab, envs, lease_seconds, progress))
    finally:
        progress("removing the lab")
        with contextlib.suppress(Exception):
            lab.kubectl("delete", "fusumavm", "--all", "--wait=false", timeout=60)
            _wait(lambda: not lab.get("fusumavm")["items"], 180, "the VMs' deletion", 1)
        for h, env in zip(lab.hosts, envs, strict=False):
            lab.stop_agent(h)
            import subprocess

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
               for k, v in TARGETS.items()]
    from fusuma.host.accel import probe_accel

    return {"meta": meta(probe_accel("auto").name, hosts=hosts, vms=vms,
                         lease_seconds=lease_seconds, qemu=qemu or "system",
                         between_hosts_blocks=f"{WARM_UP} moves not counted, then blocks "
                         f"of {PER_BLOCK}: {', '.join(BLOCKS)}"),
            "summary": summary, "targets": targets,
            "samples": {k: v for k, v in results.items() if isinstance(v, list)},
            "leftovers": left}


def _apply(lab: Lab, vms: int, progress: Callable[[str], None]) -> dict[str, Any]:
    progress(f"kubectl apply of {vms} VMs")
    docs = [_vm(f"b{i:02d}", restartable=True) for i in range(vms)]
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


def _in_host(lab: Lab, progress: Callable[[str], None]) -> dict[str, Any]:
    o = lab.get("fusumavm", "b00")
    st = o["status"]
    part = st["partition"]
    downs, totals = [], []
    for i in range(5):
        part = "p1" if part == "p0" else "p0"
        before = ((lab.get("fusumavm", "b00").get("status") or {}).get("lastMove") or {})
        progress(f"in-host move {i + 1}/5 of b00 to {part}")
        _patch(lab, "b00", {"partition": part})
        o = _wait(_arrived(lab, "b00", before, "partition", part), 120, "the in-host move")
        lm = o["status"]["lastMove"]
        downs.append(lm["downtimeMs"])
        totals.append(lm["totalMs"])
    return {"in_host_downtime_ms_median": round(statistics.median(downs), 2),
            "in_host_total_ms_median": round(statistics.median(totals), 2),
            "in_host_downtime_ms": downs, "in_host_total_ms": totals}


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


def _agents(lab: Lab, hosts: list[LabHost], plain: bool) -> None:
    """Restart ``hosts``' agents, with moves in the clear or (as usual) under TLS."""
    since = time.time()
    for h in hosts:
        lab.stop_agent(h)
        lab.start_agent(h, env={PLAIN_MOVES_ENV: "1"} if plain else {})

    def back() -> bool:
        for h in hosts:
            st = lab.get("fusumahost", h.name, None).get("status") or {}
            t = parse_time(st.get("heartbeat"))
            if t is None or t < since:
                return False
        return True

    _wait(back, 120, "the agents to register again")


def _between_hosts(lab: Lab, envs: list[dict[str, str]],
                   progress: Callable[[str], None]) -> dict[str, Any]:
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
            _agents(lab, pair, plain=mode == "plain")
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
    _agents(lab, pair, plain=False)
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
