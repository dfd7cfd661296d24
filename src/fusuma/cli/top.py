"""`fusuma top`: each running VM's CPU use, run delay and wait, refreshed every second.

The numbers come from /proc (schedstat of every QEMU thread) and the VM's leaf cgroup,
read by this command itself, so they show even while a supervisor is down; what the
governor is doing to each VM is asked of the partition supervisors (best effort).
"""

from __future__ import annotations

import json
import sys
import time
from typing import Any

import click

from fusuma.cli.common import Ctx, emit_json, pass_ctx, table
from fusuma.errors import FusumaError
from fusuma.frozen import frozen
from fusuma.governor import measure
from fusuma.vm.view import VmView


@frozen
class Target:
    name: str
    partition: str
    qos: str
    pid: int


def _targets(c: Ctx) -> list[Target]:
    out = []
    for rec in c.db.vms():
        if rec.pid is not None and VmView(rec).state in ("running", "migrating"):
            out.append(Target(rec.name, rec.partition, rec.qos, rec.pid))
    return out


def _reading(c: Ctx, t: Target) -> measure.Reading:
    from fusuma.names import vm_leaf

    try:
        stat = c.parts.cg.cpu_stat(t.partition, vm_leaf(t.name))
    except FusumaError:
        stat = None
    return measure.read(t.pid, stat)


def _governor(c: Ctx, partitions: set[str]) -> dict[str, dict[str, Any]]:
    """VM name -> the governor's control of it, from every reachable supervisor."""
    from fusuma.supervisor import rpc

    out: dict[str, dict[str, Any]] = {}
    for p in sorted(partitions):
        try:
            st = c.parts.client(p).send(rpc.GovernorStatus(limit=0), timeout=2.0).status
        except FusumaError:
            continue
        for vm in st.get("vms", []):
            out[str(vm["name"])] = vm
    return out


def _state(ctl: dict[str, Any] | None) -> str:
    if ctl is None:
        return "-"
    parts = []
    if ctl.get("short"):
        parts.append("SHORT")
    if ctl.get("dedicated_cores"):
        parts.append("own core " + ",".join(map(str, ctl["dedicated_cores"])))
    if ctl.get("cap_cpus") is not None:
        parts.append(f"capped {ctl['cap_cpus']:.2f} CPU")
    if ctl.get("qos") == "guaranteed" and ctl.get("weight", 0) > 1000:
        parts.append(f"weight {ctl['weight']}")
    return ", ".join(parts) or "-"


def sample(c: Ctx, interval: float, prev: dict[str, measure.Reading] | None = None,
           ) -> tuple[dict[str, Any], dict[str, measure.Reading]]:
    """One refresh: readings now against ``prev`` (or against readings taken
    ``interval`` seconds ago when there are none)."""
    targets = _targets(c)
    if prev is None:
        prev = {t.name: _reading(c, t) for t in targets}
        time.sleep(interval)
    cur = {t.name: _reading(c, t) for t in targets}
    gov = _governor(c, {t.partition for t in targets})
    rows = []
    for t in targets:
        before = prev.get(t.name)
        load = measure.load(before, cur[t.name]) if before is not None else None
        rows.append({"name": t.name, "partition": t.partition, "qos": t.qos, "pid": t.pid,
                     **(load.as_json() if load else {"interval_s": None}),
                     "governor": gov.get(t.name)})
    host = measure.host_pressure()
    return {"time": round(time.time(), 3), "vms": rows,
            "host_pressure_some_total_us": host}, cur


def _fmt(x: Any, digits: int = 1) -> str:
    return "-" if x is None else f"{x:.{digits}f}"


def render(data: dict[str, Any]) -> str:
    rows = [[v["name"], v["partition"], v["qos"], _fmt(v.get("cpu_pct")),
             _fmt(v.get("vcpu_pct")), _fmt(v.get("wait_pct")),
             _fmt(v.get("other_cpu_pct")), _fmt(v.get("other_wait_pct")),
             _fmt(v.get("run_delay_ms"), 2), _fmt(v.get("throttled_ms"), 0),
             _state(v.get("governor"))]
            for v in data["vms"]]
    if not rows:
        return "no running VMs"
    return table(rows, ["vm", "partition", "qos", "cpu%", "vcpu%", "wait%", "emu%",
                        "emu_wait%", "delay_ms", "throttled_ms", "governor"])


@click.command("top")
@click.option("--once", is_flag=True, help="Measure one interval, print it and exit.")
@click.option("--json", "as_json", is_flag=True,
              help="JSON: one document with --once, else one line per refresh.")
@click.option("--interval", type=click.FloatRange(0.2, 60), default=1.0, show_default=True,
              help="Seconds between refreshes.")
@pass_ctx
def top(c: Ctx, once: bool, as_json: bool, interval: float) -> None:
    """Each running VM's CPU use and wait for a CPU, refreshed every second.

    \b
    cpu%       CPU time of all the VM's QEMU threads (100 = one core)
    vcpu%      CPU time of its vCPU threads, per vCPU
    wait%      time its vCPUs were runnable but waited for a CPU (run delay), per vCPU
    emu%       CPU time of QEMU's other threads (emulator: main loop, I/O, workers),
               summed (under TCG the main loop delivers the guest's timers and devices)
    emu_wait%  their run delay, summed: what an isolated emulator core takes away
    delay_ms   mean wait per time slice, all QEMU threads
    throttled  time its cgroup was held back by a quota (the governor's caps)
    governor   what the partition's governor is doing to it"""
    data, prev = sample(c, interval)
    if once:
        if as_json:
            emit_json(data)
        else:
            click.echo(render(data))
        return
    tty = sys.stdout.isatty() and not as_json
    try:
        while True:
            if as_json:
                click.echo(json.dumps(data))
            elif tty:
                click.echo("\x1b[H\x1b[2J" + time.strftime("%H:%M:%S ") + "fusuma top "
                           "(Ctrl-C quits)\n\n" + render(data))
            else:
                click.echo(render(data) + "\n")
            time.sleep(interval)
            data, prev = sample(c, interval, prev)
    except KeyboardInterrupt:
        return
