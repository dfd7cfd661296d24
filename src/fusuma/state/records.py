"""The rows of the state file, as typed records."""

from __future__ import annotations

import time
from dataclasses import field, replace

from fusuma.frozen import frozen
from fusuma.state.machine import VmState
from fusuma.state.roles import Role


@frozen
class PartitionRecord:
    name: str
    cpus: list[int]
    memory_mib: int
    io_weight: int | None = None
    qemu: str | None = None
    supervisor_pid: int | None = None
    created_at: float = field(default_factory=time.time)
    # "cores": whole physical cores (every SMT sibling); "threads": single threads.
    smt: str = "cores"
    # How far its burstable VMs' RAM above their floors is overcommitted (>= 1.0);
    # None: the host's setting (fusuma.capacity).
    memory_overcommit: float | None = None


@frozen
class DiskRecord:
    name: str
    path: str
    partition: str
    created_file: bool = False
    # The file's identity when it was registered (st_dev, st_ino): every start opens
    # the path without following a symlink and refuses another file. None: registered
    # by a fusuma that did not record it (taken over at its first start).
    dev: int | None = None
    ino: int | None = None


@frozen
class VmRecord:
    name: str
    partition: str
    vcpus: int
    memory_mib: int
    image: str = "minimal"
    disks: list[str] = field(default_factory=list)
    accel: str = "auto"
    autostart: bool = True
    state: VmState = VmState.STOPPED
    pid: int | None = None
    accel_used: str | None = None
    qemu_binary: str | None = None
    started_at: float | None = None
    error: str | None = None
    created_at: float = field(default_factory=time.time)
    shared_ram: bool = True          # RAM in a named shared file (zero-copy migration)
    ram_path: str | None = None      # that file, once the VM has run
    qos: str = "burstable"           # guaranteed | burstable | best-effort (governor)
    segments: list[str] = field(default_factory=list)   # "NAME:/mount/point"
    mergeable: bool = False          # private RAM marked for KSM
    ports: list[str] = field(default_factory=list)      # "HOSTPORT:GUESTPORT" (tcp)
    # Host memory the VM's QEMU needs beyond guest RAM, fixed when the VM is defined
    # (None in state files from before it was recorded: fusuma.capacity computes it).
    overhead_mib: int | None = None
    # The versioned machine type pinned when the VM was defined ("pc-q35-7.2"; None in
    # state files from before it was: the machine it was started with applies).
    machine: str | None = None
    # The guest-visible device set recorded when it booted (fusuma.qemu.cmdline
    # DeviceSet as JSON): every move's destination rebuilds exactly that.
    devices: str | None = None
    qemu_version: str | None = None  # of the QEMU running it ("10.0.2")
    # Where QEMU's threads other than the vCPUs run: "shared" (the partition's cores),
    # "isolated" (cores of the partition that hold no guaranteed vCPU) or a core list.
    emulator: str = "shared"
    # Free page reporting (virtio-balloon): pages the guest frees go back to the host.
    # None: the host's default (on where guest RAM has a memory cgroup of its own).
    page_reporting: bool | None = None
    template: str | None = None      # the template a clone was started from
    # How the guest boots: "kernel" (QEMU's direct kernel boot of fusuma's own image,
    # ``image`` a built kind) or by firmware from a thin disk on an imported image
    # (``image`` its name): "bios" (SeaBIOS) or "uefi" (OVMF, NVRAM of its own).
    boot: str = "kernel"
    # Its memory class (fusuma.capacity): "guaranteed" (admitted whole, never
    # reclaimed) or "burstable" (admitted at its floor ``memory_min`` plus its share of
    # the overcommit; what it holds above the floor may be reclaimed).
    memory_class: str = "guaranteed"
    memory_min: int | None = None
    # SQLite rowid: unique among defined VMs, the number in its taps' names
    # (fusuma.network.ifnames). 0 until the record has been stored.
    slot: int = field(default=0, compare=False)
    # The uid its QEMU runs as, one of FUSUMA_UID_BASE's VM range held by this record
    # alone (fusuma.qemu.privilege); 0 until the record has been stored.
    uid: int = field(default=0, compare=False)

    def with_(self, **changes: object) -> VmRecord:
        return replace(self, **changes)  # type: ignore[arg-type]


@frozen
class ImageRecord:
    """A disk image a user imported (fusuma.images.store): a read-only file in the
    image store that VMs' thin disks are overlays of."""

    name: str
    path: str
    format: str                      # "qcow2" | "raw"
    virtual_size: int
    file_size: int
    sha256: str
    source: str
    created_at: float = field(default_factory=time.time)


@frozen
class SegmentRecord:
    name: str
    path: str
    size_bytes: int
    source: str                      # the directory or image it was built from
    created_at: float = field(default_factory=time.time)


@frozen
class TemplateRecord:
    """A booted guest kept as a RAM file and a device state file, for clones to start
    from (fusuma.memshare.templates)."""

    name: str
    ram_path: str
    state_path: str
    size_bytes: int
    memory_mib: int
    vcpus: int
    machine: str
    qemu_version: str
    devices: str
    image: str
    state_sha256: str
    source_vm: str
    accel: str = "tcg"
    segments: list[str] = field(default_factory=list)
    created_at: float = field(default_factory=time.time)
    # The networks of its guest's tap NICs, by index (nic0, nic1, ...): each clone gets
    # NICs of its own on them (fusuma.network.manager.plan_clone_nics).
    networks: list[str] = field(default_factory=list)
    # The group that may read its RAM file, one of FUSUMA_UID_BASE's template range held
    # by this record alone (fusuma.memshare.templates.template_gid); 0 until stored.
    gid: int = field(default=0, compare=False)


@frozen
class TokenRecord:
    """An API token (its SHA-256 only, which this record does not carry) and its role."""

    name: str
    role: Role
    created_at: float = field(default_factory=time.time)
    last_used_at: float | None = None
    # Made by a fusuma from before roles: it keeps the admin role it had then.
    before_roles: bool = False


@frozen
class NetworkRecord:
    """A network VMs' NICs attach to (fusuma.network): ``managed`` (a bridge fusuma
    makes, with a subnet, DHCP/DNS and NAT) or ``bridged`` (a bridge the host has)."""

    name: str
    type: str                        # "managed" | "bridged"
    bridge: str
    subnet: str | None = None
    nat: bool = False
    isolated: bool = False
    filtering: bool = False
    keeper_pid: int | None = None
    created_at: float = field(default_factory=time.time)
    mtu: int = 1500                  # the bridge's and its taps' (the guests are told)

    @property
    def managed(self) -> bool:
        return self.type == "managed"


@frozen
class NicRecord:
    """One NIC of a VM: its network, its MAC (generated once) and, on a managed
    network, its address."""

    vm: str
    index: int
    network: str
    mac: str
    ip: str | None = None
