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
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from fusuma.errors import (
    ConflictError,
    FusumaError,
    GuestAgentError,
    QemuError,
    StateError,
    TemplateError,
)
from fusuma.memshare import reporting, templates
from fusuma.migration.supervisor_ops import _wait_migration as wait_migration
from fusuma.partition import rpc
from fusuma.paths import PRIVATE_DIR, ensure_dir
from fusuma.qemu import process, versions
from fusuma.qemu.cmdline import TEMPLATE_STATE_FDSET, DeviceSet, VmConfig
from fusuma.qemu.privilege import QemuFiles
from fusuma.qemu.qga import GuestAgent
from fusuma.qemu.qmp import EVENT_MIGRATION
from fusuma.state import Job, VmRecord, VmState
from fusuma.state.db import TemplateRecord

if TYPE_CHECKING:
    from fusuma.partition.supervisor import Supervisor, VmRuntime

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
# Fault injection (tests): fail the save right after this phase.
FAULT_PHASES = ("guest", "stop", "save")
# Fault injection (tests), read from the supervisor's environment: seconds a clone's
# QEMU waits before loading the template's state, so a test can kill it there.
FAULT_RESTORE_DELAY = "FUSUMA_FAULT_CLONE_RESTORE_DELAY"

# Identity tasks under way (a reference, so they are not collected mid-flight).
_TASKS: set[asyncio.Task[None]] = set()


# -- saving ------------------------------------------------------------------------------
def refuse(rec: VmRecord, running_version: str | None) -> None:
    """Refuse (one sentence) to make a template of ``rec``."""
    if rec.template is not None:
        raise TemplateError(f"VM {rec.name!r} is a clone of template {rec.template!r}: its "
                            "RAM is a private copy-on-write mapping, not a file a template "
                            "could keep; make templates of booted VMs.")
    if not rec.shared_ram or rec.mergeable:
        raise TemplateError(f"VM {rec.name!r} has private RAM (--private-ram or "
                            "--mergeable): a template keeps a VM's shared RAM file; create "
                            "the VM with shared RAM (the default).")
    if not templates.version_ok(running_version):
        raise templates.too_old(f"VM {rec.name!r} (partition {rec.partition!r})",
                                running_version)
    if rec.disks:
        raise TemplateError(f"VM {rec.name!r} has disks ({', '.join(rec.disks)}): its "
                            "clones could not have them; detach them (stop it, `fusuma "
                            "vm detach`) and boot it again.")


async def save(sup: Supervisor, vm: str, template: str, fault: str = "") -> rpc.TemplateSaved:
    """Stop running ``vm`` into template ``template`` (see the module docstring)."""
    async with sup._lock(vm):
        rec = sup._running(vm)
        rt = sup.vms[vm]
        refuse(rec, rt.qemu_version or rec.qemu_version)
        if sup.db.find_template(template) is not None:
            raise ConflictError(f"a template named {template!r} already exists; delete it "
                                "or pick another name.")
        for left in (templates.ram_file(sup.paths, template),
                     templates.template_dir(sup.paths, template)):
            if left.exists():
                raise ConflictError(f"{left} is left from an earlier template named "
                                    f"{template!r}; remove it or pick another name.")
        if not rec.ram_path or not Path(rec.ram_path).is_file():
            raise StateError(f"VM {vm!r} has no RAM file ({rec.ram_path}); stop and start "
                             "it, then try again.")
        if not rec.devices:
            raise TemplateError(f"VM {vm!r} has no recorded device set (booted by an older "
                                "fusuma); stop and start it, then try again.")
        async with sup._job(vm, "template"):
            return await _save(sup, rec, rt, template, fault)


async def _save(sup: Supervisor, rec: VmRecord, rt: VmRuntime, name: str,
                fault: str) -> rpc.TemplateSaved:
    vm = rec.name
    t0 = time.monotonic()
    paths = sup.paths
    out = rt.run_dir / "template.state"
    tdir = templates.template_dir(paths, name)
    state = templates.state_file(paths, name)
    ram_src = Path(str(rec.ram_path))
    ram_dst = templates.ram_file(paths, name)
    unbound: list[str] = []
    stopped = committed = False
    try:
        sup._phase(vm, "guest", template=name, ram_src=str(ram_src))
        unbound = await _prepare_guest(sup, rec, rt)
        _fault(fault, "guest")
        sup._phase(vm, "stop", template=name, unbound=unbound)
        await rt.qmp.stop()
        stopped = True
        _fault(fault, "stop")
        sup._phase(vm, "save")
        await rt.qmp.migrate_set_capabilities({"x-ignore-shared": True, "events": True})
        await rt.qmp.migrate(f"file:{out}")
        info = await wait_migration(rt, SAVE_TIMEOUT_S)
        if info.status != "completed":
            raise TemplateError(f"VM {vm!r}: QEMU could not save its device state "
                                f"({info.error or info.status}); it runs on.")
        _fault(fault, "save")
        ensure_dir(tdir.parent, PRIVATE_DIR)
        ensure_dir(tdir, PRIVATE_DIR)
        sha, state_bytes = _copy_state(out, state)
        with contextlib.suppress(FileNotFoundError):
            out.unlink()
        ds = DeviceSet.loads(str(rec.devices))
        record = TemplateRecord(
            name=name, ram_path=str(ram_dst), state_path=str(state),
            size_bytes=ram_src.stat().st_size, memory_mib=rec.memory_mib,
            vcpus=rec.vcpus, machine=ds.machine,
            qemu_version=str(rt.qemu_version or rec.qemu_version), devices=ds.dumps(),
            image=rec.image, segments=list(rec.segments),
            accel=rec.accel_used or "tcg", state_sha256=sha, source_vm=vm)
        sup._phase(vm, "commit", state_bytes=state_bytes)
        record = sup.db.add_template(record)
        committed = True
    except BaseException as exc:
        if not committed:
            await _undo(sup, rt, out, tdir, stopped, unbound)
        if isinstance(exc, QemuError):
            after = ("its QEMU is gone (see `fusuma ps`)" if rt.exited.is_set()
                     else f"VM {vm!r} runs on")
            raise TemplateError(f"template {name!r} was not made ({exc}); {after}."
                                ) from exc
        raise
    await _finish(sup, vm, record, ram_src, rt)
    ms = (time.monotonic() - t0) * 1000
    sup.log.info("made template %s from %s in %.0f ms (state %d bytes)", name, vm, ms,
                 state_bytes)
    return rpc.TemplateSaved(template=name, vm=vm, ms=round(ms, 1), state_bytes=state_bytes,
                             unbound=unbound)


def _fault(fault: str, phase: str) -> None:
    if fault == phase:
        raise TemplateError(f"fault injected after phase {phase!r} (FUSUMA_FAULT_TEMPLATE).")


async def _prepare_guest(sup: Supervisor, rec: VmRecord, rt: VmRuntime) -> list[str]:
    """Make the guest small and quiet: drop its caches and, if it reports free pages,
    wait until they are handed back, then unbind its balloon driver. Returns the
    devices unbound."""
    vm = rec.name
    reports = False
    if reporting.recorded(rec):
        with contextlib.suppress(QemuError):
            status = await rt.qmp.execute("x-query-virtio-status",
                                          {"path": reporting.balloon_path()})
            reports = reporting.negotiated(status)
    async with sup._agent_lock(vm):
        try:
            async with GuestAgent(vm, rt.run_dir / "qga.sock", sup._vm_logger(vm)) as ga:
                await ga.connect(timeout=AGENT_TIMEOUT_S)
                res = await ga.run(["/bin/sh", "-c", DROP_CACHES], timeout=AGENT_TIMEOUT_S)
                if res.exit_code != 0:
                    raise GuestAgentError(f"dropping the guest's caches failed (exit "
                                          f"{res.exit_code})")
                if reports:
                    await _settle(rec, rt.pid)
                if not reporting.recorded(rec):
                    return []
                res = await ga.run(["/bin/sh", "-c", UNBIND], timeout=AGENT_TIMEOUT_S)
                return res.stdout.decode(errors="replace").split()
        except GuestAgentError as exc:
            raise TemplateError(f"VM {vm!r}: its guest agent is needed to drop the guest's "
                                f"caches and stop page reporting before it is saved, and "
                                f"it failed ({exc}); nothing was changed.") from exc


async def _settle(rec: VmRecord, pid: int) -> None:
    """Wait until the pages the guest freed have been reported (the RAM file's
    allocation holds still), as `vm trim` does."""
    last, since = reporting.resident_bytes(rec, pid), time.monotonic()
    deadline = time.monotonic() + reporting.TRIM_TIMEOUT_S
    await asyncio.sleep(2.0)
    while time.monotonic() < deadline:
        await asyncio.sleep(0.25)
        now = reporting.resident_bytes(rec, pid)
        if now != last:
            last, since = now, time.monotonic()
        elif time.monotonic() - since >= reporting.SETTLE_S:
            return


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


async def _undo(sup: Supervisor, rt: VmRuntime, out: Path, tdir: Path | None,
                stopped: bool, unbound: list[str]) -> None:
    """A save that failed before its commit: no file left, the guest runs again."""
    with contextlib.suppress(FileNotFoundError):
        out.unlink()
    if tdir is not None:
        _remove_dir(tdir)
    if rt.exited.is_set():
        return
    if stopped:
        try:
            info = await rt.qmp.query_migrate()
            if info.status in ("setup", "active", "device"):
                await rt.qmp.migrate_cancel()
            if await rt.qmp.query_status() != "running":
                await rt.qmp.cont()
        except QemuError as exc:
            sup.log.error("%s: could not resume the guest after a failed save: %s",
                          rt.name, exc)
    if unbound:
        await _rebind(sup, rt, unbound)


async def _rebind(sup: Supervisor, rt: VmRuntime, names: list[str]) -> None:
    """Give the balloon devices back to their driver (best effort)."""
    script = "; ".join(f"echo {n} > {BALLOON_DRIVER}/bind" for n in names
                       if n.startswith("virtio") and n[6:].isdigit())
    if not script:
        return
    try:
        async with sup._agent_lock(rt.name), GuestAgent(
                rt.name, rt.run_dir / "qga.sock", sup._vm_logger(rt.name)) as ga:
            await ga.connect(timeout=10.0)
            await ga.run(["/bin/sh", "-c", script], timeout=10.0)
    except FusumaError as exc:
        sup.log.warning("%s: could not rebind its balloon driver: %s", rt.name, exc)


def _remove_dir(tdir: Path) -> None:
    if not tdir.is_dir():
        return
    for f in tdir.iterdir():
        with contextlib.suppress(OSError):
            f.unlink()
    with contextlib.suppress(OSError):
        tdir.rmdir()


async def _finish(sup: Supervisor, vm: str, t: TemplateRecord, ram_src: Path,
                  rt: VmRuntime | None) -> None:
    """After the commit: the VM stops without its RAM file, which is the template's."""
    rec = sup.db.find_vm(vm)
    if rt is not None:
        rt.stopping = True
        rt.ram_file = None       # never removed on exit: it is the template's now
        rt.owns_ram = False
    if rec is not None and rec.state in (VmState.RUNNING, VmState.PAUSED):
        sup.db.transition(vm, VmState.STOPPING, ram_path=None)
    elif rec is not None and rec.ram_path:
        sup.db.set_vm(vm, ram_path=None)
    _take_ram(sup, t, ram_src)
    sup._phase(vm, "quit")
    if rt is not None and not rt.exited.is_set():
        await rt.qmp.quit()
        try:
            await asyncio.wait_for(rt.exited.wait(), 10)
        except TimeoutError:
            process.kill(rt.pid)
            await sup._wait_exit(rt)
    with contextlib.suppress(FusumaError):
        sup._settle_state(vm, VmState.STOPPED, pid=None, ram_path=None)
    sup.cg.sweep_ram_groups(sup.paths.shm)


def _take_ram(sup: Supervisor, t: TemplateRecord, ram_src: Path) -> None:
    """The VM's RAM file becomes the template's: renamed (same directory), root's,
    readable by the template's group only (its clones' QEMUs)."""
    dst = Path(t.ram_path)
    if not dst.exists():
        os.rename(ram_src, dst)
    fd = os.open(dst, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    try:
        os.fchown(fd, 0, templates.template_gid(sup.paths, t))
        os.fchmod(fd, templates.RAM_MODE)
    finally:
        os.close(fd)


async def recover(sup: Supervisor, job: Job) -> None:
    """Finish or undo the save of a supervisor that died: finished once its record
    exists (committed), else undone, asking QEMU."""
    vm = job.name
    name = str(job.detail.get("template") or "")
    t = sup.db.find_template(name) if name else None
    rt = sup.vms.get(vm)
    ram_src = Path(str(job.detail.get("ram_src") or sup.paths.ram_file(vm)))
    if t is not None and t.source_vm == vm:
        await _finish(sup, vm, t, ram_src, rt)
        sup.log.info("finished making template %s from %s (its supervisor died)", name, vm)
        return
    if name:
        _remove_dir(templates.template_dir(sup.paths, name))
    if rt is None:
        return          # its QEMU is gone: adoption recorded the crash
    run = rt.run_dir
    await _undo(sup, rt, run / "template.state", None, True,
                [str(x) for x in job.detail.get("unbound") or []])
    with contextlib.suppress(FusumaError):
        status = await rt.qmp.query_status()
        sup._settle_state(vm, VmState.RUNNING if status == "running" else VmState.PAUSED)
    sup.log.info("undid making a template of %s (its supervisor died)", vm)


# -- clones ------------------------------------------------------------------------------
def template_of(sup: Supervisor, vm: VmRecord) -> TemplateRecord:
    t = sup.db.find_template(str(vm.template))
    if t is None:
        raise TemplateError(f"VM {vm.name!r} is a clone of template {vm.template!r}, which "
                            "no longer exists; delete the VM.")
    return t


def clone_devices(sup: Supervisor, vm: VmRecord, q: versions.Qemu) -> DeviceSet:
    """The devices a clone starts with (the template's, a vmgenid guid of its own), on
    a QEMU that can map the template read-only."""
    if not templates.version_ok(q.version):
        raise templates.too_old(f"partition {sup.partition!r}", q.version)
    return templates.clone_devices(template_of(sup, vm))


def clone_config(sup: Supervisor, vm: VmRecord, cfg: VmConfig,
                 groups: list[int]) -> tuple[VmConfig, list[int]]:
    """A clone's QEMU: RAM from the template's file, ``-incoming defer``, and the
    template's group among its own (to reopen the RAM file's descriptor)."""
    t = template_of(sup, vm)
    return (replace(cfg, template_ram=Path(t.ram_path), incoming="defer", ram_file=None),
            [*groups, templates.template_gid(sup.paths, t)])


def open_files(sup: Supervisor, vm: VmRecord, cfg: VmConfig, files: QemuFiles) -> VmConfig:
    """Open the template's RAM and state files read-only for the clone's QEMU, checked
    (size, sha256) as QEMU will read them."""
    ram_fd, state_fd = templates.open_files(template_of(sup, vm))
    files.add(ram_fd)
    files.add(state_fd)
    return replace(cfg, template_ram_fd=ram_fd, template_state_fd=state_fd)


async def restore(sup: Supervisor, vm: VmRecord, rt: VmRuntime,
                  timeout: float = 30.0) -> float:
    """Load the template's state into the clone's waiting QEMU and let it run; returns
    the ms it took."""
    delay = float(os.environ.get(FAULT_RESTORE_DELAY) or 0)
    if delay > 0:
        await asyncio.sleep(delay)
        if rt.exited.is_set():
            raise TemplateError(f"VM {vm.name!r}: its QEMU exited before it loaded template "
                                f"{vm.template!r}'s state.")
    t0 = time.monotonic()
    listener = rt.qmp.listener(EVENT_MIGRATION)
    try:
        await rt.qmp.migrate_set_capabilities({"x-ignore-shared": True, "events": True})
        await rt.qmp.migrate_incoming(f"file:/dev/fdset/{TEMPLATE_STATE_FDSET}")
        deadline = time.monotonic() + timeout
        while True:
            got: asyncio.Future[Any] = asyncio.ensure_future(listener.get())
            gone: asyncio.Future[Any] = asyncio.ensure_future(rt.exited.wait())
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
            said = process.tail(sup.paths.vm_dir(vm.name) / "qemu.log", 1)
            why = ("QEMU exited" if gone in done else "it did not finish in "
                   f"{timeout:.0f} s" if not done else "QEMU refused it")
            raise TemplateError(f"VM {vm.name!r} could not load template {vm.template!r}'s "
                                f"state: {why}{': ' + said if said else ''}.")
    finally:
        rt.qmp.drop_listener(listener)
    await rt.qmp.cont()
    return (time.monotonic() - t0) * 1000


def begin_identity(sup: Supervisor, vm: str, rt: VmRuntime, requested: float,
                   restore_ms: float) -> None:
    """Give a clone that runs now its own identity, in the background (holding the
    guest agent's lock from the next loop iteration on)."""
    task = asyncio.ensure_future(_identity(sup, vm, rt, requested, restore_ms))
    _TASKS.add(task)
    task.add_done_callback(_TASKS.discard)


async def _identity(sup: Supervisor, vm: str, rt: VmRuntime, requested: float,
                    restore_ms: float) -> None:
    rec = sup.db.find_vm(vm)
    if rec is None:
        return
    machine_id = uuid.uuid4().hex
    script = templates.identity_script(vm, machine_id, templates.clone_mac(vm))
    agent_ms = identity_ms = None
    error = None
    async with sup._agent_lock(vm):
        if sup.vms.get(vm) is not rt or rt.exited.is_set():
            return
        try:
            async with GuestAgent(vm, rt.run_dir / "qga.sock", sup._vm_logger(vm)) as ga:
                await ga.connect(timeout=AGENT_TIMEOUT_S)
                await ga.ping()
                agent_ms = (time.time() - requested) * 1000
                res = await ga.run(["/bin/sh", "-c", script], stdin=os.urandom(64),
                                   timeout=AGENT_TIMEOUT_S)
                identity_ms = (time.time() - requested) * 1000
                if res.exit_code != 0:
                    error = (f"the identity script exited {res.exit_code}: "
                             f"{res.stderr.decode(errors='replace').strip()}")
        except FusumaError as exc:
            error = str(exc)
    if error is not None:
        sup.log.warning("%s: its identity as a clone is incomplete: %s", vm, error)
    else:
        sup.log.info("%s: clone of %s restored in %.0f ms, agent after %.0f ms, identity "
                     "after %.0f ms", vm, rec.template, restore_ms, agent_ms or -1,
                     identity_ms or -1)
    sup.db.emit("lifecycle", "vm-clone-ready", f"/1.0/vms/{vm}", template=rec.template,
                restore_ms=round(restore_ms, 1),
                agent_ms=None if agent_ms is None else round(agent_ms, 1),
                identity_ms=None if identity_ms is None else round(identity_ms, 1),
                machine_id=machine_id if error is None else None, error=error)
