"""The uids and gids the state file hands out: each VM's QEMU runs as a uid of its own,
each template's RAM file is readable by a group of its own (fusuma.qemu.privilege,
fusuma.memshare.templates).

Two ranges that do not meet (``Paths.vm_uids``, ``Paths.template_gids``); a new record
takes the lowest id of its range that no record holds, inside the transaction that
stores it, so a deleted VM's uid is used again: the records a host move makes on each
arrival cannot use a range up. A full range is refused with one sentence. The id is
kept in the record (``vms.uid``, ``templates.gid``) and never changes.

Records from before ids were kept got them from one range, VMs counting up from its
bottom (base + rowid) and templates down from its top (base + 65536 - rowid), until
the two met; :func:`keep_legacy_ids` writes those ids into them once, so a VM keeps
the uid its QEMU, run dir and RAM file have, and new records step around them.
"""

from __future__ import annotations

import sqlite3

from fusuma.errors import ResourceError

LEGACY_RANGE = 65536        # the one range of before: VMs up from its bottom, templates down


def used(conn: sqlite3.Connection) -> set[int]:
    """Every id a VM or a template holds."""
    rows = conn.execute("SELECT uid FROM vms WHERE uid IS NOT NULL UNION "
                        "SELECT gid FROM templates WHERE gid IS NOT NULL")
    return {int(r[0]) for r in rows}


def free_id(conn: sqlite3.Connection, ids: range, kind: str) -> int:
    """The lowest id of ``ids`` that no record holds (call inside the transaction that
    stores it); ``kind`` "vm" or "template" words the refusal of a full range."""
    held = used(conn)
    for i in ids:
        if i not in held:
            return i
    if kind == "vm":
        raise ResourceError(
            f"all {len(ids)} uids fusuma keeps for VMs' QEMUs ({ids.start}-{ids.stop - 1}) "
            "are held by defined VMs; delete a VM you no longer need, and its uid is "
            "free again.")
    raise ResourceError(
        f"all {len(ids)} groups fusuma keeps for templates ({ids.start}-{ids.stop - 1}) "
        "are held by templates; delete a template you no longer need, and its group is "
        "free again.")


def keep_legacy_ids(conn: sqlite3.Connection, base: int) -> None:
    """Write into the records of a state file from before ids were kept the ids they
    were made with, ``base`` being the FUSUMA_UID_BASE of then. Once: a record with an
    id is never changed."""
    pending = conn.execute("SELECT 1 FROM vms WHERE uid IS NULL UNION ALL "
                           "SELECT 1 FROM templates WHERE gid IS NULL LIMIT 1").fetchone()
    if pending is None:
        return
    conn.execute("BEGIN IMMEDIATE")
    try:
        conn.execute("UPDATE vms SET uid = ? + rowid WHERE uid IS NULL", (base,))
        # A template's rowid past the middle never had a group (refused since).
        conn.execute("UPDATE templates SET gid = ? - rowid WHERE gid IS NULL AND "
                     "rowid < ?", (base + LEGACY_RANGE, LEGACY_RANGE // 2))
    except BaseException:
        conn.execute("ROLLBACK")
        raise
    conn.execute("COMMIT")
