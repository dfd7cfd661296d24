"""What every command shares: the context (``fusuma.ops.context.Ctx``, made with the
CLI's notices) and output helpers.

Light on purpose (every command imports it): the DB and the managers are imported when
a command first uses them."""

from __future__ import annotations

import json
import sys
from typing import Any

import click

from fusuma.ops.context import Ctx as Ctx  # re-exported: every command (and bench) takes it
from fusuma.paths import Paths


def echo_err(text: str) -> None:
    click.echo(text, err=True)


def make_ctx(paths: Paths) -> Ctx:
    """The CLI's context: notices go through click to stderr."""
    return Ctx(paths, notice=echo_err)


pass_ctx = click.make_pass_decorator(Ctx)


def emit_json(data: Any) -> None:
    click.echo(json.dumps(data, indent=2, sort_keys=False))


def progress(msg: str) -> None:
    """Progress lines go to stderr, so stdout stays clean for --json."""
    if sys.stderr.isatty():
        click.echo(click.style(f"… {msg}", dim=True), err=True)
    else:
        click.echo(f"... {msg}", err=True)


def table(rows: list[list[str]], headers: list[str]) -> str:
    cols = [headers, *rows]
    widths = [max(len(r[i]) for r in cols) for i in range(len(headers))]
    lines = ["  ".join(h.upper().ljust(w) for h, w in zip(headers, widths, strict=True))]
    lines += ["  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)) for r in rows]
    return "\n".join(line.rstrip() for line in lines)


def cpus_option(value: str | None) -> list[int] | None:
    from fusuma.host.topology import parse_cpulist

    return None if value is None else parse_cpulist(value)
