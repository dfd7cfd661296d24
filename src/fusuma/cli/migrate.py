"""`fusuma migrate` and `fusuma maintain`."""

from __future__ import annotations

import click

from fusuma.cli.common import Ctx, emit_json, pass_ctx, progress


@click.command()
@click.argument("vm")
@click.option("--to", "to", required=True, help="Destination partition.")
@click.option("--mode", type=click.Choice(["zero-copy", "copy"]), default="zero-copy",
              show_default=True,
              help="zero-copy: the destination maps the VM's RAM file and only device "
                   "state is sent (needs shared RAM, the default); copy: ordinary "
                   "pre-copy live migration over a UNIX socket (under TCG with QEMU < "
                   "9.0 the guest is paused for the copy: live pre-copy there can lose "
                   "guest writes).")
@click.option("--json", "as_json", is_flag=True,
              help='Print {"vm", "from", "to", "mode", "total_ms", "downtime_ms", '
                   '"bytes_sent", ...}.')
@pass_ctx
def migrate(c: Ctx, vm: str, to: str, mode: str, as_json: bool) -> None:
    """Move running VM to another partition's hypervisor on this host.

    The guest keeps running; its memory and disks are intact afterwards, and its disks
    now belong to the destination partition. If the move fails at any step the VM keeps
    running where it was. total_ms counts from the migrate command to the guest running
    at the destination; downtime_ms from the guest's stop at the source to that moment
    (both from QEMU's own event timestamps)."""
    from fusuma.migration import migrate as do_migrate

    res = do_migrate(c.parts, vm, to, mode, progress=progress)
    if res.paused:
        click.echo("fusuma: notice: the guest was paused during the copy: live pre-copy "
                   "under TCG with QEMU < 9.0 can lose guest writes (fixed upstream in "
                   "QEMU 9.0); zero-copy is not affected", err=True)
    if as_json:
        emit_json(res.as_json())
    else:
        down = f"{res.downtime_ms:.1f} ms" if res.downtime_ms is not None else "unknown"
        click.echo(f"{vm}: {res.source} -> {res.to} ({mode}) in {res.total_ms:.1f} ms, "
                   f"downtime {down}, {res.bytes_sent} bytes sent")


@click.command()
@click.argument("partition")
@click.option("--via", required=True, help="Partition that holds the VMs meanwhile.")
@click.option("--qemu", default=None,
              help="Absolute path of a new QEMU binary for the partition's VMs.")
@click.option("--json", "as_json", is_flag=True)
@pass_ctx
def maintain(c: Ctx, partition: str, via: str, qemu: str | None, as_json: bool) -> None:
    """Restart PARTITION's hypervisor instance with ~no downtime for its VMs.

    Moves every running VM of PARTITION to --via (zero-copy where the VM has shared RAM),
    restarts PARTITION's supervisor (with --qemu: a different QEMU for its VMs), and
    moves them back onto new QEMU processes. Prints each move's downtime."""
    from fusuma.migration.maintain import maintain as do_maintain

    res = do_maintain(c.parts, partition, via, qemu, progress=progress)
    if as_json:
        emit_json({"partition": res.partition, "via": res.via, "qemu": res.qemu,
                   "supervisor_pid": res.supervisor_pid,
                   "moves": [m.as_json() for m in res.moves]})
        return
    for m in res.moves:
        down = f"{m.downtime_ms:.1f} ms" if m.downtime_ms is not None else "unknown"
        click.echo(f"{m.vm}: {m.source} -> {m.to} ({m.mode}) downtime {down}, total "
                   f"{m.total_ms:.1f} ms")
    click.echo(f"partition {partition}: new supervisor pid {res.supervisor_pid}"
               + (f", QEMU {qemu}" if qemu else ""))
