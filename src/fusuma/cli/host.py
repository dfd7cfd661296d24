"""`fusuma up`, `fusuma down`, `fusuma ps`: the whole host at once."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

import click

from fusuma.cli.common import Ctx, emit_json, pass_ctx, progress, table
from fusuma.views.host import ps_data

if TYPE_CHECKING:
    from fusuma.spec import HostSpec


@click.command()
@click.argument("spec", required=False, type=click.Path(path_type=Path))
@click.option("--accel", type=click.Choice(["auto", "kvm", "tcg"]), default=None,
              help="Override every VM's accelerator (default: the spec's, else auto).")
@click.option("--wait/--no-wait", default=True, show_default=True,
              help="Wait until each started VM's guest agent answers.")
@click.option("--timeout", type=float, default=120.0, show_default=True,
              help="Seconds to wait for each guest agent.")
@click.option("--print-default", is_flag=True,
              help="Print the built-in spec for this host as TOML and exit.")
@click.option("--json", "as_json", is_flag=True, help="Print what was done as JSON.")
@pass_ctx
def up(c: Ctx, spec: Path | None, accel: str | None, wait: bool, timeout: float,
       print_default: bool, as_json: bool) -> None:
    """Make the host match SPEC (a TOML file); without SPEC, a built-in default.

    The default splits this host's cores into two partitions and runs one small VM
    (1 vCPU, 256 MiB, the built-in guest image) in each. Objects that already match are
    left alone, so running `up` twice changes nothing. If any step fails, every step
    already taken is undone.

    \b
    Spec format (every key: the manual's host spec reference, at /manual/ of
    `fusuma serve`; also [[storage]] and [[network]]):
      [[partition]]  name, cpus ("0-1" or [0,1]), memory_mib, io_weight?, qemu?
      [[disk]]       name, path, partition, size_mib?
      [[vm]]         name, partition, vcpus=1, memory_mib=256, image="minimal",
                     disks=[], accel="auto", autostart=true
    """
    from fusuma import apply
    from fusuma.spec import default_spec, dump_spec, load_spec

    if print_default:
        click.echo(dump_spec(default_spec(c.parts.host)))
        return
    if spec is None:
        host_spec: HostSpec = default_spec(c.parts.host)
        source = "<built-in default>"
    else:
        host_spec = load_spec(spec)
        source = str(spec)
    if accel is not None:
        host_spec = host_spec.model_copy(update={"vm": [
            v.model_copy(update={"accel": accel}) for v in host_spec.vm]})
    for v in host_spec.vm:
        c.accel_notice(v.accel)
    from fusuma.spec import smt_warnings

    for line in smt_warnings(host_spec, c.parts.host):
        click.echo(f"fusuma: warning: {line}", err=True)
    done = apply.up(c.db, c.parts, c.vms, host_spec, source, progress=progress,
                    wait_agent=timeout if wait else 0.0)
    if as_json:
        emit_json({"actions": done.describe()})
    elif done.empty():
        click.echo("nothing to do: the host already matches the spec")
    else:
        for line in done.describe():
            click.echo(line)


@click.command()
@click.option("--json", "as_json", is_flag=True, help="Print what was removed as JSON.")
@pass_ctx
def down(c: Ctx, as_json: bool) -> None:
    """Remove every VM, disk and partition of this host (this FUSUMA_HOME).

    Running VMs are killed. Disk files that fusuma created from a spec's size_mib are
    deleted; disk files you brought are left in place. Networks go too: every bridge,
    tap, nftables table and dnsmasq fusuma made, and nothing else (a bridged network's
    parent bridge is the host's and stays)."""
    from fusuma import apply

    done = apply.down(c.db, c.parts, c.vms, progress=progress)
    if as_json:
        emit_json({"actions": done})
    else:
        click.echo("\n".join(done) if done else "nothing to do")


@click.command()
@click.option("--json", "as_json", is_flag=True,
              help='Print {"partitions": [...], "vms": [...]} as JSON.')
@click.option("--wide", is_flag=True,
              help="Show the memory governance columns even when nothing is overcommitted.")
@pass_ctx
def ps(c: Ctx, as_json: bool, wide: bool) -> None:
    """Show partitions and VMs with their state.

    A partition is `running` while its supervisor answers, `supervisor-down` after the
    supervisor died (its VMs keep running; `fusuma partition restart` re-adopts them).
    A VM is `crashed` when its QEMU ended without being asked to. pss_mib is the host
    memory of the VM's QEMU from /proc/PID/smaps_rollup (shared pages split among the
    processes that map them); it follows the process, unlike cgroup charges, which
    stay with the cgroup that first touched a page (e.g. after a zero-copy migration).
    seg_mib is the VM's share (PSS) of its segments, ksm_mib its pages merged by KSM;
    --json adds the anon/file/shmem split. `fusuma share report` has host totals.
    qemu is the version of the QEMU a partition names and of the one running each VM
    (they differ while a VM still runs on its old QEMU; see `fusuma qemu list`).

    The memory governance columns appear when a partition overcommits memory or a VM
    is burstable (and always with --wide): a partition's overcommit; mem_class, a VM's
    memory class (burstable with its floor); admitted_mib the guest RAM admitted for it
    (a burstable VM's floor plus its RAM above that divided by its partition's
    overcommit), resident_mib what its RAM holds on the host now and reclaim_mib how
    much of that lies above a burstable VM's floor (0 for a guaranteed VM); a
    partition's are its VMs' sums. --json always has them."""
    data = ps_data(c)
    if as_json:
        emit_json(data)
        return
    from fusuma.host.topology import format_cpulist

    governed = wide or _governed(data)
    prow = [[p["name"], format_cpulist(p["cpus"]), str(p["memory_mib"]),
             str(p["supervisor_pid"] or "-"), p["state"],
             p["qemu_version"] or p["qemu"] or "-", p.get("cores_held_by") or "-",
             *([f"{p['memory_overcommit']:g}", *_admission_cells(p.get("memory_admission"))]
               if governed else [])]
            for p in data["partitions"]]
    click.echo(table(prow, ["partition", "cpus", "memory_mib", "supervisor", "state",
                            "qemu", "cores_held_by",
                            *(PARTITION_MEMORY_HEADS if governed else [])]))
    click.echo()
    vrow = [[v["name"], v["partition"], v["state"], str(v["pid"] or "-"), v["accel"],
             v["qemu"] or "-", str(v["vcpus"]), str(v["memory_mib"]),
             *_mem_cells(v["host_memory"]),
             *([_mem_class(v.get("memory")), *_admission_cells(v.get("memory"))]
               if governed else []),
             _note(v)] for v in data["vms"]]
    click.echo(table(vrow, ["vm", "partition", "state", "pid", "accel", "qemu", "vcpus",
                            "memory_mib", "pss_mib", "seg_mib", "ksm_mib",
                            *(VM_MEMORY_HEADS if governed else []), "note"]))
    _nets(data)


# The memory governance columns of partitions and of VMs.
PARTITION_MEMORY_HEADS = ["overcommit", "admitted_mib", "resident_mib", "reclaim_mib"]
VM_MEMORY_HEADS = ["mem_class", "admitted_mib", "resident_mib", "reclaim_mib"]


def _governed(data: dict[str, Any]) -> bool:
    """Whether any memory is governed: a partition overcommits or a VM is burstable."""
    return any(p["memory_overcommit"] != 1 for p in data["partitions"]) or any(
        (v.get("memory") or {}).get("class") == "burstable" for v in data["vms"])


def _nets(data: dict[str, Any]) -> None:
    """`ps`'s networks and NICs, when the host has any."""
    if not data.get("networks"):
        return
    from fusuma.cli.network import network_row, tap_cell

    click.echo()
    click.echo(table([network_row(d) for d in data["networks"]],
                     ["network", "type", "bridge", "subnet", "options", "mtu", "vms", "state"]))
    nrow = [[v["name"], str(n["index"]), n["network"], n["mac"], n["ip"] or "-",
             tap_cell(n)] for v in data["vms"] for n in v.get("nics", [])]
    if nrow:
        click.echo()
        click.echo(table(nrow, ["vm", "nic", "network", "mac", "address", "tap"]))


def _note(v: dict[str, Any]) -> str:
    job = v.get("job")
    if job:
        what = f"moving to {job['peer']}" if job["kind"] == "migrate" else job["kind"]
        who = f"pid {job['owner_pid']}" if job["owner_alive"] else \
            f"pid {job['owner_pid']} died, recovering"
        return f"{what} ({job['phase']}, {who})"
    return str(v["error"] or "")


def _mem_class(m: dict[str, Any] | None) -> str:
    if not m:
        return "-"
    return f"burstable>={m['floor_mib']}" if m["class"] == "burstable" else m["class"]


def _admission_cells(m: dict[str, Any] | None) -> list[str]:
    """Admitted, resident and reclaimable MiB (fusuma.capacity), "-" where unknown."""
    if not m:
        return ["-", "-", "-"]
    return [str(m["admitted_mib"]),
            *("-" if m.get(k) is None else f"{m[k]:g}"
              for k in ("resident_mib", "reclaimable_mib"))]


def _mem_cells(mem: dict[str, Any] | None) -> list[str]:
    if not mem:
        return ["-", "-", "-"]
    ksm = mem.get("ksm_merged_mib")
    return [str(mem["pss_mib"]), str(mem["segments_pss_mib"]) if mem["segments"] else "-",
            "-" if ksm is None else str(ksm)]
