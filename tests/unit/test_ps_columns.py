"""`fusuma ps` shows its memory governance columns only where memory is governed."""

from __future__ import annotations

from typing import Any

from fusuma.cli.host import _governed


def data(overcommit: float = 1.0, cls: str = "guaranteed") -> dict[str, Any]:
    return {"partitions": [{"memory_overcommit": overcommit}],
            "vms": [{"memory": {"class": cls}}, {"memory": None}]}


def test_nothing_governed_keeps_ps_narrow() -> None:
    assert not _governed(data())
    assert not _governed({"partitions": [], "vms": []})


def test_an_overcommitted_partition_or_a_burstable_vm_shows_the_columns() -> None:
    assert _governed(data(overcommit=1.5))
    assert _governed(data(cls="burstable"))
