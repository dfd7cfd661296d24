"""`fusuma serve`: the API daemon's own command (listed in the program's command table,
``fusuma.cli.main.COMMANDS``). Kept light: the server and its libraries are imported
when it runs."""

from __future__ import annotations

import json
from pathlib import Path

import click

from fusuma.console import pass_ctx
from fusuma.ops.context import Ctx


@click.command()
@click.option("--listen", metavar="HOST:PORT",
              help="Also serve HTTPS on this TCP address (every request needs a token "
                   "from `fusuma token create`). Without it: the UNIX socket only.")
@click.option("--cert", type=click.Path(path_type=Path, dir_okay=False),
              help="TLS certificate (PEM) for --listen; default: a self-signed one made "
                   "in FUSUMA_HOME/api/server.crt on first use.")
@click.option("--key", type=click.Path(path_type=Path, dir_okay=False),
              help="The certificate's private key (PEM), with --cert.")
@click.option("--group", default="fusuma", show_default=True,
              help="Group that may use the UNIX socket (created when missing); its "
                   "members are admin, which is root-equivalent.")
@click.option("--no-access-log", is_flag=True, help="Do not log each request.")
@pass_ctx
def serve(c: Ctx, listen: str | None, cert: Path | None, key: Path | None, group: str,
          no_access_log: bool) -> None:
    """Run the host's API daemon: REST under /1.0, live events, Prometheus metrics.

    \b
    It listens on the UNIX socket FUSUMA_RUNTIME_DIR/api/fusuma.sock (directory 0750,
    socket 0660, group fusuma): root and members of that group may use it, nobody
    else, and they are admin: root-equivalent, so add only those you would give root.
    --listen adds HTTPS on TCP with bearer tokens (`fusuma token create NAME --role
    ROLE`), each with its role: metrics, viewer, operator or admin.

    \b
    Resources (OpenAPI at /openapi.json, a docs page at /docs):
      GET  /1.0                          host and API
      GET  /1.0/ps                       what `fusuma ps --json` shows
      *    /1.0/partitions[/P]           list, create, get, resize (PATCH), delete
      POST /1.0/partitions/P/restart     a new supervisor
      POST /1.0/partitions/P/maintain    {"via": Q, "qemu": PATH?}
      *    /1.0/disks[/D]                list, add, get, move (PATCH), remove
      *    /1.0/vms[/V]                  list (?partition=P), create, get, change, delete
      PUT  /1.0/vms/V/state              {"action": "start"|"stop"|"kill"}
      POST /1.0/vms/V/move               {"partition": P, "mode": "zero-copy"|"copy"}
      POST /1.0/vms/V/exec               {"command": [...], "stdin": "..."}
      *    /1.0/segments[/S], GET /1.0/share/report, /1.0/share/analyze?vm=V
      GET  /1.0/governor, /1.0/images
      GET  /1.0/operations[/ID[/wait]], DELETE /1.0/operations/ID (cancel)
      GET  /1.0/events                   server-sent events (?type=lifecycle,...)
      GET  /metrics                      Prometheus text format

    Long work answers 202 with an operation; its result is what the CLI prints with
    --json. The CLI keeps working beside the daemon: both use the same locks, jobs and
    state file, and changes made with the CLI appear in /1.0/events within a second.

    \b
    Examples:
      fusuma serve &
      curl --unix-socket /run/fusuma/api/fusuma.sock http://fusuma/1.0/vms
      fusuma serve --listen 127.0.0.1:8443"""
    import asyncio

    from fusuma.api.server import ServeOptions, parse_listen
    from fusuma.api.server import serve as run
    from fusuma.ops.tokens import before_roles_notice

    opts = ServeOptions(listen=parse_listen(listen) if listen else None, cert=cert,
                        key=key, group=group, access_log=not no_access_log)

    def ready(info: dict[str, object]) -> None:
        click.echo(f"fusuma serve: pid {info['pid']}, listening on {info['socket']}"
                   + (f" and {info['listen']}" if "listen" in info else ""), err=True)
        if "certificate_made" in info:
            click.echo(f"fusuma serve: made a self-signed certificate "
                       f"{info['certificate_made']}", err=True)
        older = info.get("tokens_before_roles")
        if isinstance(older, list) and older:
            click.echo(f"fusuma serve: {before_roles_notice(older)}", err=True)
        click.echo(json.dumps({"ready": info}), err=True)
    asyncio.run(run(c.paths, opts, ready))
