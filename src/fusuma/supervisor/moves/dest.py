"""A move's destination side, in the destination partition's supervisor.

``prepare`` starts a QEMU with ``-S -incoming defer`` in this partition (sockets under
``<run>/in-…``), with the role INCOMING, and a task that, when the stream completes,
records the move's outcome as "forward" and only then lets the guest run here
(``commit``: cont, the instance becomes the VM's RUNNING QEMU and the VM's record names
this partition and pid). ``finish`` waits for that; ``settle`` moves the sockets to
their usual place once the source QEMU is gone; ``abort`` ends a destination that must
not run.

The outcome is written once (``Database.decide``): whoever records it first, the
destination's task or a recovery, wins, and the other follows. So a source never
resumes after its destination has run, and two QEMUs never run one guest.

Zero-copy: both QEMUs map the same named RAM file and the capability
``x-ignore-shared`` keeps RAM out of the stream; only device state moves. The RAM file
then belongs to both until the source exits, so neither side deletes it on exit.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
import uuid
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from qemu.qmp import EventListener

from fusuma.errors import FusumaError, MigrationError, NotFoundError, QemuError, StateError
from fusuma.host.accel import probe_accel
from fusuma.network import queues
from fusuma.network.ifnames import tap_name
from fusuma.qemu import block, privilege, tlscreds
from fusuma.qemu.cmdline import NET_ID, hostfwd
from fusuma.qemu.instance import INCOMING_PREFIX, QemuInstance, Role
from fusuma.qemu.qmp import EVENT_MIGRATION, EVENT_RESUME, event_time
from fusuma.state import Decision, JobKind, VmState, vm_obj
from fusuma.supervisor import rpc
from fusuma.supervisor.host import PartitionHost
from fusuma.supervisor.moves.source import MODES, capabilities
from fusuma.undo import Reverter

# A zero-copy or copy move's steps at the destination, in order, each recorded (host
# realtime) when it ended: the incoming QEMU loaded the stream (its MIGRATION
# "completed" event's time), this supervisor saw that, recorded the decision, handed
# the taps over, and the guest ran (the RESUME event's time).
STEPS = ("loaded", "seen", "decided", "taps", "resumed")


@dataclass
class MoveIn:
    """What an incoming QEMU's side of a move holds (``QemuInstance.move``)."""

    listener: EventListener | None
    mode: str
    source: str
    # Resolves to the commit's result once the guest runs here (or the error).
    done: asyncio.Future[rpc.Resumed] | None = None
    task: asyncio.Task[None] | None = None
    fault_decide_delay: float = 0.0
    cpr_socket: Path | None = None
    # A move from another host: the TLS objects of its stream, dropped at the commit.
    tls: tlscreds.MoveTls | None = None
    # ... and its thin disk served over NBD for the source's mirror, until the commit.
    nbd: bool = False
    extra: dict[str, Any] = field(default_factory=dict)
    # The taps' handover at the decision, worked out before the pause (NICs only).
    handover: queues.Switch | None = None
    # Whether the VM has NICs (a move's job holds them as they are): without, the
    # commit has no tap to look up in its pause.
    nics: bool = True
    # The steps of the commit so far (``STEPS``), realtime seconds.
    steps: dict[str, float] = field(default_factory=dict)


def incoming_run_dir(h: PartitionHost, vm: str) -> Path:
    """A move destination's own dir in the VM's run dir (unique per move)."""
    return h.paths.vm_run_dir(vm) / f"{INCOMING_PREFIX}{uuid.uuid4().hex[:8]}"


def incoming(h: PartitionHost, vm: str) -> tuple[QemuInstance, MoveIn] | None:
    inst = h.instances.get(vm, Role.INCOMING)
    if inst is None or not isinstance(inst.move, MoveIn):
        return None
    return inst, inst.move


async def prepare(h: PartitionHost, vm: str, mode: str,
                  fault_decide_delay: float = 0.0) -> rpc.Prepared:
    if mode not in MODES:
        raise StateError(f"unknown migration mode {mode!r}; use zero-copy or copy.")
    rec = h.db.vm(vm)
    if rec.partition == h.partition:
        raise StateError(f"VM {vm!r} is already in partition {h.partition!r}.")
    if h.instances.get(vm) or h.instances.get(vm, Role.INCOMING):
        raise StateError(f"partition {h.partition!r} already runs a QEMU for {vm!r}.")
    job = h.db.find_job(vm_obj(vm))
    if job is None or job.kind != JobKind.MIGRATE or job.peer != h.partition:
        raise StateError(f"no move of {vm!r} to partition {h.partition!r} is under way.")
    if mode == "zero-copy" and not (rec.shared_ram and rec.ram_path):
        raise StateError(f"VM {vm!r} has private RAM; zero-copy migration needs RAM in a "
                         "shared file: use --mode copy.")
    if mode == "zero-copy":
        ram: Path | None = Path(str(rec.ram_path))
    elif rec.shared_ram:
        ram = h.paths.shm / f"{vm}.{uuid.uuid4().hex[:8]}.ram"
    else:
        ram = None
    run = incoming_run_dir(h, vm)
    accel = probe_accel(rec.accel_used or rec.accel).name
    t0 = time.monotonic()
    with Reverter() as rev:
        if mode == "copy" and ram is not None:
            rev.add(lambda: h.remove_ram(ram))
            # The destination's own RAM file, made like a new VM's (0600, the VM's uid).
            privilege.create_ram_file(ram, privilege.uid_for(h.paths, rec))
            h.charge_ram(ram, rec.memory_mib)
        # At the control weight from its start to the guest's run here (``commit``):
        # paused (-S) until the stream has arrived, it costs the partition's VMs
        # nothing but its start, and neither its start nor loading the device state
        # waits for them.
        inst = await h.launch(rec, accel, run, ram, "defer", rev, role=Role.INCOMING,
                              owns_ram=mode == "copy", disk_owner=rec.partition,
                              join_taps=True, control=True)
        uri = f"unix:{run}/migrate.sock"
        try:
            await inst.qmp.migrate_set_capabilities(capabilities(mode))
            listener = inst.qmp.listener(EVENT_MIGRATION)
            await inst.qmp.migrate_incoming(uri)
        except QemuError as exc:
            # "Disconnected" alone does not say that (or how) the QEMU ended.
            raise QemuError(f"{exc}{await h.end_note(inst)}", log_tail=exc.log_tail,
                            exit_status=inst.status) from exc
        rev.commit()
    move = MoveIn(listener, mode, rec.partition,
                  done=asyncio.get_running_loop().create_future(),
                  fault_decide_delay=fault_decide_delay)
    inst.move = move
    move.nics = bool(h.db.nics(vm=vm))
    move.handover = planned_handover(h, vm, inst) if move.nics else None
    move.task = asyncio.ensure_future(resume_when_complete(h, inst, move))
    prepare_ms = (time.monotonic() - t0) * 1000
    h.log.info("waiting for %s (%s) from %s on %s", vm, mode, rec.partition, uri)
    return rpc.Prepared(uri=uri, pid=inst.pid, prepare_ms=round(prepare_ms, 2),
                        run_dir=str(run),
                        dest_ram=str(ram) if ram and mode == "copy" else None)


async def resume_when_complete(h: PartitionHost, inst: QemuInstance, move: MoveIn) -> None:
    """When the stream has arrived, record "forward" and let the guest run here."""
    vm = inst.vm
    assert move.done is not None and move.listener is not None
    try:
        while True:
            ev: Any = await move.listener.get()
            status = ev.get("data", {}).get("status")
            if status == "completed":
                move.steps["loaded"] = event_time(ev)
                move.steps["seen"] = time.time()
                break
            if status in ("failed", "cancelled"):
                raise MigrationError(f"the stream of {vm!r} into partition "
                                     f"{h.partition!r} {status}.")
        if move.fault_decide_delay > 0:  # fault injection (tests): hold before deciding
            await asyncio.sleep(move.fault_decide_delay)
        result = await commit(h, vm, paused=True)
        if not move.done.done():
            move.done.set_result(result)
    except asyncio.CancelledError:
        _fail(move.done, MigrationError(f"the incoming QEMU of {vm!r} in partition "
                                        f"{h.partition!r} ended before the guest ran."))
    except Exception as exc:
        _fail(move.done, exc)
    finally:
        inst.qmp.drop_listener(move.listener)


def _fail(done: asyncio.Future[rpc.Resumed], exc: BaseException) -> None:
    if not done.done():
        done.set_exception(exc)
        done.exception()     # retrieved: no "never retrieved" noise when nobody waits


async def commit(h: PartitionHost, vm: str, paused: bool = False) -> rpc.Resumed:
    """Make this partition's incoming QEMU the VM's: record "forward", run the guest,
    take the record. Idempotent; refused if the outcome recorded is "back".

    ``paused``: the caller knows the guest is paused here (the stream has just
    completed into a ``-S`` QEMU), which saves a round trip in the move's downtime."""
    found = incoming(h, vm)
    if found is None:
        running = h.instances.get(vm)
        if running is not None:
            return arrived(h, vm, running)
        raise NotFoundError(f"no incoming QEMU of {vm!r} in partition {h.partition!r}.")
    inst, move = found
    steps = move.steps
    decision = h.db.decide(vm_obj(vm), Decision.FORWARD)
    if decision != Decision.FORWARD:
        raise MigrationError(f"the move of {vm!r} was decided {decision!r}: the guest "
                             f"stays at its source.")
    steps["decided"] = time.time()
    status = "paused" if paused else await inst.qmp.query_status()
    resume_ts = time.time()
    if move.nbd:
        # Before the guest runs here: its disk is no one else's to write any more.
        await block.stop_serving(inst.qmp)
    if status != "running":
        if move.nics:
            try:
                hand_over_taps(h, vm, inst, move.handover)
            except (FusumaError, OSError) as exc:
                # The guest runs here whatever the tap says: a paused guest helps no one.
                h.log.warning("%s: its taps could not be handed over: %s", vm, exc)
        steps["taps"] = time.time()
        listener = inst.qmp.listener(EVENT_RESUME)
        try:
            await inst.qmp.cont()
            with contextlib.suppress(QemuError):
                resume_ts = event_time(await inst.qmp.wait_event(listener, 5.0))
                steps["resumed"] = resume_ts
        finally:
            inst.qmp.drop_listener(listener)
    old = h.instances.get(vm)
    in_place = old is not None and old is not inst
    if old is not None and in_place:
        # An in-place move (fusuma.supervisor.moves.cpr): the old QEMU of this partition is
        # the leaving side now, ended by ``release``.
        h.instances.change(old, Role.LEAVING)
        old.owns_ram = False
    if h.db.nics(vm=vm):
        # Its NICs tell the bridges (and a VXLAN's peers) where the guest is now: on one
        # host the bridge has learnt nothing new (same tap, same port), but a switch
        # beyond a bridged network may have.
        try:
            await inst.qmp.announce_self()
        except QemuError as exc:
            h.log.warning("%s: announce-self failed after the move: %s", vm, exc)
    inst.move = None
    h.instances.change(inst, Role.RUNNING)
    if not in_place:
        h.class_cpu(vm, inst.pid)
    # Else the leaf the two QEMUs share keeps the control weight until the old one has
    # ended (``PartitionHost._record_exit``): the move's last questions to it and its
    # quit, at its class's weight beside 15 busy guests, took 130-190 ms more.
    # The guest's RAM is this QEMU's now (removal still waits until no QEMU maps it).
    inst.owns_ram = True
    rec = h.db.vm(vm)
    for dname in rec.disks:
        h.db.move_disk(dname, h.partition)
    fields: dict[str, Any] = dict(
        partition=h.partition, pid=inst.pid, error=None,
        ram_path=str(inst.ram_file) if inst.ram_file else None,
        qemu_binary=str(h.qemu().binary),
        qemu_version=inst.version or h.qemu().version)
    if rec.state == VmState.MIGRATING:
        h.db.transition(vm, VmState.RUNNING, expect={VmState.MIGRATING}, **fields)
    else:
        h.db.set_vm(vm, **fields)
    h.follow_runstate(inst)
    await h.repin_all()
    if move.tls is not None:     # after the guest runs: not in the downtime
        await tlscreds.drop(inst.qmp, move.tls)
    h.arrived[vm] = rpc.Resumed(pid=inst.pid, resume_ts=resume_ts, steps=dict(steps))
    return h.arrived[vm]


def arrived(h: PartitionHost, vm: str, running: QemuInstance) -> rpc.Resumed:
    """The answer to a caller that asks after the guest already runs here: the move
    that brought it, if ``running`` is that move's QEMU (its true resume time and
    steps: a caller that asks late, as a busy agent may, must not take the moment it
    asked for the end of the guest's downtime); else now, saying nothing of steps."""
    got = h.arrived.get(vm)
    if got is not None and got.pid == running.pid:
        h.log.info("%s: asked %.1f ms after the guest resumed here", vm,
                   (time.time() - got.resume_ts) * 1000)
        return replace(got, already=True)
    return rpc.Resumed(pid=running.pid, resume_ts=time.time(), already=True)


def nic_taps(h: PartitionHost, vm: str) -> dict[str, str]:
    """The VM's NICs' taps, by netdev id."""
    slot = h.db.vm(vm).slot
    return {f"nic{n.index}": tap_name(slot, n.index) for n in h.db.nics(vm=vm)}


def taps_of(h: PartitionHost, vm: str) -> set[str]:
    return set(nic_taps(h, vm).values())


def handover_plan(h: PartitionHost, vm: str, inst: QemuInstance) -> queues.Switch | None:
    """The handover ``hand_over_taps`` will do, worked out now, before the move's
    pause (``queues.switch``); None if the VM has no NIC."""
    rec = h.db.vm(vm)
    nics = nic_taps(h, vm)
    if not nics:
        return None
    # The source: the QEMU the record names until this commit, or in place the other
    # QEMU of this partition. Only fds of the VM's own taps are touched in it.
    others = {rec.pid} | {i.pid for i in h.instances.of(vm)}
    firsts = {nics[i]: fd for i, fd in queues.first_fds(queues.argv_of(inst.pid)).items()
              if i in nics}
    return queues.plan(sorted(p for p in others - {inst.pid} if p), inst.pid,
                       set(nics.values()), firsts)


def planned_handover(h: PartitionHost, vm: str, inst: QemuInstance) -> queues.Switch | None:
    """``handover_plan``, or None (the commit then reads the QEMUs' descriptors
    itself) if the QEMUs cannot be read now."""
    try:
        return handover_plan(h, vm, inst)
    except (FusumaError, OSError) as exc:
        h.log.warning("%s: its taps' handover not planned ahead: %s", vm, exc)
        return None


def hand_over_taps(h: PartitionHost, vm: str, inst: QemuInstance,
                   planned: queues.Switch | None = None) -> set[str]:
    """The decision is "forward": the kernel steers the VM's frames to ``inst`` from
    now on. Every queue of the VM's taps that another QEMU holds (the source, paused
    for good) is detached, then ``inst``'s queue 0 attached (``fusuma.network.queues``:
    QEMU switches its other queues itself). ``planned``: the same worked out before the
    pause, done as planned if every descriptor is still what it was. Idempotent, so a
    recovery that commits again does the same. The taps' names."""
    if planned is not None and queues.switch(planned):
        return planned.taps
    now = handover_plan(h, vm, inst)
    if now is None:
        return set()
    for pid in sorted({pid for pid, _, _ in now.leaving}):
        n = queues.detach_all(pid, now.taps)
        h.log.info("%s: detached %d queue(s) of QEMU %d from %s", vm, n, pid,
                   ", ".join(sorted(now.taps)))
    queues.attach_first(inst.pid, {tap: fd for _, fd, tap in now.arriving})
    return now.taps


async def finish(h: PartitionHost, vm: str, timeout: float = 30.0) -> rpc.Resumed:
    """Wait until the guest runs here (the destination's own task resumes it)."""
    found = incoming(h, vm)
    if found is None:
        running = h.instances.get(vm)
        if running is not None:
            return arrived(h, vm, running)
        raise NotFoundError(f"no incoming migration of {vm!r} in partition {h.partition!r}.")
    _, move = found
    if move.done is None:
        return await commit(h, vm)
    try:
        return await asyncio.wait_for(asyncio.shield(move.done), timeout)
    except TimeoutError as exc:
        raise MigrationError(f"{vm!r} did not start running in partition "
                             f"{h.partition!r} within {timeout:.0f} s.") from exc


async def settle(h: PartitionHost, vm: str) -> rpc.Settled:
    """Move the sockets of a migrated-in QEMU from ``<run>/in-…`` to ``<run>``, once
    the source QEMU is gone (``QemuInstance.settle_into``)."""
    inst = h.instances.get(vm)
    if inst is None or not inst.run_dir.name.startswith(INCOMING_PREFIX):
        return rpc.Settled(vm, moved=False)
    # The source held the forwarded host ports until it exited: take them over now.
    unbound = []
    for item in h.db.vm(vm).ports:
        host, guest = (int(x) for x in item.split(":"))
        out = await inst.qmp.execute("human-monitor-command", {
            "command-line": f"hostfwd_add {NET_ID} {hostfwd(host, guest)}"})
        if isinstance(out, str) and out.strip():
            unbound.append(item)
            h.log.warning("%s: cannot forward host port %d after migration: %s",
                          vm, host, out.strip())
    rec = h.db.vm(vm)
    if rec.ram_path and rec.shared_ram:
        # The source QEMU's memory has left the RAM group: its peak starts again here.
        h.cg.reset_ram_peak(Path(rec.ram_path).name.removesuffix(".ram"))
    inst.settle_into(inst.run_dir.parent)
    return rpc.Settled(vm, moved=True, unbound_ports=unbound)


async def abort(h: PartitionHost, vm: str) -> rpc.Ended:
    """End the incoming QEMU (never one the outcome "forward" lets run)."""
    found = incoming(h, vm)
    if found is None:
        return rpc.Ended(vm, was="gone")
    job = h.db.find_job(vm_obj(vm))
    if job is not None and job.detail.get("decision") == Decision.FORWARD:
        raise MigrationError(f"the incoming QEMU of {vm!r} is kept: the guest has moved "
                             "to it.")
    inst, move = found
    if move.task is not None:
        move.task.cancel()
    await inst.kill()
    running = h.instances.get(vm)
    if running is not None and running is not inst:
        # An in-place move's: its leaf, which the running QEMU shares, had the control
        # weight for the new one (``cpr.prepare``): back to the VM's class.
        h.class_cpu(vm, running.pid)
    return rpc.Ended(vm, was="aborted", pid=inst.pid)
