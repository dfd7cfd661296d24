"""`fusuma governor ...`: what each partition's governor is doing, and why."""

from __future__ import annotations

import time
from typing import Any

import click

from fusuma.cli.common import Ctx, emit_json, pass_ctx, table
from fusuma.views.governor import status_data


@click.group()
def governor() -> None:
    """The CPU and memory governors that run in every partition supervisor.

    Once a second the CPU governor measures each VM's CPU use and run delay; when a
    guaranteed VM's vCPUs wait for a CPU it raises the VM's weight, gives its vCPUs a
    spare core of their own, or caps burstable VMs (never below their floor), and undoes
    the caps once the pressure is gone.

    Every two seconds the memory governor compares the host's free memory with its
    target; when the host is short it takes memory back from burstable VMs only
    (`vm create --memory-class burstable --memory-min`), cheapest first: it asks their
    guests to hand free pages back, lowers their balloons (never below their floors),
    then has their guest agents drop caches; it gives the memory back when the host is
    roomy again. A guaranteed VM is never touched."""


def _fmt(x: Any, digits: int = 1) -> str:
    return "-" if x is None else f"{x:.{digits}f}"


def _text(st: dict[str, Any]) -> str:
    th = st["thresholds"]
    lines = [f"partition {st['partition']}: cores {st['cores']}, every {st['interval_s']:g} s, "
             f"{st['ticks']} tick(s), short when a guaranteed vCPU waits > "
             f"{th['wait_high_pct']:g}%"
             + (f"; {st['errors']} error(s), last: {st['last_error']}" if st["errors"] else "")]
    rows = []
    for v in st["vms"]:
        load = v.get("load") or {}
        rows.append([v["name"], str(v.get("qos", "-")), str(v.get("weight", "-")),
                     _fmt(v.get("cap_cpus"), 2),
                     ",".join(map(str, v.get("dedicated_cores") or [])) or "-",
                     _fmt(load.get("cpu_pct")), _fmt(load.get("wait_pct")),
                     "yes" if v.get("short") else "no"])
    if rows:
        lines.append(table(rows, ["vm", "qos", "weight", "cap_cpus", "own_cores", "cpu%",
                                  "wait%", "short"]))
    mem = st.get("memory")
    if mem:
        lines.append("")
        lines.append(f"memory: host free {_fmt(mem.get('host_free_mib'), 0)} MiB, target "
                     f"{mem['target_free_mib']:g} MiB, memory pressure "
                     f"{_fmt(mem.get('host_psi_pct'))}%, every {mem['interval_s']:g} s, "
                     f"{mem['ticks']} tick(s)"
                     + (f"; {mem['errors']} error(s), last: {mem['last_error']}"
                        if mem["errors"] else ""))
        mrows = [[v["name"], str(v.get("class") or "-"), str(v.get("floor_mib") or "-"),
                  str(v.get("ram_mib") or "-"), str(v["balloon_mib"]),
                  str(v.get("balloon_actual_mib") or "-"),
                  _fmt(v.get("resident_mib"))] for v in mem["vms"]]
        if mrows:
            lines.append(table(mrows, ["vm", "mem_class", "floor_mib", "ram_mib",
                                       "balloon_mib", "balloon_now_mib",
                                       "resident_mib"]))
    decisions = sorted([*st["decisions"], *(mem or {}).get("decisions", [])],
                       key=lambda d: d["at"])
    lines.append("")
    if not decisions:
        lines.append("no decisions yet")
    for d in decisions:
        nums = ", ".join(f"{k} {v}" for k, v in d["numbers"].items() if v is not None)
        stamp = time.strftime("%H:%M:%S", time.localtime(d["at"]))
        lines.append(f"{stamp}  {d['vm']:<16} {d['action']:<13} {d['reason']}"
                     + (f"  [{nums}]" if nums else ""))
    return "\n".join(lines)


@governor.command("status")
@click.argument("partition", required=False)
@click.option("--limit", type=click.IntRange(0, 256), default=20, show_default=True,
              help="Recent decisions to show per partition.")
@click.option("--json", "as_json", is_flag=True)
@pass_ctx
def status(c: Ctx, partition: str | None, limit: int, as_json: bool) -> None:
    """Each VM's class and controls, and the governor's recent decisions with the
    reason and the measured numbers (of PARTITION, or of every partition)."""
    out = status_data(c, partition, limit)["partitions"]
    if as_json:
        emit_json({"partitions": out})
        return
    if not out:
        click.echo("no partitions")
    click.echo("\n\n".join(_text(st) for st in out))
