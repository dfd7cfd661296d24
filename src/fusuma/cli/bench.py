"""`fusuma bench ...`: benchmarks that write result files."""

from __future__ import annotations

from pathlib import Path

import click

from fusuma.bench import boot
from fusuma.bench.meta import write_result
from fusuma.cli.common import Ctx, emit_json, pass_ctx, progress


@click.group()
def bench() -> None:
    """Run benchmarks; each writes a JSON result file with a `meta` block
    (git revision, date, host, accelerator) and metric names that carry units."""


@bench.command("boot")
@click.option("--vms", "n", type=click.IntRange(1, 64), default=1, show_default=True,
              help="VMs started together.")
@click.option("--runs", type=click.IntRange(1, 50), default=3, show_default=True,
              help="Repetitions; the summary is the median over all VMs and runs.")
@click.option("--memory", "memory_mib", type=int, default=256, show_default=True)
@click.option("--json", "json_file", type=click.Path(path_type=Path), default=None,
              help="Write the result file here (default: print it).")
@pass_ctx
def boot_cmd(c: Ctx, n: int, runs: int, memory_mib: int, json_file: Path | None) -> None:
    """Time from `vm start` to the guest agent answering, N VMs started together.

    Uses a scratch partition on the cores no partition holds, removed afterwards."""
    c.accel_notice("auto")
    data = boot.run(c.parts, c.vms, n, runs=runs, memory_mib=memory_mib, progress=progress)
    if json_file is None:
        emit_json(data)
    else:
        write_result(json_file, data)
        s = data["summary"]
        click.echo(f"boot to guest agent, {n} VM(s) x {runs} run(s): median "
                   f"{s['median_boot_ms']} ms (min {s['min_boot_ms']}, max "
                   f"{s['max_boot_ms']}); written to {json_file}")
