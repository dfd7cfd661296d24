"""The host spec: what partitions, disks and VMs a host should have.

A spec is a TOML file applied with ``fusuma up``::

    [[partition]]
    name = "p0"
    cpus = "0"            # or [0, 1], or "0-3,6"
    memory_mib = 1024
    # io_weight = 100     # 1..10000, best effort
    # qemu = "10.0"       # its hypervisor: a version (`fusuma qemu list`) or, from
    #                     # root's spec or CLI only, a binary's path

    [[storage]]           # a directory for disk files (FUSUMA_HOME/disks always is one)
    path = "/srv/fusuma-disks"

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
from fusuma.errors import SpecError
from fusuma.host.topology import HostInfo, format_cpulist, parse_cpulist, siblings_text
from fusuma.names import NAME_HINT, NAME_PATTERN, NAME_RE
from fusuma.names import check_name as check_name  # re-exported: older callers
from fusuma.network import addr

Accel = Literal["auto", "kvm", "tcg"]
Qos = Literal["guaranteed", "burstable", "best-effort"]
M = TypeVar("M", bound=BaseModel)


class _Model(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


# A name as the API's OpenAPI document states it (what _name_field checks).
Name = Annotated[str, Field(json_schema_extra={"pattern": NAME_PATTERN})]


def _name_field(v: str) -> str:
    if not NAME_RE.match(v):
        raise ValueError(f"name {v!r} is not allowed: use {NAME_HINT}")
    return v


class PartitionSpec(_Model):
    """A partition: exclusive cores, a memory limit, an I/O weight, its own supervisor."""

    name: Name
    cpus: list[int]
    memory_mib: Annotated[int, Field(gt=0)]
    io_weight: Annotated[int, Field(ge=1, le=10000)] | None = None
    qemu: str | None = None
    # On an SMT host: "cores" hands out whole physical cores (the cpus listed plus their
    # sibling threads); "threads" takes exactly the threads listed.
    smt: Literal["cores", "threads"] = "cores"

    _check_name = field_validator("name")(_name_field)

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

    @field_validator("path")
    @classmethod
    def _abs(cls, v: str) -> str:
        if not v.startswith("/"):
            raise ValueError(f"storage directory {v!r} must be absolute")
        return v


class DiskSpec(_Model):
    """A disk owned by one partition: a raw image file inside a storage directory."""

    name: Name
    path: str
    partition: str
    size_mib: Annotated[int, Field(gt=0)] | None = None

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
    type: Literal["managed", "bridged"] = "managed"
    subnet: str | None = None
    nat: bool | None = None           # managed: default true
    isolated: bool = False
    filtering: bool | None = None     # managed: default true
    parent: str | None = None

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
    mac: str | None = None
    ip: str | None = None

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
    partition: str
    vcpus: Annotated[int, Field(ge=1, le=64)] = 1
    memory_mib: Annotated[int, Field(ge=64)] = 256
    image: str = "minimal"
    disks: list[str] = []
    accel: Accel = "auto"
    autostart: bool = True
    # Guest RAM in a named shared file: needed for zero-copy migration. False gives
    # private anonymous RAM (migration by copy only).
    shared_ram: bool = True
    # The governor's QoS class: guaranteed (its vCPUs' worth of CPU reserved),
    # burstable (a weight, may use idle CPU) or best-effort (only otherwise idle CPU).
    qos: Qos = "burstable"
    # Shared read-only segments, each "NAME" (mounted at /mnt/NAME) or "NAME:/DIR".
    segments: list[str] = []
    # KSM: private RAM marked mergeable. Needs private RAM, so such a VM migrates by
    # copy only; mergeable = true alone implies shared_ram = false.
    mergeable: bool = False
    # TCP ports forwarded to the guest: "[ADDR:]HOSTPORT:GUESTPORT" (ADDR 127.0.0.1
    # when left out; another address needs a NIC on a managed network).
    ports: list[str] = []
    # NICs on fusuma's networks; none: QEMU's user-mode network (when ports ask).
    nics: list[NicSpec] = []
    # The versioned machine type it pins (None: the q35 machine type of the oldest
    # installed QEMU, so that it can move to every QEMU installed here).
    machine: str | None = None
    # Where QEMU's emulator threads (all but the vCPUs) run: "shared" (the partition's
    # cores), "isolated" (a core of the partition that holds no guaranteed vCPU) or an
    # explicit core list of the partition such as "1" (libvirt's <emulatorpin>).
    emulator: str = "shared"
    # Free page reporting (virtio-balloon free-page-reporting): pages the guest frees
    # are handed back to the host. None: on wherever guest RAM has a memory cgroup of
    # its own (cgroup v1 hosts), off where it cannot (see `fusuma vm create --help`).
    page_reporting: bool | None = None
    # Start from a template's RAM and device state instead of booting (`fusuma
    # template`): the clone maps the template's RAM copy-on-write.
    template: str | None = None
    # How it boots: "kernel" (QEMU's direct kernel boot of an image fusuma builds),
    # "bios" (SeaBIOS) or "uefi" (OVMF) from a thin disk on an imported image. None:
    # kernel for the built images, bios for an imported one.
    boot: Literal["kernel", "bios", "uefi"] | None = None
    # An imported image's thin disk size ("8G", "512M"); None: the image's own size.
    disk_size: str | None = None
    # cloud-init (an imported image): SSH public keys for the image's default user,
    # and the user's own user-data (a #cloud-config, a script or a MIME multipart),
    # both as text: the VM's seed disk carries them.
    ssh_keys: Annotated[list[Annotated[str, Field(max_length=16384)]],
                        Field(max_length=64)] = []
    user_data: Annotated[str, Field(max_length=65536)] | None = None

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


class HostSpec(_Model):
    """The whole host: the unit that ``fusuma up`` applies."""

    storage: list[StorageSpec] = []
    network: list[NetworkSpec] = []
    partition: list[PartitionSpec] = []
    disk: list[DiskSpec] = []
    vm: list[VmSpec] = []


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
        raise SpecError(f"{source} {key}: {msg}.") from exc


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
    planned = [capacity.planned_vm(v.name, v.partition, v.memory_mib, v.accel, v.shared_ram)
               for v in spec.vm]
    total = capacity.host_need(((p.name, p.memory_mib) for p in spec.partition), planned)
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
