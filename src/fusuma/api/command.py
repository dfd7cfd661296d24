"""`fusuma serve`: the API daemon's own command (listed in the program's command table,
``fusuma.cli.main.COMMANDS``). Kept light: the server and its libraries are imported
when it runs."""

from __future__ import annotations

import json
from pathlib import Path

import click

from fusuma.api.guard import CLIENT_TIMEOUT_S, MAX_CONNECTIONS, MAX_PER_CLIENT
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
@click.option("--group-role", "group_roles", multiple=True, metavar="GROUP=ROLE",
              help="Let the members of local group GROUP use the UNIX socket with ROLE "
                   "(metrics, viewer, operator or admin), e.g. fusuma-view=viewer; "
                   "repeatable. The socket then accepts every local user, and the "
                   "kernel's word on who connected (SO_PEERCRED) decides.")
@click.option("--no-access-log", is_flag=True, help="Do not log each request.")
@click.option("--max-connections", type=click.IntRange(min=1), default=MAX_CONNECTIONS,
              show_default=True, metavar="N",
              help="Connections each listener (the UNIX socket; the TCP port) keeps open "
                   "at once, idle ones and event streams included. One more is answered "
                   "503 with a sentence saying so, and closed.")
@click.option("--max-connections-per-client", type=click.IntRange(min=1),
              default=MAX_PER_CLIENT, show_default=True, metavar="N",
              help="Connections one address may hold open on the TCP port (all clients "
                   "behind one NAT count as one). One more is answered 429.")
@click.option("--client-timeout", type=click.FloatRange(min=0.1), default=CLIENT_TIMEOUT_S,
              show_default=True, metavar="SECONDS",
              help="How long a client may take over its TLS handshake, its request's "
                   "headers, its body, or taking what it is sent; past that it is "
                   "answered 408 (headers, body) or cut (handshake, an unread response).")
@pass_ctx
def serve(c: Ctx, listen: str | None, cert: Path | None, key: Path | None, group: str,
          group_roles: tuple[str, ...], no_access_log: bool, max_connections: int,
          max_connections_per_client: int, client_timeout: float) -> None:
    """Run the host's API daemon: REST under /1.0, live events, Prometheus metrics.

    \b
    It listens on the UNIX socket FUSUMA_RUNTIME_DIR/api/fusuma.sock (directory 0750,
    socket 0660, group fusuma): root and members of that group may use it, nobody
    else, and they are admin: root-equivalent, so add only those you would give root.
    --group-role GROUP=ROLE lets another local group in with a lesser role (as
    Incus' `incus` group beside `incus-admin`); who connected is then read from the
    kernel (SO_PEERCRED), and a user in none of the groups gets 403.
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
    Staying up under slow or many clients (each limit counted per listener):
      --max-connections N            open connections; one more gets 503
      --max-connections-per-client N on TCP, from one address; one more gets 429
      --client-timeout SECONDS       to send a request or take a response; then
                                     408 (headers, body) or the connection is cut
    An idle keep-alive connection is closed after 5 s. A wait on an operation lasts
    at most 600 s (its reply says `timed_out`; ask again) and holds no thread; token
    checks have threads of their own. The soft limit of open files is raised to what
    the connection limits need, up to the hard limit (a warning names a shortfall).

    \b
    Examples:
      fusuma serve &
      curl --unix-socket /run/fusuma/api/fusuma.sock http://fusuma/1.0/vms
      fusuma serve --listen 127.0.0.1:8443"""
    import asyncio

    from fusuma.api.guard import ClientLimits
    from fusuma.api.peers import parse_group_role
    from fusuma.api.server import ServeOptions, parse_listen
    from fusuma.api.server import serve as run
    from fusuma.ops.tokens import before_roles_notice

    limits = ClientLimits(max_connections, max_connections_per_client, client_timeout)
    opts = ServeOptions(listen=parse_listen(listen) if listen else None, cert=cert,
                        key=key, group=group, access_log=not no_access_log, limits=limits,
                        group_roles=tuple(parse_group_role(v) for v in group_roles))

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
