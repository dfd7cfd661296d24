"""`fusuma token ...`: API tokens for the daemon's HTTPS listener."""

from __future__ import annotations

import time

import click

from fusuma.cli.common import Ctx, emit_json, pass_ctx, table


@click.group()
def token() -> None:
    """API tokens for `fusuma serve --listen` (HTTPS): create, list, revoke.

    A token is printed once, when it is made; only its SHA-256 is stored. Send it as
    `Authorization: Bearer TOKEN`."""


@token.command("create")
@click.argument("name")
@click.option("--json", "as_json", is_flag=True, help='Print {"name", "token"}.')
@pass_ctx
def create(c: Ctx, name: str, as_json: bool) -> None:
    """Make token NAME and print it (the only time it is shown)."""
    from fusuma.names import check_name
    from fusuma.ops.tokens import digest, new_token

    check_name("token", name)
    tok = new_token()
    c.db.add_token(name, digest(tok))
    if as_json:
        emit_json({"name": name, "token": tok})
    else:
        click.echo(tok)
        click.echo(f"token {name!r} created; it is not shown again.", err=True)


@token.command("list")
@click.option("--json", "as_json", is_flag=True)
@pass_ctx
def list_(c: Ctx, as_json: bool) -> None:
    """List tokens (names and dates; the tokens themselves are not kept)."""
    rows = c.db.tokens()
    if as_json:
        emit_json(rows)
        return

    def when(t: float | None) -> str:
        return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(t)) if t else "never"
    click.echo(table([[r["name"], when(r["created_at"]), when(r["last_used_at"])]
                      for r in rows], ["name", "created", "last_used"]))


@token.command("revoke")
@click.argument("name")
@pass_ctx
def revoke(c: Ctx, name: str) -> None:
    """Revoke token NAME: requests carrying it get 401 from now on."""
    c.db.remove_token(name)
    click.echo(f"token {name!r} revoked")
