"""`fusuma token ...`: API tokens for the daemon's HTTPS listener."""

from __future__ import annotations

import time

import click

from fusuma.cli.common import Ctx, emit_json, pass_ctx, table
from fusuma.errors import SpecError
from fusuma.state.roles import MAY, ROLES, Role


@click.group()
def token() -> None:
    """API tokens for `fusuma serve --listen` (HTTPS): create, list, revoke.

    A token is printed once, when it is made; only its SHA-256 is stored. Send it as
    `Authorization: Bearer TOKEN`. Each token has a role (metrics, viewer, operator,
    admin: `fusuma token create --help`); admin is root-equivalent."""


def roles_help() -> str:
    """The roles, least first, as `token create --help` lists them."""
    import textwrap

    lines = ["Roles, least first (each may do what those before it may):", "", "\b"]
    for role in ROLES:
        lines += textwrap.wrap(MAY[role], 72, initial_indent=f"  {role:<9} ",
                               subsequent_indent=" " * 12)
    return "\n".join(lines)


@token.command("create", epilog=roles_help())
@click.argument("name")
@click.option("--role", type=click.Choice([r.value for r in ROLES]),
              help="What the token may do. Required: there is no default (see below).")
@click.option("--json", "as_json", is_flag=True, help='Print {"name", "role", "token"}.')
@pass_ctx
def create(c: Ctx, name: str, role: str | None, as_json: bool) -> None:
    """Make token NAME with role ROLE and print it (the only time it is shown).

    \b
    Examples:
      fusuma token create prometheus --role metrics
      fusuma token create ci --role operator"""
    from fusuma.names import check_name
    from fusuma.ops.tokens import digest, new_token

    check_name("token", name)
    if role is None:
        raise SpecError(f"say what token {name!r} may do: --role "
                        f"{'|'.join(ROLES)} (no default; `fusuma token create --help` "
                        "lists what each may do).")
    tok = new_token()
    c.db.add_token(name, digest(tok), Role(role))      # click checked it
    if as_json:
        emit_json({"name": name, "role": role, "token": tok})
    else:
        click.echo(tok)
        click.echo(f"token {name!r} ({role}) created; it is not shown again.", err=True)


@token.command("list")
@click.option("--json", "as_json", is_flag=True)
@pass_ctx
def list_(c: Ctx, as_json: bool) -> None:
    """List tokens: names, roles and dates (the tokens themselves are not kept)."""
    from fusuma.ops.tokens import before_roles_notice

    rows = c.db.tokens()
    older = [r.name for r in rows if r.before_roles]
    if older:
        click.echo(f"fusuma: {before_roles_notice(older)}", err=True)
    if as_json:
        emit_json([{"name": r.name, "role": r.role.value, "created_at": r.created_at,
                    "last_used_at": r.last_used_at, "before_roles": r.before_roles}
                   for r in rows])
        return

    def when(t: float | None) -> str:
        return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(t)) if t else "never"
    click.echo(table([[r.name, r.role.value + ("*" if r.before_roles else ""),
                       when(r.created_at), when(r.last_used_at)] for r in rows],
                     ["name", "role", "created", "last_used"]))


@token.command("revoke")
@click.argument("name")
@pass_ctx
def revoke(c: Ctx, name: str) -> None:
    """Revoke token NAME: requests carrying it get 401 from now on."""
    c.db.remove_token(name)
    click.echo(f"token {name!r} revoked")
