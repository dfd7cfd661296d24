"""What an in-place move (QEMU's cpr-transfer, ``fusuma.supervisor.moves.cpr``) needs, checked
before anything starts.

An in-place move is a move whose source and destination are the same partition
(``migrate(parts, vm, to=<its partition>, mode="cpr-transfer")``), run through the same
phases, job and recovery as any move. It needs what QEMU needs for cpr-transfer: both
QEMUs >= 10.0, the running one started with ``aux-ram-share=on``, guest RAM in a shared
file; and room in the partition for a second QEMU of the VM while both exist. Every
refusal is one sentence naming ``--via``, the way that always works.
"""

from __future__ import annotations

import os
from dataclasses import replace

from fusuma import capacity
from fusuma.errors import FusumaError, StateError
from fusuma.partition.manager import PartitionManager
from fusuma.qemu import process, versions
from fusuma.qemu.versions import Qemu, parse_version
from fusuma.vm import VmView

MODE = versions.CPR_MODE
MIN_VERSION_TEXT = versions.CPR_MIN_VERSION
AUX_RAM_SHARE = "aux-ram-share=on"
has_cpr = versions.has_cpr


def started_for_cpr(pid: int) -> bool:
    """True if the running QEMU ``pid`` allocated all its RAM shareably (its argv
    carries aux-ram-share=on), so cpr-transfer can hand every RAM block over."""
    return any(AUX_RAM_SHARE in arg for arg in process.cmdline(pid))


def partition_qemu(parts: PartitionManager, partition: str,
                   qemu: str | None = None) -> Qemu:
    """The QEMU a new QEMU process of ``partition`` runs (``qemu``: the version or path
    it is about to switch to)."""
    return versions.resolve(parts.paths, qemu or parts.db.partition(partition).qemu)


def running_qemu(parts: PartitionManager, pid: int | None,
                 recorded: str | None) -> Qemu | None:
    """The QEMU a VM's process runs: the binary recorded when it started, else its exe
    (None if neither can be resolved)."""
    for cand in (recorded, _exe(pid)):
        if cand:
            try:
                return versions.resolve(parts.paths, cand)
            except FusumaError:
                continue
    return None


def _exe(pid: int | None) -> str | None:
    if not pid:
        return None
    try:
        return os.readlink(f"/proc/{pid}/exe")
    except OSError:
        return None


def via(partition: str) -> str:
    return f"`fusuma maintain {partition} --via PARTITION`"


def check_partition(partition: str, q: Qemu, switching: bool = False) -> None:
    """Refuse an in-place maintenance onto a QEMU that lacks cpr-transfer."""
    if not has_cpr(q):
        whose = "the QEMU it would switch to is" if switching else "it runs QEMU"
        raise StateError(f"partition {partition!r} cannot be maintained in place: {whose} "
                         f"{q.version}, which lacks {MODE} (QEMU >= {MIN_VERSION_TEXT}); "
                         f"use {via(partition)} instead.")


def check(parts: PartitionManager, vm: str, new: Qemu | None = None) -> None:
    """Every refusal of an in-place move of ``vm``, before anything starts. ``new``:
    the QEMU its new process will run (default: its partition's)."""
    db = parts.db
    rec = db.vm(vm)
    state = VmView(rec).state
    if state != "running":
        raise StateError(f"VM {vm!r} is {state}; only a running VM can be moved.")
    p = rec.partition
    if parts.supervisor_pid(p) is None:
        raise StateError(f"the supervisor of partition {p!r} is not running; start it with "
                         f"`fusuma partition restart {p}`.")
    if rec.template is not None:
        raise StateError(f"VM {vm!r} is a clone of template {rec.template!r}: its RAM is a "
                         f"private copy-on-write mapping of the template's file, which "
                         f"{MODE} cannot hand to a new QEMU; move it with {via(p)} instead.")
    if rec.mergeable or not rec.shared_ram:
        raise StateError(f"VM {vm!r} has private RAM, which {MODE} cannot hand to a new "
                         f"QEMU (it needs RAM in a shared file); move it with {via(p)} "
                         "instead.")
    old = running_qemu(parts, rec.pid, rec.qemu_binary)
    if old is None or not has_cpr(old):
        have = old.version if old is not None else "of unknown version"
        raise StateError(f"VM {vm!r} runs on QEMU {have}, which lacks {MODE} (QEMU >= "
                         f"{MIN_VERSION_TEXT}); move it with {via(p)} instead.")
    if not started_for_cpr(int(rec.pid or 0)):
        raise StateError(f"VM {vm!r} was started without aux-ram-share=on, so its QEMU "
                         f"cannot hand all of its RAM to a new one; move it once with "
                         f"{via(p)} instead (its next QEMU has it).")
    new = new or partition_qemu(parts, p)
    check_partition(p, new)
    if parse_version(new.version)[:2] < parse_version(old.version)[:2]:
        raise StateError(f"VM {vm!r} runs on QEMU {old.version} and the new QEMU is "
                         f"{new.version}: QEMU migrates a guest to the same or a newer "
                         f"version only; use {via(p)} instead.")
    # Both QEMUs of the VM run in the partition until the old one quits.
    second = replace(rec, name=f"{vm} (its new QEMU)")
    capacity.check_partition_room(db, p, [second], "move")
