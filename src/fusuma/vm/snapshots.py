"""The front doors' snapshot operations on a VM: its partition's supervisor takes,
restores and deletes them (fusuma.supervisor.snapshots); the list is read from the
state file."""

from __future__ import annotations

import time
from typing import Any

from fusuma.names import check_name
from fusuma.state import Database
from fusuma.state.snapdb import SnapshotRecord
from fusuma.supervisor import rpc
from fusuma.supervisor.snapshots import JOB_S
from fusuma.vm.manager import VmManager

# The CLI waits this long beyond the supervisor's own limit on a snapshot job.
SLACK_S = 120.0


def snapshot_json(s: SnapshotRecord) -> dict[str, Any]:
    return {"vm": s.vm, "name": s.name, "memory": s.memory, "disks": s.disks,
            "created_at": s.created_at,
            "created": time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(s.created_at)),
            "running": s.running, "frozen": s.frozen, "vmstate_bytes": s.vmstate_bytes}


def list_(db: Database, vm: str) -> list[dict[str, Any]]:
    """VM ``vm``'s snapshots (only whole ones), oldest first."""
    db.vm(vm)
    return [snapshot_json(s) for s in db.snapshots(vm)]


def create(vms: VmManager, vm: str, name: str, memory: bool) -> dict[str, Any]:
    check_name("snapshot", name)
    vms.db.vm(vm)
    res = vms.send(vm, rpc.SnapshotCreate(vm, name, memory), JOB_S + SLACK_S)
    return {**snapshot_json(vms.db.snapshot(vm, name)), "seconds": res.seconds}


def restore(vms: VmManager, vm: str, name: str) -> rpc.SnapshotDone:
    check_name("snapshot", name)
    vms.db.snapshot(vm, name)
    return vms.send(vm, rpc.SnapshotRestore(vm, name), 2 * JOB_S + SLACK_S)


def delete(vms: VmManager, vm: str, name: str) -> rpc.SnapshotDone:
    check_name("snapshot", name)
    vms.db.snapshot(vm, name)
    return vms.send(vm, rpc.SnapshotDelete(vm, name), JOB_S + SLACK_S)
