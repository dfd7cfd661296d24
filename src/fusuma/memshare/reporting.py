"""Free page reporting: memory a guest frees goes back to the host.

A VM booted with page reporting has a virtio-balloon device with
``free-page-reporting=on`` (fusuma.qemu.cmdline). The guest's balloon driver reports
free blocks of 2^order pages (``page_reporting.page_reporting_order`` on its kernel
command line) and QEMU discards them: for guest RAM in a shared file, a hole punched in
the file, so the host's tmpfs gives the pages back and the VM still moves zero-copy (the
file is the same, only emptier); for private RAM, ``MADV_DONTNEED``.

Where the pages are charged when the guest touches them again decides whether it is on
by default. The kernel charges a page to the memory cgroup of the process that faults
it. On cgroup v1 the memory hierarchy is separate, so a QEMU's memory membership is its
RAM file's group wherever it runs (fusuma.supervisor): refaults land there,
and reporting is on by default. On cgroup v2 a process has one cgroup for every
controller, its partition's: RAM files are allocated whole up front (issue 18) and
refaults would be charged to the partition, so reporting is off by default there and
refused for shared RAM (private RAM is the partition's anyway, so it may have it).
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any, Protocol

from fusuma.errors import SpecError, StateError
from fusuma.qemu.cmdline import BALLOON_ID, DeviceSet, has_page_reporting
from fusuma.state.db import VmRecord

# What `fusuma vm trim` runs in the guest: write back, drop clean caches (page cache,
# dentries, inodes), compact so freed pages form blocks of the reporting order.
TRIM_ARGV = ["/bin/sh", "-c", "sync; echo 3 > /proc/sys/vm/drop_caches; "
             "echo 1 > /proc/sys/vm/compact_memory 2>/dev/null; true"]
# The guest reports 2 s after free memory crosses its threshold (PAGE_REPORTING_DELAY),
# and each pass reports about 1/16 of a free list before it waits another 2 s, so 2 GiB
# freed take about half a minute to go back. `trim` waits until the resident size has
# held still for longer than two such pauses, at most TRIM_TIMEOUT_S.
SETTLE_S = 4.5
TRIM_TIMEOUT_S = 90.0
FEATURE = "VIRTIO_BALLOON_F_REPORTING"


class _Separates(Protocol):
    @property
    def separate_memory(self) -> bool: ...


def host_default(cg: _Separates, shared_ram: bool) -> bool:
    """Reporting's default for a new VM on this host (see the module's docstring)."""
    return cg.separate_memory or not shared_ram


def resolve(asked: bool | None, shared_ram: bool, template: str | None,
            cg: _Separates) -> bool:
    """What a new VM gets: ``asked`` (None: the host's default), or a SpecError."""
    if template is not None:
        if asked:
            raise SpecError("a clone of a template cannot have page reporting: its RAM "
                            "is a private copy-on-write mapping of the template's file, "
                            "whose pages it must never give back; leave it off")
        return False
    if asked is None:
        return host_default(cg, shared_ram)
    if asked and shared_ram and not cg.separate_memory:
        raise SpecError("page reporting needs guest RAM whose refaults are charged to its "
                        "own memory cgroup, which cgroup v2 cannot give a QEMU that runs "
                        "in a partition; use private RAM (--private-ram) or leave it off")
    return asked


def wanted(vm: VmRecord, cg: _Separates) -> bool:
    """Whether ``vm`` boots with page reporting (records from before it: the default)."""
    if vm.page_reporting is not None:
        return vm.page_reporting
    if vm.template is not None:
        return False
    return host_default(cg, vm.shared_ram)


def recorded(vm: VmRecord) -> bool:
    """Whether the guest running now has the device (its recorded device set)."""
    if not vm.devices:
        return False
    try:
        return has_page_reporting(DeviceSet.loads(vm.devices))
    except (ValueError, KeyError):
        return False


def negotiated(status: dict[str, Any]) -> bool:
    """Whether the guest's driver accepted free page reporting, from QMP
    ``x-query-virtio-status`` of the balloon."""
    feats = status.get("guest-features") or {}
    names = feats.get("dev-features") or [] if isinstance(feats, dict) else []
    return any(str(n).startswith(FEATURE) for n in names)


def balloon_path() -> str:
    """The QOM path of the balloon's virtio device."""
    return f"/machine/peripheral/{BALLOON_ID}/virtio-backend"


def resident_bytes(vm: VmRecord, pid: int | None) -> int | None:
    """Host memory the guest's RAM holds now: the RAM file's allocated blocks (shared
    RAM), or QEMU's anonymous memory (private RAM: RAM and QEMU's own heap)."""
    if vm.shared_ram and vm.ram_path:
        try:
            return os.stat(vm.ram_path).st_blocks * 512
        except OSError:
            return None
    if pid is None:
        return None
    try:
        text = Path(f"/proc/{pid}/smaps_rollup").read_text()
    except OSError:
        return None
    for line in text.splitlines():
        if line.startswith("Anonymous:"):
            return int(line.split()[1]) * 1024
    return None


async def settled_bytes(vm: VmRecord, pid: int | None) -> int | None:
    """The guest RAM's resident size once it holds still: reports come 2 s after the
    guest's free memory crosses its threshold, then in batches, so wait until the
    size has stopped falling for ``SETTLE_S`` (at most ``TRIM_TIMEOUT_S``)."""
    import asyncio  # the supervisor's; `fusuma ps` reads resident_bytes without it

    last, since = resident_bytes(vm, pid), time.monotonic()
    deadline = time.monotonic() + TRIM_TIMEOUT_S
    await asyncio.sleep(2.0)
    while time.monotonic() < deadline:
        await asyncio.sleep(0.25)
        now = resident_bytes(vm, pid)
        if now != last:
            last, since = now, time.monotonic()
        elif time.monotonic() - since >= SETTLE_S:
            break
    return last


def refuse_without_device(vm: VmRecord) -> None:
    if vm.template is not None:
        raise StateError(f"VM {vm.name!r} is a clone of template {vm.template!r}: its RAM "
                         "is the template's file mapped read-only, copy-on-write, so it "
                         "never hands pages back; stop or delete the clone instead")
    if not recorded(vm):
        raise StateError(f"VM {vm.name!r} was booted without page reporting (no "
                         "virtio-balloon with free-page-reporting): nothing can be handed "
                         "back; create it with --page-reporting on (or stop and start it "
                         "on a host where it is the default)")


def refuse_without_driver(vm: str) -> StateError:
    return StateError(f"VM {vm!r}'s guest has not enabled free page reporting (its kernel "
                      "lacks the virtio_balloon driver or CONFIG_PAGE_REPORTING, or it "
                      "has not loaded yet): nothing can be handed back")
