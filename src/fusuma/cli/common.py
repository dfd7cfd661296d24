"""What every command shares: the context (``fusuma.ops.context.Ctx``, made with the
CLI's notices) and output helpers (``fusuma.console``, re-exported here).

Light on purpose (every command imports it): the DB and the managers are imported when
a command first uses them."""

from __future__ import annotations

import click

from fusuma.console import emit_json as emit_json
from fusuma.console import pass_ctx as pass_ctx
from fusuma.console import progress as progress
from fusuma.console import table as table
from fusuma.ops.context import Ctx as Ctx
from fusuma.paths import Paths


def echo_err(text: str) -> None:
    click.echo(text, err=True)


def make_ctx(paths: Paths) -> Ctx:
    """The CLI's context: notices go through click to stderr; root's CLI may name host
    paths (a QEMU binary, a segment's directory)."""
    return Ctx(paths, notice=echo_err, host_paths=True)


def cpus_option(value: str | None) -> list[int] | None:
    from fusuma.host.topology import parse_cpulist

    return None if value is None else parse_cpulist(value)
