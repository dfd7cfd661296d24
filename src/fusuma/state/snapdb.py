"""The state file's VM snapshots (mixed into fusuma.state.db.Database).

A snapshot's record is written before the first disk is touched, as ``creating``, and
becomes ``ready`` only once every disk holds it (and its memory, with ``--memory``);
a deletion marks it ``deleting`` first. Only ``ready`` snapshots are listed or restored:
a create or delete whose process was killed is finished or undone by its job's
recovery (fusuma.supervisor.snapshots.recover), never taken for a good snapshot."""

from __future__ import annotations

import enum
import json
import sqlite3
import time
from dataclasses import field

from fusuma.errors import ConflictError, NotFoundError
from fusuma.frozen import frozen


class SnapState(enum.StrEnum):
    CREATING = "creating"
    READY = "ready"
    DELETING = "deleting"


@frozen
class SnapshotRecord:
    vm: str
    name: str
    memory: bool                      # the RAM and device state too (snapshot-save)
    disks: list[str]                  # the drives (QEMU ids) whose qcow2 holds it
    state: SnapState = SnapState.CREATING
    created_at: float = field(default_factory=time.time)
    running: bool = False             # whether the VM ran when it was taken
    frozen: bool = False              # the guest agent froze the guest's filesystems
    devices: str | None = None        # a memory snapshot: the device set it was taken with
    vmstate_bytes: int | None = None  # a memory snapshot: its state's size on disk


class SnapshotTables:
    """VM snapshots: ``_conn`` is the Database's."""

    _conn: sqlite3.Connection

    @staticmethod
    def _snapshot(row: sqlite3.Row) -> SnapshotRecord:
        return SnapshotRecord(vm=row["vm"], name=row["name"], memory=bool(row["memory"]),
                              disks=json.loads(row["disks"]), state=SnapState(row["state"]),
                              created_at=row["created_at"], running=bool(row["running"]),
                              frozen=bool(row["frozen"]), devices=row["devices"],
                              vmstate_bytes=row["vmstate_bytes"])

    def snapshots(self, vm: str, *, every: bool = False) -> list[SnapshotRecord]:
        """VM ``vm``'s ready snapshots, oldest first (``every``: whatever their state)."""
        rows = self._conn.execute(
            "SELECT * FROM snapshots WHERE vm=? ORDER BY created_at, name", (vm,)).fetchall()
        recs = [self._snapshot(r) for r in rows]
        return recs if every else [s for s in recs if s.state == SnapState.READY]

    def find_snapshot(self, vm: str, name: str) -> SnapshotRecord | None:
        row = self._conn.execute("SELECT * FROM snapshots WHERE vm=? AND name=?",
                                 (vm, name)).fetchone()
        return self._snapshot(row) if row else None

    def snapshot(self, vm: str, name: str) -> SnapshotRecord:
        """A ready snapshot, or one sentence."""
        rec = self.find_snapshot(vm, name)
        if rec is None or rec.state != SnapState.READY:
            raise NotFoundError(f"VM {vm!r} has no snapshot named {name!r}; see "
                                f"`fusuma vm snapshot list {vm}`.")
        return rec

    def add_snapshot(self, s: SnapshotRecord) -> None:
        try:
            self._conn.execute(
                "INSERT INTO snapshots (vm, name, memory, disks, state, created_at, "
                "running, frozen, devices, vmstate_bytes) VALUES (?,?,?,?,?,?,?,?,?,?)",
                (s.vm, s.name, int(s.memory), json.dumps(s.disks), s.state.value,
                 s.created_at, int(s.running), int(s.frozen), s.devices, s.vmstate_bytes))
        except sqlite3.IntegrityError as exc:
            raise ConflictError(f"VM {s.vm!r} already has a snapshot named {s.name!r}; "
                                "delete it first or give another name.") from exc

    def set_snapshot(self, vm: str, name: str, *, state: SnapState,
                     frozen: bool | None = None, vmstate_bytes: int | None = None) -> None:
        self._conn.execute(
            "UPDATE snapshots SET state=?, frozen=COALESCE(?, frozen), "
            "vmstate_bytes=COALESCE(?, vmstate_bytes) WHERE vm=? AND name=?",
            (state.value, None if frozen is None else int(frozen), vmstate_bytes, vm, name))

    def remove_snapshot(self, vm: str, name: str) -> None:
        self._conn.execute("DELETE FROM snapshots WHERE vm=? AND name=?", (vm, name))
