"""`fusuma vm backup` and `fusuma vm restore`: backups of a running VM's disks, and
new VMs made from them (fusuma.vm.backups)."""

from __future__ import annotations

import time
from typing import Any

import click

from fusuma.cli.common import Ctx, emit_json, pass_ctx


def _mib(n: int) -> str:
    return f"{n / 2**20:.1f} MiB"


@click.command("backup")
@click.argument("name")
@click.argument("dest")
@click.option("--incremental", is_flag=True,
              help="Add a point to backup DEST holding only what the guest wrote since "
                   "DEST's last point (QEMU's dirty bitmap of it). Without it, DEST must "
                   "not exist: a full backup starts a new chain there.")
@click.option("--max-bandwidth", "max_mib", type=click.IntRange(min=1), default=None,
              metavar="MIB/S", help="Copy at most this many MiB per second, so that the "
              "guest's own disk I/O keeps its share.  [default: no limit]")
@click.option("--json", "as_json", is_flag=True,
              help='Print {"vm", "dest", "point", "kind", "chain", "bytes", "disk_bytes", '
                   '"seconds", "frozen", "files", "whole"} ("whole": the raw disks an '
                   'incremental point copied whole).')
@pass_ctx
def backup(c: Ctx, name: str, dest: str, incremental: bool, max_mib: int | None,
           as_json: bool) -> None:
    """Back up running VM NAME's disk into DEST, while it runs.

    \b
    DEST is a backup directory: a bare NAME is kept in FUSUMA_HOME/backups/NAME;
    root may also give an absolute path inside a storage directory
    (`fusuma storage list`). It holds one subdirectory per point: 0001 is the full
    backup, 0002, 0003... each an incremental one on the point before. Each point
    holds a compressed qcow2 per disk, the VM's UEFI variables (nvram.fd) when it
    boots by UEFI, and manifest.json, written last: the VM's configuration, each
    file's SHA-256 and the chain. A point without its manifest does not exist; the
    next backup into DEST removes it.

    \b
    The copy is QEMU's (blockdev-backup): every disk at one instant (one QMP
    transaction), while the guest runs. When the guest has a guest agent, its
    filesystems are frozen for that instant and thawed at once; without one the
    backup is what a power cut would have left on the disk. The same instant puts a
    dirty bitmap on each disk, so the next --incremental copies only what changed.
    A later full backup of the VM starts a new chain, and incrementals continue only
    the newest one.

    \b
    Backed up: the thin disk of a VM made from an imported image (`vm create
    --image IMPORTED`), and each raw disk attached to it (`--disk`) as a compressed
    qcow2 too. A raw file cannot keep a dirty bitmap, so a raw disk is copied whole
    into every point, an incremental one too (it says so): only the thin disk's
    copy is incremental. Refused: fusuma's own images (their root is shared and
    read-only).

    \b
    Examples:
      fusuma vm backup db0 db0-nightly
      fusuma vm backup db0 db0-nightly --incremental
      fusuma vm backup db0 /srv/backups/db0 --max-bandwidth 100
      fusuma vm restore db0-nightly db0-copy --start"""
    from fusuma.vm.backups import backup as run

    shown: set[str] = set()

    def progress(phase: str, detail: dict[str, Any]) -> None:
        if as_json:
            return
        if phase == "copy" and detail.get("total"):
            done, total = int(detail.get("done", 0)), int(detail["total"])
            line = f"... copy {10 * (10 * done // total)}% of {_mib(total)}"
        else:
            line = f"... {phase}"
        if line not in shown:
            shown.add(line)
            click.echo(line, err=True)

    res = run(c.vms, name, dest, incremental=incremental, anywhere=True,
              max_bandwidth=(max_mib or 0) * 2**20, progress=progress)
    if as_json:
        from dataclasses import asdict

        emit_json(asdict(res))
        return
    click.echo(f"vm {name}: {res.kind} backup, point {res.point} of {res.dest}: "
               f"{_mib(res.bytes)} written for {_mib(res.disk_bytes)} of disk in "
               f"{res.seconds:.1f} s" + ("" if res.frozen else
                                         " (no guest agent froze its filesystems)"))
    if res.whole:
        click.echo(f"raw disk(s) {', '.join(res.whole)} copied whole into this point: a "
                   "raw file keeps no dirty bitmap, so only the thin disk's copy is "
                   "incremental.")


@click.command("restore")
@click.argument("dest")
@click.argument("new")
@click.option("--partition", "-p", default=None,
              help="Partition of the new VM.  [default: the backed-up VM's]")
@click.option("--point", type=click.IntRange(min=1), default=None,
              help="Restore this point of DEST (1 is the full backup).  [default: "
                   "the last]")
@click.option("--start", is_flag=True, help="Start the new VM once it is made.")
@click.option("--json", "as_json", is_flag=True,
              help='Print {"vm", "partition", "source_vm", "dest", "point", "points", '
                   '"seconds", "disk_bytes", "disks"}.')
@pass_ctx
def restore(c: Ctx, dest: str, new: str, partition: str | None, point: int | None,
            start: bool, as_json: bool) -> None:
    """Make a new VM NEW from backup DEST (see `fusuma vm backup`).

    \b
    Every file of the chain up to the point is checked against its manifest's
    SHA-256 first; a chain that is broken or changed is refused with one sentence
    and nothing is made. NEW gets the backed-up VM's memory, vCPUs, firmware and
    machine type, a NIC on each of its networks (with a new MAC and address), a new
    cloud-init instance id (cloud-init runs its per-instance steps again, and sets
    the hostname NEW), a copy of its UEFI variables, and its disk: the chain
    flattened by `qemu-img convert` into a thin disk on the same imported image,
    which this host must have (same name and checksum). Each raw disk NAME backed
    up becomes a new raw disk NEW-NAME (FUSUMA_HOME/disks/NEW-NAME.img) in NEW's
    partition, attached to it. The backup is not changed.

    \b
    While the restore runs, `fusuma ps` shows NEW held by it ("being restored"). A
    restore that fails leaves nothing; one whose process is killed is undone by the
    next command on NEW (or, within seconds, by its partition's supervisor).

    \b
    Examples:
      fusuma vm restore db0-nightly db0-copy -p p1 --start
      fusuma vm restore /srv/backups/db0 db0-monday --point 2"""
    from fusuma.vm.backups import restore as run

    t0 = time.monotonic()
    res = run(c.vms, dest, new, partition, anywhere=True, point=point, start=start,
              say=None if as_json else (lambda s: click.echo(f"... {s}", err=True)))
    if as_json:
        from dataclasses import asdict

        emit_json(asdict(res))
        return
    click.echo(f"vm {new}: restored from point {res.point} of {res.dest} (VM "
               f"{res.source_vm}, {res.points} point(s)) in partition {res.partition} in "
               f"{time.monotonic() - t0:.1f} s" + ("; started" if start else "")
               + (f"; its raw disk(s) {', '.join(res.disks)}" if res.disks else ""))
