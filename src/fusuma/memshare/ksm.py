"""The host's Kernel Samepage Merging (KSM), through sysfs and ``/proc/PID/ksm_stat``.

KSM scans private anonymous memory that a process marked mergeable (QEMU does so for
guest RAM with ``-machine mem-merge=on``) and merges identical pages into one
copy-on-write page. The numbers follow the kernel's admin guide (admin-guide/mm/ksm.rst):

- ``pages_shared``: KSM pages in use; ``pages_sharing``: further sites mapping them,
  i.e. how many pages are saved; ``ksm_zero_pages``: pages merged with the zero page
  when ``use_zero_pages`` is set, also saved. So saved = (pages_sharing +
  ksm_zero_pages) * page size; ``general_profit`` also subtracts KSM's own metadata.
- ``full_scans``: completed passes over all mergeable memory; merging needs at least
  two passes (a page must be seen unchanged twice), so settling is measured in scans.

``run``: 0 stops the scanner (merged pages stay merged), 1 runs it, 2 stops it and
unmerges every merged page.
"""

from __future__ import annotations

import ctypes
import errno
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from fusuma.errors import HostError, SpecError, StateError
from fusuma.frozen import frozen

DEFAULT_ROOT = Path("/sys/kernel/mm/ksm")

KSM_RISK = ("KSM merges identical pages across VMs, so one guest can learn whether "
            "another VM holds a given page by timing the copy-on-write fault when it "
            "writes to its own copy (a memory-deduplication side channel); turn it on "
            "only for VMs that trust each other.")

ZERO_COPY_NOTE = ("KSM merges only private anonymous memory, so a VM with mergeable RAM "
                  "has no shared RAM file and can only be migrated by copy, never "
                  "zero-copy.")

RUN_NAMES = {0: "stopped", 1: "running", 2: "stopped, unmerged"}

# Settled: pages_sharing changed by less than this fraction between two full scans.
SETTLE_CHANGE = 0.01
SETTLE_SCANS = 2


def _mib(nbytes: int) -> float:
    return round(nbytes / 2**20, 1)


@frozen
class KsmSettings:
    """One reading of /sys/kernel/mm/ksm. Counters absent on older kernels are None."""

    run: int
    pages_to_scan: int
    sleep_millisecs: int
    pages_shared: int
    pages_sharing: int
    pages_unshared: int
    pages_volatile: int
    full_scans: int
    general_profit: int | None    # bytes, may be negative; newer kernels only
    ksm_zero_pages: int | None    # newer kernels only
    use_zero_pages: bool | None
    page_size: int

    @property
    def saved_pages(self) -> int:
        return self.pages_sharing + (self.ksm_zero_pages or 0)

    @property
    def saved_bytes(self) -> int:
        return self.saved_pages * self.page_size

    def as_json(self) -> dict[str, Any]:
        return {"run": self.run, "state": RUN_NAMES.get(self.run, str(self.run)),
                "pages_to_scan": self.pages_to_scan,
                "sleep_millisecs": self.sleep_millisecs,
                "pages_shared": self.pages_shared, "pages_sharing": self.pages_sharing,
                "pages_unshared": self.pages_unshared,
                "pages_volatile": self.pages_volatile, "full_scans": self.full_scans,
                "general_profit": self.general_profit,
                "ksm_zero_pages": self.ksm_zero_pages,
                "use_zero_pages": self.use_zero_pages, "page_size": self.page_size,
                "saved_mib": _mib(self.saved_bytes),
                "general_profit_mib": (None if self.general_profit is None
                                       else _mib(self.general_profit))}


class Ksm:
    """KSM control of one host; ``root`` is the sysfs directory (a fake one in tests),
    ``clock`` and ``sleep`` drive ``wait_settled``."""

    def __init__(self, root: Path = DEFAULT_ROOT, *, page_size: int | None = None,
                 clock: Callable[[], float] = time.monotonic,
                 sleep: Callable[[float], None] = time.sleep) -> None:
        self.root = root
        self.page_size = page_size or os.sysconf("SC_PAGE_SIZE")
        self.clock = clock
        self.sleep = sleep

    def available(self) -> bool:
        return (self.root / "run").is_file()

    def _check(self) -> None:
        if not self.available():
            raise HostError(f"KSM is not available on this host: {self.root} is missing "
                            "(kernel built without CONFIG_KSM).")

    def _read(self, name: str) -> int | None:
        try:
            return int((self.root / name).read_text().split()[0])
        except FileNotFoundError:
            return None
        except (OSError, ValueError, IndexError) as exc:
            raise HostError(f"cannot read {self.root / name}: {exc}.") from exc

    def _need(self, name: str) -> int:
        value = self._read(name)
        if value is None:
            raise HostError(f"cannot read KSM's {name}: {self.root / name} is missing; "
                            "this kernel's KSM is older than fusuma supports (2.6.32).")
        return value

    def read_settings(self) -> KsmSettings:
        self._check()
        uzp = self._read("use_zero_pages")
        return KsmSettings(
            run=self._need("run"), pages_to_scan=self._need("pages_to_scan"),
            sleep_millisecs=self._need("sleep_millisecs"),
            pages_shared=self._need("pages_shared"),
            pages_sharing=self._need("pages_sharing"),
            pages_unshared=self._need("pages_unshared"),
            pages_volatile=self._need("pages_volatile"),
            full_scans=self._need("full_scans"),
            general_profit=self._read("general_profit"),
            ksm_zero_pages=self._read("ksm_zero_pages"),
            use_zero_pages=None if uzp is None else uzp != 0,
            page_size=self.page_size)

    def _write(self, name: str, value: int) -> None:
        path = self.root / name
        try:
            path.write_text(f"{value}\n")
        except PermissionError as exc:
            raise HostError(f"cannot change KSM's {name}: writing {path} was refused; "
                            "run fusuma as root (on a host, not in a container with a "
                            "read-only /sys).") from exc
        except OSError as exc:
            if exc.errno == errno.EROFS:
                raise HostError(f"cannot change KSM's {name}: {path} is on a read-only "
                                "file system (a container?); change KSM on the host.") from exc
            raise HostError(f"cannot write {value} to {path}: "
                            f"{exc.strerror or exc}.") from exc

    def set_run(self, run: int, pages_to_scan: int | None = None,
                sleep_millisecs: int | None = None) -> KsmSettings:
        """Set the scan rate (if given), then ``run``: 0 stop, 1 run, 2 stop and unmerge
        all merged pages. Returns the settings afterwards."""
        if run not in RUN_NAMES:
            raise SpecError(f"KSM run must be 0 (stop), 1 (run) or 2 (unmerge), not {run}.")
        if pages_to_scan is not None and pages_to_scan < 1:
            raise SpecError(f"pages_to_scan must be at least 1, not {pages_to_scan}.")
        if sleep_millisecs is not None and sleep_millisecs < 0:
            raise SpecError(f"sleep_millisecs must be 0 or more, not {sleep_millisecs}.")
        self._check()
        if pages_to_scan is not None:
            self._write("pages_to_scan", pages_to_scan)
        if sleep_millisecs is not None:
            self._write("sleep_millisecs", sleep_millisecs)
        self._write("run", run)
        return self.read_settings()

    def saved_bytes(self) -> int:
        """Memory KSM saves host-wide now: (pages_sharing + ksm_zero_pages) * page size."""
        return self.read_settings().saved_bytes

    def wait_settled(self, timeout: float, progress: Callable[[str], None] | None = None,
                     poll: float = 0.5) -> KsmSettings:
        """Wait until KSM has done at least two more full scans and pages_sharing changed
        by less than 1% between the last two; returns the settings then.

        Raises StateError if KSM is not running or does not settle within ``timeout``
        seconds (raise pages_to_scan to scan faster)."""
        s = self.read_settings()
        if s.run != 1:
            raise StateError(f"KSM is not running (run={s.run}), so it will not settle; "
                             "turn it on with `fusuma share ksm on`.")
        deadline = self.clock() + timeout
        first_scan = s.full_scans
        # pages_sharing as first seen after each completed full scan
        at_scan: list[int] = []
        seen = s.full_scans
        while True:
            if s.full_scans != seen:
                seen = s.full_scans
                at_scan.append(s.pages_sharing)
                if progress:
                    progress(f"KSM full scan {seen - first_scan}: pages_sharing "
                             f"{s.pages_sharing} ({_mib(s.saved_bytes)} MiB saved)")
                if (seen - first_scan >= SETTLE_SCANS and len(at_scan) >= 2
                        and _steady(at_scan[-2], at_scan[-1])):
                    return s
            if self.clock() >= deadline:
                raise StateError(
                    f"KSM did not settle within {timeout:g} s: {seen - first_scan} full "
                    f"scan(s) done, pages_sharing now {s.pages_sharing}; raise "
                    "pages_to_scan (`fusuma share ksm on --pages-to-scan N`) or wait longer.")
            self.sleep(poll)
            s = self.read_settings()
            if s.run != 1:
                raise StateError(f"KSM was stopped (run={s.run}) while waiting for it "
                                 "to settle.")


def _steady(prev: int, cur: int) -> bool:
    return cur == prev or abs(cur - prev) < SETTLE_CHANGE * max(prev, cur)


@frozen
class ProcessKsm:
    """``/proc/PID/ksm_stat``; a field the kernel does not print is None.

    ``merging_pages``: pages of this process that are merged KSM pages;
    ``process_profit``: bytes saved for this process minus KSM's metadata for it."""

    rmap_items: int | None
    zero_pages: int | None
    merging_pages: int | None
    process_profit: int | None
    merge_any: bool | None     # PR_SET_MEMORY_MERGE: the whole process is mergeable
    mergeable: bool | None     # any of its memory is mergeable

    def as_json(self, page_size: int) -> dict[str, Any]:
        return {"rmap_items": self.rmap_items, "zero_pages": self.zero_pages,
                "merging_pages": self.merging_pages,
                "merging_mib": (None if self.merging_pages is None
                                else _mib(self.merging_pages * page_size)),
                "process_profit": self.process_profit,
                "process_profit_mib": (None if self.process_profit is None
                                       else _mib(self.process_profit)),
                "merge_any": self.merge_any, "mergeable": self.mergeable}


def parse_ksm_stat(text: str) -> ProcessKsm:
    ints: dict[str, int] = {}
    flags: dict[str, bool] = {}
    for line in text.splitlines():
        parts = line.replace(":", " ").split()
        if len(parts) != 2:
            continue
        key, value = parts
        if value.lstrip("-").isdigit():
            ints[key] = int(value)
        elif value in ("yes", "no"):
            flags[key] = value == "yes"
    return ProcessKsm(rmap_items=ints.get("ksm_rmap_items"),
                      zero_pages=ints.get("ksm_zero_pages"),
                      merging_pages=ints.get("ksm_merging_pages"),
                      process_profit=ints.get("ksm_process_profit"),
                      merge_any=flags.get("ksm_merge_any"),
                      mergeable=flags.get("ksm_mergeable"))


def process_ksm(pid: int, procfs: Path = Path("/proc")) -> ProcessKsm | None:
    """KSM counters of ``pid``, or None when the kernel has no ksm_stat (older kernels,
    no CONFIG_KSM), the process is gone or the file cannot be read."""
    try:
        text = (procfs / str(pid) / "ksm_stat").read_text()
    except OSError:
        return None
    return parse_ksm_stat(text)


PR_SET_MEMORY_MERGE = 67
_LIBC = ctypes.CDLL(None, use_errno=True)


def enable_merge_any() -> bool:
    """Make all of this process's private anonymous memory mergeable by KSM
    (``prctl(PR_SET_MEMORY_MERGE, 1)``, Linux 6.4+; kept across fork and exec since 6.7).

    Called in a mergeable VM's QEMU between fork and exec, so QEMU's heap and (under
    TCG) its translation cache can merge too, not only guest RAM. False when the
    kernel does not have it; guest RAM is still mergeable then (``merge=on``)."""
    return bool(_LIBC.prctl(PR_SET_MEMORY_MERGE, 1, 0, 0, 0) == 0)
