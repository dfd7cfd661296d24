"""`fusuma vm snapshot ...`."""

from __future__ import annotations

import click

from fusuma.cli.common import Ctx, emit_json, pass_ctx, table


@click.group()
def snapshot() -> None:
    """Snapshots of a VM's disks, and with --memory of its RAM and device state.

    \b
    A snapshot is kept inside the VM's own qcow2 disk (an internal snapshot of its thin
    disk), so it costs only the blocks that change after it, and it stays with the VM
    through every move on this host (zero-copy, copy, `maintain --via`, `--in-place`).
    Only VMs of imported images (`fusuma image import`, booted by firmware) can have
    snapshots: fusuma's own images and registered disks (`fusuma disk`) are raw files,
    which cannot hold one, and a VM with a raw disk attached is refused. The cloud-init
    seed is read-only; a UEFI VM's NVRAM file is not part of a snapshot.

    \b
    Examples:
      fusuma vm snapshot create db0 before-upgrade
      fusuma vm snapshot create db0 warm --memory
      fusuma vm snapshot list db0
      fusuma vm snapshot restore db0 before-upgrade
      fusuma vm snapshot delete db0 before-upgrade"""


@snapshot.command("create")
@click.argument("vm")
@click.argument("name")
@click.option("--memory", is_flag=True,
              help="The RAM and device state too (QEMU's snapshot-save): a restore brings "
                   "the VM back running where it was. Only a running VM; the guest is "
                   "paused while its RAM is written into its disk (seconds per GiB), and "
                   "the disk grows by the RAM's size.")
@click.option("--json", "as_json", is_flag=True, help="Print the snapshot as JSON.")
@pass_ctx
def create(c: Ctx, vm: str, name: str, memory: bool, as_json: bool) -> None:
    """Take snapshot NAME of VM VM, running or stopped.

    \b
    Running, disks only: when the guest runs QEMU's guest agent, its filesystems are
    frozen (guest-fsfreeze) for the instant QEMU snapshots its disks, then thawed
    whatever happens, so the snapshot holds clean filesystems; without an agent it holds
    what a power cut would leave (the journal replays at the next boot). All the disks
    are snapshotted in one QEMU transaction. Stopped: qemu-img snapshots the disk.

    A snapshot that did not finish (fusuma or QEMU killed meanwhile) is never listed:
    the next supervisor removes what it left."""
    from fusuma.vm import snapshots

    res = snapshots.create(c.vms, vm, name, memory)
    if as_json:
        emit_json(res)
        return
    what = "disks and memory" if res["memory"] else "disks"
    frozen = ", filesystems frozen" if res["frozen"] else ""
    click.echo(f"vm {vm}: snapshot {name} of its {what} taken in {res['seconds']:.2f} s"
               f"{frozen}")


@snapshot.command("list")
@click.argument("vm")
@click.option("--json", "as_json", is_flag=True, help="Print the snapshots as JSON.")
@pass_ctx
def list_(c: Ctx, vm: str, as_json: bool) -> None:
    """List VM VM's snapshots, oldest first: when each was taken, whether it holds the
    memory, whether the VM ran and its filesystems were frozen, and its disks."""
    from fusuma.vm import snapshots

    rows = snapshots.list_(c.db, vm)
    if as_json:
        emit_json(rows)
        return
    click.echo(table([[r["name"], r["created"], "yes" if r["memory"] else "no",
                       "running" if r["running"] else "stopped",
                       "yes" if r["frozen"] else "no", ", ".join(r["disks"])]
                      for r in rows],
                     ["name", "taken", "memory", "vm was", "frozen", "disks"]))


@snapshot.command("restore")
@click.argument("vm")
@click.argument("name")
@click.option("--json", "as_json", is_flag=True, help="Print the result as JSON.")
@pass_ctx
def restore(c: Ctx, vm: str, name: str, as_json: bool) -> None:
    """Bring VM VM back to snapshot NAME. Whatever the VM wrote since is lost; the
    snapshot stays (restore it again, or delete it).

    \b
    A snapshot with memory: the VM runs on from the moment it was taken (its QEMU
    loads the RAM, the device state and the disks; a stopped VM is started for it).
    A snapshot of the disks only, as Proxmox's rollback: a running VM is stopped (its
    filesystems flushed first), its disks are reverted, and it is started again, a fresh
    boot from the snapshot's disks; a stopped VM stays stopped."""
    from dataclasses import asdict

    from fusuma.vm import snapshots

    res = snapshots.restore(c.vms, vm, name)
    if as_json:
        emit_json(asdict(res))
        return
    click.echo(f"vm {vm}: restored to snapshot {name} in {res.seconds:.2f} s, {res.state}")


@snapshot.command("delete")
@click.argument("vm")
@click.argument("name")
@click.option("--json", "as_json", is_flag=True, help="Print the result as JSON.")
@pass_ctx
def delete(c: Ctx, vm: str, name: str, as_json: bool) -> None:
    """Delete snapshot NAME of VM VM (running or stopped); the disk space only it held
    is freed inside the disk file."""
    from dataclasses import asdict

    from fusuma.vm import snapshots

    res = snapshots.delete(c.vms, vm, name)
    if as_json:
        emit_json(asdict(res))
        return
    click.echo(f"vm {vm}: snapshot {name} deleted")
