"""A VM as `fusuma ps` shows it: the DB record checked against the live process.

Kept apart from ``manager`` (which needs the partition manager, cgroups and the
supervisor client) so that `ps` and `vm list` import only what they read. Nothing is
cached: every call reads /proc, so a QEMU killed a moment ago shows as ``crashed`` in
the very next `ps`.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from fusuma.errors import FusumaError
from fusuma.frozen import frozen
from fusuma.qemu import process
from fusuma.state import ALIVE, VmRecord, VmState


@frozen
class VmView:
    """A VM as `ps` shows it: the DB record checked against the live process."""

    record: VmRecord
    # Where segment files live (Paths.segments_dir), to find their mappings.
    segments_dir: Path = Path("/var/lib/fusuma/segments")
    # A recent reading of the QEMU's host memory (name, pid) -> host_memory JSON, or
    # None to read /proc now. The API daemon samples every running VM every 2 s, so a
    # request does not walk 16 QEMUs' page tables; the CLI always reads fresh.
    memory: Callable[[str, int], dict[str, Any] | None] | None = None

    @property
    def state(self) -> str:
        r = self.record
        if r.state == VmState.STARTING and r.pid is None:
            return r.state.value
        if r.state in ALIVE and not (r.pid and process.pid_alive(r.pid) and
                                     f"guest={r.name},debug-threads=on"
                                     in process.cmdline(r.pid)):
            # The supervisor is down or has not noticed yet: say what is true.
            return VmState.CRASHED.value
        return r.state.value

    def reason(self, state: str) -> str | None:
        """The record's error; for a VM shown ``state`` "crashed", never None. A crash
        that only /proc has seen (the record still says the VM lives: its supervisor
        is still cleaning up after the QEMU, or is down) has no recorded reason yet, so
        it is said what is known: which QEMU is gone, and that its end is not recorded."""
        r = self.record
        if state != VmState.CRASHED.value:
            return r.error
        if r.state != VmState.CRASHED:
            qemu = f"QEMU pid {r.pid}" if r.pid else "its QEMU"
            return (f"{qemu} is gone; the supervisor of partition {r.partition!r} has "
                    "not recorded how it ended yet")
        return r.error or "its QEMU ended; no reason was recorded"

    def as_json(self) -> dict[str, Any]:
        r = self.record
        state = self.state
        alive = state in ("running", "paused", "migrating", "stopping") and r.pid is not None
        mem: dict[str, Any] | None = None
        if alive and r.pid:
            mem = self.memory(r.name, r.pid) if self.memory is not None else None
            if mem is None:
                mem = read_memory(r.pid, r.segments, self.segments_dir,
                                  clone=r.template is not None)
        return {"name": r.name, "partition": r.partition, "state": state,
                "pid": r.pid if state != "crashed" else None,
                "accel": r.accel_used or r.accel, "vcpus": r.vcpus,
                "memory_mib": r.memory_mib, "shared_ram": r.shared_ram, "qos": r.qos,
                "mergeable": r.mergeable, "segments": r.segments, "ports": r.ports,
                # The QEMU version running it (None when none does, or when an older
                # fusuma started it), and the machine type it pinned.
                "qemu": r.qemu_version if alive else None, "machine": r.machine,
                "emulator": r.emulator, "template": r.template, "image": r.image,
                "boot": r.boot,
                "host_memory": mem,
                "disks": r.disks, "error": self.reason(state)}


def read_memory(pid: int, segments: Sequence[str], segments_dir: Path,
                clone: bool = False) -> dict[str, Any] | None:
    """The host memory of QEMU ``pid`` as ``ps --json`` shows it (None if it is gone);
    ``clone``: a clone of a template, whose template file's pages count apart."""
    from fusuma.memshare.report import vm_memory

    files = {seg: segments_dir / f"{seg}.erofs"
             for seg in (item.partition(":")[0] for item in segments)}
    with contextlib.suppress(FusumaError):
        return vm_memory(pid, files, clone=clone).as_json()
    return None


def views_json(records: Sequence[VmRecord], segments_dir: Path, threads: int = 4,
               memory: Callable[[str, int], dict[str, Any] | None] | None = None
               ) -> list[dict[str, Any]]:
    """``VmView(r, segments_dir).as_json()`` of every record, in order.

    Reading a running VM's PSS (smaps_rollup) makes the kernel walk the page tables of
    its QEMU, a few ms per VM with the guest's RAM mapped; several threads do that for
    several VMs at once (the read releases the GIL), which matters with many VMs."""
    out: list[dict[str, Any] | None] = [None] * len(records)
    errors: list[BaseException] = []

    def work(first: int, step: int) -> None:
        try:
            for i in range(first, len(records), step):
                out[i] = VmView(records[i], segments_dir, memory).as_json()
        except BaseException as exc:
            errors.append(exc)

    k = max(1, min(threads, len(records)))
    if k == 1:
        work(0, 1)
    else:
        pool = [threading.Thread(target=work, args=(i, k)) for i in range(k)]
        for t in pool:
            t.start()
        for t in pool:
            t.join()
    if errors:
        raise errors[0]
    return [x for x in out if x is not None]
