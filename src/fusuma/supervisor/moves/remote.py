"""The destination supervisor's half of a live move between two hosts (issue 16).

The cluster agents orchestrate (``fusuma.cluster.hostmove``); each host's supervisor
does what it does for a move inside a host, with two differences at the destination:

- ``remote_incoming``: the incoming QEMU listens on TCP, on the address other hosts
  reach this host at (port chosen by the kernel), in copy mode (hosts share no RAM),
  under TLS (``fusuma.qemu.tlscreds``): it presents this host's certificate and lets in
  only the source host's (``peer``); anyone else who connects first fails the handshake
  and QEMU goes on waiting. Its TLS objects (and the host's key in its memory) are
  dropped once the guest runs here (``dest.commit``);
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

from fusuma.errors import MigrationError, NotFoundError, StateError
from fusuma.host.accel import probe_accel
from fusuma.qemu import block, privilege, tlscreds
from fusuma.qemu.cmdline import BOOT_DRIVE
from fusuma.qemu.instance import QemuInstance, Role
from fusuma.qemu.qmp import EVENT_MIGRATION
from fusuma.state import JobKind, vm_obj
from fusuma.supervisor import rpc
from fusuma.supervisor.host import PartitionHost
from fusuma.supervisor.moves.dest import MoveIn, incoming, incoming_run_dir
from fusuma.supervisor.moves.source import capabilities, set_channels
from fusuma.undo import Reverter


async def remote_incoming(h: PartitionHost, vm: str, listen: str, peer: str,
                          tls: bool = True, channels: int = 1,
                          nbd: bool = False, shared_disk: bool = False) -> rpc.Prepared:
    """Start a QEMU for ``vm`` waiting for a stream on ``tcp:LISTEN:<port>`` from host
    ``peer``, under TLS (``tls`` False: in the clear, for the benchmark's before), over
    ``channels`` connections; with ``nbd``, serving its thin disk (under the same TLS)
    on another port of ``listen`` for the source's mirror (``block.serve``); with
    ``shared_disk`` (its files are the source's, on shared storage) its images stay
    inactive until the commit's ``cont``."""
    rec = h.db.vm(vm)
    if rec.partition != h.partition:
        raise StateError(f"VM {vm!r} is defined in partition {rec.partition!r}, not "
                         f"{h.partition!r}.")
    if h.instances.get(vm) or h.instances.get(vm, Role.INCOMING):
        raise StateError(f"partition {h.partition!r} already runs a QEMU for {vm!r}.")
    job = h.db.find_job(vm_obj(vm))
    if job is None or job.kind != JobKind.HOST_MOVE_IN:
        raise StateError(f"no move of {vm!r} from another host is under way.")
    if nbd and shared_disk:
        raise StateError(f"the disk of {vm!r} is on shared storage: it is not mirrored.")
    if nbd and not tls:
        raise StateError(f"the disk of {vm!r} is served for its mirror only under TLS, to "
                         "the source host's certificate: a move in the clear cannot "
                         "mirror it.")
    creds = tlscreds.require(h.paths) if tls else None
    if tls and not peer:
        raise StateError(f"a move of {vm!r} from another host must name that host.")
    ram: Path | None = (h.paths.shm / f"{vm}.{uuid.uuid4().hex[:8]}.ram"
                        if rec.shared_ram else None)
    run = incoming_run_dir(h, vm)
    accel = probe_accel(rec.accel_used or rec.accel).name
    t0 = time.monotonic()
    with Reverter() as rev:
        if ram is not None:
            h.paths.ensure_shm()
            rev.add(lambda: h.remove_ram(ram))
            privilege.create_ram_file(ram, privilege.uid_for(h.paths, rec))
            h.charge_ram(ram, rec.memory_mib)
        inst = await h.launch(rec, accel, run, ram, "defer", rev, role=Role.INCOMING,
                              disk_owner=rec.partition, own_taps=True)
        await inst.qmp.migrate_set_capabilities(capabilities("copy", channels,
                                                             late_block=shared_disk))
        await set_channels(inst.qmp, channels)
        move_tls = None
        if creds is not None:
            move_tls = await tlscreds.arm(inst.qmp, run, privilege.uid_for(h.paths, rec),
                                          creds, tlscreds.SERVER, peer)
        nbd_uri = None
        if nbd:
            node = (await block.drives(inst.qmp))[BOOT_DRIVE].node
            nbd_port = await block.serve(
                inst.qmp, listen, node, move_tls.creds_id if move_tls else None,
                move_tls.authz_id if move_tls else None)
            nbd_uri = f"tcp:{listen}:{nbd_port}"
        listener = inst.qmp.listener(EVENT_MIGRATION)
        await inst.qmp.migrate_incoming(f"tcp:{listen}:0")
        info = await inst.qmp.execute("query-migrate")
        port = next((a.get("port") for a in info.get("socket-address") or []
                     if a.get("type") == "inet"), None)
        if not port:
            raise MigrationError(f"the incoming QEMU of {vm!r} did not say which port it "
                                 f"listens on ({info}).")
        rev.commit()
    inst.move = MoveIn(listener, "copy", "remote", tls=move_tls, nbd=nbd)
    uri = f"tcp:{listen}:{port}"
    h.log.info("waiting for %s from another host on %s", vm, uri)
    return rpc.Prepared(uri=uri, pid=inst.pid, run_dir=str(run),
                        prepare_ms=round((time.monotonic() - t0) * 1000, 2), nbd=nbd_uri)


async def adopted_incoming(inst: QemuInstance) -> MoveIn:
    """The incoming side of a move from another host as its QEMU shows it to a
    supervisor that adopts it (the one that prepared it was killed): whether it serves
    the guest's disk over NBD, and the TLS objects it holds. The commit then stops
    serving the disk before the guest runs and drops the objects, as it would have for
    ``remote_incoming``: once "forward" is recorded this QEMU holds the only copy of
    the guest, its disk included. (An incoming QEMU is new for its move: what it holds
    is that move's.)"""
    armed = await tlscreds.armed(inst.qmp)
    return MoveIn(None, "copy", "remote", tls=armed[0] if armed else None,
                  nbd=await block.serving(inst.qmp))


async def remote_incoming_wait(h: PartitionHost, vm: str, timeout: float = 2.0
                               ) -> rpc.StreamState:
    """The incoming stream's state, waiting up to ``timeout`` for it to end:
    ``completed`` (the guest is here, paused), ``failed``/``cancelled``, ``gone`` (the
    QEMU exited), ``running`` (already committed) or the state still in progress."""
    found = incoming(h, vm)
    if found is None:
        running = h.instances.get(vm)
        if running is not None:
            return rpc.StreamState("running", running.pid)
        raise NotFoundError(f"no incoming QEMU of {vm!r} in partition {h.partition!r}.")
    inst, _ = found
    deadline = time.monotonic() + timeout
    while True:
        if inst.exited.is_set():
            return rpc.StreamState("gone")
        status = (await inst.qmp.query_migrate()).status
        if status in ("completed", "failed", "cancelled") or time.monotonic() > deadline:
            return rpc.StreamState(status, inst.pid)
        await asyncio.sleep(0.005)
