"""The destination supervisor's half of a live move between two hosts (issue 16).

The cluster agents orchestrate (``fusuma.cluster.hostmove``); each host's supervisor
does what it does for a move inside a host, with two differences at the destination:

- ``remote_incoming``: the incoming QEMU listens on TCP, on the address other hosts
  reach this host at (port chosen by the kernel), in copy mode (hosts share no RAM);
- nothing commits by itself when the stream completes: the outcome of a move between
  hosts is recorded in the FusumaVM (written once, with a resourceVersion
  precondition), which only the agent can reach. ``remote_incoming_wait`` tells the
  agent the stream's state; the agent records "forward" in the cluster, then in this
  host's job, then asks ``incoming-commit`` (the same op a local move uses).

The source half is the local move's own ``migrate-out`` (to the tcp: URI),
``release`` and ``resume-source``, each gated by the decision in the source host's job.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from pathlib import Path
from typing import TYPE_CHECKING, Any

from fusuma.errors import MigrationError, NotFoundError, StateError
from fusuma.host.accel import probe_accel
from fusuma.migration.supervisor_ops import Incoming, capabilities
from fusuma.partition import rpc
from fusuma.partition.supervisor_consts import INCOMING_PREFIX
from fusuma.paths import PRIVATE_DIR, ensure_dir
from fusuma.qemu import privilege
from fusuma.qemu.qmp import EVENT_MIGRATION
from fusuma.state import vm_obj

if TYPE_CHECKING:
    from fusuma.partition.supervisor import Supervisor

# The agent's job kinds for the two halves (fusuma.recovery leaves them to the agent).
SOURCE_JOB = "host-move"
DEST_JOB = "host-move-in"


async def remote_incoming(sup: Supervisor, vm: str, listen: str) -> rpc.Prepared:
    """Start a QEMU for ``vm`` waiting for a stream on ``tcp:LISTEN:<port>``."""
    rec = sup.db.vm(vm)
    if rec.partition != sup.partition:
        raise StateError(f"VM {vm!r} is defined in partition {rec.partition!r}, not "
                         f"{sup.partition!r}.")
    if vm in sup.vms or vm in sup.incoming:
        raise StateError(f"partition {sup.partition!r} already runs a QEMU for {vm!r}.")
    job = sup.db.find_job(vm_obj(vm))
    if job is None or job.kind != DEST_JOB:
        raise StateError(f"no move of {vm!r} from another host is under way.")
    ram: Path | None = (sup.paths.shm / f"{vm}.{uuid.uuid4().hex[:8]}.ram"
                        if rec.shared_ram else None)
    run = sup.paths.vm_run_dir(vm) / f"{INCOMING_PREFIX}{uuid.uuid4().hex[:8]}"
    accel = probe_accel(rec.accel_used or rec.accel).name
    t0 = time.monotonic()
    undo: list[Any] = []
    try:
        if ram is not None:
            ensure_dir(sup.paths.shm, PRIVATE_DIR)
            undo.append(lambda: sup._remove_ram(ram))
            privilege.create_ram_file(ram, privilege.uid_for(sup.paths, rec))
            charge = getattr(sup, "charge_ram", None)
            if charge is not None:
                charge(ram, rec.memory_mib)
        rt = await sup._launch(rec, accel, run, ram, "defer", undo,
                               disk_owner=rec.partition)
        rt.detached = True
        rt.owns_ram = True
        await rt.qmp.migrate_set_capabilities(capabilities("copy"))
        listener = rt.qmp.listener(EVENT_MIGRATION)
        await rt.qmp.migrate_incoming(f"tcp:{listen}:0")
        info = await rt.qmp.execute("query-migrate")
        port = next((a.get("port") for a in info.get("socket-address") or []
                     if a.get("type") == "inet"), None)
        if not port:
            raise MigrationError(f"the incoming QEMU of {vm!r} did not say which port it "
                                 f"listens on ({info}).")
    except BaseException:
        sup._undo(undo)
        raise
    sup.incoming[vm] = Incoming(rt, listener, "copy", "remote")
    sup._watch(rt)
    uri = f"tcp:{listen}:{port}"
    sup.log.info("waiting for %s from another host on %s", vm, uri)
    return rpc.Prepared(uri=uri, pid=rt.pid, run_dir=str(run),
                        prepare_ms=round((time.monotonic() - t0) * 1000, 2))


async def remote_incoming_wait(sup: Supervisor, vm: str, timeout: float = 2.0
                               ) -> rpc.StreamState:
    """The incoming stream's state, waiting up to ``timeout`` for it to end:
    ``completed`` (the guest is here, paused), ``failed``/``cancelled``, ``gone`` (the
    QEMU exited), ``running`` (already committed) or the state still in progress."""
    inc = sup.incoming.get(vm)
    if inc is None:
        if vm in sup.vms:
            return rpc.StreamState("running", sup.vms[vm].pid)
        raise NotFoundError(f"no incoming QEMU of {vm!r} in partition {sup.partition!r}.")
    rt = inc.rt
    deadline = time.monotonic() + timeout
    while True:
        if rt.exited.is_set():
            return rpc.StreamState("gone")
        status = (await rt.qmp.query_migrate()).status
        if status in ("completed", "failed", "cancelled") or time.monotonic() > deadline:
            return rpc.StreamState(status, rt.pid)
        await asyncio.sleep(0.005)
