"""The supervisor's half of templates (fusuma.memshare.templates): saving a running VM
into a template, and starting a clone from one.

Saving runs under the VM's ``template`` job, each phase recorded before it: ``guest``
(drop caches, hand freed pages back, unbind the balloon driver), ``stop``, ``save``
(the device state to a file), ``commit`` (the template's record, then its RAM file
takes the template's name), ``quit``. Up to ``commit`` a failure undoes everything: the
guest runs again (its balloon driver rebound), no file or record is left. From
``commit`` on the template exists and the save is finished, also by a new supervisor
that finds the job of a dead one (:func:`recover`).

A clone's start is an ordinary start (job, state machine, cgroup, pinning) whose QEMU
gets the template's devices and files (:func:`clone_devices`, :func:`clone_config`,
:func:`open_files`) and, once QMP answers, loads the template's state and continues
(:func:`restore`). Its identity comes after it runs (:func:`begin_identity`), holding the
guest agent's lock, so the next `vm exec` sees the clone's hostname, never the
template's.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import os
import stat
import time
import uuid
from pathlib import Path
from typing import Any

from fusuma.errors import (
    ConflictError,
    FusumaError,
    GuestAgentError,
    MigrationError,
    QemuError,
    StateError,
    TemplateError,
)
from fusuma.images import layers, store
from fusuma.memshare import holes, reporting, templates
from fusuma.paths import PRIVATE_DIR, ensure_dir
from fusuma.qemu.cmdline import TEMPLATE_STATE_FDSET, DeviceSet
from fusuma.qemu.instance import QemuInstance, run_again
from fusuma.qemu.process import tail
from fusuma.qemu.qgareply import ExecStarted, ExecStatus
from fusuma.qemu.qmp import EVENT_MIGRATION
from fusuma.state import Job, JobKind, VmRecord, VmState, identity_obj
from fusuma.state.db import TemplateRecord
from fusuma.supervisor import rpc
from fusuma.supervisor.host import PartitionHost

# The guest's part of a save: write back, drop clean caches, compact (so freed pages
# form blocks of the reporting order).
DROP_CACHES = ("sync; echo 3 > /proc/sys/vm/drop_caches; "
               "echo 1 > /proc/sys/vm/compact_memory 2>/dev/null; true")
BALLOON_DRIVER = "/sys/bus/virtio/drivers/virtio_balloon"
# Unbind every device the balloon driver holds, printing their names (to rebind them if
# the save is undone): from then on the guest reports no page.
UNBIND = (f"d={BALLOON_DRIVER}; for x in $d/virtio*; do [ -e \"$x\" ] || continue; "
          "n=${x##*/}; echo \"$n\" > $d/unbind && echo \"$n\"; done; true")
SAVE_TIMEOUT_S = 120.0
AGENT_TIMEOUT_S = 30.0
# The clone's identity script: a DHCP client asked again per NIC (a loaded TCG guest
# takes tens of seconds).
IDENTITY_TIMEOUT_S = 300.0
# A clone of a firmware boot's template: its guest's cloud-init stages (TCG: a minute).
CLOUD_INIT_TIMEOUT_S = 900.0
# Fault injection (tests): fail the save right after this phase.
FAULT_PHASES = ("guest", "stop", "save")
# Fault injection (tests), read from the supervisor's environment: seconds a clone's
# QEMU waits before loading the template's state, so a test can kill it there.
FAULT_RESTORE_DELAY = "FUSUMA_FAULT_CLONE_RESTORE_DELAY"
# ... and seconds a clone that runs waits before its identity step.
FAULT_IDENTITY_DELAY = "FUSUMA_FAULT_CLONE_IDENTITY_DELAY"

# Identity tasks under way (a reference, so they are not collected mid-flight).
_TASKS: set[asyncio.Task[None]] = set()


# -- saving ------------------------------------------------------------------------------
async def save(h: PartitionHost, vm: str, template: str, fault: str = "") -> rpc.TemplateSaved:
    """Stop running ``vm`` into template ``template`` (see the module docstring)."""
    async with h.lock(vm):
        rec, inst = h.running(vm)
        templates.refuse(rec, inst.version or rec.qemu_version)
        if h.db.find_template(template) is not None:
            raise ConflictError(f"a template named {template!r} already exists; delete it "
                                "or pick another name.")
        for left in (templates.ram_file(h.paths, template),
                     templates.template_dir(h.paths, template)):
            if left.exists():
                raise ConflictError(f"{left} is left from an earlier template named "
                                    f"{template!r}; remove it or pick another name.")
        if not rec.ram_path or not Path(rec.ram_path).is_file():
            raise StateError(f"VM {vm!r} has no RAM file ({rec.ram_path}); stop and start "
                             "it, then try again.")
        if not rec.devices:
            raise TemplateError(f"VM {vm!r} has no recorded device set (booted by an older "
                                "fusuma); stop and start it, then try again.")
        async with h.job(vm, JobKind.TEMPLATE):
            return await _save(h, rec, inst, template, fault)


async def _save(h: PartitionHost, rec: VmRecord, inst: QemuInstance, name: str,
                fault: str) -> rpc.TemplateSaved:
    vm = rec.name
    t0 = time.monotonic()
    paths = h.paths
    out = inst.run_dir / "template.state"
    tdir = templates.template_dir(paths, name)
    state = templates.state_file(paths, name)
    ram_src = Path(str(rec.ram_path))
    ram_dst = templates.ram_file(paths, name)
    unbound: list[str] = []
    stopped = committed = False
    try:
        h.phase(vm, "guest", template=name, ram_src=str(ram_src))
        unbound = await _prepare_guest(h, rec, inst)
        _fault(fault, "guest")
        h.phase(vm, "stop", template=name, unbound=unbound)
        await inst.qmp.clear_stale_stream()     # before the guest pauses for the save
        await inst.qmp.stop()
        stopped = True
        _fault(fault, "stop")
        h.phase(vm, "save")
        await inst.qmp.set_stream_capabilities(ignore_shared=True)
        await inst.qmp.migrate(f"file:{out}")
        info = await inst.wait_migration(SAVE_TIMEOUT_S)
        if info.status != "completed":
            raise TemplateError(f"VM {vm!r}: QEMU could not save its device state "
                                f"({info.error or info.status}); it runs on.")
        _fault(fault, "save")
        ensure_dir(tdir.parent, PRIVATE_DIR)
        ensure_dir(tdir, PRIVATE_DIR)
        sha, state_bytes = _copy_state(out, state)
        with contextlib.suppress(FileNotFoundError):
            out.unlink()
        if rec.boot != "kernel":
            # Its disk as the guest left it: the save flushed and inactivated it.
            try:
                layer_bytes = layers.freeze(paths.vm_dir(vm), tdir, rec.boot == "uefi",
                                            store.files_dir(paths, vm))
            except OSError as exc:
                raise TemplateError(f"template {name!r} was not made: VM {vm!r}'s disk "
                                    f"could not be kept ({exc.strerror or exc}); it runs "
                                    "on.") from exc
            h.log.info("template %s keeps %s's disk: %d bytes of data", name, vm,
                       layer_bytes)
        ds = DeviceSet.loads(str(rec.devices))
        record = TemplateRecord(
            name=name, ram_path=str(ram_dst), state_path=str(state),
            size_bytes=ram_src.stat().st_size, memory_mib=rec.memory_mib,
            vcpus=rec.vcpus, machine=ds.machine,
            qemu_version=str(inst.version or rec.qemu_version), devices=ds.dumps(),
            image=rec.image, segments=list(rec.segments),
            accel=rec.accel_used or "tcg", state_sha256=sha, source_vm=vm,
            networks=[n.network for n in sorted(h.db.nics(vm=vm), key=lambda n: n.index)])
        h.phase(vm, "commit", state_bytes=state_bytes)
        record = h.db.add_template(record, h.paths.template_gids)
        committed = True
    except BaseException as exc:
        if not committed:
            await _undo(h, inst, out, tdir, stopped, unbound)
        if isinstance(exc, QemuError):
            after = ("its QEMU is gone (see `fusuma ps`)" if inst.exited.is_set()
                     else f"VM {vm!r} runs on")
            raise TemplateError(f"template {name!r} was not made ({exc}); {after}."
                                ) from exc
        raise
    await _finish(h, vm, record, ram_src, inst)
    ms = (time.monotonic() - t0) * 1000
    h.log.info("made template %s from %s in %.0f ms (state %d bytes)", name, vm, ms,
                 state_bytes)
    return rpc.TemplateSaved(template=name, vm=vm, ms=round(ms, 1), state_bytes=state_bytes,
                             unbound=unbound)


def _fault(fault: str, phase: str) -> None:
    if fault == phase:
        raise TemplateError(f"fault injected after phase {phase!r} (FUSUMA_FAULT_TEMPLATE).")


async def _prepare_guest(h: PartitionHost, rec: VmRecord, inst: QemuInstance) -> list[str]:
    """Make the guest small and quiet: drop its caches and, if it reports free pages,
    wait until they are handed back, then unbind its balloon driver. Returns the
    devices unbound."""
    vm = rec.name
    reports = False
    if reporting.recorded(rec):
        with contextlib.suppress(QemuError):
            status = await inst.qmp.execute("x-query-virtio-status",
                                          {"path": reporting.balloon_path()})
            reports = reporting.negotiated(status)
    async with h.agent_lock(vm):
        try:
            async with h.agent(inst) as ga:
                await ga.connect(timeout=AGENT_TIMEOUT_S)
                res = await ga.run(["/bin/sh", "-c", DROP_CACHES], timeout=AGENT_TIMEOUT_S)
                if res.exit_code != 0:
                    raise GuestAgentError(f"dropping the guest's caches failed (exit "
                                          f"{res.exit_code})")
                if reports:
                    await reporting.settled_bytes(rec, inst.pid)
                if not reporting.recorded(rec):
                    return []
                res = await ga.run(["/bin/sh", "-c", UNBIND], timeout=AGENT_TIMEOUT_S)
                return res.stdout.decode(errors="replace").split()
        except GuestAgentError as exc:
            raise TemplateError(f"VM {vm!r}: its guest agent is needed to drop the guest's "
                                f"caches and stop page reporting before it is saved, and "
                                f"it failed ({exc}); nothing was changed.") from exc


def _copy_state(src: Path, dst: Path) -> tuple[str, int]:
    """Copy the state file QEMU wrote (in its run dir, owned by its uid) to ``dst``
    (root's, 0600), durably; returns its sha256 and size."""
    h = hashlib.sha256()
    size = 0
    try:
        fd = os.open(src, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError as exc:
        raise TemplateError(f"QEMU's state file {src} cannot be read ({exc.strerror})."
                            ) from exc
    tmp = dst.with_name(dst.name + ".tmp")
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise TemplateError(f"QEMU's state file {src} is not a regular file.")
        out = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
        try:
            while chunk := os.read(fd, 1 << 20):
                h.update(chunk)
                size += len(chunk)
                os.write(out, chunk)
            os.fsync(out)
        finally:
            os.close(out)
        os.rename(tmp, dst)
        dfd = os.open(dst.parent, os.O_RDONLY | os.O_DIRECTORY)
        try:
            os.fsync(dfd)
        finally:
            os.close(dfd)
    finally:
        os.close(fd)
        with contextlib.suppress(FileNotFoundError):
            tmp.unlink()
    return h.hexdigest(), size


async def _undo(h: PartitionHost, inst: QemuInstance, out: Path, tdir: Path | None,
                stopped: bool, unbound: list[str]) -> None:
    """A save that failed before its commit: no file left, the guest runs again."""
    with contextlib.suppress(FileNotFoundError):
        out.unlink()
    if tdir is not None:
        _remove_dir(tdir)
    if inst.exited.is_set():
        return
    if stopped:
        try:
            info = await inst.qmp.query_migrate()
            if info.status in ("setup", "active", "device"):
                await inst.qmp.migrate_cancel()
            # QEMU refuses `cont` while a save that completed is still finishing
            # ("Migration is not finalized yet"): run_again waits that out.
            await run_again(inst)
        except (QemuError, MigrationError) as exc:
            h.log.error("%s: could not resume the guest after a failed save: %s",
                          inst.vm, exc)
    if unbound:
        await _rebind(h, inst, unbound)


async def _rebind(h: PartitionHost, inst: QemuInstance, names: list[str]) -> None:
    """Give the balloon devices back to their driver (best effort)."""
    script = "; ".join(f"echo {n} > {BALLOON_DRIVER}/bind" for n in names
                       if n.startswith("virtio") and n[6:].isdigit())
    if not script:
        return
    try:
        async with h.agent_lock(inst.vm), h.agent(inst) as ga:
            await ga.connect(timeout=10.0)
            await ga.run(["/bin/sh", "-c", script], timeout=10.0)
    except FusumaError as exc:
        h.log.warning("%s: could not rebind its balloon driver: %s", inst.vm, exc)


def _remove_dir(tdir: Path) -> None:
    if not tdir.is_dir():
        return
    for f in tdir.iterdir():
        with contextlib.suppress(OSError):
            f.unlink()
    with contextlib.suppress(OSError):
        tdir.rmdir()


async def _finish(h: PartitionHost, vm: str, t: TemplateRecord, ram_src: Path,
                  inst: QemuInstance | None) -> None:
    """After the commit: the VM stops without its RAM file, which is the template's."""
    rec = h.db.find_vm(vm)
    if inst is not None:
        inst.stopping = True
        inst.ram_file = None       # never removed on exit: it is the template's now
        inst.owns_ram = False
    if rec is not None and rec.state in (VmState.RUNNING, VmState.PAUSED):
        h.db.transition(vm, VmState.STOPPING, ram_path=None)
    elif rec is not None and rec.ram_path:
        h.db.set_vm(vm, ram_path=None)
    # In a thread: the zero-page scan reads the whole RAM file (a second or more for
    # GiBs), which would stall this supervisor's other VMs' requests and moves.
    await asyncio.to_thread(_take_ram, h, t, ram_src)
    h.phase(vm, "quit")
    if inst is not None:
        await inst.stop(10.0)
    with contextlib.suppress(FusumaError):
        h.settle_state(vm, VmState.STOPPED, pid=None, ram_path=None)
    h.cg.sweep_ram_groups(h.paths.shm)


def _take_ram(h: PartitionHost, t: TemplateRecord, ram_src: Path) -> None:
    """The VM's RAM file becomes the template's: renamed (same directory), root's,
    readable by the template's group only (its clones' QEMUs)."""
    dst = Path(t.ram_path)
    if not dst.exists():
        os.rename(ram_src, dst)
    fd = os.open(dst, os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC)
    try:
        os.fchown(fd, 0, templates.template_gid(h.paths, t))
        os.fchmod(fd, templates.RAM_MODE)
        if holes.trim_every() > 0:
            # Its zero pages become holes, and its holes are recorded, so what clones
            # fill in them can be punched again (fusuma.memshare.holes).
            t0 = time.monotonic()
            freed = holes.trim_new(fd, templates.template_dir(h.paths, t.name))
            h.log.info("template %s: %d KiB of zero pages punched in %.0f ms; %d KiB "
                       "allocated", t.name, freed // 1024, (time.monotonic() - t0) * 1000,
                       holes.allocated_bytes(fd) // 1024)
    finally:
        os.close(fd)


def trim_targets(h: PartitionHost, names: set[str]) -> list[tuple[str, str, Path]]:
    """Templates ``names`` that still exist: (name, RAM file, template dir) each."""
    out = []
    for name in sorted(names):
        t = h.db.find_template(name)
        if t is not None:
            out.append((name, t.ram_path, templates.template_dir(h.paths, name)))
    return out


def trim_files(h: PartitionHost, targets: list[tuple[str, str, Path]]) -> dict[str, int]:
    """Punch what clones filled in the holes of ``targets``' RAM files (no database:
    runs in a thread); returns the bytes freed per template (a failure is logged)."""
    freed: dict[str, int] = {}
    for name, ram, tdir in targets:
        try:
            freed[name] = holes.trim(ram, tdir)
        except (OSError, TemplateError) as exc:
            h.log.warning("template %s: trimming its RAM file failed: %s", name, exc)
    return freed


async def recover(h: PartitionHost, job: Job) -> None:
    """Finish or undo the save of a supervisor that died: finished once its record
    exists (committed), else undone, asking QEMU."""
    vm = job.name
    name = str(job.detail.get("template") or "")
    t = h.db.find_template(name) if name else None
    inst = h.instances.get(vm)
    ram_src = Path(str(job.detail.get("ram_src") or h.paths.ram_file(vm)))
    if t is not None and t.source_vm == vm:
        await _finish(h, vm, t, ram_src, inst)
        h.log.info("finished making template %s from %s (its supervisor died)", name, vm)
        return
    if name:
        _remove_dir(templates.template_dir(h.paths, name))
    if inst is None:
        return          # its QEMU is gone: adoption recorded the crash
    run = inst.run_dir
    await _undo(h, inst, run / "template.state", None, True,
                [str(x) for x in job.detail.get("unbound") or []])
    with contextlib.suppress(FusumaError):
        status = await inst.qmp.query_status()
        h.settle_state(vm, VmState.RUNNING if status == "running" else VmState.PAUSED)
    h.log.info("undid making a template of %s (its supervisor died)", vm)


# -- clones ------------------------------------------------------------------------------
async def restore(h: PartitionHost, vm: VmRecord, inst: QemuInstance,
                  timeout: float = 30.0) -> float:
    """Load the template's state into the clone's waiting QEMU and let it run; returns
    the ms it took."""
    delay = float(os.environ.get(FAULT_RESTORE_DELAY) or 0)
    if delay > 0:
        await asyncio.sleep(delay)
        if inst.exited.is_set():
            raise TemplateError(f"VM {vm.name!r}: its QEMU exited before it loaded template "
                                f"{vm.template!r}'s state.")
    t0 = time.monotonic()
    listener = inst.qmp.listener(EVENT_MIGRATION)
    try:
        await inst.qmp.set_stream_capabilities(ignore_shared=True)
        await inst.qmp.migrate_incoming(f"file:/dev/fdset/{TEMPLATE_STATE_FDSET}")
        deadline = time.monotonic() + timeout
        while True:
            got: asyncio.Future[Any] = asyncio.ensure_future(listener.get())
            gone: asyncio.Future[Any] = asyncio.ensure_future(inst.exited.wait())
            done, _ = await asyncio.wait({got, gone}, timeout=max(0.0, deadline -
                                                                   time.monotonic()),
                                         return_when=asyncio.FIRST_COMPLETED)
            for f in (got, gone):
                if f not in done:
                    f.cancel()
            if got in done:
                ev: dict[str, Any] = got.result()
                status = ev.get("data", {}).get("status")
                if status == "completed":
                    break
                if status not in ("failed", "cancelled"):
                    continue
            said = tail(h.paths.vm_dir(vm.name) / "qemu.log", 1)
            why = ("QEMU exited" if gone in done else "it did not finish in "
                   f"{timeout:.0f} s" if not done else "QEMU refused it")
            raise TemplateError(f"VM {vm.name!r} could not load template {vm.template!r}'s "
                                f"state: {why}{': ' + said if said else ''}.")
    finally:
        inst.qmp.drop_listener(listener)
    if vm.boot != "kernel":
        # From now on its guest writes its disk: a later start boots it.
        layers.used(h.paths.vm_dir(vm.name))
    await inst.qmp.cont()
    return (time.monotonic() - t0) * 1000


def begin_identity(h: PartitionHost, vm: str, inst: QemuInstance, requested: float,
                   restore_ms: float, job: Job | None = None) -> None:
    """Give a clone that runs now its own identity, in the background (holding the
    guest agent's lock from the next loop iteration on). The step holds the VM's
    identity job (``identity_obj``) until it is done, so a supervisor that dies before
    leaves it to the next one (:func:`fusuma.supervisor.vms.recover_local`), which gives
    the identity again: a clone never keeps its template's. ``job``: such a job, taken
    over."""
    token = uuid.uuid4().hex[:12]     # this step's: an older one of the VM ends not it
    try:
        obj = identity_obj(vm)
        if job is None:
            held = h.db.find_job(obj)
            if held is not None and (held.owner == h.owner or not held.owner.alive()):
                h.db.take_over(obj, held.owner, h.owner)
            else:
                h.db.begin_job(Job(obj, JobKind.IDENTITY, "identity", h.owner,
                                   source=h.partition))
        h.db.set_phase(obj, h.owner, "identity", token=token)
    except Exception:     # the clone runs: give it its identity all the same
        h.log.exception("%s: its identity step could not be recorded", vm)
    task = asyncio.ensure_future(_identity(h, vm, inst, requested, restore_ms, token))
    _TASKS.add(task)
    task.add_done_callback(_TASKS.discard)


async def _identity(h: PartitionHost, vm: str, inst: QemuInstance, requested: float,
                    restore_ms: float, token: str) -> None:
    try:
        delay = float(os.environ.get(FAULT_IDENTITY_DELAY) or 0)
        if delay > 0:     # fault injection (tests): a supervisor killed before it
            await asyncio.sleep(delay)
        await _give_identity(h, vm, inst, requested, restore_ms)
    finally:
        cur = h.db.find_job(identity_obj(vm))
        if cur is not None and cur.detail.get("token") == token:
            h.db.end_job(cur.obj, h.owner)


def _clone_nics(h: PartitionHost, rec: VmRecord) -> list[tuple[str, str, str | None]]:
    """(the template's MAC, the clone's, the clone's address) of each tap NIC of clone
    ``rec``: its guest has the template's MACs until its identity step."""
    nics = h.db.nics(vm=rec.name)
    t = h.db.find_template(str(rec.template))
    if not nics or t is None:
        return []
    old = templates.nic_macs(templates.devices_of(t))
    return [(old[f"nic{n.index}"], n.mac, n.ip) for n in sorted(nics, key=lambda n: n.index)
            if f"nic{n.index}" in old]


async def _give_identity(h: PartitionHost, vm: str, inst: QemuInstance, requested: float,
                         restore_ms: float) -> None:
    rec = h.db.find_vm(vm)
    if rec is None:
        return
    machine_id = uuid.uuid4().hex
    script = templates.identity_script(vm, machine_id, templates.clone_mac(vm),
                                       _clone_nics(h, rec))
    firmware = rec.boot != "kernel"
    agent_ms = identity_ms = None
    error = None
    cloud_pid = None
    async with h.agent_lock(vm):
        if h.instances.get(vm) is not inst or inst.exited.is_set():
            return
        try:
            async with h.agent(inst) as ga:
                await ga.connect(timeout=AGENT_TIMEOUT_S)
                await ga.ping()
                agent_ms = (time.time() - requested) * 1000
                res = await ga.run(["/bin/sh", "-c", script], stdin=os.urandom(64),
                                   timeout=IDENTITY_TIMEOUT_S)
                identity_ms = (time.time() - requested) * 1000
                if res.exit_code != 0:
                    # Logged and published: the guest's stderr only as its size.
                    error = (f"the identity script exited {res.exit_code} "
                             f"({len(res.stderr)} bytes on stderr)")
                elif firmware:
                    # cloud-init's per-instance steps for the seed's new instance id:
                    # started here, so no command of the guest's user comes before.
                    cloud_pid = ExecStarted.parse(vm, await ga.execute("guest-exec", {
                        "path": "/bin/sh", "arg": ["-c", templates.CLOUD_INIT_STAGES],
                        "capture-output": True}, timeout=AGENT_TIMEOUT_S)).pid
        except GuestAgentError as exc:
            error = exc.summary
        except FusumaError as exc:
            error = str(exc)
    cloud: dict[str, Any] = {}
    if cloud_pid is not None:
        cloud = await _wait_cloud_init(h, vm, inst, cloud_pid, requested)
        if cloud.get("cloud_init_error"):
            error = str(cloud["cloud_init_error"])
    if error is not None:
        h.log.warning("%s: its identity as a clone is incomplete: %s", vm, error)
    else:
        h.log.info("%s: clone of %s restored in %.0f ms, agent after %.0f ms, identity "
                   "after %.0f ms", vm, rec.template, restore_ms, agent_ms or -1,
                   identity_ms or -1)
    h.db.emit("lifecycle", "vm-clone-ready", f"/1.0/vms/{vm}", template=rec.template,
              restore_ms=round(restore_ms, 1),
              agent_ms=None if agent_ms is None else round(agent_ms, 1),
              identity_ms=None if identity_ms is None else round(identity_ms, 1),
              machine_id=machine_id if error is None else None, error=error, **cloud)


async def _wait_cloud_init(h: PartitionHost, vm: str, inst: QemuInstance, pid: int,
                           requested: float) -> dict[str, Any]:
    """Wait for the guest's cloud-init stages (guest pid ``pid``), asking the agent
    once a second and holding its lock only for the question, so the guest's user is
    not kept waiting; what the clone-ready event says of it."""
    deadline = time.monotonic() + CLOUD_INIT_TIMEOUT_S
    while time.monotonic() < deadline:
        await asyncio.sleep(1.0)
        if h.instances.get(vm) is not inst or inst.exited.is_set():
            return {"cloud_init_error": "its QEMU ended or moved before cloud-init was "
                                        "done"}
        try:
            async with h.agent_lock(vm), h.agent(inst) as ga:
                await ga.connect(timeout=AGENT_TIMEOUT_S)
                status = ExecStatus.parse(vm, await ga.execute(
                    "guest-exec-status", {"pid": pid}, timeout=AGENT_TIMEOUT_S))
        except FusumaError as exc:
            return {"cloud_init_error": f"the guest agent failed while cloud-init ran "
                                        f"({exc})"}
        if status.exited:
            out: dict[str, Any] = {
                "cloud_init_ms": round((time.time() - requested) * 1000, 1),
                "cloud_init_exit": status.exit_code}
            if status.exit_code != 0:
                # They ran; a module of the image's said an error (as it would at a
                # boot): the guest's own word, not an identity left undone.
                out["cloud_init_warning"] = (
                    f"cloud-init's stages exited {status.exit_code}: a module reported "
                    "an error (`cloud-init status --long` in the guest)")
            return out
    return {"cloud_init_error": f"cloud-init was not done in {CLOUD_INIT_TIMEOUT_S:.0f} s"}
