"""`fusuma disk ...`: disks belong to one partition, as a Mint node owns its devices."""

from __future__ import annotations

import click

from fusuma.cli.common import Ctx, emit_json, pass_ctx, table
from fusuma.views.disks import disks_data


@click.group()
def disk() -> None:
    """Register disk files in storage directories to partitions, and move them.

    A disk is a raw image file inside a storage directory (`fusuma storage list`;
    FUSUMA_HOME/disks always is one), never a symlink or a device; its device and inode
    are recorded, and a VM's start refuses a file swapped since. A disk belongs to
    exactly one partition; only that partition's VMs can use it. It can be handed to
    another partition while no VM has it attached."""


@disk.command("add")
@click.argument("name")
@click.argument("path", required=False)
@click.option("--partition", "-p", required=True)
@click.option("--size-mib", type=int, default=None,
              help="Create PATH as a sparse raw file of this size if it does not exist.")
@pass_ctx
def add(c: Ctx, name: str, path: str | None, partition: str, size_mib: int | None) -> None:
    """Give disk NAME at PATH (default: NAME.img in FUSUMA_HOME/disks) to a partition.

    PATH must lie in a storage directory (`fusuma storage list`)."""
    from fusuma.host.storage import default_dir
    from fusuma.names import check_name
    from fusuma.spec import DiskSpec, build

    if path is None:
        path = str(default_dir(c.paths) / f"{check_name('disk', name)}.img")
    rec = c.parts.add_disk(build(DiskSpec, "disk", name=name, path=path,
                                 partition=partition, size_mib=size_mib))
    click.echo(f"disk {rec.name}: {rec.path} in partition {rec.partition}")


@disk.command("move")
@click.argument("name")
@click.option("--to", "to", required=True, help="The partition that gets the disk.")
@pass_ctx
def move(c: Ctx, name: str, to: str) -> None:
    """Hand disk NAME to another partition (refused while a VM has it attached)."""
    rec = c.parts.move_disk(name, to)
    click.echo(f"disk {rec.name}: now in partition {rec.partition}")


@disk.command("resize")
@click.argument("name")
@click.option("--size", required=True, metavar="SIZE",
              help="The new size, e.g. 16G: larger than now (a disk only grows).")
@click.option("--json", "as_json", is_flag=True)
@pass_ctx
def resize(c: Ctx, name: str, size: str, as_json: bool) -> None:
    """Grow disk NAME: online when its VM runs (QMP block_resize; the guest sees the new
    size at once), else its file. A VM's own thin disk: `fusuma vm resize`."""
    from dataclasses import asdict

    res = c.vms.resize_registered(name, size)
    if as_json:
        emit_json(asdict(res))
    else:
        click.echo(f"disk {name}: {res.old_size} -> {res.size} bytes"
                   + (f" (VM {res.vm})" if res.vm else ""))


@disk.command("remove")
@click.argument("name")
@click.option("--delete-file", is_flag=True,
              help="Also delete the image file: only one fusuma created (--size-mib), and "
                   "only while it is still that file.")
@pass_ctx
def remove(c: Ctx, name: str, delete_file: bool) -> None:
    """Unregister disk NAME (the file stays unless --delete-file)."""
    c.parts.remove_disk(name, delete_file=delete_file)
    click.echo(f"removed disk {name}")


@disk.command("list")
@click.option("--json", "as_json", is_flag=True)
@pass_ctx
def list_(c: Ctx, as_json: bool) -> None:
    """List disks and the partition each belongs to."""
    rows = disks_data(c)
    if as_json:
        emit_json(rows)
        return
    click.echo(table([[str(r["name"]), str(r["path"]), str(r["partition"]), r["vm"] or "-"]
                      for r in rows],
                     ["name", "path", "partition", "vm"]))
