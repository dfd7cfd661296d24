"""A move's source side, in the source partition's supervisor.

``perform`` streams the VM and reports (its QEMU is then the LEAVING side: the
destination, or a recovery, decides whether the guest moves on); ``confirm`` ends the
source once the outcome is "forward" (``release``) or runs it again once the outcome
is "back" (``resume``). ``instances`` tells recovery what this supervisor holds of a
VM, asking QEMU.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from typing import Any

from qemu.qmp import EventListener

from fusuma.errors import FusumaError, MigrationError, QemuError, StateError
from fusuma.frozen import frozen
from fusuma.qemu import block, privilege, tlscreds
from fusuma.qemu.cmdline import BOOT_DRIVE
from fusuma.qemu.instance import QemuInstance, Role, run_again
from fusuma.qemu.qmp import EVENT_MIGRATION, EVENT_STOP, MigrationInfo, Qmp, event_time
from fusuma.state import Decision, VmState, vm_obj
from fusuma.supervisor import rpc
from fusuma.supervisor.host import PartitionHost

MODES = ("zero-copy", "copy")
# QEMU before 9.0 loses TCG guest writes from the dirty bitmap during pre-copy
# (fixed upstream by 03bfc2188f06 "physmem: Fix migration dirty bitmap coherency with
# TCG memory access"): a live copy migration can hand the destination stale pages.
# Under TCG with such a QEMU, copy mode pauses the guest for the transfer instead.
TCG_DIRTY_FIX = (9, 0)


# The most parallel channels (QEMU's multifd) a stream between hosts may use.
MAX_CHANNELS = 8


def capabilities(mode: str, channels: int = 1, mirror: bool = False,
                 late_block: bool = False) -> dict[str, bool]:
    """A move's migration capabilities (every one named, so that a QEMU's earlier move
    leaves nothing behind): RAM out of the stream for zero-copy; ``channels`` > 1
    sends it over that many connections (multifd); with a disk ``mirror`` the stream
    stops before the switch (``pause-before-switchover``), its guest paused and its
    disks still active, so that the mirror ends there, as libvirt's does. At a
    destination whose disks are the source's very files (shared storage),
    ``late_block``: its images stay inactive when the stream completes and are
    activated by the ``cont`` after "forward" (QEMU activates them at once otherwise,
    while a "back" would leave the source to write them too)."""
    return {"x-ignore-shared": mode == "zero-copy", "events": True,
            "multifd": channels > 1, "pause-before-switchover": mirror,
            "late-block-activate": late_block}


# A stream over several channels (only moves between hosts, under TLS) is compressed:
# QEMU's multifd then hands TLS one buffer per packet instead of one iovec per page,
# which QEMU 10.0 turns into one TLS record and one send each, and the network carries
# about 2.5 times fewer bytes (docs/results/cluster-tls-zstd.json). Level 1: zstd's
# fastest, the CPU it costs is the move's time on a host where QEMUs share cores.
MULTIFD_COMPRESSION = {"multifd-compression": "zstd", "multifd-zstd-level": 1}


async def set_channels(qmp: Qmp, channels: int) -> None:
    """Capabilities are set already; with multifd, how many channels (both sides) and
    their compression (``MULTIFD_COMPRESSION``: both sides set the same)."""
    if not 1 <= channels <= MAX_CHANNELS:
        raise StateError(f"a move uses 1 to {MAX_CHANNELS} channels, not {channels}.")
    if channels > 1:
        await qmp.migrate_set_parameters({"multifd-channels": channels})
        try:
            await qmp.migrate_set_parameters(MULTIFD_COMPRESSION)
        except QemuError as e:
            raise StateError(f"this QEMU cannot compress a move's stream with zstd ({e}); "
                             "moves between hosts need a QEMU built with zstd.") from e


async def perform(h: PartitionHost, vm: str, uri: str, mode: str,
                  timeout: float = 600.0, max_bandwidth: int = 0, tls_peer: str = "",
                  plain_tcp: bool = False, channels: int = 1, nbd: str = "",
                  mirror_speed: int = 0) -> rpc.Streamed:
    """Stream ``vm`` to ``uri``. To another host (a ``tcp:`` URI) the stream goes under
    TLS to host ``tls_peer`` (``fusuma.qemu.tlscreds``): its certificate must name that
    host, this host's certificate proves who sends; ``plain_tcp`` sends it in the clear
    (the benchmark's before, never the agents' default); over ``channels`` connections
    (as many as the destination prepared). With ``nbd`` (the destination's export,
    tcp:ADDRESS:PORT) the thin disk's top layer is mirrored there first, under the
    same TLS, and the mirror ends once the guest is paused, before the switch."""
    inst = h.instances.get(vm)
    rec = h.db.vm(vm)
    if inst is None:
        raise StateError(f"VM {vm!r} is {rec.state.value}, not running in partition "
                         f"{h.partition!r}.")
    if rec.state != VmState.MIGRATING:
        raise StateError(f"VM {vm!r} is {rec.state.value}; no move of it is under way.")
    inst.resumed_back = False
    creds = None
    if uri.startswith("tcp:") and not plain_tcp:
        if not tls_peer:
            raise StateError(f"the stream of {vm!r} to {uri} leaves this host: it must be "
                             "encrypted to a named destination host.")
        creds = tlscreds.require(h.paths)
    if nbd and (not uri.startswith("tcp:") or rec.boot == "kernel"):
        raise StateError(f"only a VM with a thin disk moving to another host has its "
                         f"disk mirrored, not {vm!r}.")
    # What an earlier stream of this QEMU left (a failed one not yet cleaned up, the
    # "setup" a refused `migrate` leaves) goes before the listener takes this
    # stream's events and before the capabilities, which QEMU refuses meanwhile.
    await inst.qmp.clear_stale_stream()
    listener = inst.qmp.listener(EVENT_STOP, EVENT_MIGRATION)
    paused = False
    move_tls = None
    mirroring = False
    inst.streaming = True
    try:
        await inst.qmp.migrate_set_capabilities(capabilities(mode, channels, bool(nbd)))
        await set_channels(inst.qmp, channels)
        if creds is not None:
            move_tls = await tlscreds.arm(inst.qmp, inst.run_dir,
                                          privilege.uid_for(h.paths, rec), creds,
                                          tlscreds.CLIENT, tls_peer)
        if max_bandwidth > 0:     # fault injection (tests): a stream slow enough to hit
            await inst.qmp.execute("migrate-set-parameters",
                                   {"max-bandwidth": max_bandwidth})
        if mode == "copy" and await _tcg_dirty_bug(inst, rec.accel_used):
            paused = True
        if nbd:
            where, _, port = nbd.removeprefix("tcp:").rpartition(":")
            node = (await block.drives(inst.qmp))[BOOT_DRIVE].node
            mirroring = True
            await block.mirror_start(inst.qmp, node, where, int(port),
                                     move_tls.creds_id if move_tls else None,
                                     tls_peer or None, mirror_speed)
            await block.mirror_ready(inst.qmp, timeout)
        t0 = time.time()
        if paused:
            await inst.qmp.stop()
        if mode == "zero-copy":
            # Device state only: the guest is paused for nearly all of the stream, and
            # its QEMU does the move's work then, whatever busy VM shares its cores.
            h.control_cpu(vm)
        await inst.qmp.migrate(uri)
        if nbd:
            await _until_switchover(inst, timeout)
            await block.mirror_finish(inst.qmp, timeout)
            mirroring = False
            await inst.qmp.execute("migrate-continue", {"state": "pre-switchover"})
        end = await stream_end(inst, listener, timeout)
        if end.status == "completed" and uri.startswith("unix:"):
            await outcome_or(h, vm, DECIDED_WAIT_S)
        # QEMU's own figures, asked once the stream has ended (not while it stops the
        # guest and sends the device state: no QMP command reaches it then).
        info = await final_figures(inst.qmp)
        if end.status != "completed" or info.status != "completed":
            raise MigrationError(f"migration of {vm!r} failed "
                                 f"({info.error or info.status or end.status}).")
        stop_ts, completed_ts = end.stop_ts, end.completed_ts
    except BaseException:
        if inst.resumed_back:     # "back" was decided meanwhile: the guest runs here
            with contextlib.suppress(QemuError, MigrationError):
                await run_again(inst)
        if not inst.exited.is_set():    # a failed stream: the guest runs on here
            h.class_cpu(vm, inst.pid)
        raise
    finally:
        inst.streaming = False
        inst.qmp.drop_listener(listener)
        if mirroring:     # the stream, if begun, cannot switch without the disk
            with contextlib.suppress(QemuError):
                await inst.qmp.migrate_cancel()
            await block.mirror_abort(inst.qmp)
        if move_tls is not None:
            await tlscreds.drop(inst.qmp, move_tls)
    # The stream is complete; this QEMU is paused ("postmigrate"). It is the leaving
    # side now: the destination (or recovery) decides whether the guest moves on.
    # Unless "back" was decided while it streamed (an agent restarted mid-move decides
    # so and asks ``resume``, which found the guest still running and had nothing to
    # do, and may have ended the job since): then the guest runs on here, as decided.
    # Checked with no await before ``leaving``, so a ``resume`` after it finds the
    # paused guest and runs it.
    if inst.resumed_back or decided_back(h, vm):
        inst.resumed_back = False
        await run_again(inst)
        h.class_cpu(vm, inst.pid)
        h.follow_runstate(inst)
        raise MigrationError(f"the move of {vm!r} was decided back while it streamed; "
                             "the guest runs on here.")
    leaving(h, inst, owns_ram=mode == "copy")
    return rpc.Streamed(t0=t0, stop_ts=stop_ts, qemu_total_ms=info.total_ms,
                        qemu_downtime_ms=info.downtime_ms, bytes_sent=info.transferred,
                        source_pid=inst.pid, paused=paused, completed_ts=completed_ts)


async def _until_switchover(inst: QemuInstance, timeout: float) -> None:
    """Wait until the stream stopped before the switch (``pre-switchover``: the guest
    paused, its disks still this QEMU's); MigrationError if it ended otherwise."""
    info = await inst.wait_migration(timeout, until=("pre-switchover",))
    if info.status != "pre-switchover":
        raise MigrationError(f"migration of {inst.vm!r} failed "
                             f"({info.error or info.status}).")


@frozen
class StreamEnd:
    """How a source QEMU's stream ended, by its own events: the MIGRATION status
    (completed, failed, cancelled) and the times of its STOP and "completed"."""

    status: str
    stop_ts: float | None = None
    completed_ts: float | None = None


END_STATES = ("completed", "failed", "cancelled")


async def stream_end(inst: QemuInstance, listener: EventListener, timeout: float
                     ) -> StreamEnd:
    """Wait for the stream of ``inst`` (a source QEMU with the ``events`` capability,
    ``listener`` taking its STOP and MIGRATION events since before ``migrate``) to end:
    its MIGRATION event says so, so no ``query-migrate`` polls it meanwhile (each a
    round trip its main loop serves, on the partition's core, while the migration
    thread stops the guest and saves the device state). Cancelled after ``timeout``;
    refused once the process has exited."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    stop_ts: float | None = None
    exited = asyncio.ensure_future(inst.exited.wait())
    try:
        while True:
            got = asyncio.ensure_future(listener.get())
            done, _ = await asyncio.wait({got, exited}, timeout=max(0.0, deadline - loop.time()),
                                         return_when=asyncio.FIRST_COMPLETED)
            if got not in done:
                got.cancel()
                if exited in done:
                    raise MigrationError(f"the source QEMU of {inst.vm!r} exited during "
                                         "migration.")
                with contextlib.suppress(QemuError):
                    await inst.qmp.migrate_cancel()
                raise MigrationError(f"migration of {inst.vm!r} did not finish in "
                                     f"{timeout:.0f} s and was cancelled.")
            ev: Any = got.result()
            if ev.get("event") == EVENT_STOP:
                stop_ts = event_time(ev)
                continue
            status = str(ev.get("data", {}).get("status"))
            if status in END_STATES:
                return StreamEnd(status, stop_ts,
                                 event_time(ev) if status == "completed" else None)
    finally:
        exited.cancel()


# How long a source whose stream completed waits for the destination's decision before
# it reports anyway (``outcome_or``), and how often it looks. A destination on this host
# records it a few milliseconds after the stream's end; one that takes longer (a busy
# host, a test holding the move before its decision) gets the report all the same.
DECIDED_WAIT_S = 0.1
DECIDED_POLL_S = 0.0005


def decided_back(h: PartitionHost, vm: str) -> bool:
    """Whether the move of ``vm`` is recorded as "back" in this host's job."""
    job = h.db.find_job(vm_obj(vm))
    return job is not None and job.detail.get("decision") == Decision.BACK


async def outcome_or(h: PartitionHost, vm: str, limit: float) -> bool:
    """Wait until the move's outcome is recorded, at most ``limit`` seconds; whether it
    was. A move on this host: the destination records it within a few milliseconds of
    the stream's end, and until then it is loading the device state and running the
    guest (the move's downtime) on its partition's cores. The report this source sends
    next sets the CLI and then the destination's supervisor working (the next steps'
    requests): sent at once, that work lands on the destination's cores in the pause
    and lengthens it (measured: ``bench vmbeam``'s before and after). Looking meanwhile
    costs only this partition's core, idle once its QEMU has sent the stream: a read of
    the state file, which never blocks the destination's write."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + limit
    while True:
        job = h.db.find_job(vm_obj(vm))
        if job is None or job.detail.get("decision") is not None:
            return job is not None
        if loop.time() >= deadline:
            return False
        await asyncio.sleep(DECIDED_POLL_S)


async def final_figures(qmp: Qmp, tries: int = 20) -> MigrationInfo:
    """``query-migrate`` once the stream ended. QEMU sends MIGRATION "completed" just
    before it computes the total and downtime it reports: asked at once, it may still
    say 0 for both, so ask again a few times (1 ms apart)."""
    info = await qmp.query_migrate()
    for _ in range(tries):
        if info.status != "completed" or info.total_ms:
            break
        await asyncio.sleep(0.001)
        info = await qmp.query_migrate()
    return info


def leaving(h: PartitionHost, inst: QemuInstance, owns_ram: bool) -> None:
    """The VM's QEMU whose stream completed becomes the move's leaving side."""
    inst.owns_ram = owns_ram
    if inst.role == Role.RUNNING and h.instances.get(inst.vm) is inst \
            and not inst.exited.is_set():
        h.instances.change(inst, Role.LEAVING)


async def _tcg_dirty_bug(inst: QemuInstance, accel: str | None) -> bool:
    """True if this QEMU runs the guest under TCG and predates the dirty-bitmap fix."""
    if accel != "tcg":
        return False
    try:
        ver = (await inst.qmp.execute("query-version"))["qemu"]
        return (int(ver["major"]), int(ver["minor"])) < TCG_DIRTY_FIX
    except (QemuError, KeyError, TypeError, ValueError):
        return True


async def release(h: PartitionHost, vm: str, timeout: float = 10.0) -> rpc.Ended:
    """End the source QEMU of a move whose outcome is "forward"."""
    inst = h.instances.get(vm, Role.LEAVING)
    if inst is None:
        cand = h.instances.get(vm)
        rec = h.db.find_vm(vm)
        if cand is None or rec is None or (rec.partition == h.partition
                                           and rec.pid == cand.pid):
            return rpc.Ended(vm, was="gone")
        inst = cand     # a source the record no longer names (adopted after a crash)
    job = h.db.find_job(vm_obj(vm))
    decision = job.detail.get("decision") if job else None
    if job is not None and decision != Decision.FORWARD:
        raise MigrationError(f"the source QEMU of {vm!r} is kept: the move's outcome is "
                             f"{decision or 'not decided'}.")
    if inst.role == Role.RUNNING:
        h.instances.change(inst, Role.LEAVING)
    h.instances.remove(inst)
    await inst.stop(timeout)
    done = time.monotonic()
    quit_ms = handled_ms = None
    if inst.quit_at is not None and inst.gone_at is not None:
        quit_ms = round((inst.gone_at - inst.quit_at) * 1000, 2)
        handled_ms = round((done - inst.gone_at) * 1000, 2)
    h.log.info("released the source QEMU of %s (pid %d): quit took %s ms, its exit's "
               "handling %s ms", vm, inst.pid, quit_ms, handled_ms)
    return rpc.Ended(vm, was="released", pid=inst.pid, quit_ms=quit_ms,
                     handled_ms=handled_ms)


async def resume(h: PartitionHost, vm: str) -> rpc.Resumed:
    """Run the source again: only once the move's outcome is recorded as "back"."""
    inst = h.instances.get(vm, Role.LEAVING) or h.instances.get(vm)
    if inst is None or inst.exited.is_set():
        raise MigrationError(f"the source QEMU of {vm!r} is gone.")
    decision = h.db.decide(vm_obj(vm), Decision.BACK)
    if decision not in (Decision.BACK, None):
        raise MigrationError(f"the source of {vm!r} must not run again: its destination "
                             "may already have run the guest.")
    inst.resumed_back = True     # a stream still running must end with the guest here
    if not inst.streaming:
        await end_unowned_stream(inst)
        await clear_leftovers(h, inst)
        await run_again(inst)
    # Else ``perform`` owns the stream: QEMU may be paused before its switch or saving
    # the device state, when it refuses `cont`; ``perform`` runs the guest at the
    # stream's end (``resumed_back``), whichever way it ends.
    job = h.db.find_job(vm_obj(vm))
    if job is not None and job.detail.get("mode") == "cpr-transfer":
        await set_mode(inst, "normal")    # its next move may be an ordinary one
    if inst.role == Role.LEAVING:
        h.instances.change(inst, Role.RUNNING)
    inst.owns_ram = True
    h.class_cpu(vm, inst.pid)
    h.follow_runstate(inst)
    return rpc.Resumed(pid=inst.pid, resume_ts=time.time())


async def clear_leftovers(h: PartitionHost, inst: QemuInstance) -> None:
    """Remove what a move that went back left in its source QEMU when the supervisor
    that began it was killed mid-move (no ``perform`` of this one owns it): the disk's
    mirror job and its NBD node, which would go on writing to the destination, and the
    move's TLS objects (the host's key in QEMU's memory) and parameters, so that the
    next move starts clean. Best effort: the guest runs on here either way."""
    try:
        if await block.mirror_left(inst.qmp):
            h.log.warning("ending the mirror of %s's disk a killed supervisor began",
                             inst.vm)
            await block.mirror_abort(inst.qmp)
        for tls in await tlscreds.armed(inst.qmp):
            await tlscreds.drop(inst.qmp, tls)
    except QemuError as exc:
        h.log.warning("what a move left in the QEMU of %s is not all removed: %s",
                         inst.vm, exc)


# An outgoing stream's states before its end (QEMU's MigrationStatus).
STREAMING = ("setup", "active", "pre-switchover", "device", "wait-unplug", "cancelling")
CANCEL_WAIT_S = 30.0


async def end_unowned_stream(inst: QemuInstance, wait: float = CANCEL_WAIT_S) -> None:
    """Cancel a stream of ``inst`` that no ``perform`` of this supervisor owns (its
    owner was a supervisor killed mid-move: a mirrored move's QEMU would wait before
    its switch forever, and refuse `cont`), and wait until QEMU says it ended."""
    info = await inst.qmp.query_migrate()
    if info.status not in STREAMING:
        return
    with contextlib.suppress(QemuError):
        await inst.qmp.migrate_cancel()
    loop = asyncio.get_running_loop()
    deadline = loop.time() + wait
    while (info := await inst.qmp.query_migrate()).status in STREAMING:
        if loop.time() > deadline:
            raise MigrationError(f"the stream of {inst.vm!r} that a killed supervisor "
                                 f"began did not end in {wait:.0f} s after its cancel "
                                 f"(QEMU says {info.status}).")
        await asyncio.sleep(0.05)


async def set_mode(inst: QemuInstance, mode: str) -> str | None:
    """Set a QEMU's migration mode (normal, cpr-transfer); the mode it reports then,
    or None if it could not be asked (best effort)."""
    try:
        await inst.qmp.execute("migrate-set-parameters", {"mode": mode})
        params: Any = await inst.qmp.execute("query-migrate-parameters")
        return str(params.get("mode"))
    except FusumaError:
        return None


async def instances(h: PartitionHost, vm: str) -> list[rpc.Instance]:
    """What this supervisor holds of ``vm``, as QEMU itself reports it."""
    out = []
    for inst in h.instances.of(vm):
        if not inst.alive:
            continue
        try:
            status = await inst.qmp.query_status()
            migration = (await inst.qmp.query_migrate()).status
        except FusumaError as exc:
            status, migration = f"unknown ({exc})", "unknown"
        out.append(rpc.Instance(role=inst.role.value, pid=inst.pid, status=status,
                                migration=migration, run_dir=str(inst.run_dir)))
    return out
