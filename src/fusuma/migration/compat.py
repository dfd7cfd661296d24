"""Can a destination's QEMU take a guest? Checked before a move starts anything.

A guest keeps its versioned machine type and its recorded device set for life
(fusuma.qemu.cmdline.DeviceSet): a move's destination rebuilds exactly those, on
whatever QEMU version its partition runs. QEMU guarantees migration compatibility for
one versioned machine type from an older QEMU to a newer one, and (in practice, which
is what distributions test) back, as long as the older QEMU has that machine type. So
a destination is refused only when its QEMU lacks the machine type: an older QEMU than
the one the type was introduced by.
"""

from __future__ import annotations

from fusuma.errors import StateError
from fusuma.paths import Paths
from fusuma.qemu import versions
from fusuma.qemu.cmdline import DeviceSet
from fusuma.state import Database, VmRecord


def guest(paths: Paths, rec: VmRecord) -> tuple[str, tuple[str, ...]]:
    """The machine type and CPU features of ``rec``'s guest: its recorded device
    set's, else its pinned machine type or what it was started with
    (fusuma.qemu.versions.machine_of) and no known CPU features."""
    if rec.devices:
        try:
            ds = DeviceSet.loads(rec.devices)
        except (ValueError, KeyError, TypeError) as exc:
            raise StateError(f"VM {rec.name!r}: its recorded device set is unreadable "
                             f"({exc}); stop and start it to record it anew.") from exc
        return ds.machine, ds.cpu_features
    return versions.machine_of(paths, rec), ()


def check_runs_on(paths: Paths, rec: VmRecord, q: versions.Qemu, to: str) -> str:
    """Refuse (one sentence) to move ``rec``'s guest onto ``q`` (partition ``to``'s
    QEMU, now or after a switch); return the guest's machine type."""
    machine, cpu = guest(paths, rec)
    why = versions.cannot_run(q, machine)
    missing = versions.cpu_missing(q, cpu)
    if why is None and missing:
        # The guest was told it has these (it booted where every installed QEMU had
        # them); a QEMU without them would fault on its next such instruction.
        raise StateError(f"VM {rec.name!r} cannot move to partition {to!r}: its guest's "
                         f"CPU has {', '.join(missing)}, which QEMU {q.version}'s TCG "
                         "cannot emulate; move it to a partition on a newer QEMU.")
    if why is not None:
        newer = [x for x in versions.installed(paths) if x.has_machine(machine)]
        hint = (f"move it to a partition on QEMU {newer[0].series} or newer" if newer
                else "no installed QEMU has it")
        raise StateError(f"VM {rec.name!r} cannot move to partition {to!r}: its guest has "
                         f"machine type {machine}, and {why} ({to!r} would run it); "
                         f"{hint}.")
    return machine


def check_destination(paths: Paths, db: Database, rec: VmRecord, to: str) -> str:
    """Refuse a move of ``rec`` to partition ``to`` whose QEMU cannot run its guest.

    A VM booted by a fusuma that pinned no machine type gets the one it runs with
    pinned in its record here, so it keeps it on every later start and move."""
    q = versions.resolve(paths, db.partition(to).qemu)
    machine = check_runs_on(paths, rec, q, to)
    if rec.machine is None:
        db.set_vm(rec.name, machine=machine)
    return machine
