"""Typed access to the SQLite state file."""

from __future__ import annotations

import json
import sqlite3
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import replace
from pathlib import Path
from typing import Any

from fusuma.errors import ConflictError, HostError, NotFoundError, StateError
from fusuma.paths import DEFAULT_UID_BASE, legacy_uid_base, template_gids, vm_uids
from fusuma.state import ids
from fusuma.state.imagedb import ImageTables
from fusuma.state.jobs import Job, JobKind, JobOwner, busy_sentence
from fusuma.state.machine import DELETABLE, VmState, check_transition, lifecycle_action
from fusuma.state.netdb import NetworkTables
from fusuma.state.records import (
    DiskRecord,
    ImageRecord,
    NetworkRecord,
    NicRecord,
    PartitionRecord,
    SegmentRecord,
    TemplateRecord,
    TokenRecord,
    VmRecord,
)
from fusuma.state.roles import Role
from fusuma.state.schema import ADDED_COLUMNS, ID_INDEXES, SCHEMA, SCHEMA_VERSION
from fusuma.state.snapdb import SnapshotTables

# The ranges of the default FUSUMA_UID_BASE (callers pass their Paths' own).
DEFAULT_VM_UIDS = vm_uids(DEFAULT_UID_BASE)
DEFAULT_TEMPLATE_GIDS = template_gids(DEFAULT_UID_BASE)

__all__ = ["Database", "DiskRecord", "ImageRecord", "NetworkRecord", "NicRecord",
           "PartitionRecord",
           "SegmentRecord", "TemplateRecord", "TokenRecord", "VmRecord"]


class Database(NetworkTables, ImageTables, SnapshotTables):
    """One connection to the state file; cheap to open, safe across processes."""

    def __init__(self, path: Path) -> None:
        self.path = path
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            self._conn = sqlite3.connect(str(path), timeout=30, isolation_level=None)
        except (OSError, sqlite3.Error) as exc:
            raise HostError(f"cannot open the state file {path}: {exc}; check FUSUMA_HOME "
                            "and that you are root.") from exc
        self._conn.row_factory = sqlite3.Row
        self._conn.execute("PRAGMA journal_mode=WAL")
        self._conn.execute("PRAGMA foreign_keys=ON")
        # WAL + NORMAL: a commit survives any process being killed (what fusuma must
        # survive), without an fsync in a move's downtime.
        self._conn.execute("PRAGMA synchronous=NORMAL")
        self._conn.executescript(SCHEMA)
        self._add_columns()
        ids.keep_legacy_ids(self._conn, legacy_uid_base())
        self._conn.executescript(ID_INDEXES)
        self._conn.execute("INSERT OR IGNORE INTO meta VALUES ('schema', ?)",
                           (str(SCHEMA_VERSION),))

    def _add_columns(self) -> None:
        for table, column, definition in ADDED_COLUMNS:
            have = {r["name"] for r in self._conn.execute(f"PRAGMA table_info({table})")}
            if column not in have:
                try:
                    self._conn.execute(f"ALTER TABLE {table} ADD COLUMN {column} {definition}")
                except sqlite3.OperationalError as exc:
                    if "duplicate column" not in str(exc):   # another process was first
                        raise

    def close(self) -> None:
        self._conn.close()

    def __enter__(self) -> Database:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @contextmanager
    def transaction(self) -> Iterator[sqlite3.Connection]:
        """An IMMEDIATE transaction: checks and writes inside it see one state."""
        self._conn.execute("BEGIN IMMEDIATE")
        try:
            yield self._conn
        except BaseException:
            self._conn.execute("ROLLBACK")
            raise
        self._conn.execute("COMMIT")

    @contextmanager
    def atomic(self) -> Iterator[sqlite3.Connection]:
        """The caller's transaction if one is open (its writes commit together), else
        one of its own (:meth:`transaction`)."""
        if self._conn.in_transaction:
            yield self._conn
            return
        with self.transaction() as conn:
            yield conn

    # -- host settings ------------------------------------------------------------
    def setting(self, key: str) -> str | None:
        """A host-wide setting kept in the meta table (None when never set)."""
        row = self._conn.execute("SELECT value FROM meta WHERE key=?", (key,)).fetchone()
        return None if row is None else str(row["value"])

    def set_setting(self, key: str, value: str) -> None:
        self._conn.execute("INSERT INTO meta VALUES (?, ?) ON CONFLICT(key) DO UPDATE SET "
                           "value=excluded.value", (key, value))

    # -- partitions ---------------------------------------------------------------
    @staticmethod
    def _partition(row: sqlite3.Row) -> PartitionRecord:
        return PartitionRecord(name=row["name"], cpus=json.loads(row["cpus"]),
                               memory_mib=row["memory_mib"], io_weight=row["io_weight"],
                               qemu=row["qemu"], supervisor_pid=row["supervisor_pid"],
                               created_at=row["created_at"], smt=row["smt"],
                               memory_overcommit=row["memory_overcommit"])

    def partitions(self) -> list[PartitionRecord]:
        rows = self._conn.execute("SELECT * FROM partitions ORDER BY name").fetchall()
        return [self._partition(r) for r in rows]

    def find_partition(self, name: str) -> PartitionRecord | None:
        row = self._conn.execute("SELECT * FROM partitions WHERE name=?", (name,)).fetchone()
        return self._partition(row) if row else None

    def partition(self, name: str) -> PartitionRecord:
        rec = self.find_partition(name)
        if rec is None:
            known = ", ".join(p.name for p in self.partitions()) or "none yet"
            raise NotFoundError(f"no partition named {name!r} (known: {known}); "
                                "see `fusuma partition list`.")
        return rec

    def add_partition(self, p: PartitionRecord) -> None:
        try:
            self._conn.execute(
                "INSERT INTO partitions (name, cpus, memory_mib, io_weight, qemu, "
                "supervisor_pid, created_at, smt, memory_overcommit) "
                "VALUES (?,?,?,?,?,?,?,?,?)",
                (p.name, json.dumps(p.cpus), p.memory_mib, p.io_weight, p.qemu,
                 p.supervisor_pid, p.created_at, p.smt, p.memory_overcommit))
        except sqlite3.IntegrityError as exc:
            raise ConflictError(f"a partition named {p.name!r} already exists.") from exc
        self.emit("lifecycle", "partition-created", f"/1.0/partitions/{p.name}",
                  cpus=p.cpus, memory_mib=p.memory_mib)

    def update_partition(self, p: PartitionRecord) -> None:
        self._conn.execute(
            "UPDATE partitions SET cpus=?, memory_mib=?, io_weight=?, qemu=?, supervisor_pid=?, "
            "memory_overcommit=? WHERE name=?",
            (json.dumps(p.cpus), p.memory_mib, p.io_weight, p.qemu, p.supervisor_pid,
             p.memory_overcommit, p.name))

    def set_supervisor_pid(self, name: str, pid: int | None) -> None:
        self._conn.execute("UPDATE partitions SET supervisor_pid=? WHERE name=?", (pid, name))

    def remove_partition(self, name: str) -> None:
        cur = self._conn.execute("DELETE FROM partitions WHERE name=?", (name,))
        if cur.rowcount:
            self.emit("lifecycle", "partition-deleted", f"/1.0/partitions/{name}")

    # -- disks --------------------------------------------------------------------
    @staticmethod
    def _disk(row: sqlite3.Row) -> DiskRecord:
        return DiskRecord(name=row["name"], path=row["path"], partition=row["partition"],
                          created_file=bool(row["created_file"]), dev=row["dev"],
                          ino=row["ino"])

    def disks(self, partition: str | None = None) -> list[DiskRecord]:
        if partition is None:
            rows = self._conn.execute("SELECT * FROM disks ORDER BY name").fetchall()
        else:
            rows = self._conn.execute("SELECT * FROM disks WHERE partition=? ORDER BY name",
                                      (partition,)).fetchall()
        return [self._disk(r) for r in rows]

    def find_disk(self, name: str) -> DiskRecord | None:
        row = self._conn.execute("SELECT * FROM disks WHERE name=?", (name,)).fetchone()
        return self._disk(row) if row else None

    def disk(self, name: str) -> DiskRecord:
        rec = self.find_disk(name)
        if rec is None:
            raise NotFoundError(f"no disk named {name!r}; see `fusuma disk list`.")
        return rec

    def add_disk(self, d: DiskRecord) -> None:
        try:
            self._conn.execute(
                "INSERT INTO disks (name, path, partition, created_file, dev, ino) "
                "VALUES (?,?,?,?,?,?)",
                (d.name, d.path, d.partition, int(d.created_file), d.dev, d.ino))
        except sqlite3.IntegrityError as exc:
            raise ConflictError(f"a disk named {d.name!r} or with path {d.path} "
                                "is already registered.") from exc

    def disk_with_identity(self, dev: int, ino: int) -> DiskRecord | None:
        row = self._conn.execute("SELECT * FROM disks WHERE dev=? AND ino=?",
                                 (dev, ino)).fetchone()
        return self._disk(row) if row else None

    def set_disk_identity(self, name: str, dev: int, ino: int) -> bool:
        """Record the identity of a disk registered without one (a take-over); False
        when it has one already (another process took it over first)."""
        cur = self._conn.execute("UPDATE disks SET dev=?, ino=? WHERE name=? AND dev IS NULL",
                                 (dev, ino, name))
        return cur.rowcount == 1

    # -- storage directories --------------------------------------------------------
    def storage_dirs(self) -> list[str]:
        """The directories root declared for disk files (`fusuma storage add`)."""
        return [r["path"] for r in
                self._conn.execute("SELECT path FROM storage ORDER BY path").fetchall()]

    def shared_storage_dirs(self) -> list[str]:
        """The storage directories root declared shared (`fusuma storage add --shared`):
        the same files at the same path on other hosts."""
        return [r["path"] for r in self._conn.execute(
            "SELECT path FROM storage WHERE shared=1 ORDER BY path").fetchall()]

    def add_storage_dir(self, path: str, shared: bool = False) -> bool:
        """False when it was declared already."""
        cur = self._conn.execute("INSERT OR IGNORE INTO storage (path, created_at, shared) "
                                 "VALUES (?, ?, ?)", (path, time.time(), int(shared)))
        return cur.rowcount == 1

    def remove_storage_dir(self, path: str) -> None:
        self._conn.execute("DELETE FROM storage WHERE path=?", (path,))

    def move_disk(self, name: str, partition: str) -> None:
        self._conn.execute("UPDATE disks SET partition=? WHERE name=?", (partition, name))

    def remove_disk(self, name: str) -> None:
        self._conn.execute("DELETE FROM disks WHERE name=?", (name,))

    # -- vms ----------------------------------------------------------------------
    @staticmethod
    def _vm(row: sqlite3.Row) -> VmRecord:
        return VmRecord(
            name=row["name"], partition=row["partition"], vcpus=row["vcpus"],
            memory_mib=row["memory_mib"], image=row["image"], disks=json.loads(row["disks"]),
            accel=row["accel"], autostart=bool(row["autostart"]), state=VmState(row["state"]),
            pid=row["pid"], accel_used=row["accel_used"], qemu_binary=row["qemu_binary"],
            started_at=row["started_at"], error=row["error"], created_at=row["created_at"],
            shared_ram=bool(row["shared_ram"]), ram_path=row["ram_path"], qos=row["qos"],
            segments=json.loads(row["segments"]), mergeable=bool(row["mergeable"]),
            ports=json.loads(row["ports"]), overhead_mib=row["overhead_mib"],
            machine=row["machine"], devices=row["devices"],
            qemu_version=row["qemu_version"], emulator=row["emulator"],
            page_reporting=(None if row["page_reporting"] is None
                            else bool(row["page_reporting"])),
            template=row["template"], slot=row["rowid"], uid=row["uid"] or 0,
            boot=row["boot"], memory_class=row["memory_class"],
            memory_min=row["memory_min"])

    def vms(self, partition: str | None = None) -> list[VmRecord]:
        if partition is None:
            rows = self._conn.execute("SELECT rowid, * FROM vms ORDER BY name").fetchall()
        else:
            rows = self._conn.execute("SELECT rowid, * FROM vms WHERE partition=? ORDER BY name",
                                      (partition,)).fetchall()
        return [self._vm(r) for r in rows]

    def find_vm(self, name: str) -> VmRecord | None:
        row = self._conn.execute("SELECT rowid, * FROM vms WHERE name=?", (name,)).fetchone()
        return self._vm(row) if row else None

    def vm(self, name: str) -> VmRecord:
        rec = self.find_vm(name)
        if rec is None:
            raise NotFoundError(f"no VM named {name!r}; see `fusuma vm list`.")
        return rec

    def add_vm(self, v: VmRecord,
               uids: range = DEFAULT_VM_UIDS) -> VmRecord:
        """Store ``v`` with the lowest uid of ``uids`` (``Paths.vm_uids``) no record
        holds; returns it with that uid."""
        try:
            with self.atomic():
                if self.find_vm(v.name) is not None:
                    raise ConflictError(f"a VM named {v.name!r} already exists.")
                uid = ids.free_id(self._conn, uids, "vm")
                cur = self._conn.execute(
                    "INSERT INTO vms (name, partition, vcpus, memory_mib, image, disks, "
                    "accel, autostart, state, pid, accel_used, qemu_binary, started_at, "
                    "error, created_at, shared_ram, ram_path, qos, segments, mergeable, "
                    "ports, overhead_mib, machine, emulator, page_reporting, template, uid, "
                    "boot, memory_class, memory_min) "
                    "VALUES (?,?,?,?,?,?,?,?,?,?,?,?,?,?,?,?,?,?,?,?,?,?,?,?,?,?,?,?,?,?)",
                    (v.name, v.partition, v.vcpus, v.memory_mib, v.image,
                     json.dumps(v.disks), v.accel, int(v.autostart), v.state.value, v.pid,
                     v.accel_used, v.qemu_binary, v.started_at, v.error, v.created_at,
                     int(v.shared_ram), v.ram_path, v.qos, json.dumps(v.segments),
                     int(v.mergeable), json.dumps(v.ports), v.overhead_mib, v.machine,
                     v.emulator, None if v.page_reporting is None else int(v.page_reporting),
                     v.template, uid, v.boot, v.memory_class, v.memory_min))
                self._emit("lifecycle", "vm-created", f"/1.0/vms/{v.name}",
                           {"partition": v.partition})
        except sqlite3.IntegrityError as exc:
            raise ConflictError(f"a VM named {v.name!r} already exists.") from exc
        return replace(v, uid=uid, slot=int(cur.lastrowid or 0))

    # Columns a VM's record may change after its definition; the state is not one of
    # them: it moves only through ``transition``.
    VM_FIELDS = frozenset({"partition", "vcpus", "memory_mib", "disks", "pid", "accel_used",
                           "qemu_binary", "started_at", "error", "ram_path", "qos",
                           "segments", "ports", "overhead_mib", "machine", "devices",
                           "qemu_version", "emulator"})

    @staticmethod
    def _column_value(value: object) -> object:
        if isinstance(value, list):
            return json.dumps(value)
        if isinstance(value, bool):
            return int(value)
        return value

    def set_vm(self, name: str, *, expect: VmState | None = None, **fields: Any) -> None:
        """Change some columns of a VM (never a blind write of the whole record).

        With ``expect``, only while the VM is in that state (a conditional update)."""
        bad = set(fields) - self.VM_FIELDS
        if bad:
            raise ValueError(f"not a changeable VM field: {sorted(bad)}")
        if not fields:
            return
        cols = ", ".join(f"{k}=?" for k in fields)
        args = [self._column_value(v) for v in fields.values()]
        sql = f"UPDATE vms SET {cols} WHERE name=?"
        args.append(name)
        if expect is not None:
            sql += " AND state=?"
            args.append(expect.value)
        cur = self._conn.execute(sql, args)
        if cur.rowcount == 0:
            rec = self.vm(name)
            raise StateError(f"VM {name!r} is {rec.state.value}, no longer "
                             f"{expect.value if expect else rec.state.value}; see "
                             "`fusuma ps`.")

    def transition(self, name: str, to: VmState, *,
                   expect: frozenset[VmState] | set[VmState] | None = None,
                   **fields: Any) -> VmRecord:
        """Move VM ``name`` to state ``to`` (and set ``fields``) if the table allows it.

        One IMMEDIATE transaction reads the state and writes it back conditionally, so
        of two processes racing on one VM exactly one succeeds; the other gets a
        StateError naming the state it found. Inside a caller's transaction (see
        :meth:`atomic`) it is one step of that one."""
        bad = set(fields) - self.VM_FIELDS
        if bad:
            raise ValueError(f"not a changeable VM field: {sorted(bad)}")
        with self.atomic():
            cur = self.vm(name)
            if expect is not None and cur.state not in expect:
                want = " or ".join(sorted(s.value for s in expect))
                raise StateError(f"VM {name!r} is {cur.state.value}, not {want}; see "
                                 "`fusuma ps`.")
            check_transition(name, cur.state, to)
            cols = ", ".join(["state=?", *(f"{k}=?" for k in fields)])
            args = [to.value, *(self._column_value(v) for v in fields.values()),
                    name, cur.state.value]
            self._conn.execute(f"UPDATE vms SET {cols} WHERE name=? AND state=?", args)
            action = lifecycle_action(cur.state, to)
            if action is not None:
                ctx: dict[str, Any] = {"partition": fields.get("partition", cur.partition),
                                       "from_state": cur.state.value}
                if fields.get("pid"):
                    ctx["pid"] = fields["pid"]
                if fields.get("error"):
                    ctx["error"] = fields["error"]
                self._emit("lifecycle", action, f"/1.0/vms/{name}", ctx)
        return self.vm(name)

    def remove_vm(self, name: str) -> None:
        """Delete a VM's record: only while it is stopped or crashed and has no job
        (but its delete's, or the restore's that was making it)."""
        states = ",".join("?" * len(DELETABLE))
        cur = self._conn.execute(
            f"DELETE FROM vms WHERE name=? AND state IN ({states}) AND NOT EXISTS "
            "(SELECT 1 FROM jobs WHERE obj=? AND kind NOT IN (?, ?))",
            (name, *(s.value for s in DELETABLE), f"vm:{name}", JobKind.DELETE.value,
             JobKind.RESTORE.value))
        if cur.rowcount:
            self.emit("lifecycle", "vm-deleted", f"/1.0/vms/{name}")
        if cur.rowcount == 0 and self.find_vm(name) is not None:
            rec = self.vm(name)
            job = self.find_job(f"vm:{name}")
            if job is not None and job.kind not in (JobKind.DELETE, JobKind.RESTORE):
                raise StateError(busy_sentence(job))
            raise StateError(f"VM {name!r} is {rec.state.value}; stop it before deleting it.")

    # -- jobs ---------------------------------------------------------------------
    @staticmethod
    def _job(row: sqlite3.Row) -> Job:
        return Job(obj=row["obj"], kind=row["kind"], phase=row["phase"],
                   owner=JobOwner(row["owner_pid"], row["owner_start"]),
                   source=row["source"], peer=row["peer"], started_at=row["started_at"],
                   updated_at=row["updated_at"], detail=json.loads(row["detail"]))

    def jobs(self) -> list[Job]:
        return [self._job(r) for r in
                self._conn.execute("SELECT * FROM jobs ORDER BY started_at").fetchall()]

    def find_job(self, obj: str) -> Job | None:
        row = self._conn.execute("SELECT * FROM jobs WHERE obj=?", (obj,)).fetchone()
        return self._job(row) if row else None

    def begin_job(self, job: Job) -> Job | None:
        """Record ``job`` if its object has none. Returns None on success, else the job
        that holds the object (alive or not: the caller decides)."""
        try:
            self._conn.execute(
                "INSERT INTO jobs (obj, kind, phase, source, peer, owner_pid, owner_start, "
                "started_at, updated_at, detail) VALUES (?,?,?,?,?,?,?,?,?,?)",
                (job.obj, job.kind, job.phase, job.source, job.peer, job.owner.pid,
                 job.owner.start, job.started_at, job.updated_at, json.dumps(job.detail)))
        except sqlite3.IntegrityError:
            held = self.find_job(job.obj)
            if held is None:     # ended meanwhile: try once more
                return self.begin_job(job)
            return held
        return None

    def set_phase(self, obj: str, owner: JobOwner, phase: str,
                  **detail: object) -> Job:
        """Record the next phase of a job this owner holds (merging ``detail``)."""
        with self.transaction():
            job = self.find_job(obj)
            if job is None or job.owner != owner:
                raise StateError(f"the job on {obj} was taken over by another process "
                                 "(recovery); stopping here.")
            merged = {**job.detail, **detail}
            self._conn.execute("UPDATE jobs SET phase=?, detail=?, updated_at=? WHERE obj=?",
                               (phase, json.dumps(merged), time.time(), obj))
        return self.find_job(obj) or job

    def decide(self, obj: str, decision: str) -> str | None:
        """Record a move's outcome once: "forward" (the destination may run the guest)
        or "back" (the source may). Returns the decision in force: the first one made.
        Whoever loses follows it, so a source never resumes after its destination ran.

        One conditional UPDATE (no read-then-write transaction): it sits in the move's
        downtime, between the completed stream and the destination's `cont`."""
        cur = self._conn.execute(
            "UPDATE jobs SET detail=json_set(detail, '$.decision', ?), updated_at=? "
            "WHERE obj=? AND json_extract(detail, '$.decision') IS NULL",
            (decision, time.time(), obj))
        if cur.rowcount:
            return decision
        job = self.find_job(obj)
        if job is None:
            return None
        have = job.detail.get("decision")
        return str(have) if have else None

    def take_over(self, obj: str, old: JobOwner, new: JobOwner) -> Job | None:
        """Become the owner of a job whose owner ``old`` died (None if someone else did)."""
        cur = self._conn.execute(
            "UPDATE jobs SET owner_pid=?, owner_start=?, updated_at=? WHERE obj=? AND "
            "owner_pid=? AND owner_start=?",
            (new.pid, new.start, time.time(), obj, old.pid, old.start))
        return self.find_job(obj) if cur.rowcount else None

    def end_job(self, obj: str, owner: JobOwner) -> None:
        self._conn.execute("DELETE FROM jobs WHERE obj=? AND owner_pid=? AND owner_start=?",
                           (obj, owner.pid, owner.start))

    # -- events -------------------------------------------------------------------
    # An append-only log that every process writes (the CLI, supervisors, the API
    # daemon), so `fusuma serve` streams and counts what any of them did. Only the
    # newest EVENTS_KEPT rows are kept.
    EVENTS_KEPT = 20000

    def emit(self, type_: str, action: str, source: str, **context: Any) -> int:
        """Append one event; returns its id."""
        return self._emit(type_, action, source, context)

    def emit_context(self, type_: str, action: str, source: str,
                     context: dict[str, Any]) -> int:
        """``emit`` with the context as one dict (keys may be any string)."""
        return self._emit(type_, action, source, context)

    def _emit(self, type_: str, action: str, source: str, context: dict[str, Any]) -> int:
        cur = self._conn.execute(
            "INSERT INTO events (ts, type, action, source, context) VALUES (?,?,?,?,?)",
            (time.time(), type_, action, source, json.dumps(context, default=str)))
        eid = int(cur.lastrowid or 0)
        if eid % 1000 == 0:
            self._conn.execute("DELETE FROM events WHERE id <= ?", (eid - self.EVENTS_KEPT,))
        return eid

    def events_since(self, after: int, limit: int = 1000) -> list[dict[str, Any]]:
        """Events with an id above ``after``, oldest first."""
        rows = self._conn.execute(
            "SELECT * FROM events WHERE id > ? ORDER BY id LIMIT ?", (after, limit)).fetchall()
        return [{"id": r["id"], "ts": r["ts"], "type": r["type"], "action": r["action"],
                 "source": r["source"], "context": json.loads(r["context"])} for r in rows]

    def last_event_id(self) -> int:
        row = self._conn.execute("SELECT MAX(id) FROM events").fetchone()
        return int(row[0] or 0)

    # -- API tokens ---------------------------------------------------------------
    def add_token(self, name: str, digest: str, role: Role) -> None:
        try:
            self._conn.execute("INSERT INTO tokens (name, hash, created_at, role) "
                               "VALUES (?,?,?,?)", (name, digest, time.time(), role.value))
        except sqlite3.IntegrityError as exc:
            raise ConflictError(f"a token named {name!r} already exists; revoke it first "
                                "or pick another name.") from exc

    @staticmethod
    def _token(row: sqlite3.Row) -> TokenRecord:
        if row["role"] is None:      # made before roles: what it could do then
            return TokenRecord(row["name"], Role.ADMIN, row["created_at"],
                               row["last_used_at"], before_roles=True)
        try:
            role = Role(row["role"])
        except ValueError:
            raise StateError(f"token {row['name']!r} has the role {row['role']!r}, which "
                             "this fusuma does not know (a newer fusuma made it?); revoke "
                             "it with `fusuma token revoke`.") from None
        return TokenRecord(row["name"], role, row["created_at"], row["last_used_at"])

    def tokens(self) -> list[TokenRecord]:
        rows = self._conn.execute("SELECT * FROM tokens ORDER BY name").fetchall()
        return [self._token(r) for r in rows]

    def token_by_hash(self, digest: str) -> TokenRecord | None:
        row = self._conn.execute("SELECT * FROM tokens WHERE hash=?", (digest,)).fetchone()
        return self._token(row) if row else None

    def token_used(self, name: str) -> None:
        self._conn.execute("UPDATE tokens SET last_used_at=? WHERE name=?",
                           (time.time(), name))

    def remove_token(self, name: str) -> None:
        cur = self._conn.execute("DELETE FROM tokens WHERE name=?", (name,))
        if cur.rowcount == 0:
            raise NotFoundError(f"no token named {name!r}; see `fusuma token list`.")

    # -- segments -----------------------------------------------------------------
    @staticmethod
    def _segment(row: sqlite3.Row) -> SegmentRecord:
        return SegmentRecord(name=row["name"], path=row["path"],
                             size_bytes=row["size_bytes"], source=row["source"],
                             created_at=row["created_at"])

    def segments(self) -> list[SegmentRecord]:
        rows = self._conn.execute("SELECT * FROM segments ORDER BY name").fetchall()
        return [self._segment(r) for r in rows]

    def find_segment(self, name: str) -> SegmentRecord | None:
        row = self._conn.execute("SELECT * FROM segments WHERE name=?", (name,)).fetchone()
        return self._segment(row) if row else None

    def segment(self, name: str) -> SegmentRecord:
        rec = self.find_segment(name)
        if rec is None:
            raise NotFoundError(f"no segment named {name!r}; see `fusuma segment list`.")
        return rec

    def add_segment(self, seg: SegmentRecord) -> None:
        try:
            self._conn.execute(
                "INSERT INTO segments (name, path, size_bytes, source, created_at) "
                "VALUES (?,?,?,?,?)",
                (seg.name, seg.path, seg.size_bytes, seg.source, seg.created_at))
        except sqlite3.IntegrityError as exc:
            raise ConflictError(f"a segment named {seg.name!r} already exists.") from exc

    def remove_segment(self, name: str) -> None:
        self._conn.execute("DELETE FROM segments WHERE name=?", (name,))

    # -- templates ----------------------------------------------------------------
    @staticmethod
    def _template(row: sqlite3.Row) -> TemplateRecord:
        return TemplateRecord(
            name=row["name"], ram_path=row["ram_path"], state_path=row["state_path"],
            size_bytes=row["size_bytes"], memory_mib=row["memory_mib"], vcpus=row["vcpus"],
            machine=row["machine"], qemu_version=row["qemu_version"],
            devices=row["devices"], image=row["image"],
            segments=json.loads(row["segments"]), accel=row["accel"],
            state_sha256=row["state_sha256"], source_vm=row["source_vm"],
            created_at=row["created_at"], gid=row["gid"] or 0,
            networks=json.loads(row["networks"] or "[]"))

    def templates(self) -> list[TemplateRecord]:
        rows = self._conn.execute("SELECT rowid, * FROM templates ORDER BY name").fetchall()
        return [self._template(r) for r in rows]

    def find_template(self, name: str) -> TemplateRecord | None:
        row = self._conn.execute("SELECT rowid, * FROM templates WHERE name=?",
                                 (name,)).fetchone()
        return self._template(row) if row else None

    def template(self, name: str) -> TemplateRecord:
        rec = self.find_template(name)
        if rec is None:
            raise NotFoundError(f"no template named {name!r}; see `fusuma template list`.")
        return rec

    def add_template(self, t: TemplateRecord,
                     gids: range = DEFAULT_TEMPLATE_GIDS) -> TemplateRecord:
        """Store ``t`` with the lowest gid of ``gids`` (``Paths.template_gids``) no
        record holds; returns it with that gid."""
        try:
            with self.atomic():
                gid = ids.free_id(self._conn, gids, "template")
                self._conn.execute(
                    "INSERT INTO templates (name, ram_path, state_path, size_bytes, "
                    "memory_mib, vcpus, machine, qemu_version, devices, image, segments, "
                    "accel, state_sha256, source_vm, created_at, gid, networks) "
                    "VALUES (?,?,?,?,?,?,?,?,?,?,?,?,?,?,?,?,?)",
                    (t.name, t.ram_path, t.state_path, t.size_bytes, t.memory_mib, t.vcpus,
                     t.machine, t.qemu_version, t.devices, t.image, json.dumps(t.segments),
                     t.accel, t.state_sha256, t.source_vm, t.created_at, gid,
                     json.dumps(t.networks)))
                self._emit("lifecycle", "template-created", f"/1.0/templates/{t.name}",
                           {"source_vm": t.source_vm, "memory_mib": t.memory_mib})
        except sqlite3.IntegrityError as exc:
            raise ConflictError(f"a template named {t.name!r} already exists; delete it "
                                "or pick another name.") from exc
        return replace(t, gid=gid)

    def clones_of(self, name: str) -> list[str]:
        """The VMs (whatever their state) started from template ``name``."""
        rows = self._conn.execute("SELECT name FROM vms WHERE template=? ORDER BY name",
                                  (name,)).fetchall()
        return [str(r["name"]) for r in rows]

    def remove_template(self, name: str) -> None:
        """Delete a template's record: only while no VM was cloned from it (one
        conditional statement, so a clone defined meanwhile keeps it)."""
        cur = self._conn.execute(
            "DELETE FROM templates WHERE name=? AND NOT EXISTS "
            "(SELECT 1 FROM vms WHERE template=?)", (name, name))
        if cur.rowcount:
            self.emit("lifecycle", "template-deleted", f"/1.0/templates/{name}")
            return
        users = self.clones_of(name)
        if users:
            raise StateError(f"template {name!r} is used by VM(s) {', '.join(users)}; "
                             "delete them first.")
