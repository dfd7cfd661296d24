"""What every benchmark and report shares: the ``meta`` block of a result file (git
revision, date, host, accelerator), writing and loading result files, markdown tables,
and a report directory of a markdown file and its plots.

Reports are made from result files alone, never during a run, so a report can be
redrawn or compared later (`fusuma bench report NAME FILE DIR`). matplotlib is imported
only when a plot is drawn.
"""

from __future__ import annotations

import datetime as dt
import importlib
import json
import os
import platform
import subprocess
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import Any, NamedTuple, TypeVar, cast

from fusuma import __version__
from fusuma.errors import SpecError
from fusuma.frozen import frozen

T = TypeVar("T")

# A target's verdict. A target the result file has no numbers for is NOT MEASURED,
# never PASS.
PASS, FAIL, UNMEASURED = "PASS", "FAIL", "NOT MEASURED"


@frozen
class Check:
    """One target judged against a result file's numbers."""

    target: str
    measured: str
    verdict: str


# -- the meta block -------------------------------------------------------------------
def git_revision() -> str:
    here = Path(__file__).resolve().parent
    try:
        out = subprocess.run(["git", "-C", str(here), "rev-parse", "HEAD"],
                             capture_output=True, text=True, timeout=5, check=True)
        dirty = subprocess.run(["git", "-C", str(here), "status", "--porcelain", "--",
                                str(here.parent)], capture_output=True, text=True, timeout=5)
        return out.stdout.strip() + ("-dirty" if dirty.stdout.strip() else "")
    except (OSError, subprocess.SubprocessError):
        return f"fusuma-{__version__}"


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def qemu_version(binary: str = "qemu-system-x86_64") -> str:
    try:
        out = subprocess.run([binary, "--version"], capture_output=True, text=True,
                             timeout=10)
        return out.stdout.splitlines()[0] if out.stdout else "unknown"
    except (OSError, subprocess.SubprocessError):
        return "not installed"


def meta(accel: str, **extra: Any) -> dict[str, Any]:
    return {"git_revision": git_revision(),
            "date": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
            "host": platform.node(), "host_cpu": cpu_model(), "host_cores": os.cpu_count(),
            "kernel": platform.release(), "qemu": qemu_version(), "accel": accel,
            "fusuma_version": __version__, **extra}


# -- result files -----------------------------------------------------------------------
def write_result(path: Path, data: dict[str, Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json.dumps(data, indent=2) + "\n")
    tmp.replace(path)


def load_result(path: Path, benchmark: str, parse: Callable[[dict[str, Any]], T],
                unnamed_ok: bool = False) -> T:
    """``parse`` of the result file of `fusuma bench BENCHMARK` at ``path``; one
    SpecError that says what is wrong with it (parse raises ValueError, KeyError,
    TypeError or AttributeError on a malformed file). With ``unnamed_ok``, a file whose
    meta names no benchmark is taken too (dcss wrote such files)."""
    try:
        data = json.loads(path.read_text())
        got = data["meta"].get("benchmark")
        if got != benchmark and not (got is None and unnamed_ok):
            raise ValueError(f"not a {benchmark} result file: its benchmark is {got!r}")
        return parse(data)
    except OSError as exc:
        raise SpecError(f"cannot read result file {path}: {exc.strerror}.") from exc
    except (ValueError, KeyError, TypeError, AttributeError) as exc:
        raise SpecError(f"{path} is not a `fusuma bench {benchmark}` result file ({exc}); "
                        f"make one with `fusuma bench {benchmark} --json FILE`.") from exc


class Report(NamedTuple):
    """A report made from one benchmark's result file: the module with its
    ``load(path)`` and ``render(result_file, out_dir) -> paths``, and the help of its
    `bench report NAME` command."""

    module: str
    help: str


REPORTS: dict[str, Report] = {
    "vmbeam": Report("fusuma_bench.report_vmbeam", "Write OUT_DIR/report.md and "
                     "OUT_DIR/vmbeam.png from a `bench vmbeam` result file."),
    "maintain": Report("fusuma_bench.report_maintain", "Write OUT_DIR/report.md and "
                       "OUT_DIR/maintain.png from a `bench maintain` result file."),
    "mint": Report("fusuma_bench.mint_report", "Write OUT_DIR/report.md and "
                   "OUT_DIR/mint-*.png from a `bench mint` result file."),
    "scheduler": Report("fusuma_bench.report_scheduler", "Write OUT_DIR/report.md and "
                        "OUT_DIR/scheduler.png from a `bench scheduler` file."),
    "dcss": Report("fusuma_bench.report_dcss", "Write OUT_DIR/report.md and "
                   "OUT_DIR/dcss.png from a `bench dcss` result file."),
    "density": Report("fusuma_bench.report_density", "Write OUT_DIR/report.md and "
                      "OUT_DIR/density.png from a `bench density` file."),
    "memory": Report("fusuma_bench.report_memory", "Write OUT_DIR/report.md and "
                     "OUT_DIR/memory-*.png from a `bench memory` result file."),
    "network": Report("fusuma_bench.report_network", "Write OUT_DIR/report.md and "
                      "OUT_DIR/network.png from a `bench network` result file."),
}


def render_report(name: str, result_file: Path, out_dir: Path) -> list[Path]:
    """Render report NAME from ``result_file`` into ``out_dir``; the files written."""
    module = importlib.import_module(REPORTS[name].module)
    return cast(list[Path], module.render(result_file, out_dir))


# -- report directories ----------------------------------------------------------------
def write_report(out_dir: Path, markdown: str,
                 plots: Mapping[str, Callable[[Path], None]]) -> list[Path]:
    """Write OUT_DIR/report.md and each plot (file name -> drawing function); the paths,
    the markdown first."""
    out_dir.mkdir(parents=True, exist_ok=True)
    md = out_dir / "report.md"
    md.write_text(markdown)
    pngs = [out_dir / name for name in plots]
    for png, draw in zip(pngs, plots.values(), strict=True):
        draw(png)
    return [md, *pngs]


@contextmanager
def figure(png: Path, dpi: int = 120, **subplots: Any) -> Iterator[tuple[Any, Any]]:
    """A matplotlib figure and its axes (``plt.subplots(**subplots)``), saved to PNG
    when the block ends without an error, and always closed."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(**subplots)
    try:
        yield fig, axes
        fig.tight_layout()
        fig.savefig(png, dpi=dpi)
    finally:
        plt.close(fig)


# -- markdown ---------------------------------------------------------------------------
def table(headers: list[str], rows: list[list[str]]) -> list[str]:
    """A markdown table, one line per element."""
    return ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers),
            *("| " + " | ".join(r) + " |" for r in rows)]


def check_table(checks: list[Check]) -> list[str]:
    """The targets table: target, measured, verdict (bold)."""
    return table(["target", "measured", "verdict"],
                 [[c.target, c.measured, f"**{c.verdict}**"] for c in checks])


def fixed(x: float | None, digits: int = 2) -> str:
    """``x`` with ``digits`` decimals, or "unknown"."""
    return "unknown" if x is None else f"{x:.{digits}f}"


def dash(x: Any, unit: str = "") -> str:
    """``x`` and its unit as given, or a dash when there is no value."""
    return "–" if x is None else f"{x}{unit}"


def opt_float(value: Any) -> float | None:
    return None if value is None else float(value)
