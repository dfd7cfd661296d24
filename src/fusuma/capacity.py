"""The one memory arithmetic every admission check uses: VM create, partition create and
resize, migrate, maintain, the spec check and VM start.

Guest RAM is admitted once, host-wide, and belongs to its VM wherever it runs (VMBeam's
premise: a zero-copy move changes the owner of the memory, it copies none). Three
budgets are checked:

- **the host**: every partition's ``memory_mib`` plus every VM's guest RAM in a shared
  file (``guest_ram``) must fit in what the host gives (``host_need``). A copy move of
  such a VM holds a second RAM file until it ends, so it needs that much more. A
  template's RAM file counts here too, once, whatever its clones (``template_ram``).
- **partitions**: a partition's ``memory_mib`` is the budget for what runs in it beyond
  guest RAM: its supervisor (SUPERVISOR_MIB) and each VM's QEMU (``partition_share``:
  the QEMU's own memory; a VM with private RAM, for KSM, also counts its RAM there, as
  its RAM is its QEMU's anonymous memory; so does a clone of a template, whose RAM is a
  private copy-on-write mapping: at worst it writes every page). A zero-copy move needs room at the
  destination only for the new QEMU's own memory. A VM's footprint is fixed when it is
  defined (``VmRecord.overhead_mib``), so a check never changes its mind because the
  host's settings changed since.
- **the shm filesystem** (Paths.shm): shared guest RAM lives in files there. A file
  fills as its guest touches memory (or at once: fusuma allocates it in the VM's own
  memory cgroup when the VM starts, see ``fusuma.host.cgroups``), so a new RAM file
  needs room for its whole size plus what the other RAM files have yet to fill; a copy
  move of a shared-RAM VM needs a second RAM file (``<vm>.<hex>.ram``).

**Overcommit by policy.** Each VM has a memory class. A ``guaranteed`` VM (the default)
is admitted at its whole RAM ``R`` and never reclaimed. A ``burstable`` VM has a floor
``F`` (``--memory-min``, at most ``R``) below which nothing is ever taken from it, and is
admitted at

    admitted = F + ceil((R - F) / O)      (MiB)

where ``O`` >= 1.0 is the memory overcommit of its partition: the partition's own
``memory_overcommit``, or the host's (``fusuma up``'s ``[host] memory_overcommit``) when
the partition sets none; both are 1.0 unless set, and at 1.0 every VM is admitted whole,
as before overcommit existed. So a burstable VM's floor is always backed by memory, and
only the RAM above it is shared out: at ``O = 2`` two burstable VMs' RAM above their
floors is admitted in the room of one. ``admitted_ram`` is the only place this is
computed; wherever guest RAM is counted, it is the admitted figure that counts:

- in the host's budget of guest RAM, for a VM whose RAM is a shared file
  (``guest_ram``, ``host_need``),
- in the shm filesystem, where a burstable VM's RAM file is counted up to its admitted
  size (``check_start``, ``shm_need``'s ``admitted``).

What is *not* overcommitted: a VM's QEMU overhead; a partition's budget, and so the RAM
of a VM with private RAM (KSM, a template's clone), which lives under the partition's
hard limit beside other VMs' QEMUs: overcommitted there, one guest's growth would make
the kernel reclaim or kill inside the partition, guaranteed VMs included; a template's
RAM file; a copy move's second RAM file; and the kernel's limit of a RAM file's own
memory cgroup (``ram_group_limit``), which stays the file's whole size for both
classes: a guest may touch all its RAM, and shmem cannot be reclaimed by the kernel
without swap, so a lower limit would make the kernel kill the QEMU instead of letting
the memory governor take memory back through the guest (balloon, free page reporting).
So the overcommit is a bet on the host as a whole, covered by the memory governor, and
never on one VM's cgroup.
What a burstable VM holds above its floor is its *reclaimable* memory
(``reclaimable_mib``), which the memory governor may take back when the host runs short
and gives back when pressure falls; a guaranteed VM's is 0.

The kernel agrees with this bookkeeping: each RAM file is charged to a memory cgroup of
its own (``RAM_GROUP/<file stem>``, limited to the file's size), not to the partition
whose QEMU first touched it, so a move changes no partition's counter.

Every refusal is a ResourceError whose sentence shows the sum, e.g.
``64 + vm0 128 + web0 128 = 320 > 300 MiB``, and says how to fix it.

What counts where lives in ``admitted_ram``, ``guest_ram``, ``partition_share`` and
``host_need`` only.
"""

from __future__ import annotations

import math
import os
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Literal

from fusuma.errors import ResourceError
from fusuma.frozen import frozen
from fusuma.paths import Paths
from fusuma.state import Database, VmRecord

if TYPE_CHECKING:
    from fusuma.host.topology import HostInfo

MIB = 1024 * 1024

# Memory a partition keeps for its supervisor (a Python process) on top of its VMs.
SUPERVISOR_MIB = 64
# The smallest partition: a supervisor and room for at least a tiny VM's QEMU.
MIN_PARTITION_MIB = SUPERVISOR_MIB + 64

Verb = Literal["create", "move"]

MEMORY_CLASSES = ("guaranteed", "burstable")
# The host-wide setting's key in the state file's meta table.
OVERCOMMIT_KEY = "memory_overcommit"
DEFAULT_OVERCOMMIT = 1.0
# Overcommits beyond this are refused: a typo (20 for 2.0) would otherwise admit a
# host's worth of burstable RAM in a twentieth of its room.
MAX_OVERCOMMIT = 16.0


# -- memory classes and overcommit --------------------------------------------------------
def check_overcommit(value: float, what: str) -> float:
    """``value`` if it is an overcommit fusuma accepts; otherwise one sentence naming
    ``what`` (``partition 'p0'``, ``the host``)."""
    if not math.isfinite(value) or value < 1.0:
        raise ResourceError(f"{what}: memory overcommit {value:g} is below 1.0; an "
                            "overcommit admits more burstable RAM than there is memory, "
                            "never less: give 1.0 (no overcommit) or more.")
    if value > MAX_OVERCOMMIT:
        raise ResourceError(f"{what}: memory overcommit {value:g} is above "
                            f"{MAX_OVERCOMMIT:g}; give a ratio such as 1.5 or 2.")
    return value


def check_memory_class(name: str, memory_mib: int, memory_class: str,
                       memory_min: int | None) -> None:
    """Refuse a memory class and floor that do not go together, in one sentence."""
    if memory_class not in MEMORY_CLASSES:
        raise ResourceError(f"VM {name!r}: unknown memory class {memory_class!r}; use "
                            f"{' or '.join(MEMORY_CLASSES)}.")
    if memory_class == "guaranteed":
        if memory_min is not None:
            raise ResourceError(f"VM {name!r}: a guaranteed VM's RAM is never reclaimed, "
                                "so it has no floor; drop --memory-min or make it "
                                "--memory-class burstable.")
        return
    if memory_min is None:
        raise ResourceError(f"VM {name!r}: a burstable VM needs a floor, the RAM it is "
                            "never reclaimed below: give --memory-min MiB (at most its "
                            f"{memory_mib} MiB).")
    if memory_min < 1:
        raise ResourceError(f"VM {name!r}: memory floor {memory_min} MiB is not positive; "
                            "give --memory-min 1 MiB or more.")
    if memory_min > memory_mib:
        raise ResourceError(f"VM {name!r}: memory floor {memory_min} MiB is above its RAM "
                            f"({memory_mib} MiB); give --memory-min {memory_mib} or less, "
                            "or more --memory.")


def host_overcommit(db: Database) -> float:
    """The host's memory overcommit (1.0 unless ``fusuma up`` set another)."""
    value = db.setting(OVERCOMMIT_KEY)
    try:
        return DEFAULT_OVERCOMMIT if value is None else max(1.0, float(value))
    except ValueError:
        return DEFAULT_OVERCOMMIT


def effective_overcommit(own: float | None, host: float) -> float:
    """A partition's overcommit: its own setting, else the host's."""
    return host if own is None else own


def overcommits(db: Database) -> dict[str, float]:
    """Every partition's effective memory overcommit, by name."""
    host = host_overcommit(db)
    return {p.name: effective_overcommit(p.memory_overcommit, host) for p in db.partitions()}


def memory_floor(rec: VmRecord) -> int:
    """RAM the VM is never reclaimed below: a burstable VM's floor, else all of it."""
    if rec.memory_class == "burstable" and rec.memory_min is not None:
        return min(rec.memory_min, rec.memory_mib)
    return rec.memory_mib


def admitted_ram(rec: VmRecord, overcommit: float = DEFAULT_OVERCOMMIT) -> int:
    """The guest RAM admitted for one VM (MiB): its whole RAM if guaranteed (or private:
    see above), its floor plus its RAM above the floor divided by ``overcommit``
    (rounded up) if burstable."""
    floor = memory_floor(rec)
    above = rec.memory_mib - floor
    if above <= 0 or not rec.shared_ram:
        return rec.memory_mib
    # round(): 1.0, 1.5, 2 give exact quotients; no float residue tips a ceil over.
    return floor + math.ceil(round(above / max(1.0, overcommit), 6))


def reclaimable_mib(rec: VmRecord, resident_mib: float | None) -> float | None:
    """What the memory governor may take back from a VM now: its resident RAM above its
    floor if burstable, 0 if guaranteed (None when its resident RAM is unknown)."""
    if rec.memory_class != "burstable":
        return 0.0
    if resident_mib is None:
        return None
    return round(max(0.0, resident_mib - memory_floor(rec)), 1)


# -- one VM -------------------------------------------------------------------------------
def ram_group_limit(size_bytes: int) -> int:
    """A RAM cgroup's limit: the file's size plus the page cache's index of its pages
    (xarray nodes, about 0.2% of its size; v1 charges them with the pages) and the
    allocating process itself."""
    return size_bytes + size_bytes // 256 + 8 * 1024 * 1024


def lazy_ram_limit(size_bytes: int, overhead_bytes: int) -> int:
    """A RAM group that also holds the QEMUs mapping the file (cgroup v1): two of them
    while a move runs, each within its overhead."""
    return ram_group_limit(size_bytes) + 2 * overhead_bytes


def definition_overhead(accel: str, firmware: bool = False) -> int:
    """QEMU's overhead for a VM being defined with ``accel`` (auto, kvm or tcg): the
    value stored in ``VmRecord.overhead_mib``. ``auto`` is resolved on this host now.
    ``firmware``: the VM boots by firmware (a larger TCG translation cache)."""
    from fusuma.qemu.cmdline import overhead_mib

    if accel in ("kvm", "tcg"):
        return overhead_mib(accel, firmware)
    from fusuma.host.accel import probe_accel

    return overhead_mib(probe_accel("auto").name, firmware)


def planned_vm(name: str, partition: str, memory_mib: int, accel: str,
               shared_ram: bool = True, memory_class: str = "guaranteed",
               memory_min: int | None = None) -> VmRecord:
    """A VM not yet defined (a spec's), with the footprint its definition would fix."""
    return VmRecord(name=name, partition=partition, vcpus=1, memory_mib=memory_mib,
                    accel=accel, overhead_mib=definition_overhead(accel),
                    shared_ram=shared_ram, memory_class=memory_class,
                    memory_min=memory_min)


def vm_overhead(rec: VmRecord) -> int:
    """QEMU's overhead for a defined VM: as recorded at definition; a VM from a state file
    older than that record falls back to the accelerator it used (or asked for, TCG's
    larger figure when unknown)."""
    if rec.overhead_mib is not None:
        return rec.overhead_mib
    from fusuma.qemu.cmdline import overhead_mib  # state files older than the record

    accel = rec.accel_used or (rec.accel if rec.accel in ("kvm", "tcg") else "tcg")
    return overhead_mib(accel)


def vm_footprint(rec: VmRecord) -> int:
    """Host memory one VM needs: guest RAM + its QEMU's overhead."""
    return rec.memory_mib + vm_overhead(rec)


def guest_ram(rec: VmRecord, overcommit: float = DEFAULT_OVERCOMMIT) -> int:
    """Guest RAM admitted host-wide for one VM: its RAM file's admitted size (0 for
    private RAM, which is its QEMU's own memory and counts in its partition)."""
    return admitted_ram(rec, overcommit) if rec.shared_ram else 0


def partition_share(rec: VmRecord) -> int:
    """What one VM counts against the memory of the partition it runs in: its QEMU's own
    memory (with private RAM, its whole RAM too: it is the QEMU's anonymous memory, under
    the partition's hard limit, which is never overcommitted)."""
    return vm_overhead(rec) if rec.shared_ram else vm_footprint(rec)


def _ram_label(rec: VmRecord, what: str) -> str:
    return f"{rec.name} burstable {what}" if memory_floor(rec) < rec.memory_mib \
        else f"{rec.name} {what}"


# -- sums ---------------------------------------------------------------------------------
@frozen
class Term:
    """One addend of a sum: ``vm0 384``, or a bare number when it has no label."""

    label: str
    mib: int

    def __str__(self) -> str:
        return f"{self.label} {self.mib}" if self.label else str(self.mib)


@frozen
class Need:
    """A sum of memory terms, rendered as ``64 + vm0 384 + web0 384 = 832``."""

    terms: tuple[Term, ...]

    @property
    def total(self) -> int:
        return sum(t.mib for t in self.terms)

    def __str__(self) -> str:
        if not self.terms:
            return "0"
        if len(self.terms) == 1:
            return str(self.terms[0])
        return f"{' + '.join(map(str, self.terms))} = {self.total}"

    def against(self, limit: int, unit: str = "MiB") -> str:
        """``64 + vm0 384 = 448 > 400 MiB`` (or ``<=`` when it fits)."""
        op = ">" if self.total > limit else "<="
        return f"{self} {op} {limit} {unit}"


def vms_need(vms: Iterable[VmRecord]) -> Need:
    """A partition's need for these VMs: its supervisor plus each VM's share."""
    return Need((Term("", SUPERVISOR_MIB),
                 *(Term(v.name, partition_share(v)) for v in vms)))


def partition_need(db: Database, partition: str, *, adding: Sequence[VmRecord] = (),
                   removing: Iterable[str] = ()) -> Need:
    """What ``partition`` needs with its defined VMs, less ``removing``, plus ``adding``."""
    skip = set(removing) | {v.name for v in adding}
    return vms_need([*(v for v in db.vms(partition) if v.name not in skip), *adding])


def host_need(partitions: Iterable[tuple[str, int]],
              vms: Iterable[VmRecord] = (),
              overcommit: Mapping[str, float] | None = None) -> Need:
    """What partitions (name, memory_mib) and the guest RAM of ``vms`` ask of the host;
    each VM's RAM at the overcommit of its partition (``overcommit``, 1.0 when none)."""
    oc = overcommit or {}
    terms = []
    for v in vms:
        mib = guest_ram(v, oc.get(v.partition, DEFAULT_OVERCOMMIT))
        if mib:
            terms.append(Term(_ram_label(v, "RAM"), mib))
    return Need((*(Term(name, mib) for name, mib in partitions), *terms))


def template_ram(db: Database) -> tuple[Term, ...]:
    """Every template's RAM file, admitted host-wide once (its clones' private copies
    count in their partitions)."""
    return tuple(Term(f"template {t.name}", t.memory_mib) for t in db.templates())


def host_now(db: Database, *, partitions: Mapping[str, int] | None = None,
             adding: Sequence[VmRecord] = (), extra: Sequence[Term] = (),
             overcommit: Mapping[str, float] | None = None,
             host_overcommit_now: float | None = None) -> Need:
    """The host's need with the defined partitions (sizes overridden by ``partitions``),
    VMs (plus ``adding``) and templates, and ``extra`` terms (a copy move's second RAM
    file, a template being made); partitions' overcommits as they are, or as
    ``overcommit`` (by partition) and ``host_overcommit_now`` (the host's) would make
    them."""
    sizes = {p.name: p.memory_mib for p in db.partitions()}
    sizes.update(partitions or {})
    skip = {v.name for v in adding}
    vms = [*(v for v in db.vms() if v.name not in skip), *adding]
    host_oc = host_overcommit(db) if host_overcommit_now is None else host_overcommit_now
    ocs = {p.name: effective_overcommit(p.memory_overcommit, host_oc)
           for p in db.partitions()}
    ocs.update(overcommit or {})
    need = host_need(sizes.items(), vms, ocs)
    return Need((*need.terms, *template_ram(db), *extra))


def _host_refusal(what: str, need: Need, host: HostInfo, fix: str) -> ResourceError:
    avail = host.memory_available_for_partitions_mib
    burst = (" (a burstable VM's at its floor plus its RAM above it divided by its "
             "partition's overcommit)") if any(" burstable " in t.label for t in need.terms) \
        else ""
    return ResourceError(f"{what}: the host would need {need.against(avail)} (partitions' "
                         f"budgets plus guest RAM{burst}; {host.memory_reserved_mib} MiB is "
                         f"kept for the host itself); {fix}.")


def check_host_ram(db: Database, host: HostInfo, vms: Sequence[VmRecord], what: str,
                   fix: str) -> Need:
    """Refuse adding ``vms``' guest RAM unless the host holds it beside the rest."""
    need = host_now(db, adding=vms)
    if need.total > host.memory_available_for_partitions_mib:
        raise _host_refusal(what, need, host, fix)
    return need


def check_template(db: Database, host: HostInfo, name: str, memory_mib: int) -> None:
    """Refuse a new template unless the host holds its RAM file beside the rest (the VM
    it is made from keeps its own admission: it may boot again)."""
    need = host_now(db, extra=[Term(f"template {name}", memory_mib)])
    if need.total > host.memory_available_for_partitions_mib:
        raise _host_refusal(f"template {name!r} keeps {memory_mib} MiB of guest RAM", need,
                            host, "delete a VM or a template, or shrink a partition")


# -- partition checks ---------------------------------------------------------------------
def check_partition_room(db: Database, partition: str, vms: Sequence[VmRecord],
                         verb: Verb, limit: int | None = None) -> Need:
    """Refuse unless ``partition`` can hold ``vms`` beside its own (for ``verb``: a VM
    being created, or VMs moving in). Returns the sum that fits."""
    if limit is None:
        limit = db.partition(partition).memory_mib
    need = partition_need(db, partition, adding=vms)
    if need.total <= limit:
        return need
    who = (repr(vms[0].name) if len(vms) == 1
           else "the VMs " + ", ".join(repr(v.name) for v in vms))
    other = ("give the VM less memory" if verb == "create"
             else "move a VM out of it first")
    raise ResourceError(f"partition {partition!r} has no room for {who}: "
                        f"{need.against(limit)}; grow it with `fusuma partition resize "
                        f"{partition} --memory {need.total}` or {other}.")


def check_resize(db: Database, partition: str, new_mib: int) -> None:
    """Refuse a memory limit below what the partition's supervisor and VMs need."""
    need = partition_need(db, partition)
    if new_mib < need.total:
        raise ResourceError(f"partition {partition!r} needs at least {need.total} MiB for "
                            f"its supervisor and VMs ({need.against(new_mib)}); give it "
                            f"at least {need.total} MiB or move or delete a VM first.")


def check_host_room(db: Database, host: HostInfo, partition: str, memory_mib: int,
                    overcommit: float | None = None) -> None:
    """Refuse a partition size (and overcommit, when one is being set) that, with the
    other partitions and the guest RAM of all VMs, the host cannot give."""
    avail = host.memory_available_for_partitions_mib
    ocs = None
    if overcommit is not None:
        what = f"partition {partition!r}"
        check_overcommit(overcommit, what)
        ocs = {partition: overcommit}
        part = db.find_partition(partition)
        if part is not None:
            need = host_now(db, overcommit=ocs)
            if need.total > avail:
                raise _host_refusal(f"{what} at memory overcommit {overcommit:g}", need,
                                    host, "keep a higher overcommit, or delete a VM or "
                                    "shrink a partition first")
    need = host_now(db, partitions={partition: memory_mib}, overcommit=ocs)
    if need.total > avail:
        others = need.total - memory_mib
        raise ResourceError(
            f"partition {partition!r} asks for {memory_mib} MiB but only "
            f"{max(0, avail - others)} MiB is left on this host ({need.against(avail)}: "
            f"partitions' budgets plus guest RAM; {host.memory_reserved_mib} MiB is kept "
            "for the host itself); shrink another partition, delete a VM or ask for less.")


def check_host_overcommit(db: Database, host: HostInfo, value: float) -> None:
    """Refuse a new host overcommit under which the VMs already admitted would no longer
    fit (a lower one admits burstable RAM above the floors at more)."""
    check_overcommit(value, "the host")
    need = host_now(db, host_overcommit_now=value)
    if need.total > host.memory_available_for_partitions_mib:
        raise _host_refusal(f"the host at memory overcommit {value:g}", need, host,
                            "keep a higher overcommit, or delete a VM or shrink a "
                            "partition first")


# -- the shm filesystem -------------------------------------------------------------------
@frozen
class ShmSpace:
    """Free space of the filesystem that holds (or will hold) Paths.shm."""

    path: Path              # Paths.shm
    fstype: str             # "tmpfs", "hugetlbfs", ... ("?" when unknown)
    free_mib: int

    def __str__(self) -> str:
        return f"{self.path} ({self.fstype})"


def _existing(path: Path) -> Path:
    while not path.exists() and path != path.parent:
        path = path.parent
    return path


def _fstype(path: Path) -> str:
    """The type of the filesystem mounted at the longest mount point above ``path``."""
    best, kind = "", "?"
    try:
        lines = Path("/proc/self/mounts").read_text().splitlines()
    except OSError:
        return kind
    target = str(path.resolve())
    for line in lines:
        fields = line.split()
        if len(fields) < 3:
            continue
        mnt = fields[1].encode().decode("unicode_escape")   # \040 for a space
        if (target == mnt or target.startswith(mnt.rstrip("/") + "/")) and len(mnt) >= len(best):
            best, kind = mnt, fields[2]
    return kind


def shm_space(paths: Paths) -> ShmSpace:
    where = _existing(paths.shm)
    st = os.statvfs(where)
    return ShmSpace(paths.shm, _fstype(where), st.f_bavail * st.f_frsize // MIB)


def _unfilled_bytes(path: Path) -> int:
    """What a sparse file may still allocate: its size minus its allocated blocks."""
    st = path.stat()
    return max(0, st.st_size - st.st_blocks * 512)


def _allocated_bytes(path: Path) -> int:
    try:
        return path.stat().st_blocks * 512
    except FileNotFoundError:
        return 0


def shm_need(paths: Paths, label: str, size_mib: int, *,
             replacing: Iterable[Path] = (),
             admitted: Mapping[str, int] | None = None) -> Need:
    """Room a new RAM file of ``size_mib`` (its admitted size) needs in Paths.shm: that,
    less what the files it replaces hold now, then what every other file there has yet
    to fill as its guest touches memory (a burstable VM's file, named by its stem in
    ``admitted``, only up to its admitted size: the rest is the overcommit, which the
    memory governor keeps in check)."""
    replaced = {Path(p) for p in replacing}
    size = size_mib * MIB - sum(_allocated_bytes(p) for p in replaced)
    terms = [Term(label, max(0, math.ceil(size / MIB)))]
    cap = admitted or {}
    if paths.shm.is_dir():
        for f in sorted(paths.shm.iterdir()):
            if f in replaced or not f.is_file():
                continue
            try:
                left = math.ceil(_unfilled_bytes(f) / MIB)
                stem = f.name.removesuffix(".ram")
                if stem in cap:
                    held = math.ceil(_allocated_bytes(f) / MIB)
                    left = min(left, max(0, cap[stem] - held))
            except FileNotFoundError:   # gone meanwhile
                continue
            if left:
                terms.append(Term(f"unfilled {f.name.removesuffix('.ram')}", left))
    return Need(tuple(terms))


def check_shm_room(paths: Paths, need: Need, what: str, fix: str) -> None:
    """Refuse ``what`` (``starting 'v'``) unless the shm filesystem's free space holds
    ``need``; ``fix`` ends the sentence (how to make room)."""
    space = shm_space(paths)
    if need.total > space.free_mib:
        raise ResourceError(f"{what} needs {need.total} MiB in {space} but "
                            f"{space.free_mib} MiB is free there ({need.against(space.free_mib)}"
                            f" free); {fix}.")


def burstable_files(db: Database) -> dict[str, int]:
    """The RAM files of burstable VMs (by stem) and the size each is admitted at."""
    ocs = overcommits(db)
    out = {}
    for v in db.vms():
        if v.shared_ram and v.ram_path and memory_floor(v) < v.memory_mib:
            out[Path(v.ram_path).name.removesuffix(".ram")] = admitted_ram(
                v, ocs.get(v.partition, DEFAULT_OVERCOMMIT))
    return out


def check_start(paths: Paths, rec: VmRecord, db: Database | None = None) -> None:
    """A shared-RAM VM about to start: room for its RAM file (which replaces any file
    left at its path, counted at its admitted size) and for the other RAM files to fill
    (burstable VMs' up to their admitted sizes; ``db`` names them)."""
    if not rec.shared_ram:
        return
    admitted = burstable_files(db) if db is not None else {}
    size = rec.memory_mib
    if db is not None:
        size = admitted_ram(rec, overcommits(db).get(rec.partition, DEFAULT_OVERCOMMIT))
    need = shm_need(paths, rec.name, size, replacing=[paths.ram_file(rec.name)],
                    admitted=admitted)
    check_shm_room(paths, need, f"starting {rec.name!r}",
                   "free memory there (stop or delete a VM), grow that filesystem or give "
                   "the VM less memory")


# -- moves --------------------------------------------------------------------------------
def _copies_ram_file(rec: VmRecord, mode: str) -> bool:
    """A copy move of a shared-RAM VM: the destination QEMU gets a RAM file of its own."""
    return mode == "copy" and rec.shared_ram


def check_overcommit_move(db: Database, host: HostInfo, vms: Sequence[VmRecord],
                          to: str) -> None:
    """Refuse moving burstable VMs into a partition whose lower overcommit would admit
    their RAM at more than the host holds (a move changes no guaranteed VM's figure)."""
    moved = [v.with_(partition=to) for v in vms if memory_floor(v) < v.memory_mib]
    if not moved:
        return
    need = host_now(db, adding=moved)
    if need.total > host.memory_available_for_partitions_mib:
        who = ", ".join(repr(v.name) for v in moved)
        raise _host_refusal(f"moving {who} into partition {to!r} admits burstable RAM at "
                            "that partition's memory overcommit "
                            f"({overcommits(db).get(to, DEFAULT_OVERCOMMIT):g})", need, host,
                            "raise that partition's overcommit or free memory first")


def check_move(paths: Paths, db: Database, rec: VmRecord, to: str, mode: str,
               host: HostInfo | None = None) -> None:
    """Refuse a move of ``rec`` into partition ``to`` the destination cannot hold: room in
    the partition for its new QEMU, room on the host for a burstable VM's RAM at the
    destination's overcommit and, for a copy of shared RAM, a second RAM file on the
    host and in the shm fs."""
    check_partition_room(db, to, [rec], "move")
    if host is not None:
        check_overcommit_move(db, host, [rec], to)
    if _copies_ram_file(rec, mode):
        if host is not None:
            need = host_now(db, extra=[Term(f"{rec.name} RAM (second copy)", rec.memory_mib)])
            if need.total > host.memory_available_for_partitions_mib:
                raise _host_refusal(f"a copy move of {rec.name!r} holds a second RAM file "
                                    "until it ends", need, host,
                                    "use --mode zero-copy (the RAM file changes owner "
                                    "instead) or free memory")
        need = shm_need(paths, f"{rec.name} (second copy)", rec.memory_mib)
        check_shm_room(paths, need, f"a copy move of {rec.name!r}",
                       "use --mode zero-copy (the RAM file changes owner instead) or free "
                       "memory there")


def check_many(paths: Paths, db: Database, vms: Sequence[VmRecord], to: str,
               modes: Mapping[str, str] | None = None, host: HostInfo | None = None) -> None:
    """Refuse moving all of ``vms`` into ``to`` (``fusuma maintain``) unless they fit
    there together. Moves run one after another and a copy move's source RAM file goes
    when it ends, so the host and the shm fs need room for the largest second RAM file
    only."""
    if not vms:
        return
    check_partition_room(db, to, vms, "move")
    if host is not None:
        check_overcommit_move(db, host, vms, to)
    modes = modes or {v.name: "zero-copy" if v.shared_ram else "copy" for v in vms}
    copies = [v for v in vms if _copies_ram_file(v, modes.get(v.name, "zero-copy"))]
    if copies:
        big = max(copies, key=lambda v: v.memory_mib)
        if host is not None:
            need = host_now(db, extra=[Term(f"{big.name} RAM (second copy)", big.memory_mib)])
            if need.total > host.memory_available_for_partitions_mib:
                raise _host_refusal(f"a copy move of {big.name!r} holds a second RAM file "
                                    "until it ends", need, host,
                                    "use zero-copy moves or free memory")
        need = shm_need(paths, f"{big.name} (second copy)", big.memory_mib)
        check_shm_room(paths, need, f"a copy move of {big.name!r}",
                       "use zero-copy moves or free memory there")


# -- a state file from before guest RAM was admitted host-wide ----------------------------
MODEL_KEY = "memory_model"
MODEL = "host-wide-guest-ram"


def take_over(db: Database) -> list[str]:
    """Convert a state file whose partitions' ``memory_mib`` still include their VMs'
    guest RAM: each partition keeps what it had beyond that RAM as its budget. Once per
    state file (a conditional write of the model key); returns one notice per change."""
    with db.transaction() as conn:
        row = conn.execute("SELECT value FROM meta WHERE key=?", (MODEL_KEY,)).fetchone()
        if row is not None:
            return []
        notices = []
        for p in db.partitions():
            ram = sum(guest_ram(v) for v in db.vms(p.name))
            if not ram:
                continue
            budget = max(MIN_PARTITION_MIB, p.memory_mib - ram)
            conn.execute("UPDATE partitions SET memory_mib=? WHERE name=?", (budget, p.name))
            notices.append(f"fusuma: notice: partition {p.name!r}: memory {p.memory_mib} MiB "
                           f"included its VMs' guest RAM ({ram} MiB), which is now admitted "
                           f"host-wide; its budget for QEMUs and its supervisor is {budget} "
                           "MiB.")
        conn.execute("INSERT INTO meta VALUES (?, ?)", (MODEL_KEY, MODEL))
    return notices
