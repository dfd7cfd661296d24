"""`fusuma storage ...`: the directories that hold guests' disk files."""

from __future__ import annotations

import click

from fusuma.cli.common import Ctx, emit_json, pass_ctx, table


@click.group()
def storage() -> None:
    """Directories for disk files: disks are created or registered only inside them.

    FUSUMA_HOME/disks is always one. Only root declares more, here or with a spec's
    [[storage]]: the API's callers name disk files inside these directories and no
    other host file (a disk must be a regular file of its own, never a symlink or a
    device)."""


@storage.command("add")
@click.argument("directory")
@click.option("--shared", is_flag=True,
              help="Other hosts see the same files at the same path (NFS, a cluster "
                   "file system): VMs placed here (`vm create --storage DIR`) move "
                   "between hosts that declared it shared too without copying their "
                   "disks. Declare it so on each host.")
@pass_ctx
def add(c: Ctx, directory: str, shared: bool) -> None:
    """Declare DIRECTORY for disk files (created 0700 if missing)."""
    real = c.parts.add_storage(directory, shared)
    click.echo(f"{'shared ' if shared else ''}storage directory {real} declared")


@storage.command("remove")
@click.argument("directory")
@pass_ctx
def remove(c: Ctx, directory: str) -> None:
    """Undeclare DIRECTORY (refused while a disk lies in it); its files stay."""
    real = c.parts.remove_storage(directory)
    click.echo(f"storage directory {real} removed (its files stay)")


@storage.command("list")
@click.option("--json", "as_json", is_flag=True)
@pass_ctx
def list_(c: Ctx, as_json: bool) -> None:
    """List the storage directories and the disks in each."""
    from fusuma.views.disks import storage_data

    rows = storage_data(c)
    if as_json:
        emit_json(rows)
        return
    click.echo(table([[str(r["path"]), "yes" if r["default"] else "-",
                       "yes" if r["shared"] else "-",
                       ",".join(r["disks"]) or "-", ",".join(r["vms"]) or "-"]
                      for r in rows],
                     ["directory", "default", "shared", "disks", "vms"]))
