"""The state file's networks and NICs (mixed into fusuma.state.db.Database)."""

from __future__ import annotations

import sqlite3
from collections.abc import Sequence

from fusuma.errors import ConflictError, NotFoundError, StateError
from fusuma.state.records import NetworkRecord, NicRecord


class NetworkTables:
    """Networks and NICs: ``_conn`` and ``emit`` are the Database's."""

    _conn: sqlite3.Connection

    def emit(self, type_: str, action: str, source: str, **context: object) -> int:
        raise NotImplementedError

    # -- networks -------------------------------------------------------------------
    @staticmethod
    def _network(row: sqlite3.Row) -> NetworkRecord:
        return NetworkRecord(name=row["name"], type=row["type"], bridge=row["bridge"],
                             subnet=row["subnet"], nat=bool(row["nat"]),
                             isolated=bool(row["isolated"]),
                             filtering=bool(row["filtering"]),
                             keeper_pid=row["keeper_pid"], created_at=row["created_at"],
                             mtu=row["mtu"])

    def networks(self) -> list[NetworkRecord]:
        rows = self._conn.execute("SELECT * FROM networks ORDER BY name").fetchall()
        return [self._network(r) for r in rows]

    def find_network(self, name: str) -> NetworkRecord | None:
        row = self._conn.execute("SELECT * FROM networks WHERE name=?", (name,)).fetchone()
        return self._network(row) if row else None

    def network(self, name: str) -> NetworkRecord:
        rec = self.find_network(name)
        if rec is None:
            known = ", ".join(n.name for n in self.networks()) or "none yet"
            raise NotFoundError(f"no network named {name!r} (known: {known}); see "
                                "`fusuma network list`.")
        return rec

    def add_network(self, n: NetworkRecord) -> None:
        try:
            self._conn.execute(
                "INSERT INTO networks (name, type, bridge, subnet, nat, isolated, "
                "filtering, keeper_pid, created_at, mtu) VALUES (?,?,?,?,?,?,?,?,?,?)",
                (n.name, n.type, n.bridge, n.subnet, int(n.nat), int(n.isolated),
                 int(n.filtering), n.keeper_pid, n.created_at, n.mtu))
        except sqlite3.IntegrityError as exc:
            raise ConflictError(f"a network named {n.name!r} (or one on bridge "
                                f"{n.bridge}) already exists.") from exc
        self.emit("lifecycle", "network-created", f"/1.0/networks/{n.name}",
                  type=n.type, bridge=n.bridge)

    def set_network_mtu(self, name: str, mtu: int) -> None:
        self._conn.execute("UPDATE networks SET mtu=? WHERE name=?", (mtu, name))

    def set_keeper_pid(self, name: str, pid: int | None) -> None:
        self._conn.execute("UPDATE networks SET keeper_pid=? WHERE name=?", (pid, name))

    def remove_network(self, name: str) -> None:
        """Delete a network's record: only while no NIC is on it (one statement)."""
        cur = self._conn.execute(
            "DELETE FROM networks WHERE name=? AND NOT EXISTS "
            "(SELECT 1 FROM nics WHERE network=?)", (name, name))
        if cur.rowcount:
            self.emit("lifecycle", "network-deleted", f"/1.0/networks/{name}")
            return
        users = self.network_users(name)
        if users:
            raise StateError(f"network {name!r} is used by VM(s) {', '.join(users)}; "
                             "delete them first.")

    # -- NICs -----------------------------------------------------------------------
    @staticmethod
    def _nic(row: sqlite3.Row) -> NicRecord:
        return NicRecord(vm=row["vm"], index=row["idx"], network=row["network"],
                         mac=row["mac"], ip=row["ip"])

    def nics(self, vm: str | None = None, network: str | None = None) -> list[NicRecord]:
        sql, args = "SELECT * FROM nics", []
        if vm is not None:
            sql, args = sql + " WHERE vm=?", [vm]
        elif network is not None:
            sql, args = sql + " WHERE network=?", [network]
        rows = self._conn.execute(sql + " ORDER BY vm, idx", args).fetchall()
        return [self._nic(r) for r in rows]

    def add_nics(self, nics: Sequence[NicRecord]) -> None:
        try:
            self._conn.executemany(
                "INSERT INTO nics (vm, idx, network, mac, ip) VALUES (?,?,?,?,?)",
                [(n.vm, n.index, n.network, n.mac, n.ip) for n in nics])
        except sqlite3.IntegrityError as exc:
            raise ConflictError(f"a NIC's MAC or address is taken already ({exc}); try "
                                "again, or give another mac= or ip=.") from exc

    def network_users(self, name: str) -> list[str]:
        """The VMs with a NIC on network ``name``."""
        rows = self._conn.execute("SELECT DISTINCT vm FROM nics WHERE network=? ORDER BY vm",
                                  (name,)).fetchall()
        return [str(r["vm"]) for r in rows]
