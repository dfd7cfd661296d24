"""An in-place move's VM leaf keeps the control weight until its old QEMU has ended.

The two QEMUs of an in-place move share the VM's leaf. The new one starts at the
control weight (``cpr.prepare``); the commit used to give the leaf back to the VM's
class at once, and the move's last questions to the old QEMU and its quit, at the
class's weight beside 15 busy guests on one core, took 130-190 ms more. The class comes
back when the old QEMU ends, whichever way it ends (``PartitionHost._record_exit``)."""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path
from typing import Any

from fusuma.qemu.instance import Instances, QemuInstance, Role
from fusuma.qemu.qmp import Qmp
from fusuma.supervisor.host import PartitionHost


def _inst(tmp_path: Path, pid: int, role: Role) -> QemuInstance:
    return QemuInstance("v", pid, Qmp("v", tmp_path / f"{pid}.sock", logging.getLogger("q")),
                        run_dir=tmp_path / str(pid), ram_file=None, role=role)


def _host(tmp_path: Path, classed: list[tuple[str, int]]) -> Any:
    h = PartitionHost.__new__(PartitionHost)
    h.partition = "p0"
    h.log = logging.getLogger("t")
    h.instances = Instances()
    h.class_cpu = lambda vm, pid: classed.append((vm, pid))  # type: ignore[method-assign]
    h.delete_leaf = lambda vm: None                          # type: ignore[method-assign]
    h.remove_ram = lambda ram: None                          # type: ignore[method-assign]
    h.db = type("Db", (), {"find_vm": lambda self, n: None,
                           "find_job": lambda self, o: None})()
    return h


def test_the_old_qemus_end_gives_the_leaf_back_to_the_class(tmp_path: Path) -> None:
    classed: list[tuple[str, int]] = []
    h = _host(tmp_path, classed)
    new, old = _inst(tmp_path, 4242, Role.RUNNING), _inst(tmp_path, 4141, Role.LEAVING)
    h.instances.add(new)
    h.instances.add(old)
    asyncio.run(h._record_exit(old))
    assert classed == [("v", 4242)]


def test_a_running_qemus_end_or_a_lone_leavers_changes_no_weight(tmp_path: Path) -> None:
    classed: list[tuple[str, int]] = []
    h = _host(tmp_path, classed)
    gone = _inst(tmp_path, 4343, Role.LEAVING)     # a zero-copy source: nothing runs here
    h.instances.add(gone)
    asyncio.run(h._record_exit(gone))
    crashed = _inst(tmp_path, 4444, Role.RUNNING)
    h.instances.add(crashed)
    asyncio.run(h._record_exit(crashed))
    assert classed == []
