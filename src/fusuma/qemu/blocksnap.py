"""Typed QMP commands for internal snapshots of a running QEMU's qcow2 disks.

- the disks' snapshots together, atomically: one ``transaction`` of
  ``blockdev-snapshot-internal-sync`` actions (QEMU drains every disk first and takes
  them all or none);
- RAM and device state too: the ``snapshot-save`` job (QEMU >= 6.0), loaded back by
  ``snapshot-load`` and removed by ``snapshot-delete``. They write the migration stream
  into the qcow2 disk named ``vmstate``, so the migration capabilities apply to it:
  ``x-ignore-shared`` on would leave guest RAM in a shared file (fusuma's RAM file)
  out of the state, and both ends must agree on it. :func:`for_snapshot` turns off
  what changes the stream (:func:`stream_settings` reads it first, :func:`put_back`
  sets it again after).

The drives and their snapshots are read, and the job awaited, by fusuma.qemu.block.
"""

from __future__ import annotations

from typing import Any

from fusuma.errors import QemuError
from fusuma.qemu import block
from fusuma.qemu.qmp import Qmp

#: The one QMP job of fusuma's snapshots (one at a time per VM: its job lock).
JOB_ID = "fusuma-snapshot"
#: Capabilities that change what a snapshot's stream holds: off while one is written
#: or read.
STREAM_CAPS = ("x-ignore-shared", "multifd", "mapped-ram", "pause-before-switchover")
SNAPSHOT_QEMU = (6, 0)


async def snapshot_disks(qmp: Qmp, ids: list[str], name: str) -> None:
    """Internal snapshot ``name`` of every drive in ``ids``, in one transaction."""
    await qmp.execute("transaction", {"actions": [
        {"type": "blockdev-snapshot-internal-sync", "data": {"device": d, "name": name}}
        for d in ids]}, timeout=300.0)


async def delete_internal(qmp: Qmp, drive: str, name: str) -> None:
    await qmp.execute("blockdev-snapshot-delete-internal-sync",
                      {"device": drive, "name": name}, timeout=300.0)


async def capabilities(qmp: Qmp) -> dict[str, bool]:
    """The migration capabilities of :data:`STREAM_CAPS` this QEMU has, and their
    state."""
    reply = await qmp.execute("query-migrate-capabilities")
    return {str(c["capability"]): bool(c["state"]) for c in reply
            if isinstance(c, dict) and c.get("capability") in STREAM_CAPS}


async def stream_settings(qmp: Qmp) -> dict[str, Any]:
    """What of the migration settings changes a snapshot's stream, as set now: the
    capabilities of :data:`STREAM_CAPS` and the migration mode (QEMU >= 8.2; a QEMU
    made by an in-place move may be left in ``cpr-transfer``, which skips RAM)."""
    params = await qmp.execute("query-migrate-parameters")
    mode = params.get("mode") if isinstance(params, dict) else None
    return {"caps": await capabilities(qmp), "mode": None if mode is None else str(mode)}


async def put_back(qmp: Qmp, settings: dict[str, Any]) -> None:
    """Set what :func:`stream_settings` read (a job's record of it: checked)."""
    caps = settings.get("caps")
    if isinstance(caps, dict) and caps:
        await qmp.migrate_set_capabilities({str(k): bool(v) for k, v in caps.items()
                                            if k in STREAM_CAPS})
    mode = settings.get("mode")
    if isinstance(mode, str) and mode in ("normal", "cpr-reboot", "cpr-transfer",
                                          "cpr-exec"):
        await qmp.migrate_set_parameters({"mode": mode})


async def for_snapshot(qmp: Qmp, before: dict[str, Any]) -> None:
    """Turn off what would change a snapshot's stream (x-ignore-shared above all, a
    cpr mode), given what is set now (:func:`stream_settings`); checked."""
    caps = before["caps"]
    if any(caps.values()):
        await qmp.migrate_set_capabilities({k: False for k, on in caps.items() if on})
    if before["mode"] not in (None, "normal"):
        await qmp.migrate_set_parameters({"mode": "normal"})
    after = await stream_settings(qmp)
    if any(after["caps"].values()) or after["mode"] not in (None, "normal"):
        kept = [k for k, v in after["caps"].items() if v]
        if after["mode"] not in (None, "normal"):
            kept.append(f"mode {after['mode']}")
        raise QemuError(f"QEMU kept {', '.join(kept)}; a snapshot of the RAM would leave "
                        "the RAM out.")


async def run_job(qmp: Qmp, command: str, args: dict[str, Any], timeout: float) -> None:
    """Run a snapshot job (``snapshot-save``, ``-load``, ``-delete``) to its end; its
    failure as one sentence with QEMU's words (``block.JobFailed``)."""
    await qmp.execute(command, {"job-id": JOB_ID, **args})
    await block.wait(qmp, [JOB_ID], timeout, command)


async def save(qmp: Qmp, name: str, vmstate: str, nodes: list[str], timeout: float) -> None:
    await run_job(qmp, "snapshot-save", {"tag": name, "vmstate": vmstate, "devices": nodes},
                  timeout)


async def load(qmp: Qmp, name: str, vmstate: str, nodes: list[str], timeout: float) -> None:
    await run_job(qmp, "snapshot-load", {"tag": name, "vmstate": vmstate, "devices": nodes},
                  timeout)
