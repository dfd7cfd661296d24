"""Report of a `fusuma bench vmbeam` result file: DIR/report.md and DIR/vmbeam.png.

Made from the result file alone (never during a run), so a report can be redrawn or
compared later: `fusuma bench report vmbeam FILE DIR`. Every target is checked against
the numbers in the file; a target the file has no numbers for is NOT MEASURED, never
PASS.
"""

from __future__ import annotations

import math
from functools import partial
from pathlib import Path
from typing import Any

from fusuma.frozen import frozen
from fusuma.migration import DOWNTIME_STEPS
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

# The paper's figures (papers/README.md §3): Xen P2M swap between two guest
# hypervisors on a Xeon E5-2665.
PAPER_S_PER_GIB = 0.5
PAPER_1024_MS = 500.0
PAPER_FASTER_PCT = 28
PAPER_CPU_SWAP_PCT = 98
PAPER_CPU_NET_PCT = 346

# fusuma's targets for zero-copy moves.
TARGET_TOTAL_MS = 20.0
TARGET_DOWNTIME_MS = 5.0
TARGET_GROWTH = 2.0          # largest size's total at most this times the smallest's
TARGET_SPEEDUP = 50.0        # copy total / zero-copy total at TARGET_SPEEDUP_MIB
TARGET_SPEEDUP_MIB = 1024
# fusuma's zero-copy move against raw QEMU's same move (no fusuma) in the same run.
TARGET_RAW_DOWNTIME = 2.0    # fusuma's downtime at most this times raw QEMU's
TARGET_RAW_TOTAL = 1.5       # fusuma's total at most this times raw QEMU's
RAW = "raw"

TICK_MS = 10.0               # /proc/<pid>/stat CPU time resolution (USER_HZ 100)

@frozen
class Row:
    """The median of the moves of one (mode, size)."""

    mode: str
    memory_mib: int
    total_ms: float | None          # None: no move of this case completed
    downtime_ms: float | None
    bytes_sent: int | None
    cpu_s: float | None
    data_intact: bool
    moves: int
    planned: int
    kernel_errors: int
    error: str | None
    steps_ms: dict[str, float | None] | None = None
    load_before: list[float] | None = None

    @property
    def cpu_pct(self) -> float | None:
        """CPU time of both QEMUs during the move, in percent of one core."""
        if self.cpu_s is None or not self.total_ms:
            return None
        return 100.0 * self.cpu_s / (self.total_ms / 1000)


@frozen
class Result:
    meta: dict[str, Any]
    rows: list[Row]
    moves: list[dict[str, Any]]

    def row(self, mode: str, size: int) -> Row | None:
        return next((r for r in self.rows if r.mode == mode and r.memory_mib == size), None)

    def sizes(self, mode: str) -> list[int]:
        """Sizes with a measured total for ``mode``."""
        return sorted(r.memory_mib for r in self.rows
                      if r.mode == mode and r.total_ms is not None)


def parse(data: dict[str, Any]) -> Result:
    planned = int(data["meta"]["moves"])
    rows = [Row(mode=str(r["mode"]), memory_mib=int(r["memory_mib"]),
                total_ms=opt_float(r["total_ms"]), downtime_ms=opt_float(r["downtime_ms"]),
                bytes_sent=None if r["bytes_sent"] is None else int(r["bytes_sent"]),
                cpu_s=opt_float(r["cpu_s"]), data_intact=bool(r["data_intact"]),
                moves=int(r["moves"]), planned=planned,
                kernel_errors=int(r.get("guest_kernel_errors", 0)),
                error=r.get("error"), steps_ms=r.get("steps_ms"),
                load_before=r.get("load_before"))
            for r in data["results"]]
    return Result(meta=dict(data["meta"]), rows=rows, moves=list(data["moves"]))


def load(path: Path) -> Result:
    return load_result(path, "vmbeam", parse)


def render(result_file: Path, out_dir: Path) -> list[Path]:
    """Write report.md and vmbeam.png for ``result_file`` into ``out_dir``."""
    res = load(result_file)
    return write_report(out_dir, markdown(res, result_file),
                        {"vmbeam.png": partial(plot, res)})


# -- checks -------------------------------------------------------------------------
def raw_ratio(res: Result, size: int, what: str) -> float | None:
    """fusuma's zero-copy ``what`` (total_ms, downtime_ms) over raw QEMU's, one size."""
    zc, raw = res.row("zero-copy", size), res.row(RAW, size)
    a = getattr(zc, what) if zc else None
    b = getattr(raw, what) if raw else None
    if a is None or b is None or b <= 0:
        return None
    return float(a) / float(b)


def raw_checks(res: Result) -> list[Check]:
    """fusuma's move within a factor of the mechanism's own, at every size measured."""
    sizes = sorted({r.memory_mib for r in res.rows if r.mode == RAW})
    out = []
    for what, target in (("downtime_ms", TARGET_RAW_DOWNTIME),
                         ("total_ms", TARGET_RAW_TOTAL)):
        name = f"zero-copy {what} <= {target:g}x raw QEMU's at every size"
        got = {s: raw_ratio(res, s, what) for s in sizes}
        if not sizes or any(v is None for v in got.values()):
            out.append(Check(name, "no raw QEMU row for every size", UNMEASURED))
            continue
        worst = max(got.values(), key=lambda v: v or 0.0) or 0.0
        out.append(Check(name, ", ".join(f"{got[s]:.2f}x ({s} MiB)" for s in sizes),
                         PASS if worst <= target else FAIL))
    return out


def ratio(res: Result, size: int) -> float | None:
    zc, cp = _total(res, "zero-copy", size), _total(res, "copy", size)
    if zc is None or cp is None or zc <= 0:
        return None
    return cp / zc


def checks(res: Result) -> list[Check]:
    zc = [r for r in res.rows if r.mode == "zero-copy"]
    out: list[Check] = []
    if any(r.total_ms is None for r in zc):
        out.append(Check(f"zero-copy total_ms <= {TARGET_TOTAL_MS:g} at every size",
                         "no completed move at some size", FAIL))
        zc = [r for r in zc if r.total_ms is not None]
    if zc:
        worst = max(zc, key=lambda r: r.total_ms or 0.0)
        out.append(Check(f"zero-copy total_ms <= {TARGET_TOTAL_MS:g} at every size",
                         f"max {worst.total_ms:g} ms ({worst.memory_mib} MiB)",
                         PASS if (worst.total_ms or 0.0) <= TARGET_TOTAL_MS else FAIL))
        downs = [r for r in zc if r.downtime_ms is not None]
        if len(downs) < len(zc):
            out.append(Check(f"zero-copy downtime_ms <= {TARGET_DOWNTIME_MS:g} at every size",
                             "downtime unknown for some size", UNMEASURED))
        else:
            w = max(downs, key=lambda r: r.downtime_ms or 0.0)
            out.append(Check(f"zero-copy downtime_ms <= {TARGET_DOWNTIME_MS:g} at every size",
                             f"max {w.downtime_ms:g} ms ({w.memory_mib} MiB)",
                             PASS if (w.downtime_ms or 0.0) <= TARGET_DOWNTIME_MS else FAIL))
    else:
        out.append(Check("zero-copy targets", "no zero-copy results", UNMEASURED))
    sizes = res.sizes("zero-copy")
    growth = f"zero-copy total at largest size <= {TARGET_GROWTH:g}x smallest"
    if len(sizes) >= 2:
        lo = _total(res, "zero-copy", sizes[0]) or 0.0
        hi = _total(res, "zero-copy", sizes[-1]) or 0.0
        g = hi / lo if lo > 0 else math.inf
        out.append(Check(growth, f"{hi:g} ms ({sizes[-1]} MiB) / {lo:g} ms "
                                 f"({sizes[0]} MiB) = {g:.2f}x",
                         PASS if g <= TARGET_GROWTH else FAIL))
    else:
        out.append(Check(growth, "fewer than two sizes", UNMEASURED))
    speed = f"zero-copy >= {TARGET_SPEEDUP:g}x faster than copy at {TARGET_SPEEDUP_MIB} MiB"
    r = ratio(res, TARGET_SPEEDUP_MIB)
    out.append(Check(speed, f"{r:.1f}x" if r is not None else
                     f"no {TARGET_SPEEDUP_MIB} MiB results for both modes",
                     UNMEASURED if r is None else PASS if r >= TARGET_SPEEDUP else FAIL))
    bad = [m for m in res.moves if not m.get("data_intact")]
    bad_rows = [r for r in res.rows if not r.data_intact]
    planned = sum(r.planned for r in res.rows)
    out.append(Check("data_intact after every move",
                     f"{len(res.moves) - len(bad)}/{len(res.moves)} moves checked intact, "
                     f"{planned} planned",
                     UNMEASURED if not res.moves else
                     PASS if not bad and not bad_rows else FAIL))
    kernel = sum(len(m.get("kernel_errors") or []) for m in res.moves)
    out.append(Check("no guest kernel error after any move (console)",
                     f"{kernel} error line(s)", PASS if kernel == 0 else FAIL))
    return out + raw_checks(res)


# -- markdown -----------------------------------------------------------------------
def markdown(res: Result, source: Path) -> str:
    m = res.meta
    lines = ["# VMBeam on fusuma", "",
             f"Result file `{source.name}`: {m.get('date')}, revision {m.get('git_revision')},"
             f" host {m.get('host')} ({m.get('host_cpu')}, {m.get('host_cores')} cores), "
             f"accelerator **{m.get('accel')}**, {m.get('qemu')}.", "",
             f"Each figure is the median of {m.get('moves')} moves of one running 1-vCPU VM "
             "back and forth between two partitions (one core each), while a writer in the "
             "guest keeps dirtying memory; after every move the md5 of a random blob in the "
             "guest is compared with its value before the first move.", "",
             "## Results", ""]
    lines += table(["mode", "memory_mib", "total_ms", "downtime_ms", "bytes_sent", "cpu_s",
                     "data_intact"],
                    [[r.mode, str(r.memory_mib), fixed(r.total_ms), fixed(r.downtime_ms),
                      "unknown" if r.bytes_sent is None else str(r.bytes_sent),
                      fixed(r.cpu_s, 3), str(r.data_intact).lower()
                      + ("" if r.moves == r.planned else f" ({r.moves}/{r.planned} moves)")]
                     for r in sorted(res.rows, key=lambda r: (r.mode != "zero-copy",
                                                              r.mode, r.memory_mib))])
    lines += _raw_section(res)
    lines += ["", "## copy / zero-copy", ""]
    sizes = sorted({r.memory_mib for r in res.rows})
    lines += table(["memory_mib", "zero-copy total_ms", "copy total_ms", "copy / zero-copy"],
                    [[str(s), fixed(_total(res, "zero-copy", s)), fixed(_total(res, "copy", s)),
                      "n/a" if ratio(res, s) is None else f"{ratio(res, s):.1f}x"]
                     for s in sizes])
    lines += ["", "## Targets", ""]
    lines += check_table(checks(res))
    lines += ["", "## Beside the paper", "", *_paper_table(res)]
    problems = _problems(res)
    if problems:
        lines += ["", "## Problems seen", "", *problems]
    lines += ["", "## Notes", "",
              "- VMBeam swaps page ownership in Xen's P2M table, so its time grows with "
              "guest memory; fusuma's zero-copy mode maps the same shared RAM file in both "
              "QEMUs and sends only device state, so its time should not.",
              "- total_ms runs from the migrate command at the source to the guest running "
              "at the destination, downtime_ms from the guest's stop to that moment (QEMU "
              "event timestamps); prepare_ms (starting the waiting QEMU) comes before and "
              "is not in total_ms.",
              "- cpu_s is utime+stime of both QEMUs during the move (/proc, 10 ms ticks): "
              "zero-copy values are at that resolution, and under TCG the copy figure also "
              "holds the guest's own emulated CPU work.",
              f"- Host and accelerator differ from the paper's (Xeon E5-2665, Xen; here "
              f"{m.get('accel')}), and the paper's baseline is a transfer over Xen's virtual "
              "network, ours a pre-copy migration over a UNIX socket: compare the shapes "
              "(growth with memory, ratio to copying), not absolute times.", ""]
    return "\n".join(lines)


def _raw_section(res: Result) -> list[str]:
    """fusuma beside raw QEMU: ratios and where each one's downtime went."""
    sizes = sorted({r.memory_mib for r in res.rows if r.mode == RAW})
    if not sizes:
        return []
    lines = ["", "## fusuma / raw QEMU", "",
             "The raw row is the same zero-copy move by two bare QEMUs and no fusuma (same "
             "guest, size, workload and cores, measured the same way); the ratio is what "
             "fusuma's own steps cost over the mechanism's.", ""]

    def ratio_s(s: int, what: str) -> str:
        r = raw_ratio(res, s, what)
        return "n/a" if r is None else f"{r:.2f}x"
    lines += table(["memory_mib", "raw downtime_ms", "fusuma downtime_ms", "ratio",
                    "raw total_ms", "fusuma total_ms", "ratio"],
                   [[str(s), fixed(_down(res, RAW, s)), fixed(_down(res, "zero-copy", s)),
                     ratio_s(s, "downtime_ms"), fixed(_total(res, RAW, s)),
                     fixed(_total(res, "zero-copy", s)), ratio_s(s, "total_ms")]
                    for s in sizes])
    steps = [r for r in res.rows if r.mode in (RAW, "zero-copy") and r.steps_ms]
    names = [n for n in DOWNTIME_STEPS.values() if any(n in (r.steps_ms or {}) for r in steps)]
    if steps:
        lines += ["", "Where the downtime went (medians, ms; load average at the start "
                  "of each row's moves):", ""]
        lines += table(["mode", "memory_mib", *names, "load"],
                       [[r.mode, str(r.memory_mib),
                         *[fixed((r.steps_ms or {})[k]) if k in (r.steps_ms or {}) else "-"
                           for k in names],
                         " ".join(f"{x:g}" for x in (r.load_before or [])) or "-"]
                        for r in sorted(steps, key=lambda r: (r.memory_mib, r.mode))])
    return lines


def _down(res: Result, mode: str, size: int) -> float | None:
    r = res.row(mode, size)
    return None if r is None else r.downtime_ms


def _problems(res: Result) -> list[str]:
    out = [f"- {r.mode} {r.memory_mib} MiB: {r.error}" for r in res.rows if r.error]
    for m in res.moves:
        errs = m.get("kernel_errors") or []
        if errs:
            out.append(f"- {m.get('mode')} {m.get('memory_mib')} MiB, move to {m.get('to')}: "
                       f"guest kernel said `{errs[0]}`"
                       + (f" (+{len(errs) - 1} more line(s))" if len(errs) > 1 else ""))
    return out


def _total(res: Result, mode: str, size: int) -> float | None:
    r = res.row(mode, size)
    return None if r is None else r.total_ms


def _cpu(row: Row | None) -> str:
    """CPU share of a move, or why it cannot be given: /proc counts 10 ms ticks."""
    if row is None or row.cpu_pct is None or row.cpu_s is None or row.total_ms is None:
        return "not measured"
    if row.total_ms < 10 * TICK_MS:
        return (f"below resolution ({row.cpu_s:g} s CPU counted in {row.total_ms:g} ms; "
                f"{TICK_MS:g} ms ticks)")
    return f"{row.cpu_pct:.0f}%"


def _paper_table(res: Result) -> list[str]:
    zc, cp = _total(res, "zero-copy", 1024), _total(res, "copy", 1024)
    big = max(res.sizes("zero-copy"), default=None)
    zbig = _total(res, "zero-copy", big) if big else None
    r = ratio(res, 1024)
    zrow, crow = res.row("zero-copy", 1024), res.row("copy", 1024)
    nm = "not measured"
    rows = [["move of a 1024 MiB guest", f"{PAPER_1024_MS / 1000:g} s",
             f"{zc:.2f} ms" if zc is not None else nm,
             f"{cp:.0f} ms" if cp is not None else nm],
            ["time per GiB", f"{PAPER_S_PER_GIB:g} s/GiB",
             f"{zbig / ((big or 1024) / 1024):.2f} ms/GiB (at {big} MiB)"
             if zbig is not None else nm,
             f"{cp / 1000:.1f} s/GiB (at 1024 MiB)" if cp is not None else nm],
            ["against copying", f"{PAPER_FASTER_PCT}% faster than network transfer",
             f"{r:.0f}x faster than copy ({100 * (1 - 1 / r):.1f}% less time)"
             if r else nm, "-"],
            ["CPU during the move", f"{PAPER_CPU_SWAP_PCT}% (swap) vs {PAPER_CPU_NET_PCT}% "
             "(network)", _cpu(zrow), _cpu(crow)]]
    return table(["", "VMBeam (paper)", "fusuma zero-copy", "fusuma copy"], rows)


# -- plot ---------------------------------------------------------------------------
def plot(res: Result, png: Path) -> None:
    with figure(png, figsize=(7, 4.5)) as (_, ax):
        styles = {"zero-copy": ("tab:blue", "o"), "copy": ("tab:red", "s"),
                  RAW: ("tab:olive", "^")}
        for mode, (color, marker) in styles.items():
            sizes = res.sizes(mode)
            if not sizes:
                continue
            ys = [_total(res, mode, s) or math.nan for s in sizes]  # sizes: measured only
            ax.plot(sizes, ys, color=color, marker=marker,
                    label="raw QEMU zero-copy, no fusuma (median)" if mode == RAW
                    else f"fusuma {mode} (median)")
            pts = [(int(m["memory_mib"]), float(m["total_ms"])) for m in res.moves
                   if m.get("mode") == mode and m.get("total_ms") is not None]
            if pts:
                ax.scatter([p[0] for p in pts], [p[1] for p in pts], color=color, alpha=0.3,
                           s=12)
        bad = [r for r in res.rows if not r.data_intact and r.total_ms is not None]
        if bad:
            ax.scatter([r.memory_mib for r in bad], [r.total_ms or math.nan for r in bad],
                       color="black", marker="x", s=90, zorder=4, label="data not intact")
        all_sizes = sorted({r.memory_mib for r in res.rows} | {1024})
        lo, hi = all_sizes[0], all_sizes[-1]
        ax.plot([lo, hi], [PAPER_S_PER_GIB * 1000 * lo / 1024, PAPER_S_PER_GIB * 1000 * hi / 1024],
                color="gray", linestyle="--", label=f"VMBeam paper ({PAPER_S_PER_GIB:g} s/GiB)")
        ax.scatter([1024], [PAPER_1024_MS], color="gray", marker="*", s=90, zorder=3,
                   label="VMBeam paper: 1024 MiB in 0.5 s")
        ax.axhline(TARGET_TOTAL_MS, color="tab:green", linestyle=":", linewidth=1,
                   label=f"zero-copy target ({TARGET_TOTAL_MS:g} ms)")
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xticks(all_sizes, [str(s) for s in all_sizes])
        ax.set_xlabel("guest memory (MiB)")
        ax.set_ylabel("total migration time (ms, log)")
        ax.set_title(f"VMBeam experiment on fusuma ({res.meta.get('accel')}, "
                     f"{res.meta.get('moves')} moves each)")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=8)
