"""The host spec: what partitions, disks and VMs a host should have.

A spec is a TOML file applied with ``fusuma up``::

    [host]
    # memory_overcommit = 1.0   # burstable VMs' RAM above their floors, see capacity

    [[partition]]
    name = "p0"
    cpus = "0"            # or [0, 1], or "0-3,6"
    memory_mib = 1024
    # io_weight = 100     # 1..10000, best effort
    # memory_overcommit = 2.0   # default: the host's
    # qemu = "10.0"       # its hypervisor: a version (`fusuma qemu list`) or, from
    #                     # root's spec or CLI only, a binary's path

    [[storage]]           # a directory for disk files (FUSUMA_HOME/disks always is one)
    path = "/srv/fusuma-disks"
    shared = false        # true: other hosts see the same files (VMs' `storage`)

    [[disk]]
    name = "d0"
    path = "/srv/fusuma-disks/d0.img"   # inside a storage directory
    partition = "p0"
    size_mib = 64         # created (sparse) when the file does not exist

    [[vm]]
    name = "vm0"
    partition = "p0"
    vcpus = 1
    memory_mib = 256
    disks = ["d0"]
    # qos = "burstable"   # guaranteed | burstable | best-effort
    # memory_class = "burstable"   # guaranteed (default) | burstable
    # memory_min = 128    # a burstable VM's floor, MiB
    # segments = ["tools", "debian-root:/"]   # NAME[:MOUNTPOINT], default /mnt/NAME
    # mergeable = false   # private RAM for KSM (copy migration only; see `share ksm`)
    # ports = ["8080:80"] # host 127.0.0.1:8080 -> guest tcp port 80; "0.0.0.0:8080:80"
    #                     # forwards from every host address (needs a managed NIC)
    # nics = [{ network = "lan0" }, { network = "lan0", ip = "10.0.5.9", mac = "..." }]
    # machine = "pc-q35-7.2"  # pinned machine type (default: the oldest QEMU's q35)

    [[network]]
    name = "lan0"
    type = "managed"      # a bridge fusuma makes, DHCP/DNS (dnsmasq), NAT; or "bridged"
    subnet = "10.0.5.0/24"  # managed: default, the first free 10.x.y.0/24
    # nat = true  isolated = false  filtering = true   # managed
    # mtu = 1500          # managed: bridge, taps and guests (DHCP tells them)
    # parent = "br0"      # bridged: a bridge the host has

Validation errors name the file and the key (``spec.toml: vm[1].partition: ...``).
"""

from __future__ import annotations

import json
import re
import tomllib
from pathlib import Path
from typing import Annotated, Any, Literal, TypeVar

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    field_validator,
    model_validator,
)

from fusuma import capacity
from fusuma.errors import ResourceError, SpecError
from fusuma.host.topology import HostInfo, format_cpulist, parse_cpulist, siblings_text
from fusuma.names import NAME_HINT, NAME_PATTERN, NAME_RE
from fusuma.names import check_name as check_name  # re-exported: older callers
from fusuma.network import addr

Accel = Literal["auto", "kvm", "tcg"]
Qos = Literal["guaranteed", "burstable", "best-effort"]
M = TypeVar("M", bound=BaseModel)


class _Model(BaseModel):
    # Each key's docstring is its description: in the spec reference, the OpenAPI
    # document and `kubectl explain`-like tools (a unit test wants one on every key).
    model_config = ConfigDict(extra="forbid", frozen=True, use_attribute_docstrings=True)


# A name as the API's OpenAPI document states it (what _name_field checks).
Name = Annotated[str, Field(json_schema_extra={"pattern": NAME_PATTERN})]


def _name_field(v: str) -> str:
    if not NAME_RE.match(v):
        raise ValueError(f"name {v!r} is not allowed: use {NAME_HINT}")
    return v


def _overcommit_field(v: float | None) -> float | None:
    if v is None:
        return v
    try:
        return capacity.check_overcommit(v, "memory_overcommit")
    except ResourceError as exc:
        raise ValueError(str(exc).removeprefix("memory_overcommit: ").rstrip(".")) from exc


class PartitionSpec(_Model):
    """A partition: exclusive cores, a memory limit, an I/O weight, its own supervisor."""

    name: Name
    """The partition's name, unique on the host."""
    cpus: list[int]
    """The host cores it owns, no other partition's: a list (`[0, 1]`), one number or
    a cpulist string (`"0-3,6"`)."""
    memory_mib: Annotated[int, Field(gt=0)]
    """Its memory budget in MiB for what runs in it beyond guest RAM: 64 MiB for its
    supervisor plus each VM's QEMU overhead (a VM with private RAM counts its RAM here
    too); guest RAM is admitted host-wide. A VM that would not fit is refused."""
    io_weight: Annotated[int, Field(ge=1, le=10000)] | None = None
    """Its share of disk bandwidth against the other partitions (cgroup `io.weight`,
    best effort); unset: the kernel's default (100)."""
    qemu: str | None = None
    """The QEMU its VMs run: a version from `fusuma qemu list` (`"10.0"`) or, from
    root's spec or the CLI only, a binary's path; unset: the system's QEMU."""
    smt: Literal["cores", "threads"] = "cores"
    """On an SMT host: `cores` hands out whole physical cores (the cpus listed plus
    their sibling threads); `threads` takes exactly the threads listed."""
    memory_overcommit: float | None = None
    """How far the guest RAM of its burstable VMs above their floors is overcommitted,
    1.0 (none) to 16: each is admitted at its floor plus that RAM divided by this;
    unset: the host's `memory_overcommit`."""

    _check_name = field_validator("name")(_name_field)
    _check_overcommit = field_validator("memory_overcommit")(_overcommit_field)

    @field_validator("cpus", mode="before")
    @classmethod
    def _cpus(cls, v: Any) -> Any:
        if isinstance(v, str):
            try:
                return parse_cpulist(v)
            except SpecError as exc:
                raise ValueError(str(exc)) from exc
        if isinstance(v, int):
            return [v]
        return v

    @field_validator("cpus")
    @classmethod
    def _cpus_nonempty(cls, v: list[int]) -> list[int]:
        if not v:
            raise ValueError("a partition needs at least one core")
        if any(c < 0 for c in v):
            raise ValueError("core numbers are not negative")
        if len(set(v)) != len(v):
            raise ValueError("a core is listed twice")
        return sorted(v)


class StorageSpec(_Model):
    """A directory root declares for disk files (`fusuma storage add`)."""

    path: str
    """The directory's absolute path; disks' files must lie inside a storage directory
    (FUSUMA_HOME/disks always is one)."""
    shared: bool = False
    """Other hosts see the same files at the same path (NFS, a cluster file system):
    VMs placed there (`storage` of a VM) move between them without copying disks."""

    @field_validator("path")
    @classmethod
    def _abs(cls, v: str) -> str:
        if not v.startswith("/"):
            raise ValueError(f"storage directory {v!r} must be absolute")
        return v


class DiskSpec(_Model):
    """A disk owned by one partition: a raw image file inside a storage directory."""

    name: Name
    """The disk's name, unique on the host; VMs list it in their `disks`."""
    path: str
    """The raw image file's absolute path, inside a storage directory (no comma)."""
    partition: str
    """The partition that owns it: only that partition's VMs may use it."""
    size_mib: Annotated[int, Field(gt=0)] | None = None
    """Its size in MiB when fusuma creates the file (sparse); unset: the file must
    exist."""

    _check_name = field_validator("name")(_name_field)

    @field_validator("path")
    @classmethod
    def _abs(cls, v: str) -> str:
        if not v.startswith("/"):
            raise ValueError(f"disk path {v!r} must be absolute")
        if "," in v:
            raise ValueError(f"disk path {v!r} contains a comma, which QEMU options "
                             "cannot carry; rename or link the file")
        return v


class NetworkSpec(_Model):
    """A network (fusuma.network): ``managed`` (a bridge fusuma makes, with a subnet,
    DHCP and DNS from dnsmasq, NAT and filtering) or ``bridged`` (a bridge the host
    has, named by ``parent``)."""

    name: Name
    """The network's name, unique on the host; NICs name it."""
    type: Literal["managed", "bridged"] = "managed"
    """`managed`: a bridge fusuma makes, with DHCP, DNS and NAT; `bridged`: a bridge
    the host already has (`parent`)."""
    subnet: str | None = None
    """A managed network's private IPv4 subnet, /16 to /29, that no host route overlaps
    (`"10.0.5.0/24"`; the gateway is its first address); unset: the first free
    10.x.y.0/24."""
    nat: bool | None = None
    """Managed: masquerade the VMs' traffic that leaves by another interface (unset:
    true); false: routed only."""
    isolated: bool = False
    """Managed: VMs see only the gateway (and through it, the NAT), never each
    other."""
    filtering: bool | None = None
    """Managed: drop frames a VM sends from another MAC or IPv4 address than its own,
    and IPv6 (unset: true)."""
    mtu: int | None = None
    """Managed: the MTU of its bridge and taps, 1280 to 9000 (unset: 1500); when not
    1500, dnsmasq tells the guests (DHCP option 26)."""
    parent: str | None = None
    """Bridged: the host's bridge to attach to (it must exist)."""

    _check_name = field_validator("name")(_name_field)

    @field_validator("subnet")
    @classmethod
    def _subnet(cls, v: str | None) -> str | None:
        if v is None:
            return v
        try:
            return addr.parse_subnet(v).cidr
        except SpecError as exc:
            raise ValueError(str(exc).rstrip(".")) from exc


class NicSpec(_Model):
    """A VM's NIC: its network, and optionally its MAC and (managed) address."""

    network: str
    """The network it joins (a `[[network]]` or one made with `fusuma network`)."""
    mac: str | None = None
    """Its MAC address; unset: one generated once (52:54:00:..)."""
    ip: str | None = None
    """On a managed network, its IPv4 address (inside the subnet, not in use), handed
    out by DHCP; unset: the subnet's next free one."""

    _check_network = field_validator("network")(_name_field)

    @field_validator("mac")
    @classmethod
    def _mac(cls, v: str | None) -> str | None:
        if v is None:
            return v
        try:
            return addr.check_mac(v)
        except SpecError as exc:
            raise ValueError(str(exc).rstrip(".")) from exc


class VmSpec(_Model):
    """A VM: one QEMU process inside its partition's cgroup."""

    name: Name
    """The VM's name, unique on the host (a clone's is its hostname too)."""
    partition: str
    """The partition it runs in: its QEMU lives in that partition's cgroup, on its
    cores, under its supervisor."""
    vcpus: Annotated[int, Field(ge=1, le=64)] = 1
    """Its virtual CPUs (a clone: its template's)."""
    memory_mib: Annotated[int, Field(ge=64)] = 256
    """Guest RAM in MiB (a clone: its template's)."""
    image: str = "minimal"
    """What it boots: a kind fusuma builds (`minimal`, `debian`) or an imported image
    (`fusuma image list`)."""
    disks: list[str] = []
    """Disks of its partition to attach (`[[disk]]` names), each to one VM only."""
    accel: Accel = "auto"
    """The accelerator: `auto` is KVM when usable, else TCG (software emulation)."""
    autostart: bool = True
    """Start it (when it is not running) each time `fusuma up` applies the spec."""
    shared_ram: bool = True
    """Guest RAM in a named shared file, which zero-copy moves need; false: private
    anonymous RAM, moved by copy only."""
    qos: Qos = "burstable"
    """The governor's CPU class: `guaranteed` (its vCPUs' worth of CPU reserved; a
    partition's guaranteed vCPUs may not exceed its cores), `burstable` (a weight, may
    use idle CPU) or `best-effort` (only otherwise idle CPU)."""
    memory_class: Literal["guaranteed", "burstable"] = "guaranteed"
    """The memory governor's class: `guaranteed` (its RAM admitted whole and never
    reclaimed) or `burstable` (admitted at `memory_min` plus its RAM above that divided
    by its partition's memory overcommit; what it holds above `memory_min` may be
    reclaimed when the host runs short)."""
    memory_min: Annotated[int, Field(ge=1)] | None = None
    """A burstable VM's floor in MiB, at most `memory_mib`: RAM it is admitted at in
    full and never reclaimed below (required for `burstable`, refused for
    `guaranteed`)."""
    segments: list[str] = []
    """Shared read-only segments to attach, each `"NAME"` (mounted at /mnt/NAME with
    DAX) or `"NAME:/DIR"` (`fusuma segment`)."""
    mergeable: bool = False
    """Private guest RAM marked mergeable for KSM; implies `shared_ram = false`, so
    the VM moves by copy only. KSM opens a side channel between guests."""
    ports: list[str] = []
    """TCP ports forwarded to the guest, each `"[ADDR:]HOSTPORT:GUESTPORT"` (ADDR
    127.0.0.1 when left out; another address needs a NIC on a managed network)."""
    nics: list[NicSpec] = []
    """NICs on fusuma's networks (a tap each); none: QEMU's user-mode network."""
    machine: str | None = None
    """The versioned machine type it pins (`"pc-q35-7.2"`); unset: the q35 type of the
    oldest installed QEMU, so that it can move to every QEMU installed here."""
    emulator: str = "shared"
    """Where QEMU's emulator threads (all but the vCPUs) run: `shared` (the
    partition's cores), `isolated` (a core of the partition that holds no guaranteed
    vCPU) or a core list of the partition such as `"1"`."""
    page_reporting: bool | None = None
    """Free page reporting: memory the guest frees goes back to the host. Unset: on
    where the RAM's pages can be charged to a cgroup of their own (cgroup v1) or the
    RAM is private, off otherwise (see `fusuma vm create --help`)."""
    template: str | None = None
    """Start as a clone of this template (`fusuma template`): from its RAM (mapped
    copy-on-write) and device state, in milliseconds, instead of booting."""
    boot: Literal["kernel", "bios", "uefi"] | None = None
    """How it boots: `kernel` (QEMU's direct boot of an image fusuma builds), `bios`
    (SeaBIOS) or `uefi` (OVMF) from a thin disk on an imported image; unset: kernel
    for fusuma's images, bios for imported ones."""
    disk_size: str | None = None
    """An imported image's thin disk size (`"8G"`, `"512M"`), at least the image's;
    unset: the image's own size."""
    ssh_keys: Annotated[list[Annotated[str, Field(max_length=16384)]],
                        Field(max_length=64)] = []
    """An imported image: SSH public keys (the keys' text) cloud-init authorizes for
    the image's default user."""
    user_data: Annotated[str, Field(max_length=65536)] | None = None
    """An imported image: cloud-init user-data as text (a #cloud-config, a script or a
    MIME multipart), run at its first boot."""
    storage: Annotated[str, Field(max_length=4096)] | None = None
    """An imported image: a storage directory root declared shared (`fusuma storage
    add DIR --shared`) for its thin disk, NVRAM and seed (in `DIR/vm-NAME`), so that
    it moves between hosts sharing it without copying its disk; unset: its own
    directory under FUSUMA_HOME."""

    _check_name = field_validator("name")(_name_field)

    @field_validator("emulator")
    @classmethod
    def _emulator(cls, v: str) -> str:
        if v in ("shared", "isolated"):
            return v
        try:
            cores = parse_cpulist(v)
        except SpecError as exc:
            raise ValueError(f"emulator {v!r} is not shared, isolated or a core list "
                             "such as \"1\" or \"2-3\"") from exc
        if not cores:
            raise ValueError("emulator core list is empty")
        return format_cpulist(cores)

    @field_validator("segments")
    @classmethod
    def _segments(cls, v: list[str]) -> list[str]:
        out: list[str] = []
        seen: set[str] = set()
        for item in v:
            name, _, mount = item.partition(":")
            _name_field(name)
            mount = mount or f"/mnt/{name}"
            if not mount.startswith("/") or any(c in mount for c in " ,:\t\n"):
                raise ValueError(f"segment {item!r}: the mount point must be an absolute "
                                 "path without spaces, commas or colons")
            if name in seen:
                raise ValueError(f"segment {name!r} is listed twice")
            seen.add(name)
            out.append(f"{name}:{mount}")
        return out

    @field_validator("machine")
    @classmethod
    def _machine(cls, v: str | None) -> str | None:
        if v is not None and not re.fullmatch(r"pc-q35-\d+\.\d+(\.\d+)?", v):
            raise ValueError(f"machine type {v!r} is not a versioned q35 machine type; "
                             "give one like \"pc-q35-7.2\" (see `fusuma qemu list`)")
        return v

    @field_validator("ports")
    @classmethod
    def _ports(cls, v: list[str]) -> list[str]:
        seen: list[addr.PortForward] = []
        for item in v:
            try:
                f = addr.parse_forward(item)
            except SpecError as exc:
                raise ValueError(str(exc).rstrip(".")) from exc
            if any(f.clashes(o) for o in seen):
                raise ValueError(f"host port {f.host_port} is forwarded twice")
            seen.append(f)
        return v

    @model_validator(mode="after")
    def _memory_floor(self) -> VmSpec:
        try:
            capacity.check_memory_class(self.name, self.memory_mib, self.memory_class,
                                        self.memory_min)
        except ResourceError as exc:
            msg = str(exc).removeprefix(f"VM {self.name!r}: ").rstrip(".")
            raise ValueError(msg.replace("--memory-min", "memory_min")
                             .replace("--memory-class", "memory_class =")
                             .replace("--memory", "memory_mib")) from exc
        return self

    @model_validator(mode="before")
    @classmethod
    def _mergeable_ram(cls, data: Any) -> Any:
        if isinstance(data, dict) and data.get("mergeable") is True:
            if data.get("shared_ram") is True:
                raise ValueError("mergeable = true needs private RAM (KSM merges only "
                                 "private pages), so shared_ram = true cannot go with it; "
                                 "drop one of them")
            data = {**data, "shared_ram": False}
        return data


class HostSettingsSpec(_Model):
    """Host-wide settings."""

    memory_overcommit: float = 1.0
    """How far burstable VMs' guest RAM above their floors is overcommitted on this
    host, 1.0 (none, the default) to 16, for partitions that set none of their own."""

    _check_overcommit = field_validator("memory_overcommit")(_overcommit_field)


class HostSpec(_Model):
    """The whole host: the unit that ``fusuma up`` applies."""

    host: HostSettingsSpec = HostSettingsSpec()
    """Host-wide settings (`[host]`); left out: every setting's default."""

    storage: list[StorageSpec] = []
    """Directories root declares for disk files."""
    network: list[NetworkSpec] = []
    """Networks VMs' NICs join."""
    partition: list[PartitionSpec] = []
    """Partitions: cores, a memory budget and a supervisor each."""
    disk: list[DiskSpec] = []
    """Disks, each owned by one partition."""
    vm: list[VmSpec] = []
    """VMs, each in one partition."""


def _loc(path: str, loc: tuple[int | str, ...]) -> str:
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        else:
            out += ("." if out else "") + part
    return f"{path}: {out}" if out else path


def parse_spec(text: str, source: str = "<spec>") -> HostSpec:
    """Parse and validate a spec's text; errors name ``source`` and the key."""
    try:
        raw = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise SpecError(f"{source}: not valid TOML ({exc}).") from exc
    try:
        spec = HostSpec.model_validate(raw)
    except ValidationError as exc:
        err = exc.errors()[0]
        msg = str(err["msg"]).removeprefix("Value error, ")
        if err["type"] == "extra_forbidden":
            msg = "unknown key (check the spelling; see `fusuma up --help`)"
        elif err["type"] == "missing":
            msg = "required key is missing"
        raise SpecError(f"{_loc(source, tuple(err['loc']))}: {msg}.") from exc
    check_consistency(spec, source)
    return spec


def build(model: type[M], source: str = "argument", **fields: Any) -> M:
    """Construct a spec model from CLI arguments; a bad value becomes one SpecError."""
    try:
        return model.model_validate(fields)
    except ValidationError as exc:
        err = exc.errors()[0]
        msg = str(err["msg"]).removeprefix("Value error, ")
        key = ".".join(str(x) for x in err["loc"])
        raise SpecError(f"{source} {key}: {msg}." if key else f"{source}: {msg}.") from exc


def load_spec(path: Path) -> HostSpec:
    """Read a spec file; a missing or unreadable file is a SpecError."""
    try:
        text = path.read_text()
    except OSError as exc:
        raise SpecError(f"cannot read spec file {path}: {exc.strerror}.") from exc
    return parse_spec(text, str(path))


def check_consistency(spec: HostSpec, source: str = "<spec>") -> None:
    """Cross-object rules: unique names, disjoint cores, references that resolve."""
    seen_dirs: set[str] = set()
    for i, st in enumerate(spec.storage):
        if st.path in seen_dirs:
            raise SpecError(f"{source}: storage[{i}].path: {st.path} is listed twice.")
        seen_dirs.add(st.path)
    named: list[tuple[str, list[str]]] = [
        ("partition", [p.name for p in spec.partition]),
        ("disk", [d.name for d in spec.disk]), ("vm", [v.name for v in spec.vm]),
        ("network", [n.name for n in spec.network])]
    for kind, names in named:
        seen: set[str] = set()
        for i, name in enumerate(names):
            if name in seen:
                raise SpecError(f"{source}: {kind}[{i}].name: duplicate {kind} name "
                                f"{name!r}; every {kind} needs its own name.")
            seen.add(name)
    owner: dict[int, str] = {}
    for i, p in enumerate(spec.partition):
        for c in p.cpus:
            if c in owner:
                raise SpecError(f"{source}: partition[{i}].cpus: core {c} is already given to "
                                f"partition {owner[c]!r}; partitions cannot share a core.")
            owner[c] = p.name
    parts = {p.name for p in spec.partition}
    disks = {d.name: d for d in spec.disk}
    paths: set[str] = set()
    for i, d in enumerate(spec.disk):
        if d.partition not in parts:
            raise SpecError(f"{source}: disk[{i}].partition: no partition named "
                            f"{d.partition!r} in this spec.")
        if d.path in paths:
            raise SpecError(f"{source}: disk[{i}].path: {d.path} is already another disk.")
        paths.add(d.path)
    used: dict[str, str] = {}
    cores = {p.name: len(p.cpus) for p in spec.partition}
    guaranteed: dict[str, int] = {}
    for i, v in enumerate(spec.vm):
        if v.partition not in parts:
            raise SpecError(f"{source}: vm[{i}].partition: no partition named "
                            f"{v.partition!r} in this spec.")
        if v.qos == "guaranteed":
            guaranteed[v.partition] = guaranteed.get(v.partition, 0) + v.vcpus
            if guaranteed[v.partition] > cores[v.partition]:
                raise SpecError(f"{source}: vm[{i}].qos: partition {v.partition!r} has "
                                f"{cores[v.partition]} core(s) but its guaranteed VMs would "
                                f"have {guaranteed[v.partition]} vCPUs; a guaranteed vCPU "
                                "needs a core: make a VM burstable or give the partition "
                                "more cores.")
        for dname in v.disks:
            if dname not in disks:
                raise SpecError(f"{source}: vm[{i}].disks: no disk named {dname!r} in this spec.")
            if disks[dname].partition != v.partition:
                raise SpecError(f"{source}: vm[{i}].disks: disk {dname!r} belongs to partition "
                                f"{disks[dname].partition!r}, not {v.partition!r}.")
            if dname in used:
                raise SpecError(f"{source}: vm[{i}].disks: disk {dname!r} is already used by "
                                f"vm {used[dname]!r}.")
            used[dname] = v.name


def check_host_fit(spec: HostSpec, host: HostInfo, source: str = "<spec>") -> None:
    """Refuse cores the host does not have, memory it cannot give, and partitions too
    small for their VMs (the arithmetic of ``fusuma.capacity``)."""
    for i, p in enumerate(spec.partition):
        missing = [c for c in p.cpus if c not in host.cpus]
        if missing:
            raise SpecError(f"{source}: partition[{i}].cpus: core(s) {format_cpulist(missing)} "
                            f"do not exist; this host has cores {format_cpulist(host.cpus)}.")
    held: dict[int, str] = {}
    for i, p in enumerate(spec.partition):
        cpus = host.whole_cores(p.cpus) if p.smt == "cores" else p.cpus
        for c in cpus:
            if c in held and held[c] != p.name:
                raise SpecError(
                    f"{source}: partition[{i}].cpus: partitions {held[c]!r} and {p.name!r} "
                    f"both need CPU {c}: {siblings_text(host.core_of(c))} goes whole to one "
                    "partition; give each partition other cores, or smt = \"threads\" to "
                    "both to split the core's threads.")
            held[c] = p.name
    planned = [capacity.planned_vm(v.name, v.partition, v.memory_mib, v.accel, v.shared_ram,
                                   v.memory_class, v.memory_min)
               for v in spec.vm]
    overcommit = {p.name: capacity.effective_overcommit(p.memory_overcommit,
                                                        spec.host.memory_overcommit)
                  for p in spec.partition}
    total = capacity.host_need(((p.name, p.memory_mib) for p in spec.partition), planned,
                               overcommit)
    avail = host.memory_available_for_partitions_mib
    if total.total > avail:
        raise SpecError(f"{source}: partitions and guest RAM ask for {total.total} MiB of "
                        f"memory but this host can give at most {avail} MiB "
                        f"({total.against(avail)}; {host.memory_reserved_mib} MiB is kept "
                        "for the host itself).")
    for i, p in enumerate(spec.partition):
        need = capacity.vms_need(v for v in planned if v.partition == p.name)
        if need.total > p.memory_mib:
            raise SpecError(f"{source}: partition[{i}].memory_mib: partition {p.name!r} has no "
                            f"room for its VMs ({need.against(p.memory_mib)}); set memory_mib "
                            f"= {need.total} or give its VMs less memory.")


def smt_warnings(spec: HostSpec, host: HostInfo) -> list[str]:
    """Partitions that split a physical core's SMT threads between them (smt = "threads"):
    their vCPUs compete for the core's execution units. Warned, not refused."""
    owner = {c: p.name for p in spec.partition for c in p.cpus}
    out = []
    for group in host.siblings:
        names = sorted({owner[c] for c in group if c in owner})
        if len(names) > 1:
            who = ", ".join(f"{owner[c]!r} has thread {c}" for c in group if c in owner)
            out.append(f"partitions {' and '.join(repr(n) for n in names)} split "
                       f"{siblings_text(group)} ({who}): their vCPUs compete for that "
                       "core's execution units and caches.")
    return out


def default_spec(host: HostInfo) -> HostSpec:
    """The built-in layout: the cores split into two partitions, one small VM in each."""
    cpus = host.cpus
    if len(cpus) >= 2:
        half = len(cpus) // 2
        groups = [cpus[:half], cpus[half:]]
    else:
        groups = [cpus]
    mem = min(1024, max(384, host.memory_available_for_partitions_mib // (2 * len(groups))))
    parts = [PartitionSpec(name=f"p{i}", cpus=g, memory_mib=mem) for i, g in enumerate(groups)]
    vms = [VmSpec(name=f"vm{i}", partition=f"p{i}", vcpus=1, memory_mib=256)
           for i in range(len(groups))]
    return HostSpec(partition=parts, vm=vms)


def _toml_value(v: object) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, int):
        return str(v)
    if isinstance(v, list):
        return "[" + ", ".join(_toml_value(x) for x in v) + "]"
    if isinstance(v, dict):
        return "{ " + ", ".join(f"{k} = {_toml_value(x)}" for k, x in v.items()
                                if x is not None) + " }"
    # JSON string escapes are valid TOML basic-string escapes.
    return json.dumps(str(v))


def dump_spec(spec: HostSpec) -> str:
    """Render a spec back to TOML (``fusuma up --print-default``); keys left at their
    default are omitted, so ``parse_spec(dump_spec(s)) == s``."""
    lines: list[str] = []
    tables: list[tuple[str, list[BaseModel]]] = [
        ("storage", list(spec.storage)), ("network", list(spec.network)),
        ("partition", list(spec.partition)),
        ("disk", list(spec.disk)), ("vm", list(spec.vm))]
    for table, items in tables:
        for item in items:
            lines.append(f"[[{table}]]")
            for key, value in item.model_dump(exclude_defaults=True).items():
                if key == "cpus":
                    value = format_cpulist(value)
                lines.append(f"{key} = {_toml_value(value)}")
            lines.append("")
    return "\n".join(lines)
