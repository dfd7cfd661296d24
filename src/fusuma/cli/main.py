"""Entry point: `fusuma [OPTIONS] COMMAND ...`.

Commands are loaded lazily: COMMANDS maps each name to the module that defines it and a
one-line summary, so `fusuma ps` imports only what `ps` runs and `fusuma --help` lists
every command without importing any of them (tests/unit/test_cli_imports.py checks that
each summary still equals the command's own short help, and that no command pulls in
the benchmarks, matplotlib or a server/cluster library it does not use).

Other installed packages add commands through the `fusuma.commands` entry point group
(`fusuma bench` is the fusuma_bench package's). The entry points are read only for a
name that is not built in and for the `--help` listing, so a built-in command never
pays for the scan, and the runtime never imports those packages itself.

The table is the program's one place that names every front door's commands: most
live in ``fusuma.cli``; the daemons' own (`serve`, `agent`, `cluster`, and `host`, which
talks to the cluster) live with their daemon (``fusuma.api.command``,
``fusuma.cluster.command``), so the CLI never imports the API or the cluster package,
nor they the CLI.
"""

from __future__ import annotations

import functools
import importlib
import logging
import os
import sys
from typing import TYPE_CHECKING

import click

if TYPE_CHECKING:
    from importlib.metadata import EntryPoint

from fusuma import __version__
from fusuma.errors import FusumaError

# name -> ("module:attribute", summary). The summary is the first sentence of the
# command's help, as click would show it in the listing.
COMMANDS: dict[str, tuple[str, str]] = {
    "agent": ("fusuma.cluster.command:agent",
              "Run this host's fusuma agent: register it, reconcile the cluster's objects "
              "here."),
    "cluster": ("fusuma.cluster.command:cluster",
                "fusuma on Kubernetes: the CRDs, policy and host identities the agents need."),
    "disk": ("fusuma.cli.disk:disk",
             "Register disk files in storage directories to partitions, and move them."),
    "down": ("fusuma.cli.host:down",
             "Remove every VM, disk and partition of this host (this FUSUMA_HOME)."),
    "governor": ("fusuma.cli.governor:governor",
                 "The CPU and memory governors that run in every partition supervisor."),
    "host": ("fusuma.cluster.command:host",
             "The cluster's hosts: list them, cordon, drain and uncordon one."),
    "image": ("fusuma.cli.image:image",
              "Build guest images, and import your own disk images."),
    "maintain": ("fusuma.cli.migrate:maintain",
                 "Restart PARTITION's hypervisor instance with ~no downtime for its VMs."),
    "migrate": ("fusuma.cli.migrate:migrate",
                "Move VM to another partition's hypervisor on this host."),
    "network": ("fusuma.cli.network:network",
                "Networks for VMs: bridges with DHCP, DNS, NAT and filtering, or the "
                "host's own."),
    "partition": ("fusuma.cli.partition:partition",
                  "Create, resize, restart and delete partitions."),
    "ps": ("fusuma.cli.host:ps", "Show partitions and VMs with their state."),
    "qemu": ("fusuma.cli.qemu:qemu",
             "Install, list and remove QEMU versions that partitions can run."),
    "segment": ("fusuma.cli.segment:segment",
                "Shared segments: read-only memory shared by many VMs (z/VM's DCSS)."),
    "serve": ("fusuma.api.command:serve",
              "Run the host's API daemon: REST under /1.0, live events, Prometheus "
              "metrics."),
    "share": ("fusuma.cli.share:share",
              "Memory shared between VMs, and exactly where every shared MiB comes from."),
    "storage": ("fusuma.cli.storage:storage",
                "Directories for disk files: disks are created or registered only inside "
                "them."),
    "template": ("fusuma.cli.template:template",
                 "Templates: a booted VM's RAM and device state, to start clones from."),
    "token": ("fusuma.cli.token:token",
              "API tokens for `fusuma serve --listen` (HTTPS): create, list, revoke."),
    "top": ("fusuma.cli.top:top",
            "Each running VM's CPU use and wait for a CPU, refreshed every second."),
    "up": ("fusuma.cli.host:up",
           "Make the host match SPEC (a TOML file); without SPEC, a built-in default."),
    "vm": ("fusuma.cli.vm:vm", "Create, start, stop and use VMs."),
}

EPILOG = """\b
Environment:
  FUSUMA_HOME         state DB and logs (default /var/lib/fusuma)
  FUSUMA_RUNTIME_DIR  sockets and pidfiles (default /run/fusuma)
  FUSUMA_SHM_DIR      shared guest-RAM files (default /dev/shm/fusuma)
  FUSUMA_CACHE        guest images (default /var/cache/fusuma)

\b
Start with `fusuma up` (a default layout for this host) and `fusuma ps`.
"""


PLUGIN_GROUP = "fusuma.commands"


def load_command(name: str) -> click.Command:
    """Import the module that defines command NAME and return the command."""
    module, _, attr = COMMANDS[name][0].partition(":")
    cmd = getattr(importlib.import_module(module), attr)
    if not isinstance(cmd, click.Command):
        raise TypeError(f"{module}:{attr} is not a click command")
    return cmd


@functools.cache
def plugin_commands() -> dict[str, EntryPoint]:
    """The commands other installed packages add (entry point group PLUGIN_GROUP), by
    name; a built-in name wins, and of two packages with one name the first found."""
    from importlib.metadata import entry_points

    found: dict[str, EntryPoint] = {}
    for ep in entry_points(group=PLUGIN_GROUP):
        if ep.name not in COMMANDS:
            found.setdefault(ep.name, ep)
    return found


def load_plugin(name: str) -> click.Command | None:
    """Command NAME from an installed package, or None if no package adds one."""
    ep = plugin_commands().get(name)
    if ep is None:
        return None
    cmd = ep.load()
    if not isinstance(cmd, click.Command):
        raise TypeError(f"entry point {name} = {ep.value} is not a click command")
    return cmd


class LazyGroup(click.Group):
    """A group whose subcommands (from COMMANDS, then the entry points) are imported
    only when run."""

    def list_commands(self, ctx: click.Context) -> list[str]:
        return sorted({*COMMANDS, *self.commands, *plugin_commands()})

    def get_command(self, ctx: click.Context, cmd_name: str) -> click.Command | None:
        if cmd_name in self.commands:
            return self.commands[cmd_name]
        if cmd_name not in COMMANDS:
            return load_plugin(cmd_name)
        return load_command(cmd_name)

    def format_commands(self, ctx: click.Context, formatter: click.HelpFormatter) -> None:
        """Like click's listing, but from the summaries: imports no built-in command (a
        package's command is loaded for the summary in its own help)."""
        names = self.list_commands(ctx)
        if not names:
            return
        limit = formatter.width - 6 - max(len(n) for n in names)
        rows = []
        for name in names:
            if name in self.commands:
                short = self.commands[name].get_short_help_str(limit)
            elif name not in COMMANDS:
                # A package's command: its summary is in its own help.
                cmd = load_plugin(name)
                short = cmd.get_short_help_str(limit) if cmd else ""
            else:
                # A stand-in with the summary as its help: click's own shortening.
                short = click.Command(name, help=COMMANDS[name][1]).get_short_help_str(limit)
            rows.append((name, short))
        with formatter.section("Commands"):
            formatter.write_dl(rows)


@click.group(cls=LazyGroup, epilog=EPILOG,
             context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="fusuma")
@click.option("-v", "--verbose", count=True, help="More log output (-vv for debug).")
@click.pass_context
def cli(ctx: click.Context, verbose: int) -> None:
    """fusuma divides one Linux host into partitions, each with exclusive cores, a
    memory limit and its own hypervisor supervisor, and runs QEMU VMs inside them.

    Must run as root (it creates cgroups and starts QEMU)."""
    from fusuma.cli.common import make_ctx
    from fusuma.paths import Paths

    level = logging.WARNING if verbose == 0 else logging.INFO if verbose == 1 else logging.DEBUG
    logging.basicConfig(level=level, format="%(levelname)s %(name)s: %(message)s")
    ctx.obj = make_ctx(Paths.from_env())


def main() -> None:
    # Least privilege: nothing fusuma creates (state, logs, disks, RAM files) is for
    # other users unless it says so with an explicit mode.
    os.umask(0o077)
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
