"""What every command shares: the context (paths, DB, managers) and output helpers.

Light on purpose (every command imports it): the DB and the managers are imported when
a command first uses them."""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import click

from fusuma.paths import Paths

if TYPE_CHECKING:
    from fusuma.partition.manager import PartitionManager
    from fusuma.state import Database
    from fusuma.vm import VmManager


@dataclass
class Ctx:
    paths: Paths
    _db: Database | None = None
    _parts: PartitionManager | None = None
    _vms: VmManager | None = None
    notices: set[str] = field(default_factory=set)

    @property
    def db(self) -> Database:
        if self._db is None:
            from fusuma.state import Database

            self.paths.ensure_parents()
            self._db = Database(self.paths.db)
            from fusuma.capacity import take_over

            for line in take_over(self._db):
                click.echo(line, err=True)
        return self._db

    @property
    def parts(self) -> PartitionManager:
        if self._parts is None:
            from fusuma.partition.manager import PartitionManager

            self._parts = PartitionManager(self.paths, self.db)
            self._parts.notice = lambda text: click.echo(text, err=True)
        return self._parts

    @property
    def vms(self) -> VmManager:
        if self._vms is None:
            from fusuma.vm import VmManager

            self._vms = VmManager(self.paths, self.db, self.parts)
        return self._vms

    def accel_notice(self, requested: str) -> None:
        """Say once per command why a VM runs under TCG."""
        from fusuma.host.accel import probe_accel

        choice = probe_accel(requested)
        if choice.notice and choice.notice not in self.notices:
            self.notices.add(choice.notice)
            click.echo(choice.notice, err=True)


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
