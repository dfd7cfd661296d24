"""Entry point: `fusuma [OPTIONS] COMMAND ...`."""

from __future__ import annotations

import logging
import sys

import click

from fusuma import __version__
from fusuma.cli.bench import bench
from fusuma.cli.common import Ctx
from fusuma.cli.disk import disk
from fusuma.cli.governor import governor
from fusuma.cli.host import down, ps, up
from fusuma.cli.image import image
from fusuma.cli.migrate import maintain, migrate
from fusuma.cli.partition import partition
from fusuma.cli.segment import segment
from fusuma.cli.share import share
from fusuma.cli.top import top
from fusuma.cli.vm import vm
from fusuma.errors import FusumaError
from fusuma.paths import Paths

EPILOG = """\b
Environment:
  FUSUMA_HOME         state DB and logs (default /var/lib/fusuma)
  FUSUMA_RUNTIME_DIR  sockets and pidfiles (default /run/fusuma)
  FUSUMA_SHM_DIR      shared guest-RAM files (default /dev/shm/fusuma)
  FUSUMA_CACHE        guest images (default /var/cache/fusuma)

\b
Start with `fusuma up` (a default layout for this host) and `fusuma ps`.
"""


@click.group(epilog=EPILOG, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="fusuma")
@click.option("-v", "--verbose", count=True, help="More log output (-vv for debug).")
@click.pass_context
def cli(ctx: click.Context, verbose: int) -> None:
    """fusuma divides one Linux host into partitions, each with exclusive cores, a
    memory limit and its own hypervisor supervisor, and runs QEMU VMs inside them.

    Must run as root (it creates cgroups and starts QEMU)."""
    level = logging.WARNING if verbose == 0 else logging.INFO if verbose == 1 else logging.DEBUG
    logging.basicConfig(level=level, format="%(levelname)s %(name)s: %(message)s")
    ctx.obj = Ctx(Paths.from_env())


for command in (up, down, ps, partition, vm, disk, migrate, maintain, image, bench, top,
                governor, segment, share):
    cli.add_command(command)


def main() -> None:
    try:
        cli.main(standalone_mode=False)
    except FusumaError as exc:
        click.echo(f"fusuma: error: {exc}", err=True)
        sys.exit(exc.exit_code)
    except click.exceptions.Abort:
        click.echo("fusuma: aborted", err=True)
        sys.exit(130)
    except click.ClickException as exc:
        exc.show()
        sys.exit(exc.exit_code)
    except click.exceptions.Exit as exc:
        sys.exit(exc.exit_code)
    except KeyboardInterrupt:
        click.echo("fusuma: interrupted", err=True)
        sys.exit(130)


if __name__ == "__main__":
    main()
