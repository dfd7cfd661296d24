"""What every command of the `fusuma` program shares, wherever it is defined (``cli/``,
and the daemons' own commands: ``api/command.py``, ``cluster/command.py``): the
context decorator and terminal output. JSON and tables go to stdout, progress to
stderr, so stdout stays clean for --json."""

from __future__ import annotations

import json
import sys
from typing import Any

import click

from fusuma.ops.context import Ctx

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
