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
                   '"steps_ms", "bytes_sent", ...}; steps_ms: where the downtime went, '
                   'ms per step.')
@pass_ctx
def migrate(c: Ctx, vm: str, to: str, mode: str, as_json: bool) -> None:
    """Move VM to another partition's hypervisor on this host.

    A stopped VM just changes partition: its files and disks stay and it starts there
    next time (--mode does not apply). A running guest keeps running; its memory and
    disks are intact afterwards, and its disks now belong to the destination partition.
    If the move fails at any step the VM keeps running where it was. total_ms counts
    from the migrate command to the guest running at the destination; downtime_ms from
    the guest's stop at the source to that moment (both from QEMU's own event
    timestamps). steps_ms splits the downtime: the source QEMU sending the device state
    (source_saved), the destination QEMU loading it (dest_loaded), its supervisor seeing
    that (event), recording the decision (decision), handing the taps over (taps) and
    running the guest (cont)."""
    from fusuma.migration import migrate as do_migrate
    from fusuma.migration import move_stopped
    from fusuma.vm import VmView

    rec = c.db.vm(vm)
    if VmView(rec).state in ("stopped", "crashed"):
        move_stopped(c.parts, vm, to)
        if as_json:
            emit_json({"vm": vm, "from": rec.partition, "to": to, "mode": "stopped"})
        else:
            click.echo(f"{vm}: {rec.partition} -> {to} (stopped: it starts there)")
        return
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
@click.option("--via", default=None, help="Partition that holds the VMs meanwhile.")
@click.option("--in-place", "in_place", is_flag=True,
              help="No second partition: each VM moves to a new QEMU process in PARTITION "
                   "itself by QEMU's cpr-transfer (the new QEMU receives the guest RAM's "
                   "file descriptors over a UNIX socket; QEMU >= 10.0 on both sides).")
@click.option("--qemu", default=None,
              help="The QEMU the partition's VMs run on from now on: a version from "
                   "`fusuma qemu list` or the absolute path of a qemu-system-x86_64.")
@click.option("--pipeline/--serial", default=True, show_default=True,
              help="--pipeline: start each next VM's new QEMU while the VM before it "
                   "already runs on its new QEMU and its old one is being ended (never "
                   "during a VM's pause). --serial: each VM's move begins once the one "
                   "before is done (slower on a quiet host; steadier when other work "
                   "loads the partition's cores).")
@click.option("--json", "as_json", is_flag=True,
              help='Print {"partition", "via", "qemu", "supervisor_pid", "moves": [{"vm", '
                   '"from", "to", "method", "downtime_ms", "total_ms", ...}]}.')
@pass_ctx
def maintain(c: Ctx, partition: str, via: str | None, in_place: bool, qemu: str | None,
             pipeline: bool, as_json: bool) -> None:
    """Restart PARTITION's hypervisor instance with ~no downtime for its VMs.

    With --via: moves every running VM of PARTITION to --via (zero-copy where the VM has
    shared RAM), restarts PARTITION's supervisor (with --qemu: a different QEMU for its
    VMs), and moves them back onto new QEMU processes. With --in-place: each running VM
    moves to a new QEMU process in PARTITION by cpr-transfer (with --qemu: on that
    QEMU); the old QEMU quits. Prints each move's downtime and method."""
    from fusuma.errors import SpecError
    from fusuma.migration.maintain import maintain as do_maintain
    from fusuma.migration.maintain import maintain_in_place

    if (via is None) == (not in_place):
        raise SpecError("give either --via PARTITION (move the VMs out and back) or "
                        "--in-place (cpr-transfer, QEMU >= 10.0), not both or neither.")
    if in_place:
        res = maintain_in_place(c.parts, partition, qemu, progress=progress,
                                ahead=pipeline)
    else:
        assert via is not None
        res = do_maintain(c.parts, partition, via, qemu, progress=progress, ahead=pipeline)
    if as_json:
        emit_json({"partition": res.partition, "via": res.via, "in_place": in_place,
                   "qemu": res.qemu, "supervisor_pid": res.supervisor_pid,
                   "moves": [m.as_json() for m in res.moves]})
        return
    for m in res.moves:
        down = f"{m.downtime_ms:.1f} ms" if m.downtime_ms is not None else "unknown"
        where = f"{m.source}, new QEMU pid {m.dest_pid}" if in_place \
            else f"{m.source} -> {m.to}"
        click.echo(f"{m.vm}: {where} ({m.mode}) downtime {down}, total "
                   f"{m.total_ms:.1f} ms")
    if in_place:
        click.echo(f"partition {partition}: {len(res.moves)} VM(s) on new QEMU processes"
                   + (f", QEMU {qemu}" if qemu else ""))
    else:
        click.echo(f"partition {partition}: new supervisor pid {res.supervisor_pid}"
                   + (f", QEMU {qemu}" if qemu else ""))
