"""The moves part of `fusuma bench network`: what each kind of move on one host costs a
VM's tap NIC, and whether a tap NIC changes a zero-copy move's downtime.

Run in the benchmark's world (``fusuma_bench.network.World``) once the throughput runs
are done and their four Debian guests are deleted, so that both cores are free. Guests
here: the default (minimal) image, MOVE_MEMORY_MIB each, one vCPU, with busybox ``nc``
echoing a TCP port.

1. **NIC or no NIC** (the system's QEMU, the default): ``mv`` with a tap NIC on the
   network ``bench`` and ``bare``, the same VM without any NIC, both in ``p0``, move
   by zero-copy between ``p0`` and ``p1`` in turn (``mv, bare`` then ``bare, mv``, ...),
   DOWNTIME_RUNS moves each. Nothing else runs meanwhile. Their downtimes' medians,
   side by side, say whether a NIC changes the downtime bound.
2. **Each kind of move** with a tap NIC: ``bare`` is deleted, both partitions are made
   again on QEMU 10.0 (``maintain --in-place`` needs it; zero-copy, copy and ``--via``
   then run on the same QEMU), ``mv`` goes there by one move that is not counted, then
   moves MOVE_RUNS times by each kind while ``fusuma_bench.netprobe`` runs a TCP stream
   and a 1 ms ICMP echo from fusuma's namespace to it. Per run: echoes sent and lost,
   the longest outage (echoes lost in a row, ms), the stream's longest stall (the
   slowest line's round trip, ms) and whether it kept its connection with every line,
   fusuma's downtime (STOP to RESUME) and QEMU's own (query-migrate), summed over the
   moves of the run (``--via`` is two). A run whose move outlasts the probes counts as
   failed (its outage might not be seen). Without QEMU 10.0 the kinds run on the
   system's QEMU and ``--in-place`` says why it has no figures.

Every step is bounded: each fusuma command has a timeout, each probe a span, and the
whole part a budget (BUDGET_S) after which the runs left are recorded as skipped.
"""

from __future__ import annotations

import json
import statistics
import subprocess
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from functools import partial
from typing import Any, Protocol

from fusuma.errors import FusumaError
from fusuma_bench import netprobe

Progress = Callable[[str], None]


class World(Protocol):
    """What this part needs of ``fusuma_bench.network.World``."""

    @property
    def ns(self) -> str: ...

    def nsenter(self, ns: str) -> list[str]: ...

    def fusuma(self, *args: str, timeout: float = 300, check: bool = True
               ) -> subprocess.CompletedProcess[str]: ...

    def guest(self, vm: str, script: str, timeout: float = 60) -> str: ...


class MoveBenchError(FusumaError):
    """A guest of the moves part could not be made ready."""

MOVE_RUNS = 3
DOWNTIME_RUNS = 5
MOVE_MEMORY_MIB = 256
MOVE_IP = "10.124.1.20"
ECHO_PORT = 5000
CPR_QEMU = "10.0"
BUDGET_S = 240.0
BOOT_TIMEOUT_S = 120.0
# How long the stream and the echo run around one move of each kind, in seconds (the
# move starts netprobe.LEAD_S in); a run fails if its move is not done by then.
SPAN_S = {"zero-copy": 3.0, "copy": 6.0, "maintain --via": 10.0,
          "maintain --in-place": 4.0}
KINDS = tuple(SPAN_S)
# Kinds this benchmark cannot run, and why (still a row each, so the table is whole).
NOT_RUN = {"between hosts": "needs two hosts: `fusuma bench cluster` moves between them"}


@dataclass(kw_only=True)
class _Moved:
    """What every measured move has: its run, its downtimes, or why it has none."""

    run: int
    downtime_ms: float | None = None
    qemu_downtime_ms: float | None = None
    error: str | None = None

    def as_json(self) -> dict[str, Any]:
        return asdict(self)


@dataclass
class MoveSample(_Moved):
    """One move (or, for --via, the two of one `maintain`) with the probes around it;
    downtimes summed over its moves."""

    kind: str
    echoes_sent: int | None = None
    echoes_lost: int | None = None
    outage_ms: float | None = None
    tcp_stall_ms: float | None = None
    stream_whole: bool | None = None
    moves: int | None = None
    move_s: float | None = None
    qemu: str | None = None


@dataclass
class DowntimeSample(_Moved):
    """One zero-copy move of ``mv`` (tap NIC) or ``bare`` (no NIC)."""

    nic: bool
    total_ms: float | None = None
    steps_ms: dict[str, float] | None = None    # where the downtime went, per step


@dataclass
class MovesResult:
    qemu_kinds: str | None = None        # the QEMU the kinds of move ran on
    qemu_downtime: str | None = None     # the QEMU of the NIC / no NIC comparison
    samples: list[MoveSample] = field(default_factory=list)
    downtime: list[DowntimeSample] = field(default_factory=list)
    skipped: dict[str, str] = field(default_factory=dict)   # kind -> why
    error: str | None = None      # why the part stopped early (its figures stay)


# -- arithmetic -----------------------------------------------------------------------
def _sum(values: Sequence[Any]) -> float | None:
    got = [float(v) for v in values if v is not None]
    return round(sum(got), 2) if got and len(got) == len(values) else None


def sample_of(kind: str, run: int, seen: netprobe.Seen[dict[str, Any]], span_s: float,
              move_s: float) -> MoveSample:
    """A run's figures from what the probes saw and fusuma's JSON answer (a `migrate`'s
    result, or a `maintain`'s with its ``moves``). Downtimes are summed over the moves;
    one that QEMU did not report leaves the sum empty rather than short."""
    moves = seen.moved.get("moves") or [seen.moved]
    s = MoveSample(kind, run=run, echoes_sent=int(seen.echo["sent"]),
                   echoes_lost=int(seen.echo["lost"]), outage_ms=seen.outage_ms,
                   tcp_stall_ms=float(seen.stream["max_gap_ms"]),
                   stream_whole=seen.stream_whole, moves=len(moves),
                   downtime_ms=_sum([m.get("downtime_ms") for m in moves]),
                   qemu_downtime_ms=_sum([m.get("qemu_downtime_ms") for m in moves]),
                   move_s=round(move_s, 2))
    if netprobe.LEAD_S + move_s >= span_s:
        s.error = (f"the move took {move_s:.1f} s and outlasted the probes "
                   f"({span_s:g} s from {netprobe.LEAD_S:g} s before it)")
    elif not s.stream_whole:
        s.error = f"the TCP stream broke: {seen.stream.get('error')}"
    return s


def _median(values: Sequence[float | None]) -> float | None:
    got = [v for v in values if v is not None]
    return round(statistics.median(got), 2) if got else None


def summarize_kind(kind: str, samples: Sequence[MoveSample]) -> dict[str, Any]:
    """The medians over a kind's good runs (a run with an error counts in ``failed``
    only); ``stream_whole`` is true when every run kept the stream whole."""
    mine = [s for s in samples if s.kind == kind]
    good = [s for s in mine if s.error is None]
    return {"kind": kind, "runs": len(good), "failed": len(mine) - len(good),
            "moves_per_run": good[0].moves if good else None,
            "echoes_sent_median": _median([s.echoes_sent for s in good]),
            "echoes_lost_median": _median([s.echoes_lost for s in good]),
            "echoes_lost_max": max((s.echoes_lost or 0 for s in good), default=None),
            "outage_ms_median": _median([s.outage_ms for s in good]),
            "outage_ms_max": max((s.outage_ms or 0.0 for s in good), default=None),
            "tcp_stall_ms_median": _median([s.tcp_stall_ms for s in good]),
            "downtime_ms_median": _median([s.downtime_ms for s in good]),
            "qemu_downtime_ms_median": _median([s.qemu_downtime_ms for s in good]),
            "stream_whole": bool(mine) and all(s.stream_whole for s in mine),
            "qemu": good[0].qemu if good else None}


def _step_medians(steps: Sequence[dict[str, float] | None]) -> dict[str, float | None]:
    """Each downtime step's median over the moves that timed it, in the steps' order."""
    names = list(dict.fromkeys(k for one in steps if one for k in one))
    return {k: _median([one.get(k) for one in steps if one]) for k in names}


def summarize_downtime(samples: Sequence[DowntimeSample]) -> dict[str, Any]:
    """Per side (NIC or not) the median, min and max of the downtime (fusuma's, STOP to
    RESUME, and QEMU's own) over the good moves, and each of its steps' median; the
    difference NIC minus no NIC of
    the medians, and whether the two sides' ranges overlap."""
    out: dict[str, Any] = {}
    ranges = {}
    for nic, key in ((True, "with_nic"), (False, "without_nic")):
        good = [s for s in samples if s.nic is nic and s.error is None
                and s.downtime_ms is not None]
        downs = [s.downtime_ms for s in good if s.downtime_ms is not None]
        out[f"{key}_moves"] = len(good)
        out[f"{key}_downtime_ms_median"] = _median(downs)
        out[f"{key}_downtime_ms_min"] = min(downs) if downs else None
        out[f"{key}_downtime_ms_max"] = max(downs) if downs else None
        out[f"{key}_qemu_downtime_ms_median"] = _median([s.qemu_downtime_ms for s in good])
        out[f"{key}_steps_ms_median"] = _step_medians([s.steps_ms for s in good])
        ranges[nic] = (min(downs), max(downs)) if downs else None
    a, b = out["with_nic_downtime_ms_median"], out["without_nic_downtime_ms_median"]
    out["nic_minus_no_nic_ms"] = round(a - b, 2) if a is not None and b is not None \
        else None
    yes, no = ranges[True], ranges[False]
    out["ranges_overlap"] = (yes[0] <= no[1] and no[0] <= yes[1]) \
        if yes is not None and no is not None else None
    return out


def summarize(res: MovesResult) -> dict[str, Any]:
    rows = [summarize_kind(k, res.samples) for k in KINDS]
    for row in rows:
        row["qemu"] = row["qemu"] or res.qemu_kinds
        row["skipped"] = res.skipped.get(row["kind"])
    rows += [{"kind": k, "runs": 0, "failed": 0, "skipped": why, "qemu": None}
             for k, why in NOT_RUN.items()]
    return {"kinds": rows, "qemu_kinds": res.qemu_kinds, "error": res.error,
            "nic_downtime": {**summarize_downtime(res.downtime),
                             "qemu": res.qemu_downtime, "mode": "zero-copy"},
            "samples": [s.as_json() for s in res.samples],
            "downtime_samples": [s.as_json() for s in res.downtime]}


# -- running them -----------------------------------------------------------------------
def _other(partition: str) -> str:
    return "p1" if partition == "p0" else "p0"


def _show(w: World, vm: str) -> dict[str, Any]:
    data: dict[str, Any] = json.loads(w.fusuma("vm", "show", vm, "--json").stdout)
    return data


def _json(p: subprocess.CompletedProcess[str]) -> dict[str, Any]:
    data: dict[str, Any] = json.loads(p.stdout)
    return data


def _said(exc: BaseException) -> str:
    return str(exc).strip().splitlines()[-1][:300] if str(exc).strip() else repr(exc)


def _has_cpr_qemu(w: World) -> bool:
    p = w.fusuma("qemu", "list", "--json", check=False)
    try:
        return p.returncode == 0 and any(q.get("series") == CPR_QEMU
                                         for q in json.loads(p.stdout))
    except ValueError:
        return False


def _start(w: World, vm: str, progress: Progress) -> None:
    progress(f"booting {vm} (default image, {MOVE_MEMORY_MIB} MiB)")
    w.fusuma("vm", "start", vm, "--wait", "--timeout", str(BOOT_TIMEOUT_S),
             timeout=BOOT_TIMEOUT_S + 30)


def _wait_address(w: World, vm: str, ip: str, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while f"inet {ip}/" not in w.guest(vm, "ip -4 -o addr show eth0"):
        if time.monotonic() > deadline:
            raise MoveBenchError(f"{vm} got no lease for {ip} in {timeout:g} s.")
        time.sleep(1)


def compare_downtime(w: World, res: MovesResult, runs: int, deadline: float,
                     progress: Progress) -> None:
    """Zero-copy moves of ``mv`` and ``bare`` in turn, ``runs`` each."""
    where = {"mv": "p0", "bare": "p0"}
    for r in range(runs):
        for vm in (("mv", "bare") if r % 2 == 0 else ("bare", "mv")):
            s = DowntimeSample(nic=vm == "mv", run=r)
            if time.monotonic() > deadline:
                s.error = "skipped: the moves' time budget ran out"
            else:
                try:
                    got = _json(w.fusuma("migrate", vm, "--to", _other(where[vm]),
                                         "--mode", "zero-copy", "--json", timeout=120))
                    where[vm] = _other(where[vm])
                    s.downtime_ms = got.get("downtime_ms")
                    s.qemu_downtime_ms = got.get("qemu_downtime_ms")
                    s.total_ms = got.get("total_ms")
                    s.steps_ms = got.get("steps_ms")
                except (FusumaError, subprocess.SubprocessError, ValueError) as exc:
                    s.error = _said(exc)
                    where[vm] = str(_show(w, vm)["partition"])
            res.downtime.append(s)
            progress(f"downtime run {r + 1}/{runs} {vm:4} "
                     f"({'tap NIC' if s.nic else 'no NIC '}): "
                     + (f"{s.downtime_ms} ms" if s.error is None else s.error))


def _argv(kind: str, at: str) -> list[str]:
    return {"zero-copy": ["migrate", "mv", "--to", _other(at), "--mode", "zero-copy"],
            "copy": ["migrate", "mv", "--to", _other(at), "--mode", "copy"],
            "maintain --via": ["maintain", at, "--via", _other(at)],
            "maintain --in-place": ["maintain", at, "--in-place"]}[kind]


def _timed(w: World, argv: list[str], took: list[float]) -> dict[str, Any]:
    """fusuma's JSON answer to ``argv``; how long it took goes into ``took``."""
    t0 = time.monotonic()
    try:
        return _json(w.fusuma(*argv, timeout=180))
    finally:
        took.append(time.monotonic() - t0)


def move_kinds(w: World, res: MovesResult, runs: int, deadline: float,
               progress: Progress) -> None:
    """Each kind of move of ``mv``, ``runs`` times, kinds interleaved (a round of every
    kind, then the next)."""
    nsenter = w.nsenter(w.ns)
    for r in range(runs):
        for kind in KINDS:
            if kind in res.skipped:
                continue
            s = MoveSample(kind, run=r)
            if time.monotonic() > deadline:
                s.error = "skipped: the moves' time budget ran out"
                res.samples.append(s)
                continue
            t: list[float] = []
            try:
                argv = [*_argv(kind, str(_show(w, "mv")["partition"])), "--json"]
                seen = netprobe.around(nsenter, MOVE_IP, ECHO_PORT, SPAN_S[kind],
                                       partial(_timed, w, argv, t))
                s = sample_of(kind, r, seen, SPAN_S[kind], t[0])
                s.qemu = _show(w, "mv").get("qemu")
            except (FusumaError, subprocess.SubprocessError, ValueError) as exc:
                s.error = _said(exc)
            res.samples.append(s)
            progress(f"move run {r + 1}/{runs} {kind:19}: " + (
                f"{s.echoes_lost}/{s.echoes_sent} echoes lost, outage {s.outage_ms} ms, "
                f"TCP stall {s.tcp_stall_ms} ms, downtime {s.downtime_ms} ms"
                if s.error is None else s.error))


def run(w: World, move_runs: int = MOVE_RUNS, downtime_runs: int = DOWNTIME_RUNS,
        progress: Progress = lambda s: None) -> dict[str, Any]:
    """Both parts in ``w`` (partitions p0 and p1 exist, empty of VMs, on the system's
    QEMU; the network ``bench`` exists)."""
    res = MovesResult()
    try:
        _run(w, res, move_runs, downtime_runs, progress)
    except (FusumaError, subprocess.SubprocessError, ValueError, KeyError) as exc:
        # The throughput figures and the moves measured so far stay in the result.
        res.error = _said(exc)
        progress(f"the moves part stopped: {res.error}")
    return summarize(res)


def _run(w: World, res: MovesResult, move_runs: int, downtime_runs: int,
         progress: Progress) -> None:
    deadline = time.monotonic() + BUDGET_S
    common = ["--memory", str(MOVE_MEMORY_MIB)]
    w.fusuma("vm", "create", "mv", "-p", "p0", *common, "--nic", f"bench,ip={MOVE_IP}")
    w.fusuma("vm", "create", "bare", "-p", "p0", *common)
    for vm in ("mv", "bare"):
        _start(w, vm, progress)
    _wait_address(w, "mv", MOVE_IP)
    w.guest("mv", f"setsid nc -ll -p {ECHO_PORT} -e /bin/cat </dev/null >/dev/null 2>&1 &")
    res.qemu_downtime = _show(w, "mv").get("qemu")
    compare_downtime(w, res, downtime_runs, deadline, progress)
    w.fusuma("vm", "delete", "bare", "--force")
    if _has_cpr_qemu(w):
        # Both partitions onto QEMU 10.0: the empty one is made again, mv moves there
        # (not counted), then the other.
        at = str(_show(w, "mv")["partition"])
        for name in (_other(at), at):
            if name == at:
                w.fusuma("migrate", "mv", "--to", _other(at), "--mode", "zero-copy",
                         timeout=120)
            w.fusuma("partition", "delete", name)
            w.fusuma("partition", "create", name, "--cpus", name[1:], "--memory", "1024",
                     "--qemu", CPR_QEMU)
    else:
        res.skipped["maintain --in-place"] = (f"needs QEMU {CPR_QEMU} (cpr-transfer): "
                                              f"`fusuma qemu install {CPR_QEMU}`")
    res.qemu_kinds = _show(w, "mv").get("qemu")
    move_kinds(w, res, move_runs, deadline, progress)
