"""Report of a `fusuma bench mint` result file: DIR/report.md and one plot per test.

Made from the result file alone (never during a run): `fusuma bench report mint FILE
DIR`. A configuration's figure for a (test, size) is the mean of its probes' medians
(configs 3, 6 and 7 run two probes, the others one); ratios divide two such figures.
"""

from __future__ import annotations

import math
import statistics
from functools import partial
from pathlib import Path
from typing import Any

from fusuma.frozen import frozen
from fusuma_bench.report import figure, load_result, table, write_report

TESTS = ("register", "copy", "io")
CONFIG_IDS = tuple(range(1, 10))


@frozen
class Comparison:
    """One of the paper's findings as a ratio of two configurations' figures."""

    label: str
    num: int
    den: int
    test: str
    paper: str                   # what the paper says, as text for the table
    paper_ratio: float | None    # the same as a number, when it gives one
    paper_sizes: tuple[int, ...] | None = None  # sizes the number is for (None: all)


_SAME = "≈1 (same)"
COMPARISONS: tuple[Comparison, ...] = (
    Comparison("partition vs host (2 vs 1)", 2, 1, "register", _SAME, 1.0),
    Comparison("partition vs host (2 vs 1)", 2, 1, "copy", _SAME, 1.0),
    Comparison("partition vs host (2 vs 1)", 2, 1, "io", _SAME, 1.0),
    Comparison("VM vs native (4 vs 1)", 4, 1, "register", _SAME, 1.0),
    Comparison("VM vs native (4 vs 1)", 4, 1, "copy", "1.20 at 1024 KiB", 1.20, (1024,)),
    Comparison("VM vs native (4 vs 1)", 4, 1, "io", "1.16", 1.16),
    Comparison("VM in a partition vs unpartitioned (5 vs 4)", 5, 4, "register", _SAME, 1.0),
    Comparison("VM in a partition vs unpartitioned (5 vs 4)", 5, 4, "copy", _SAME, 1.0),
    Comparison("VM in a partition vs unpartitioned (5 vs 4)", 5, 4, "io", _SAME, 1.0),
    Comparison("concurrent vs alone, host (3 vs 2)", 3, 2, "register", _SAME, 1.0),
    Comparison("concurrent vs alone, host (3 vs 2)", 3, 2, "copy", "1.70", 1.70),
    Comparison("concurrent vs alone, one hypervisor (7 vs 4)", 7, 4, "register", _SAME, 1.0),
    Comparison("concurrent vs alone, one hypervisor (7 vs 4)", 7, 4, "copy", "1.67", 1.67),
    Comparison("concurrent vs alone, two partitions (6 vs 5)", 6, 5, "register", _SAME, 1.0),
    Comparison("concurrent vs alone, two partitions (6 vs 5)", 6, 5, "copy", "1.71", 1.71),
    Comparison("two VMs: one hypervisor vs two (7 vs 6)", 7, 6, "register", _SAME, 1.0),
    Comparison("two VMs: one hypervisor vs two (7 vs 6)", 7, 6, "copy", _SAME, 1.0),
    Comparison("two VMs: one hypervisor vs two (7 vs 6)", 7, 6, "io", "1.08", 1.08),
    Comparison("CPU hog in the other partition (8 vs 6)", 8, 6, "register",
               "≈1 (claimed, not measured)", None),
    Comparison("CPU hog in the other partition (8 vs 6)", 8, 6, "copy",
               "≈1 (claimed, not measured)", None),
    Comparison("CPU hog in the other partition (8 vs 6)", 8, 6, "io",
               "≈1 (claimed, not measured)", None),
    Comparison("CPU hog in the same partition (9 vs 6)", 9, 6, "register",
               "not in the paper", None),
    Comparison("CPU hog in the same partition (9 vs 6)", 9, 6, "copy", "not in the paper",
               None),
    Comparison("CPU hog in the same partition (9 vs 6)", 9, 6, "io", "not in the paper", None),
)


@frozen
class Row:
    """The repetitions of one probe in one configuration, for one (test, size)."""

    config: int
    test: str
    size_kib: int | None
    vm: str | None
    partition: str | None
    median_ns: float
    min_ns: float
    max_ns: float
    median_cycles: float
    hog_cpu_pct: float | None = None


@frozen
class Result:
    meta: dict[str, Any]
    rows: list[Row]

    def sizes(self, test: str) -> list[int | None]:
        return sorted({r.size_kib for r in self.rows if r.test == test},
                      key=lambda s: s or 0)

    def rows_of(self, config: int, test: str, size: int | None) -> list[Row]:
        return [r for r in self.rows
                if r.config == config and r.test == test and r.size_kib == size]

    def figure(self, config: int, test: str, size: int | None) -> float | None:
        """Mean of the configuration's probes' medians (ns); None if not measured."""
        rows = self.rows_of(config, test, size)
        return statistics.fmean(r.median_ns for r in rows) if rows else None

    def spread(self, config: int, test: str, size: int | None) -> tuple[float, float] | None:
        rows = self.rows_of(config, test, size)
        return (min(r.min_ns for r in rows), max(r.max_ns for r in rows)) if rows else None

    def label(self, config: int) -> str:
        c = self.meta.get("configs", {}).get(str(config), {})
        return str(c.get("label", f"config {config}"))

    def description(self, config: int) -> str:
        c = self.meta.get("configs", {}).get(str(config), {})
        return str(c.get("description", ""))


def _positive(value: Any, what: str) -> float:
    x = float(value)
    if not (math.isfinite(x) and x > 0):
        raise ValueError(f"{what} is {value!r}, not a positive number")
    return x


def parse(data: dict[str, Any]) -> Result:
    """A Result from a decoded result file; ValueError/KeyError/TypeError if malformed."""
    rows = []
    for r in data["results"]:
        test = str(r["test"])
        if test not in TESTS:
            raise ValueError(f"unknown test {test!r}")
        config = int(r["config"])
        if config not in CONFIG_IDS:
            raise ValueError(f"unknown configuration {config}")
        size = None if r["size_kib"] is None else int(r["size_kib"])
        rows.append(Row(config=config, test=test, size_kib=size, vm=r.get("vm"),
                        partition=r.get("partition"),
                        median_ns=_positive(r["median_ns"], "median_ns"),
                        min_ns=_positive(r["min_ns"], "min_ns"),
                        max_ns=_positive(r["max_ns"], "max_ns"),
                        median_cycles=_positive(r["median_cycles"], "median_cycles"),
                        hog_cpu_pct=None if r.get("hog_cpu_pct") is None
                        else float(r["hog_cpu_pct"])))
    return Result(meta=dict(data["meta"]), rows=rows)


def load(path: Path) -> Result:
    return load_result(path, "mint", parse)


def render(result_file: Path, out_dir: Path) -> list[Path]:
    """Write report.md and mint-<test>.png for ``result_file`` into ``out_dir``."""
    res = load(result_file)
    return write_report(out_dir, markdown(res, result_file),
                        {f"mint-{t}.png": partial(plot, res, t) for t in TESTS if res.sizes(t)})


# -- ratios -------------------------------------------------------------------------
@frozen
class Ratio:
    comparison: Comparison
    size_kib: int | None
    value: float | None          # None: one of the two configurations is not measured

    @property
    def paper_ratio(self) -> float | None:
        c = self.comparison
        if c.paper_sizes is not None and self.size_kib not in c.paper_sizes:
            return None
        return c.paper_ratio


def ratio(res: Result, num: int, den: int, test: str, size: int | None) -> float | None:
    a, b = res.figure(num, test, size), res.figure(den, test, size)
    if a is None or b is None or b <= 0:
        return None
    return a / b


def ratios(res: Result) -> list[Ratio]:
    out = []
    for c in COMPARISONS:
        sizes = res.sizes(c.test) or ([None] if c.test == "register" else [])
        out += [Ratio(c, s, ratio(res, c.num, c.den, c.test, s)) for s in sizes]
    return out


# -- markdown -----------------------------------------------------------------------
def ms(ns: float | None) -> str:
    if ns is None:
        return "—"
    v = ns / 1e6
    return f"{v:.3f}" if v < 10 else f"{v:.2f}" if v < 100 else f"{v:.1f}"


def _size(size: int | None) -> str:
    return "—" if size is None else f"{size} KiB"


def _who(r: Row) -> str:
    return r.vm or (f"host probe in {r.partition}" if r.partition else "host probe")


def results_section(res: Result, test: str) -> list[str]:
    sizes = res.sizes(test)
    lines = [f"### {test}", ""]
    headers = ["config", "what", "probe", *(f"{_size(s)} median ms (min–max)"
                                           if s else "median ms (min–max)" for s in sizes)]
    if test == "register":
        headers.append("median Mcycles")
    rows = []
    for config in CONFIG_IDS:
        probes = sorted({(r.partition, r.vm) for r in res.rows
                         if r.config == config and r.test == test}, key=str)
        for partition, vm in probes:
            cells = [str(config), res.label(config), ""]
            mcycles = ""
            for s in sizes:
                row = next((r for r in res.rows_of(config, test, s)
                            if (r.partition, r.vm) == (partition, vm)), None)
                if row is None:
                    cells.append("—")
                    continue
                cells[2] = _who(row)
                cells.append(f"{ms(row.median_ns)} ({ms(row.min_ns)}–{ms(row.max_ns)})")
                mcycles = f"{row.median_cycles / 1e6:.1f}"
            rows.append(cells + ([mcycles] if test == "register" else []))
    return lines + table(headers, rows) + [""]


def ratio_section(res: Result, test: str) -> list[str]:
    """One row per finding about ``test``: the paper's ratio, then ours at each size."""
    sizes = res.sizes(test) or [None]
    rows = []
    for c in (c for c in COMPARISONS if c.test == test):
        cells = [c.label, c.paper]
        for s in sizes:
            v = ratio(res, c.num, c.den, test, s)
            cells.append("not measured" if v is None else f"{v:.2f}")
        rows.append(cells)
    headers = ["comparison", "paper (KVM)",
               *(f"fusuma {_size(s)}" if s else "fusuma" for s in sizes)]
    return [f"### {test}", "", *table(headers, rows), ""]


def markdown(res: Result, source: Path) -> str:
    m = res.meta
    hog = [r.hog_cpu_pct for r in res.rows if r.hog_cpu_pct is not None]
    lines = ["# Mint + KVM evaluation on fusuma", "",
             f"Result file `{source.name}`: {m.get('date')}, revision {m.get('git_revision')},"
             f" host {m.get('host')} ({m.get('host_cpu')}, {m.get('host_cores')} cores), "
             f"accelerator **{m.get('accel')}**, {m.get('qemu')}"
             + (", **quick run**" if m.get("quick") else "") + ".", "",
             f"Probe: {m.get('reps')} repetitions of each test; register M = {m.get('m')}, "
             f"copy N = {m.get('n')}, io L = {m.get('l')} reads with O_DIRECT from a "
             f"{m.get('disk_mib')} MiB raw disk file ({m.get('disk_fs')}); guests have 1 vCPU "
             f"and {m.get('guest_memory_mib')} MiB. Each figure is the median of the "
             "repetitions (time of one repetition: M increments, N copies or L reads).", "",
             "## Configurations", ""]
    lines += table(["config", "label", "what"],
                    [[str(c), res.label(c), res.description(c)] for c in CONFIG_IDS])
    lines += ["", "## Results", ""]
    for test in TESTS:
        if res.sizes(test):
            lines += results_section(res, test)
    lines += ["## Beside the paper", "",
              "Ratios of two configurations' figures (a configuration with two probes "
              "counts the mean of their medians); above 1 means the first is slower.", ""]
    for test in TESTS:
        lines += ratio_section(res, test)
    lines += ["## Notes", "",
              f"- The paper ran KVM on an Intel Core i7 with a hard disk per OS node; this "
              f"run used {m.get('accel')}. Under TCG every guest instruction is "
              "translated, so VM-vs-native ratios measure the emulator, not a "
              "hypervisor's overhead: compare the concurrency and isolation ratios, "
              "whose both sides run the same way.",
              "- \"Unpartitioned\" (configs 4 and 7) is one fusuma partition holding every "
              "core: fusuma always needs a partition. Its supervisor still pins each vCPU "
              "to one core, round-robin over the VMs, so config 7's two vCPUs sit on "
              "different cores as in config 6; what differs is one supervisor, one cgroup "
              "and one memory limit for both.",
              "- Disks are raw files on the host's filesystem. The host probes open them "
              "with O_DIRECT; QEMU opens them with its default cache mode (writeback), so "
              "the host page cache is dropped before every io run and the probe never "
              "reads a block twice in one run.",
              "- The hog (configs 8, 9) is a 1-vCPU VM running a shell busy loop"
              + (f"; its QEMU used {min(hog):.0f}–{max(hog):.0f}% of a core during the "
                 "measurements" if hog else "") + ".", ""]
    return "\n".join(lines)


# -- plots --------------------------------------------------------------------------
LOG_SCALE_SPREAD = 20
_COLOURS = {1: "#4c72b0", 2: "#4c72b0", 3: "#4c72b0", 4: "#dd8452", 5: "#dd8452",
            6: "#dd8452", 7: "#dd8452", 8: "#c44e52", 9: "#c44e52"}


def plot(res: Result, test: str, png: Path) -> None:
    """One bar per configuration (its figure, whiskers: fastest and slowest repetition
    of its probes), one panel per size, like the paper's figures 5-10."""
    sizes = res.sizes(test)
    with figure(png, ncols=len(sizes), figsize=(max(6.5, 4.6 * len(sizes)), 4.4),
                squeeze=False) as (fig, axes):
        for ax, size in zip(axes[0], sizes, strict=True):
            configs = [c for c in CONFIG_IDS if res.figure(c, test, size) is not None]
            ys = [(res.figure(c, test, size) or 0.0) / 1e6 for c in configs]
            spreads = [res.spread(c, test, size) or (0.0, 0.0) for c in configs]
            lo = [y - s[0] / 1e6 for y, s in zip(ys, spreads, strict=True)]
            hi = [s[1] / 1e6 - y for y, s in zip(ys, spreads, strict=True)]
            xs = list(range(len(configs)))
            bars = ax.bar(xs, ys, color=[_COLOURS[c] for c in configs],
                          yerr=[[max(0.0, v) for v in lo], [max(0.0, v) for v in hi]],
                          capsize=3, ecolor="black")
            ax.bar_label(bars, labels=[ms(y * 1e6) for y in ys], fontsize=7, padding=2)
            ax.set_xticks(xs, [f"{c}\n{res.label(c)}" for c in configs], fontsize=6.5,
                          rotation=45, ha="right")
            # Under TCG a VM's copy can be hundreds of times the host's: a linear axis
            # would flatten the host bars to nothing.
            positive = [y for y in ys if y > 0]
            if positive and max(positive) > LOG_SCALE_SPREAD * min(positive):
                ax.set_yscale("log")
                ax.set_ylabel("time per repetition (ms, log scale)")
            else:
                ax.set_ylabel("time per repetition (ms)")
            ax.set_title(test if size is None else f"{test}, {size} KiB")
            ax.grid(True, axis="y", alpha=0.3)
        fig.suptitle(f"Mint evaluation on fusuma: {test} ({res.meta.get('accel')})\n"
                     "blue: host probe, orange: VMs, red: VM beside a CPU hog; whiskers: "
                     "fastest and slowest repetition", fontsize=8.5)
