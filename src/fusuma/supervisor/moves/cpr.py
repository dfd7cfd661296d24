"""The supervisor's half of an in-place move: QEMU's ``cpr-transfer`` (QEMU >= 10.0).

    fusuma maintain P --in-place        (orchestrated by ``fusuma.migration.inplace``)

A new QEMU process in the VM's own partition takes the guest over from the old one.
Guest RAM is neither copied nor re-opened: the old QEMU hands the new one the
descriptor of every RAM block over a UNIX socket (SCM_RIGHTS), and only device state
goes through the migration stream. The protocol, as QEMU 10.0 implements it
(docs/devel/migration/CPR.rst, qapi/migration.json):

1. ``prepare``: the new QEMU starts like any move's destination (``-S -incoming
   defer``) plus a second ``-incoming`` naming the cpr channel as JSON
   (``{"channel-type": "cpr", "addr": {"transport": "socket", "type": "unix", ...}}``).
   It listens on that socket and blocks there *before* it creates its devices and its
   monitor: it has no QMP socket yet. The cpr channel can only be given on the
   command line.
2. ``transfer``, old QEMU: ``migrate-set-parameters mode=cpr-transfer``, then
   ``migrate`` with ``channels``: ``main`` (unix migrate.sock) and ``cpr`` (unix
   cpr.sock). It writes the cpr state (the descriptors) at once, then waits for the
   new QEMU to hang up the cpr channel before it connects the main one. The guest runs
   on meanwhile, so the new QEMU's start is not downtime.
3. new QEMU: it builds the machine on the descriptors it received and opens QMP;
   ``migrate-incoming unix:migrate.sock`` makes it listen there and close the cpr
   channel (that hang-up is the old QEMU's signal).
4. old QEMU connects the main channel, stops the guest (cpr always stops it before it
   saves anything: no dirty tracking), sends the device state and enters postmigrate.
5. From here it is a zero-copy move's end (``fusuma.supervisor.moves.dest`` and ``source``):
   the new QEMU stays paused (-S) until "forward" is recorded and only then runs
   (``dest.commit``); the old one quits only then (``source.release``), or runs on if
   "back" is recorded
   (``source.resume``). Never two QEMUs running one guest.

Requirements, checked before anything starts (``fusuma.migration.inplace``): both
QEMUs >= 10.0; the old one started with ``-machine aux-ram-share=on`` (RAM QEMU
allocates by itself, ROMs and firmware, lives in memfds it can pass on) and the guest's
RAM in a ``share=on`` backend (fusuma's shared RAM file). The sandbox (``-sandbox
...,spawn=deny``) lets both through: memfd_create and SCM_RIGHTS are not denied.

If the new QEMU dies before step 4, the old one sees the cpr channel hang up, cannot
connect the main channel, and its migration fails with the guest never stopped; after
step 4 its migration fails and QEMU resumes the guest itself. Either way the move is
resolved "back" (``migration.resolve``): the VM stays on its old QEMU, running.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from pathlib import Path
from typing import Any

from fusuma.errors import FusumaError, MigrationError, QemuError, StateError
from fusuma.host.accel import probe_accel
from fusuma.network import queues
from fusuma.qemu import process
from fusuma.qemu.instance import QemuInstance, Role
from fusuma.qemu.qmp import EVENT_MIGRATION, EVENT_STOP, event_time
from fusuma.qemu.versions import CPR_MIN_VERSION as MIN_VERSION_TEXT
from fusuma.qemu.versions import CPR_MODE as MODE
from fusuma.qemu.versions import has_cpr
from fusuma.state import Job, JobKind, VmRecord, VmState, vm_obj
from fusuma.supervisor import rpc
from fusuma.supervisor.host import PartitionHost
from fusuma.supervisor.moves.dest import (
    MoveIn,
    incoming,
    incoming_run_dir,
    planned_handover,
    resume_when_complete,
    taps_of,
)
from fusuma.supervisor.moves.source import leaving, set_mode
from fusuma.undo import Reverter

CPR_SOCKET = "cpr.sock"
MAIN_SOCKET = "migrate.sock"
# Both sides of a migration must agree on x-ignore-shared (QEMU checks the source's
# capabilities on load); in cpr-transfer mode every RAM block is skipped anyway.
# (Every stream capability is named: ``Qmp.set_stream_capabilities``.)
CAPABILITIES = {"x-ignore-shared": True, "events": True, "multifd": False,
                "pause-before-switchover": False}
# How long the new QEMU may take to open its monitor once it has its descriptors.
CONNECT_TIMEOUT_S = 30.0


# -- adoption ---------------------------------------------------------------------------
def in_place_side(job: Job | None, partition: str, rec: VmRecord | None,
                  pid: int) -> Role | None:
    """Which side of an in-place move in ``partition`` the QEMU ``pid`` is, for a
    supervisor adopting it: INCOMING (the new QEMU, while the record still names the
    old one), LEAVING (the old one, once the record names the new one), or None (no
    in-place move, or the QEMU the record names)."""
    if job is None or job.kind != JobKind.MIGRATE or not job.source == job.peer == partition:
        return None
    if rec is not None and rec.partition == partition and rec.pid == pid:
        return None
    if rec is not None and rec.pid is not None and rec.pid == job.detail.get("source_pid"):
        return Role.INCOMING
    return Role.LEAVING


# -- the new QEMU -------------------------------------------------------------------------
async def prepare(h: PartitionHost, vm: str, fault_decide_delay: float = 0.0) -> rpc.Prepared:
    """Start the new QEMU of an in-place move, waiting on its cpr channel."""
    rec = h.db.vm(vm)
    old = h.instances.get(vm)
    if rec.partition != h.partition or old is None:
        raise StateError(f"VM {vm!r} does not run in partition {h.partition!r}.")
    if h.instances.get(vm, Role.INCOMING) or h.instances.get(vm, Role.LEAVING):
        raise StateError(f"partition {h.partition!r} already runs a second QEMU for "
                         f"{vm!r}.")
    job = h.db.find_job(vm_obj(vm))
    if job is None or job.kind != JobKind.MIGRATE or job.peer != h.partition \
            or job.source != h.partition:
        raise StateError(f"no in-place move of {vm!r} is under way.")
    if not (rec.shared_ram and rec.ram_path):
        raise StateError(f"VM {vm!r} has private RAM; cpr-transfer hands over RAM in a "
                         "shared file only.")
    q = h.qemu()
    if not has_cpr(q):
        raise StateError(f"the QEMU of partition {h.partition!r} ({q.version}) lacks "
                         f"{MODE} (QEMU >= {MIN_VERSION_TEXT}).")
    run = incoming_run_dir(h, vm)
    accel = probe_accel(rec.accel_used or rec.accel).name
    t0 = time.monotonic()
    with Reverter() as rev:
        # ``control``: the VM's leaf (both of its QEMUs) gets the control weight until
        # the new QEMU runs the guest (``dest.commit``) or is ended (``dest.abort``).
        # At its class's weight beside 15 busy guests on one core, the new QEMU's start
        # and its machine's build took about 1 s each, and the downtime 100-130 ms.
        new = await h.launch(rec, accel, run, Path(str(rec.ram_path)), "defer", rev,
                             role=Role.INCOMING, owns_ram=False, cpr_socket=run / CPR_SOCKET,
                             join_taps=True, control=True)
        rev.commit()
    new.move = MoveIn(None, MODE, h.partition,
                      done=asyncio.get_running_loop().create_future(),
                      fault_decide_delay=fault_decide_delay, cpr_socket=run / CPR_SOCKET)
    new.move.handover = planned_handover(h, vm, new)
    prepare_ms = (time.monotonic() - t0) * 1000
    h.log.info("new QEMU of %s (pid %d, QEMU %s) waits for its descriptors on %s", vm,
               new.pid, q.version, run / CPR_SOCKET)
    return rpc.Prepared(pid=new.pid, prepare_ms=round(prepare_ms, 2), run_dir=str(run),
                        binary=str(q.binary), version=q.version)


async def _connect_new(new: QemuInstance, timeout: float) -> None:
    """Connect to the new QEMU's monitor, giving up as soon as it exits. Its socket
    appears once the descriptors have arrived and the machine is built: watched every
    2 ms (``Qmp.connect`` retries every 50 ms, which would all be move time).
    ``timeout`` counts the time the new QEMU could run (``process.Patience``): on a
    loaded host it may wait for a CPU longer than that, and is not given up on then."""
    patience = process.Patience(new.pid, timeout)
    while not new.qmp.socket.exists() and not new.exited.is_set() \
            and not patience.expired():
        await asyncio.sleep(0.002)
    connect = asyncio.ensure_future(new.qmp.connect(timeout=timeout))
    exited = asyncio.ensure_future(new.exited.wait())
    try:
        await asyncio.wait({connect, exited}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        exited.cancel()
    if not connect.done():
        connect.cancel()
        with contextlib.suppress(asyncio.CancelledError, FusumaError):
            await connect
        raise MigrationError(f"the new QEMU of {new.vm!r} (pid {new.pid}) exited before "
                             "it took the guest's descriptors.")
    connect.result()


async def _migration_end(old: QemuInstance, listener: Any, timeout: float) -> str:
    """Wait for the old QEMU's migration to end, from its MIGRATION events (asking it
    only every second, in case an event was missed); the final status."""
    deadline = time.monotonic() + timeout
    while True:
        if old.exited.is_set():
            raise MigrationError(f"the old QEMU of {old.vm!r} exited during the "
                                 "cpr-transfer.")
        try:
            ev = await asyncio.wait_for(listener.get(), 1.0)
            status = str(ev.get("data", {}).get("status"))
        except TimeoutError:
            status = (await old.qmp.query_migrate()).status
        if status in ("completed", "failed", "cancelled"):
            return status
        if time.monotonic() > deadline:
            with contextlib.suppress(QemuError):
                await old.qmp.migrate_cancel()
            raise MigrationError(f"the cpr-transfer of {old.vm!r} did not finish in "
                                 f"{timeout:.0f} s and was cancelled.")


async def transfer(h: PartitionHost, vm: str, timeout: float = 600.0,
                   fault_incoming_delay: float = 0.0) -> rpc.Streamed:
    """Steps 2-4 of the module docstring: the old QEMU sends, the new one receives.

    Returns when the old QEMU has completed (it is then the move's leaving side); the
    new QEMU's own task records "forward" and runs the guest (``dest.finish``).
    ``fault_incoming_delay`` (tests): hold between step 3's descriptors and
    ``migrate-incoming``, the new QEMU built and the guest still running on the old."""
    old = h.instances.get(vm)
    found = incoming(h, vm)
    rec = h.db.vm(vm)
    if found is None and old is not None:
        raise MigrationError(f"the new QEMU of {vm!r} ended before the transfer began.")
    if old is None or found is None or found[1].mode != MODE:
        raise StateError(f"no in-place move of {vm!r} is prepared in partition "
                         f"{h.partition!r}.")
    if rec.state != VmState.MIGRATING:
        raise StateError(f"VM {vm!r} is {rec.state.value}; no move of it is under way.")
    new, move = found
    main, cpr = new.run_dir / MAIN_SOCKET, Path(str(move.cpr_socket))
    # A cpr-transfer's `migrate` registers its yank instance only once the new QEMU
    # hangs up the cpr channel, and QEMU drops that refusal unsaid: an earlier
    # stream's leftovers are cleared before it, and before the listeners.
    await old.qmp.clear_stale_stream()
    stopped = old.qmp.listener(EVENT_STOP)
    migrated = old.qmp.listener(EVENT_MIGRATION)
    hold: queues.HeaderHold | None = None
    try:
        await old.qmp.migrate_set_capabilities(CAPABILITIES)
        await old.qmp.execute("migrate-set-parameters", {"mode": MODE})
        mode = str((await old.qmp.execute("query-migrate-parameters")).get("mode"))
        if mode != MODE:
            raise MigrationError(f"the QEMU of {vm!r} did not take migration mode {MODE} "
                                 f"(it says {mode}).")
        # QEMU 10.0 carries no tap in its cpr state: the new QEMU has queues of its own
        # (``h.launch(join_taps=True)``), and its machine, built once the descriptors
        # arrive, sets each tap's header size to its default under the old QEMU, which
        # runs the guest until the main channel connects: held at the old QEMU's from
        # `migrate` until the new QEMU's monitor answers (its machine is built then).
        headers = queues.header_sizes(old.pid, taps_of(h, vm))
        hold = queues.HeaderHold(old.pid, headers)
        hold.start()
        t0 = time.time()
        await old.qmp.migrate(channels=[
            {"channel-type": "main", "addr": {"transport": "socket", "type": "unix",
                                              "path": str(main)}},
            {"channel-type": "cpr", "addr": {"transport": "socket", "type": "unix",
                                             "path": str(cpr)}}])
        try:
            await _connect_new(new, CONNECT_TIMEOUT_S)
            hold.stop()
            if headers:
                queues.restore_header(new.pid, headers)
            if hold.fixed:
                h.log.info("%s: put its taps' header size back %d time(s) while its new "
                           "QEMU built its machine", vm, hold.fixed)
            if fault_incoming_delay > 0:
                await asyncio.sleep(fault_incoming_delay)
            if new.exited.is_set():
                raise MigrationError(f"the new QEMU of {vm!r} (pid {new.pid}) ended "
                                     "before it took the device state.")
            await new.qmp.migrate_set_capabilities(CAPABILITIES)
            move.listener = new.qmp.listener(EVENT_MIGRATION)
            await new.qmp.migrate_incoming(f"unix:{main}")
        except FusumaError:
            # The old QEMU waits for the cpr channel to hang up: end the new one so it
            # does, and its migration fails with the guest never stopped.
            with contextlib.suppress(QemuError):
                await new.kill()
            with contextlib.suppress(FusumaError):
                await old.wait_migration(10.0)
            raise
        connected_ts = time.time()
        move.task = asyncio.ensure_future(resume_when_complete(h, new, move))
        # Both QEMUs and this supervisor share the partition's cores: during the
        # downtime nothing here asks the old QEMU anything (its MIGRATION events say
        # when it is done), and its results are read once the guest runs again.
        status = await _migration_end(old, migrated, timeout)
        resume_ts = None
        if status == "completed" and not move.fault_decide_delay \
                and move.done is not None:
            # Answer once the new QEMU runs the guest (or failed to): the caller's next
            # write to the state file then never queues behind the decision, which
            # sits in the guest's downtime.
            with contextlib.suppress(Exception):
                ran = await asyncio.wait_for(asyncio.shield(move.done), 10.0)
                resume_ts = ran.resume_ts
        info = await old.qmp.query_migrate()
        # Evidence that this move was a cpr-transfer, from the old QEMU itself.
        said = str((await old.qmp.execute("query-migrate-parameters")).get("mode"))
        await set_mode(old, "normal")    # should it run on ("back"), a normal QEMU again
        if info.status != "completed":
            raise MigrationError(f"cpr-transfer of {vm!r} failed "
                                 f"({info.error or info.status}).")
        stop_ts = None
        with contextlib.suppress(QemuError):
            stop_ts = event_time(await old.qmp.wait_event(stopped, 5.0))
    except FusumaError:
        if not old.exited.is_set():
            await set_mode(old, "normal")
        raise
    finally:
        if hold is not None:
            hold.stop()
        old.qmp.drop_listener(stopped)
        old.qmp.drop_listener(migrated)
    # The old QEMU is paused (postmigrate): the leaving side now, as a source is.
    leaving(h, old, owns_ram=False)
    end = time.time()

    def ms(a: float | None, b: float | None) -> str:
        return "unknown" if a is None or b is None else f"{(b - a) * 1000:.0f}"
    h.log.info("cpr-transfer of %s: the new QEMU took the descriptors, built its machine "
               "and listened in %s ms; the guest stopped %s ms after that, ran again %s ms "
               "after its stop; the old QEMU's results read %s ms later", vm,
               ms(t0, connected_ts), ms(connected_ts, stop_ts), ms(stop_ts, resume_ts),
               ms(resume_ts, end))
    return rpc.Streamed(t0=t0, connected_ts=connected_ts, stop_ts=stop_ts,
                        qemu_total_ms=info.total_ms, qemu_downtime_ms=info.downtime_ms,
                        bytes_sent=info.transferred, source_pid=old.pid, dest_pid=new.pid,
                        source_mode=said, paused=False, resume_ts=resume_ts)
