"""`fusuma partition ...`."""

from __future__ import annotations

import click

from fusuma.capacity import check_overcommit
from fusuma.cli.common import Ctx, cpus_option, emit_json, pass_ctx, table
from fusuma.host.topology import format_cpulist, parse_cpulist
from fusuma.views.host import partitions_data

OVERCOMMIT_HELP = ("Memory overcommit, 1.0 (none) to 16: each burstable VM's guest RAM "
                   "above its floor is admitted divided by this (`vm create --memory-class "
                   "burstable --memory-min`); guaranteed VMs are always admitted whole.")


@click.group()
def partition() -> None:
    """Create, resize, restart and delete partitions.

    A partition owns whole cores (no two partitions share one), a memory limit and
    disks, and runs its own supervisor process: the hypervisor instance that starts and
    watches its VMs. Killing or restarting one partition's supervisor never touches
    another partition, nor its own running VMs."""


@partition.command("create")
@click.argument("name")
@click.option("--cpus", required=True, help='Cores, e.g. "0", "0-3" or "0,2".')
@click.option("--memory", "memory_mib", type=int, required=True,
              help="Memory budget in MiB for what runs in the partition beyond guest RAM: "
                   "its supervisor (64) and its VMs' QEMUs (and the RAM of VMs with private "
                   "RAM). Guest RAM in a shared file is admitted host-wide and charged to a "
                   "memory cgroup of its own, so a zero-copy move needs room here only for "
                   "the new QEMU.")
@click.option("--io-weight", type=click.IntRange(1, 10000), default=None,
              help="Block I/O weight 1-10000 (best effort; needs the io/bfq controller).")
@click.option("--qemu", default=None,
              help="This partition's QEMU (its hypervisor version): a version from "
                   "`fusuma qemu list` such as 10.0, or the absolute path of a "
                   "qemu-system-x86_64. Default: the system's.")
@click.option("--smt", type=click.Choice(["cores", "threads"]), default="cores",
              show_default=True,
              help="On a host with SMT: cores hands out whole physical cores (the CPUs "
                   "given plus their sibling threads); threads takes exactly the CPUs "
                   "given, with a warning when another partition holds a sibling.")
@click.option("--memory-overcommit", type=float, default=None, metavar="RATIO",
              help=OVERCOMMIT_HELP + " Default: the host's (`[host] memory_overcommit` of "
                   "the spec, 1.0 unless set).")
@click.option("--json", "as_json", is_flag=True, help="Print the new partition as JSON.")
@pass_ctx
def create(c: Ctx, name: str, cpus: str, memory_mib: int, io_weight: int | None,
           qemu: str | None, smt: str, memory_overcommit: float | None,
           as_json: bool) -> None:
    """Create partition NAME and start its supervisor."""
    from fusuma.spec import PartitionSpec, build

    if memory_overcommit is not None:
        check_overcommit(memory_overcommit, f"partition {name!r}")
    spec = build(PartitionSpec, "partition", name=name, cpus=parse_cpulist(cpus),
                 memory_mib=memory_mib, io_weight=io_weight, qemu=qemu, smt=smt,
                 memory_overcommit=memory_overcommit)
    rec = c.parts.create(spec)
    if as_json:
        emit_json({"name": rec.name, "cpus": rec.cpus, "memory_mib": rec.memory_mib,
                   "memory_overcommit": rec.memory_overcommit,
                   "supervisor_pid": rec.supervisor_pid})
    else:
        click.echo(f"partition {rec.name}: cores {format_cpulist(rec.cpus)}, "
                   f"{rec.memory_mib} MiB, supervisor pid {rec.supervisor_pid}")


@partition.command("resize")
@click.argument("name")
@click.option("--cpus", default=None, help="New set of cores (replaces the old set).")
@click.option("--memory", "memory_mib", type=int, default=None, help="New memory limit, MiB.")
@click.option("--memory-overcommit", type=float, default=None, metavar="RATIO",
              help=OVERCOMMIT_HELP + " Lowering it is refused while the VMs already "
                   "admitted would not fit.")
@click.option("--json", "as_json", is_flag=True)
@pass_ctx
def resize(c: Ctx, name: str, cpus: str | None, memory_mib: int | None,
           memory_overcommit: float | None, as_json: bool) -> None:
    """Move cores and memory to or from running partition NAME.

    The vCPUs of its running VMs are pinned again to the new cores. To move a core
    from partition A to B, shrink A first, then grow B: fusuma refuses any layout in
    which two partitions would share a core."""
    if cpus is None and memory_mib is None and memory_overcommit is None:
        raise click.UsageError("give --cpus, --memory and/or --memory-overcommit.")
    rec = c.parts.resize(name, cpus_option(cpus), memory_mib, memory_overcommit)
    if as_json:
        emit_json({"name": rec.name, "cpus": rec.cpus, "memory_mib": rec.memory_mib,
                   "memory_overcommit": rec.memory_overcommit})
    else:
        oc = "" if rec.memory_overcommit is None else \
            f", memory overcommit {rec.memory_overcommit:g}"
        click.echo(f"partition {rec.name}: cores {format_cpulist(rec.cpus)}, "
                   f"{rec.memory_mib} MiB{oc}")


@partition.command("restart")
@click.argument("name")
@pass_ctx
def restart(c: Ctx, name: str) -> None:
    """Start a new supervisor for NAME; it re-adopts the running VMs.

    Use it after a supervisor died, or to pick up a new fusuma version. VMs keep
    running throughout."""
    pid = c.parts.restart(name)
    adopted = [v.name for v in c.db.vms(name) if v.state.value == "running"]
    click.echo(f"partition {name}: supervisor pid {pid}; running VMs: "
               f"{', '.join(adopted) or 'none'}")


@partition.command("delete")
@click.argument("name")
@click.option("--force", is_flag=True, help="Also kill and delete the partition's VMs.")
@pass_ctx
def delete(c: Ctx, name: str, force: bool) -> None:
    """Delete partition NAME: its supervisor, cgroup and disk registrations."""
    c.parts.delete(name, force=force)
    click.echo(f"deleted partition {name}")


@partition.command("list")
@click.option("--json", "as_json", is_flag=True)
@pass_ctx
def list_(c: Ctx, as_json: bool) -> None:
    """List partitions."""
    data = partitions_data(c)
    if as_json:
        emit_json(data)
        return
    click.echo(table([[p["name"], format_cpulist(p["cpus"]), str(p["memory_mib"]),
                       str(p["supervisor_pid"] or "-"), p["state"], ",".join(p["disks"])]
                      for p in data],
                     ["name", "cpus", "memory_mib", "supervisor", "state", "disks"]))
