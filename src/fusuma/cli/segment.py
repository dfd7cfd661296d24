"""`fusuma segment ...`: shared read-only segments (DCSS)."""

from __future__ import annotations

from pathlib import Path

import click

from fusuma.cli.common import Ctx, emit_json, pass_ctx, progress, table
from fusuma.ops import segments
from fusuma.ops.segments import segment_manager
from fusuma.views.segments import segment_json, segments_data


@click.group()
def segment() -> None:
    """Shared segments: read-only memory shared by many VMs (z/VM's DCSS).

    A segment is an erofs image in one host file, given to each VM that lists it as a
    read-only virtio-pmem device and mounted in the guest with DAX: guests run
    binaries and read files in place from the host's single copy, with no page cache of
    their own. `fusuma ps --json` and `fusuma share report` show each VM's share.
    Segments are named shared files, so VMs using them still migrate zero-copy.

    \b
    Examples:
      fusuma segment create tools --from /opt/tools
      fusuma segment create debian-root --from-image debian
      fusuma vm create web0 -p p0 --image debian --segment debian-root:/"""


@segment.command("create")
@click.argument("name")
@click.option("--from", "from_dir", type=click.Path(path_type=Path), metavar="DIR",
              help="Directory tree to put in the segment.")
@click.option("--from-image", metavar="KIND",
              help="Take the root filesystem of a built guest image (debian), for "
                   "VMs of that image to mount at / (NAME:/): the DCSS layout, all "
                   "files shared, changes to them private to each VM.")
@click.option("--json", "as_json", is_flag=True)
@pass_ctx
def create(c: Ctx, name: str, from_dir: Path | None, from_image: str | None,
           as_json: bool) -> None:
    """Build segment NAME from a directory or an image's root filesystem."""
    rec = segments.create(c, name, from_dir=from_dir, from_image=from_image,
                          progress=progress)
    if as_json:
        emit_json(segment_json(c, rec))
    else:
        click.echo(f"segment {rec.name}: {rec.size_bytes / 2**20:.0f} MiB, {rec.path}")


@segment.command("list")
@click.option("--json", "as_json", is_flag=True)
@pass_ctx
def list_(c: Ctx, as_json: bool) -> None:
    """List segments with their size and the VMs that attach them."""
    rows = segments_data(c)
    if as_json:
        emit_json(rows)
        return
    click.echo(table([[r["name"], f"{r['size_mib']:.0f}", ",".join(r["used_by"]) or "-",
                       r["source"]] for r in rows],
                     ["segment", "size_mib", "used_by", "source"]))


@segment.command("delete")
@click.argument("name")
@pass_ctx
def delete(c: Ctx, name: str) -> None:
    """Delete segment NAME (refused while a VM definition attaches it)."""
    segment_manager(c).delete(name)
    click.echo(f"segment {name} deleted")
