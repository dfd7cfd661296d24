"""Report of a `fusuma bench maintain` result file: DIR/report.md and DIR/maintain.png.

Made from the result file alone (`fusuma bench report maintain FILE DIR`). Every target
is checked against the numbers in the file; a target it has no numbers for is NOT
MEASURED, never PASS. The report says which method upgraded the partition faster, by
how much, and why.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import field
from functools import partial
from pathlib import Path
from typing import Any

from fusuma.frozen import frozen
from fusuma_bench.report import (
    FAIL,
    PASS,
    UNMEASURED,
    Check,
    check_table,
    figure,
    fixed,
    load_result,
    opt_float,
    table,
    write_report,
)

TARGET_VMS = 16
# The whole maintain of TARGET_VMS VMs of 256 MiB, per method, in s.
TARGET_MAINTAIN_S = {"cpr-transfer": 2.0, "zero-copy": 3.0}
# Every move's downtime with the guests busy: the median and the 99th percentile, in ms.
TARGET_DOWNTIME_MS = 5.0
TARGET_DOWNTIME_P99_MS = 10.0
# The figures these targets were set against: 16 VMs, measured before maintain was a
# pipeline (the closing notes of the QEMU-upgrade work, quoted by the maintenance issue).
PREVIOUS = {"cpr-transfer": {"maintain_s": 3.37, "downtime_ms_median": 6.79,
                             "downtime_ms_max": 23.0},
            "zero-copy": {"maintain_s": 9.34}}
PREVIOUS_SOURCE = ("before the pipeline: 16 VMs, `maintain --in-place` 3.37 s with "
                   "downtime median 6.79 ms (max 23 ms), `maintain --via` 9.34 s")
LABELS = {"zero-copy": "--via, zero-copy (2 moves per VM + supervisor restart)",
          "cpr-transfer": "--in-place, cpr-transfer (1 move per VM)"}


@frozen
class Row:
    method: str
    vms: int
    from_qemu: str
    to_qemu: str
    maintain_s: float | None
    moves: int
    downtime_ms_max: float | None
    downtime_ms_median: float | None
    downtime_ms_p99: float | None
    bytes_sent_median: float | None
    data_intact: bool
    error: str | None


@frozen
class Result:
    meta: dict[str, Any]
    rows: list[Row]               # the maintains as fusuma runs them (pipelined)
    moves: list[dict[str, Any]]
    # --compare-pipeline: the same maintains serially (`maintain --serial`).
    serial: list[Row] = field(default_factory=list)

    def row(self, method: str, vms: int) -> Row | None:
        return next((r for r in self.rows if r.method == method and r.vms == vms), None)

    def methods(self) -> list[str]:
        return [m for m in LABELS if any(r.method == m for r in self.rows)]

    def counts(self) -> list[int]:
        return sorted({r.vms for r in self.rows})


def parse(data: dict[str, Any]) -> Result:
    def row(r: dict[str, Any]) -> Row:
        return Row(method=str(r["method"]), vms=int(r["vms"]),
                   from_qemu=str(r["from_qemu"]), to_qemu=str(r["to_qemu"]),
                   maintain_s=opt_float(r["maintain_s"]), moves=int(r["moves"]),
                   downtime_ms_max=opt_float(r["downtime_ms_max"]),
                   downtime_ms_median=opt_float(r["downtime_ms_median"]),
                   downtime_ms_p99=opt_float(r.get("downtime_ms_p99")),
                   bytes_sent_median=opt_float(r["bytes_sent_median"]),
                   data_intact=bool(r["data_intact"]), error=r.get("error"))
    # A result from before the pipeline has no "pipelined": its rows are the rows.
    return Result(meta=dict(data["meta"]),
                  rows=[row(r) for r in data["results"] if r.get("pipelined", True)],
                  moves=[m for m in data["moves"] if m.get("pipelined", True)],
                  serial=[row(r) for r in data["results"]
                          if not r.get("pipelined", True)])


def pipeline_lines(res: Result) -> list[str]:
    """Each method's maintain serially and pipelined (as fusuma runs it), side by
    side in one run."""
    rows = []
    for s in sorted(res.serial, key=lambda r: (r.vms, r.method)):
        p = res.row(s.method, s.vms)
        if p is None or p.maintain_s is None or s.maintain_s is None:
            continue
        rows.append([LABELS.get(s.method, s.method), str(s.vms), fixed(s.maintain_s),
                     fixed(p.maintain_s), f"{s.maintain_s / max(p.maintain_s, 1e-9):.2f}x",
                     f"{fixed(s.downtime_ms_median)} / {fixed(p.downtime_ms_median)}",
                     f"{fixed(s.downtime_ms_max)} / {fixed(p.downtime_ms_max)}"])
    if not rows:
        return []
    return ["", "## Serial and pipelined, in this run", "",
            "Each method first ran serially (`maintain --serial`: each move begun once "
            "the one before was done), then pipelined as maintain runs by default (the "
            "next move's QEMU started while this one's source QEMU is ended), on the same "
            "VMs. A speed-up below 1 means the pipeline was slower.", "",
            *table(["method", "VMs", "serial maintain_s", "pipelined maintain_s",
                    "speed-up", "downtime_ms median serial / pipelined",
                    "downtime_ms max serial / pipelined"], rows)]


def load(path: Path) -> Result:
    return load_result(path, "maintain", parse)


def render(result_file: Path, out_dir: Path) -> list[Path]:
    """Write report.md and maintain.png for ``result_file`` into ``out_dir``."""
    res = load(result_file)
    return write_report(out_dir, markdown(res, result_file),
                        {"maintain.png": partial(plot, res)})


# -- checks -------------------------------------------------------------------------
def _downtimes(res: Result, method: str) -> list[float]:
    return [float(m["downtime_ms"]) for m in res.moves
            if m.get("method") == method and m.get("downtime_ms") is not None]


def faster(res: Result, vms: int) -> Row | None:
    """The method whose maintain of ``vms`` VMs took least (measured, data intact)."""
    done = [r for r in res.rows if r.vms == vms and r.maintain_s is not None
            and r.data_intact and not r.error]
    return min(done, key=lambda r: r.maintain_s or math.inf) if done else None


def _prev(method: str, key: str, unit: str) -> str:
    v = PREVIOUS.get(method, {}).get(key)
    return f" (before: {v:g} {unit})" if v is not None else ""


def checks(res: Result) -> list[Check]:
    busy = bool(res.meta.get("busy_guests"))
    out = []
    for method in LABELS:
        downs = _downtimes(res, method)
        rows = [r for r in res.rows if r.method == method]
        complete = bool(rows) and all(r.moves and not r.error for r in rows)
        row = res.row(method, TARGET_VMS)
        limit = TARGET_MAINTAIN_S[method]
        target = f"{method}: maintain of {TARGET_VMS} VMs <= {limit:g} s"
        if row is None or row.maintain_s is None:
            out.append(Check(target, "not measured", UNMEASURED))
        else:
            out.append(Check(target, f"{row.maintain_s:.2f} s"
                             + _prev(method, "maintain_s", "s"),
                             PASS if row.maintain_s <= limit and not row.error
                             and row.data_intact else FAIL))
        target = (f"{method}: downtime median <= {TARGET_DOWNTIME_MS:g} ms and p99 <= "
                  f"{TARGET_DOWNTIME_P99_MS:g} ms, guests busy")
        if not downs:
            out.append(Check(target, "no move measured", UNMEASURED))
            continue
        med, p99 = median(downs) or 0.0, nearest_rank(downs, 0.99) or 0.0
        ok = med <= TARGET_DOWNTIME_MS and p99 <= TARGET_DOWNTIME_P99_MS
        said = (f"median {med:.2f} ms, p99 {p99:.2f} ms over {len(downs)} moves, "
                f"{'busy' if busy else 'idle'} guests"
                + _prev(method, "downtime_ms_median", "ms median"))
        # Idle guests cannot pass a target set for busy ones, but can fail it.
        verdict = FAIL if not ok else (PASS if complete and busy else UNMEASURED)
        out.append(Check(target, said, verdict))
    intact = [r for r in res.rows if r.maintain_s is not None]
    out.append(Check("data intact in every guest after every maintain (failed ones too)",
                     f"{sum(r.data_intact for r in intact)}/{len(intact)} runs intact",
                     UNMEASURED if not intact else
                     PASS if all(r.data_intact for r in intact) else FAIL))
    return out


def median(values: Sequence[float]) -> float | None:
    if not values:
        return None
    s = sorted(values)
    mid = len(s) // 2
    return round(s[mid] if len(s) % 2 else (s[mid - 1] + s[mid]) / 2, 3)


def nearest_rank(values: Sequence[float], q: float) -> float | None:
    """The q-quantile by nearest rank (of 16 moves, p99 is the largest)."""
    if not values:
        return None
    s = sorted(values)
    rank = math.ceil(round(q * len(s), 9))      # 1-based; round: 0.99 * 100 is 98.999...
    return s[min(len(s), max(rank, 1)) - 1]


# -- markdown -----------------------------------------------------------------------
def verdict_text(res: Result) -> list[str]:
    """Which method wins, by how much, and why (from the numbers in the file)."""
    lines = []
    for n in res.counts():
        zc, cpr = res.row("zero-copy", n), res.row("cpr-transfer", n)
        if zc is None or cpr is None or zc.maintain_s is None or cpr.maintain_s is None:
            continue
        win, lose = (cpr, zc) if cpr.maintain_s <= zc.maintain_s else (zc, cpr)
        assert win.maintain_s is not None and lose.maintain_s is not None
        times = lose.maintain_s / max(win.maintain_s, 1e-9)
        lines.append(f"- {n} VM(s): **{win.method}** in {win.maintain_s:.2f} s against "
                     f"{lose.maintain_s:.2f} s ({times:.1f}x); "
                     f"downtime max {fixed(win.downtime_ms_max)} vs "
                     f"{fixed(lose.downtime_ms_max)} ms.")
    if not lines:
        return ["Only one method was measured (run with `--in-place` for both)."]
    return [*lines, "",
            "Why: both methods send only device state (about 0.1 MB per move) and leave "
            "guest RAM where it is: zero-copy maps the same RAM file in the destination "
            "QEMU (x-ignore-shared), cpr-transfer hands the RAM's file descriptors to the "
            "new QEMU over a UNIX socket. So a single move's downtime is the device state's "
            "save and load plus fusuma's decision and `cont` in both. What differs is the "
            "work around the downtime: `--via` moves every VM twice (out, and back onto the "
            "new QEMU) and restarts the partition's supervisor in between, so it starts two "
            "QEMU processes per VM; `--in-place` moves every VM once and starts one. The "
            "new QEMU's start (exec, firmware and kernel loading) dominates a move's total "
            "time, so cpr-transfer needs less than half the time of `--via`, which also "
            "waits for a supervisor restart. cpr-transfer also needs no second partition "
            "(no spare cores or memory), but it needs QEMU >= 10.0 on both sides and a VM "
            "whose QEMU started with aux-ram-share=on; `--via` works from any QEMU, which "
            "is how a partition leaves 7.2."]


def markdown(res: Result, source: Path) -> str:
    m = res.meta
    lines = ["# Upgrading a partition's QEMU under running VMs", "",
             f"Result file `{source.name}`: {m.get('date')}, revision "
             f"{m.get('git_revision')}, host {m.get('host')} ({m.get('host_cpu')}, "
             f"{m.get('host_cores')} cores), accelerator **{m.get('accel')}**, QEMU "
             f"{m.get('from_version')} -> {m.get('to_version')}; run took "
             f"{m.get('duration_s')} s.", "",
             f"Per VM count, N {'busy' if m.get('busy_guests') else 'idle'} 1-vCPU guests "
             f"of {m.get('guest_memory_mib')} MiB (each "
             f"holding a {m.get('blob_mib')} MiB random blob whose md5 is checked "
             "afterwards) run in one partition on one core, on QEMU "
             f"{m.get('from_version')}. `maintain --via` upgrades that partition to QEMU "
             f"{m.get('to_version')} through a second partition (one core); then "
             "`maintain --in-place` moves the same VMs to new QEMU "
             f"{m.get('to_version')} processes by cpr-transfer.", "",
             "## Results", ""]
    lines += table(["method", "VMs", "QEMU", "maintain_s", "moves", "downtime_ms max",
                     "downtime_ms median", "bytes/move (median)", "data_intact"],
                    [[LABELS.get(r.method, r.method), str(r.vms),
                      f"{r.from_qemu} -> {r.to_qemu}", fixed(r.maintain_s), str(r.moves),
                      fixed(r.downtime_ms_max), fixed(r.downtime_ms_median),
                      "unknown" if r.bytes_sent_median is None
                      else f"{r.bytes_sent_median / 1000:.0f} KB",
                      str(r.data_intact).lower()]
                     for r in sorted(res.rows, key=lambda r: (r.vms, r.method))])
    lines += pipeline_lines(res)
    lines += ["", "## Which method wins", "", *verdict_text(res)]
    lines += ["", "## Targets", "",
              f"\"before\" is the figure each target was set against ({PREVIOUS_SOURCE}).",
              ""]
    lines += check_table(checks(res))
    problems = [f"- {r.method} x{r.vms}: {r.error}" for r in res.rows if r.error]
    if problems:
        lines += ["", "## Problems seen", "", *problems]
    lines += ["", "## Notes", "",
              "- maintain_s is the wall time of the whole `maintain` (checks, every move, "
              "for --via the supervisor's restart), measured around the call.",
              "- downtime_ms runs from the guest's stop in the old QEMU to its resume in "
              "the new one (QEMU event timestamps); it includes fusuma recording the "
              "move's outcome before the new QEMU may run (never two QEMUs running one "
              "guest).",
              ("- Busy guests: each guest runs a CPU loop through each maintain; the "
               "guests' QEMUs used the cores given as busy_cores_before in the result "
               "file just before it began." if m.get("busy_guests") else
               f"- Each maintain starts once the guests' QEMUs use less than "
              f"{m.get('quiet_cores')} core together (waiting at most {m.get('quiesce_s')} "
              "s): under TCG a guest on a new QEMU process translates its code anew for a "
              "while, which would otherwise be measured as the next method's time."),
              f"- Under TCG on two cores shared with whatever else runs on the host: load "
              f"average {m.get('loadavg_1m_start')} at the start, {m.get('loadavg_1m_end')} "
              "at the end. Both methods wait on the same cores, so compare them with each "
              "other first.", ""]
    return "\n".join(lines)


# -- plot ---------------------------------------------------------------------------
def plot(res: Result, png: Path) -> None:
    with figure(png, ncols=3, figsize=(16, 4.5)) as (_, (left, right, per_vm)):
        styles = {"zero-copy": ("tab:blue", "o"), "cpr-transfer": ("tab:orange", "s")}
        counts = res.counts()
        for method in res.methods():
            color, marker = styles[method]
            rows = [res.row(method, n) for n in counts]
            xs = [n for n, r in zip(counts, rows, strict=True)
                  if r is not None and r.maintain_s is not None]
            ys = [r.maintain_s for r in rows if r is not None and r.maintain_s is not None]
            left.plot(xs, ys, color=color, marker=marker, label=LABELS[method])
            left.axhline(TARGET_MAINTAIN_S[method], color=color, linestyle=":",
                         label=f"{method} target ({TARGET_MAINTAIN_S[method]:g} s)")
            prev = PREVIOUS.get(method, {}).get("maintain_s")
            if prev is not None:
                left.scatter([TARGET_VMS], [prev], facecolors="none", edgecolors=color,
                             marker=marker, s=80, label=f"{method} before ({prev:g} s)")
            pts = [(int(m["vms"]), float(m["downtime_ms"])) for m in res.moves
                   if m.get("method") == method and m.get("downtime_ms") is not None]
            off = 0.94 if method == "zero-copy" else 1.06
            right.scatter([p[0] * off for p in pts], [p[1] for p in pts], color=color,
                          marker=marker, alpha=0.45, s=16, label=f"{method}: every move")
            bad = [r for r in rows if r is not None and not r.data_intact
                   and r.maintain_s is not None]
            if bad:
                left.scatter([r.vms for r in bad], [r.maintain_s for r in bad],
                             color="black", marker="x", s=90, zorder=4)
            # Downtime per VM: each VM's moves in the largest run, in VM order.
            most = max(counts)
            mine = sorted((_vm_index(str(m["vm"])), float(m["downtime_ms"]))
                           for m in res.moves if m.get("method") == method
                           and int(m["vms"]) == most and m.get("downtime_ms") is not None)
            per_vm.scatter([i for i, _ in mine], [d for _, d in mine], color=color,
                           marker=marker, alpha=0.7, s=20, label=f"{method}, {most} VMs")
        right.axhline(TARGET_DOWNTIME_MS, color="tab:green", linestyle=":",
                      label=f"median target ({TARGET_DOWNTIME_MS:g} ms)")
        for ax in (right, per_vm):
            ax.axhline(TARGET_DOWNTIME_P99_MS, color="tab:red", linestyle=":",
                       label=f"p99 target ({TARGET_DOWNTIME_P99_MS:g} ms)")
        for ax in (left, right):
            # Set first: a run whose every maintain failed plots nothing, and a log
            # axis of matplotlib's default (0, 1) range cannot be drawn.
            ax.set_xlim(min(counts) / 1.5, max(counts) * 1.5)
            ax.set_xscale("log", base=2)
            ax.set_xticks(counts, [str(n) for n in counts])
            ax.set_xlabel("running VMs in the partition")
        for ax in (left, right, per_vm):
            ax.grid(True, which="both", alpha=0.3)
            ax.legend(fontsize=7)
        left.set_ylabel("whole maintain (s)")
        left.set_title(f"QEMU {res.meta.get('from_version')} -> "
                       f"{res.meta.get('to_version')} ({res.meta.get('accel')})")
        right.set_ylabel("downtime per move (ms)")
        right.set_title("guest downtime of each move")
        per_vm.set_xlabel("VM (index in the partition)")
        per_vm.set_ylabel("downtime (ms)")
        per_vm.set_title(f"downtime per VM ({'busy' if res.meta.get('busy_guests') else 'idle'}"
                         " guests)")


def _vm_index(name: str) -> int:
    digits = name[len(name.rstrip("0123456789")):]
    return int(digits) if digits else 0
