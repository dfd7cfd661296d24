"""`fusuma qemu ...`: QEMU versions side by side."""

from __future__ import annotations

import click

from fusuma.cli.common import Ctx, emit_json, pass_ctx, table


def _say(msg: str) -> None:
    """Progress on stderr (a download takes seconds), stdout stays for --json."""
    click.echo(f"… {msg}", err=True)


def _q35_range(machines: list[str]) -> str:
    if not machines:
        return "-"
    return machines[0] if len(machines) == 1 else f"{machines[0]} … {machines[-1]}"


@click.group()
def qemu() -> None:
    """Install, list and remove QEMU versions that partitions can run.

    The system's QEMU (the distribution's package) is always there; `qemu install`
    unpacks another version from Debian's backports suite under FUSUMA_CACHE without
    touching the system's. A partition names its QEMU by version
    (`partition create --qemu 10.0`, `qemu = "10.0"` in a spec); `fusuma maintain P --via
    Q --qemu 10.0` moves a partition's running VMs onto another version."""


@qemu.command("install")
@click.argument("series")
@click.option("--json", "as_json", is_flag=True, help="Print the installed QEMU as JSON.")
@pass_ctx
def install(c: Ctx, series: str, as_json: bool) -> None:
    """Fetch QEMU SERIES (e.g. 10.0) from Debian's backports suite into FUSUMA_CACHE.

    Uses apt with a configuration of its own (the host's sources are not changed) and
    dpkg-deb; nothing is left half unpacked if the download fails. Installing a version
    that is already there does nothing."""
    from fusuma.qemu import fetch

    q = fetch.install(c.paths, series, progress=_say)
    if as_json:
        emit_json(q.as_json())
    else:
        click.echo(f"QEMU {q.version}: {q.binary} ({'system' if q.system else 'fusuma'}); "
                   f"machine types {_q35_range(q.q35_machines)}")


@qemu.command("list")
@click.option("--json", "as_json", is_flag=True)
@pass_ctx
def list_(c: Ctx, as_json: bool) -> None:
    """List installed QEMU versions with their machine types and features.

    The oldest one's q35 machine type is what a new VM pins by default, so that it can
    move to every version installed here."""
    from fusuma.qemu import versions

    found = versions.installed(c.paths)
    if as_json:
        emit_json([q.as_json() for q in found])
        return
    rows = [[q.series, q.version, "system" if q.system else "fusuma", str(q.binary),
             _q35_range(q.q35_machines),
             ",".join(k for k, v in q.features.items() if v) or "-"] for q in found]
    click.echo(table(rows, ["series", "version", "source", "binary", "q35 machine types",
                            "features"]))


@qemu.command("remove")
@click.argument("series")
@pass_ctx
def remove(c: Ctx, series: str) -> None:
    """Remove QEMU SERIES that `qemu install` unpacked.

    Refused while a VM runs on it or a partition names it."""
    from fusuma.qemu import versions

    q = versions.remove(c.paths, series, progress=_say)
    click.echo(f"removed QEMU {q.version} ({q.root})")
