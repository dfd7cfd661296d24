"""A new supervisor accounts for every QEMU of its partition that outlived the last.

Each QEMU found in the partition's VM cgroups (or named by a record) is taken back as
what the state and the jobs say it is: a VM's own QEMU (role RUNNING), a move's
incoming destination (INCOMING) or its leaving source (LEAVING). A QEMU nothing
explains is ended if it is not running a guest. A record whose QEMU is gone becomes
crashed. Jobs whose owner (an earlier supervisor) died are then finished.
"""

from __future__ import annotations

import contextlib
from pathlib import Path

from fusuma.errors import FusumaError, QemuError, StateError
from fusuma.qemu import process
from fusuma.qemu.instance import (
    INCOMING_PREFIX,
    QemuInstance,
    Role,
    remove_run_files,
)
from fusuma.qemu.process import end_unmanaged
from fusuma.state import LOCAL_JOBS, JobKind, VmState, vm_obj
from fusuma.state.machine import ALIVE
from fusuma.supervisor import vms
from fusuma.supervisor.host import PartitionHost


async def adopt(h: PartitionHost) -> None:
    found: dict[str, list[int]] = {}
    for vm in h.db.vms(h.partition):
        if vm.pid:
            found.setdefault(vm.name, []).append(vm.pid)
    for name, pids in _qemus_in_cgroup(h).items():
        found.setdefault(name, []).extend(pids)
    for name, pids in sorted(found.items()):
        for pid in sorted(set(pids)):
            if process.pid_alive(pid) and process.is_vm_process(
                    pid, name, h.paths.vm_run_dir(name)):
                await _adopt_one(h, name, pid)
    for vm in h.db.vms(h.partition):
        job = h.db.find_job(vm_obj(vm.name))
        if vm.state in ALIVE and h.instances.get(vm.name) is None and (
                job is None or job.kind not in (JobKind.MIGRATE, JobKind.HOST_MOVE_IN)):
            if vm.pid and process.pid_alive(vm.pid) and process.is_vm_process(
                    vm.pid, vm.name, h.paths.vm_run_dir(vm.name)):
                h.log.error("%s (pid %d) runs but could not be adopted; left alone (see "
                            "the warning above)", vm.name, vm.pid)
                continue
            vms.crashed_while_away(h, vm)
    for job in h.db.jobs():
        if job.kind in LOCAL_JOBS and job.source == h.partition and not job.owner.alive():
            await vms.recover_local(h, job)


def _qemus_in_cgroup(h: PartitionHost) -> dict[str, list[int]]:
    """QEMU pids in this partition's per-VM cgroups, by VM name."""
    out: dict[str, list[int]] = {}
    if not h.cg.exists(h.partition):
        return out
    for pid in h.cg.pids(h.partition):
        for arg in process.cmdline(pid):
            if arg.startswith("guest=") and arg.endswith(",debug-threads=on"):
                out.setdefault(arg[len("guest="):-len(",debug-threads=on")], []).append(pid)
    return out


async def _register(h: PartitionHost, inst: QemuInstance) -> bool:
    """Hold and watch an adopted QEMU; one a QEMU of the same VM already holds the
    same role for (two strays of one move) is ended, so that adoption goes on."""
    try:
        h.instances.add(inst)
    except StateError as exc:
        h.log.warning("ending QEMU pid %d of %s: %s", inst.pid, inst.vm, exc)
        await inst.qmp.disconnect()
        end_unmanaged(inst.pid, inst.vm, h.paths.vm_run_dir(inst.vm), timeout=0)
        return False
    h.watch(inst)
    return True


def _run_dir_of(h: PartitionHost, name: str, pid: int) -> Path:
    """Where this QEMU's sockets are now: where its argv put them, unless a move's
    ``settle`` has since renamed them into the VM's usual run dir. (An in-place move's
    new QEMU that still waits on its cpr channel has no QMP socket yet: its dir is
    where its cpr socket is, never the old QEMU's.)"""
    base = h.paths.vm_run_dir(name)
    for arg in process.cmdline(pid):
        if "path=" in arg and "qmp.sock" in arg:
            sock = Path(arg.split("path=", 1)[1].split(",", 1)[0])
            if sock.exists():
                return sock.parent
            from fusuma.supervisor.moves import cpr

            if (sock.parent / cpr.CPR_SOCKET).exists():
                return sock.parent
    return base


async def _adopt_one(h: PartitionHost, name: str, pid: int) -> None:
    rec = h.db.find_vm(name)
    job = h.db.find_job(vm_obj(name))
    run = _run_dir_of(h, name, pid)
    mine = rec is not None and rec.partition == h.partition and rec.pid == pid
    side = None
    if job is not None:     # (the mover's modules only for a QEMU a job names)
        from fusuma.supervisor.moves import cpr

        side = cpr.in_place_side(job, h.partition, rec, pid)
    ram = Path(rec.ram_path) if rec and rec.ram_path else None
    try:
        if side == Role.INCOMING and not (run / "qmp.sock").exists():
            raise QemuError(f"VM {name}: no QMP socket yet")
        inst, status = await QemuInstance.adopt(name, pid, run, ram, h.vm_logger(name),
                                                h.console_log(name))
    except QemuError as exc:
        if side == Role.INCOMING:
            # An in-place move's new QEMU still waiting for the guest's descriptors
            # (it opens QMP only once it has them): it has not run the guest, and
            # nothing can decide "forward" for it without QMP. Ending it is safe.
            h.log.warning("ending the new QEMU pid %d of %s: it never received the "
                          "guest (%s)", pid, name, exc)
            end_unmanaged(pid, name, h.paths.vm_run_dir(name), timeout=0)
            remove_run_files(run)
            return
        h.log.warning("cannot adopt %s (pid %d): %s", name, pid, exc)
        return
    mode = str(job.detail.get("mode", "zero-copy")) if job else "zero-copy"
    if job is not None and job.kind == JobKind.MIGRATE and job.peer == h.partition \
            and not mine and side != Role.LEAVING:
        # A move's destination, not yet the VM's QEMU: recovery decides its fate.
        from fusuma.supervisor.moves import dest

        inst.role = Role.INCOMING
        inst.owns_ram = mode == "copy"
        if mode == "copy":
            inst.ram_file = Path(str(job.detail.get("dest_ram"))) \
                if job.detail.get("dest_ram") else None
        inst.move = dest.MoveIn(None, mode, job.source or "")
        if not await _register(h, inst):
            return
        h.log.info("adopted %s (pid %d) as the incoming side of a move", name, pid)
        return
    if job is not None and job.kind == JobKind.HOST_MOVE_IN and job.source == h.partition \
            and not mine:
        # A move from another host's destination, not yet the VM's QEMU: its agent
        # decides its fate (it may be "forward" already: then it holds the only copy of
        # the guest, its disk served over NBD until the commit).
        from fusuma.supervisor.moves import dest, remote

        inst.role = Role.INCOMING
        try:
            inst.move = await remote.adopted_incoming(inst)
        except QemuError as exc:
            h.log.warning("%s (pid %d): what its move holds is unknown (%s)", name, pid,
                          exc)
            inst.move = dest.MoveIn(None, "copy", "remote")
        if not await _register(h, inst):
            return
        h.log.info("adopted %s (pid %d) as the incoming side of a move from another "
                   "host%s", name, pid, " serving its disk" if inst.move.nbd else "")
        return
    if job is not None and job.kind == JobKind.MIGRATE and job.source == h.partition \
            and not mine:
        # The source of a move whose record has gone on to the destination.
        inst.role = Role.LEAVING
        inst.owns_ram = mode == "copy"
        if not await _register(h, inst):
            return
        h.log.info("adopted %s (pid %d) as the leaving side of a move", name, pid)
        return
    if mine and rec is not None:
        if not await _register(h, inst):
            return
        if job is None:
            with contextlib.suppress(FusumaError):
                h.settle_state(name, VmState.RUNNING if status == "running"
                               else VmState.PAUSED)
            if run.name.startswith(INCOMING_PREFIX):
                # Migrated in, its sockets never moved to their usual place; the
                # source is gone (no job), so that is safe now.
                from fusuma.supervisor.moves import dest

                with contextlib.suppress(FusumaError):
                    await dest.settle(h, name)
        h.log.info("adopted %s (pid %d, %s)", name, pid, status)
        with contextlib.suppress(FusumaError):
            h.apply_class(rec, pid)
        return
    # Nothing explains this QEMU: never let it run a guest beside the VM's own.
    h.log.warning("ending QEMU pid %d of %s: no record or job explains it (%s)", pid, name,
                  status)
    await inst.qmp.disconnect()
    end_unmanaged(pid, name, h.paths.vm_run_dir(name), timeout=0)
