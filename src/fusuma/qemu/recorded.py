"""A recorded device set that another machine wrote, parsed into exactly the devices
fusuma makes before any argv is built from it.

A move between hosts starts the destination's QEMU from the device set the source
recorded when the guest booted (``status.move.record`` of the FusumaVM, which the
source host writes). That is data from another machine, and it becomes ``-device``,
``-machine``, ``-cpu``, ``-smp``, ``-m`` and ``-serial`` options of a QEMU the
destination's root starts. So it is an allow-list, not a blocklist: each device must be
one of the kinds ``fusuma.qemu.cmdline.device_set`` makes, with exactly its options in
its order, ids and names of fusuma's own form (no comma, no path, no ``=``), counts
within bounds; the machine, CPU, memory and serial port only the forms fusuma writes.
Anything else is a ``DeviceSetRefused`` with one sentence, and the move goes back.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from typing import Any

from fusuma.names import NAME
from fusuma.qemu.cmdline import (
    BALLOON_ID,
    BOOT_DRIVE,
    DEVICE_SET_VERSION,
    MACHINE_OPTS,
    NET_ID,
    QGA_PORT_NAME,
    VMGENID_ID,
    Device,
    DeviceSet,
)
from fusuma.qemu.versions import TCG_CPU_IDENTITY

# Bounds: far above what fusuma makes, far below what could hurt.
MAX_TEXT = 64 * 1024              # characters of the JSON text
MAX_DEVICES = 32                  # a q35 root bus has 32 slots
MAX_SEGMENTS = 16                 # virtio-pmem devices (memory hotplug slots)
MAX_DISKS = 24                    # virtio-blk devices, the image's root disk included
MAX_VCPUS = 64                    # VmSpec's bound
MAX_MEMORY_MIB = 4 * 2**20        # 4 TiB
MAX_CPU_FEATURES = 512
MAX_NICS = 8                      # NICs on taps (nic0..nic7)
NIC_ID = "nic[0-7]"
MAC = "[0-9a-f]{2}(:[0-9a-f]{2}){5}"
# 2 * queues + 2 for 2..MAX_QUEUES queues (fusuma.network.link.queues_for).
VECTORS = "(6|8|10|12|14|16|18)"
# The -cpu forms fusuma writes: KVM's host CPU, TCG's max, and TCG's max with one
# identity on every QEMU version.
CPUS = ("host", "max", f"max,{TCG_CPU_IDENTITY}")
SERIALS = (None, "con0")
FIELDS = {"version", "machine", "machine_props", "cpu", "smp", "memory", "serial",
          "devices", "cpu_features", "firmware"}
OPTIONAL = {"cpu_features", "firmware"}
# The firmware of a guest booted from its disk (SeaBIOS; OVMF in pflash): only these,
# and only with the boot disk fusuma gives such a guest.
FIRMWARES = ("bios", "uefi")
# What a move carries from the source's VM record (fusuma.cluster.hostmove.CARRIED).
CARRIED = ("machine", "devices", "accel_used")
# ... and its NICs on fusuma's networks (index, network, MAC, address): the destination
# gives the VM the same, on taps of its own (:func:`carried_nics`).
CARRIED_NICS = "nics"
ACCELS = ("kvm", "tcg")

_NAME = NAME
# \Z, not $: Python's $ also matches before a final newline.
MACHINE_RE = re.compile(r"^pc-q35-[0-9]{1,3}\.[0-9]{1,3}(\.[0-9]{1,3})?\Z")
MEMORY_RE = re.compile(
    r"^([1-9][0-9]{1,7})M(?:,slots=([1-9][0-9]?),maxmem=([1-9][0-9]{1,17}))?\Z")
FEATURE_RE = re.compile(r"^[a-z0-9][a-z0-9_.-]{0,47}\Z")
IPV4_RE = re.compile(r"^[0-9]{1,3}(?:\.[0-9]{1,3}){3}\Z")
UUID_RE = r"[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}"

# Each device kind fusuma makes: its options in order, each a pattern its whole value
# must match, and how many of it a guest may have.
KINDS: dict[str, tuple[tuple[tuple[str, str], ...], int]] = {
    "virtio-serial-pci": ((("id", "vser0"),), 1),
    "virtserialport": ((("bus", r"vser0\.0"), ("chardev", "qga0"),
                        ("name", re.escape(QGA_PORT_NAME))), 1),
    "virtio-pmem-pci": ((("memdev", f"seg-{_NAME}"), ("id", f"pmem-{_NAME}")),
                        MAX_SEGMENTS),
    "virtio-blk-pci": ((("drive", f"disk-{_NAME}"), ("serial", _NAME)), MAX_DISKS),
    "virtio-net-pci": ((("netdev", NET_ID), ("romfile", "")), 1 + MAX_NICS),
    "virtio-balloon-pci": ((("id", BALLOON_ID), ("free-page-reporting", "on")), 1),
    "vmgenid": ((("id", VMGENID_ID), ("guid", UUID_RE)), 1),
}
# Kinds fusuma makes in more than one form: each other form, tried when the first's
# options do not match. A NIC on a tap (fusuma.qemu.cmdline.NicConfig.device): its
# netdev nicN, its MAC, and with several queues mq=on and one vector per queue (rx and
# tx) plus two.
FORMS: dict[str, tuple[tuple[tuple[str, str], ...], ...]] = {
    "virtio-net-pci": (
        (("netdev", NIC_ID), ("mac", MAC), ("romfile", "")),
        (("netdev", NIC_ID), ("mac", MAC), ("romfile", ""), ("mq", "on"),
         ("vectors", VECTORS)),
    ),
}
_PATTERNS = {kind: tuple((k, re.compile(f"^{p}\\Z")) for k, p in props)
             for kind, (props, _) in KINDS.items()}
_FORMS = {kind: [_PATTERNS[kind]] + [tuple((k, re.compile(f"^{p}\\Z")) for k, p in form)
                                     for form in FORMS.get(kind, ())]
          for kind in KINDS}


class DeviceSetRefused(ValueError):
    """A recorded device set holds something fusuma does not make (one sentence)."""


def _refuse(why: str) -> DeviceSetRefused:
    return DeviceSetRefused(f"the recorded device set is refused: {why}")


def _names(names: list[str]) -> str:
    """Names another machine wrote, shown safely: each quoted, the whole bounded."""
    return ", ".join(repr(n) for n in names)[:200]


def _str(value: object, what: str, limit: int = 256) -> str:
    if not isinstance(value, str):
        raise _refuse(f"{what} is {type(value).__name__}, not a string")
    if len(value) > limit:
        raise _refuse(f"{what} is longer than {limit} characters")
    return value


def _int(value: object, what: str, low: int, high: int) -> int:
    # bool is an int to Python, not to JSON's writer: true is not a count.
    if not isinstance(value, int) or isinstance(value, bool):
        raise _refuse(f"{what} is {type(value).__name__}, not an integer")
    if not low <= value <= high:
        raise _refuse(f"{what} is {value}, outside {low}..{high}")
    return value


def _list(value: object, what: str, limit: int) -> list[Any]:
    if not isinstance(value, list):
        raise _refuse(f"{what} is {type(value).__name__}, not a list")
    if len(value) > limit:
        raise _refuse(f"{what} has {len(value)} entries, more than {limit}")
    return value


def _pairs(value: object, what: str, limit: int) -> tuple[tuple[str, str], ...]:
    out = []
    for i, pair in enumerate(_list(value, what, limit)):
        if not isinstance(pair, list) or len(pair) != 2:
            raise _refuse(f"{what}[{i}] is not a [name, value] pair")
        out.append((_str(pair[0], f"{what}[{i}] name", 64),
                    _str(pair[1], f"{what}[{i}] value", 64)))
    return tuple(out)


def _device(i: int, raw: object) -> Device:
    if not isinstance(raw, dict) or set(raw) != {"driver", "props"}:
        raise _refuse(f"device {i} is not an object of driver and props")
    driver = _str(raw["driver"], f"device {i}'s driver", 64)
    if driver not in KINDS:
        raise _refuse(f"device {i} is {driver!r}, not a device kind fusuma makes "
                      f"({', '.join(KINDS)})")
    props = _pairs(raw["props"], f"device {i} ({driver}) props", 8)
    forms = _FORMS[driver]
    want = next((f for f in forms if [k for k, _ in props] == [k for k, _ in f]), None)
    if want is None:
        raise _refuse(f"device {i} ({driver}) has options "
                      f"{_names([k for k, _ in props]) or 'none'}, not "
                      + " or ".join(", ".join(k for k, _ in f) for f in forms))
    for (key, value), (_, pattern) in zip(props, want, strict=True):
        if not pattern.match(value):
            raise _refuse(f"device {i} ({driver}) option {key}={value!r} is not of the "
                          "form fusuma gives it")
    return Device(driver, props)


def _same_names(dev: Device, a: str, pa: str, b: str, pb: str) -> bool:
    d = dict(dev.props)
    return d[a].removeprefix(pa) == d[b].removeprefix(pb)


def _devices(value: object) -> tuple[Device, ...]:
    devices = tuple(_device(i, d) for i, d in enumerate(_list(value, "devices",
                                                              MAX_DEVICES)))
    for kind, (_, most) in KINDS.items():
        n = sum(d.driver == kind for d in devices)
        if n > most:
            raise _refuse(f"it has {n} {kind} devices, more than {most}")
    # The user-mode NIC is one (its backend is named once), tap NICs are not with it.
    if any(dict(d.props).get("netdev") == NET_ID for d in devices) and sum(
            d.driver == "virtio-net-pci" for d in devices) > 1:
        raise _refuse("it has a user-mode NIC beside other NICs")
    backends = [b for d in devices for b in d.backends()] + \
        [dict(d.props)["id"] for d in devices if "id" in dict(d.props)]
    twice = sorted({b for b in backends if backends.count(b) > 1})
    if twice:
        raise _refuse(f"it names {', '.join(twice)} twice")
    for d in devices:
        if d.driver == "virtio-blk-pci" and not _same_names(d, "drive", "disk-",
                                                           "serial", ""):
            raise _refuse("a virtio-blk-pci device's serial is not its disk's name")
        if d.driver == "virtio-pmem-pci" and not _same_names(d, "memdev", "seg-",
                                                            "id", "pmem-"):
            raise _refuse("a virtio-pmem-pci device's id is not its segment's name")
    macs = [dict(d.props)["mac"] for d in devices if "mac" in dict(d.props)]
    if len(set(macs)) != len(macs):
        raise _refuse("two of its NICs have one MAC")
    if any(int(m[:2], 16) & 1 for m in macs):
        raise _refuse("a NIC's MAC is a multicast address")
    ports = [i for i, d in enumerate(devices) if d.driver == "virtserialport"]
    buses = [i for i, d in enumerate(devices) if d.driver == "virtio-serial-pci"]
    if ports and (not buses or buses[0] > ports[0]):
        raise _refuse("its virtserialport comes before the virtio-serial-pci it sits on")
    return devices


def _nic_queues(devices: tuple[Device, ...], smp: int) -> None:
    """A NIC on a tap has one queue per vCPU (at most 8): mq and vectors as fusuma
    gives them for ``smp`` vCPUs, or neither for one."""
    queues = max(1, min(smp, 8))
    for d in devices:
        props = dict(d.props)
        if "mac" not in props:
            continue
        got = int(props["vectors"]) if "vectors" in props else None
        want = 2 * queues + 2 if queues > 1 else None
        if got != want:
            raise _refuse(f"NIC {props['netdev']} has "
                          f"{'vectors=' + str(got) if got else 'one queue'} for {smp} "
                          f"vCPU(s), not {'vectors=' + str(want) if want else 'one queue'}")


def _memory(value: object, pmem: int) -> str:
    text = _str(value, "memory", 64)
    m = MEMORY_RE.match(text)
    if m is None:
        raise _refuse(f"memory {text!r} is not of the form fusuma gives -m")
    mib = _int(int(m.group(1)), "memory (MiB)", 64, MAX_MEMORY_MIB)
    slots = int(m.group(2)) if m.group(2) else 0
    if slots != pmem:
        raise _refuse(f"memory has {slots} slots for {pmem} virtio-pmem devices")
    # maxmem: guest RAM plus the segments' sizes (each at most 1 TiB).
    if m.group(3) and not 0 < int(m.group(3)) - mib * 2**20 <= slots * 2**40:
        raise _refuse(f"memory's maxmem {m.group(3)} is out of bounds")
    return text


def parse_device_set(text: object) -> DeviceSet:
    """``text`` (a recorded device set's JSON) as a DeviceSet of exactly the devices
    fusuma makes; DeviceSetRefused otherwise."""
    raw_text = _str(text, "the record", MAX_TEXT)
    try:
        d = json.loads(raw_text)
    except ValueError as exc:
        raise _refuse(f"it is not JSON ({exc})") from exc
    if not isinstance(d, dict):
        raise _refuse("it is not a JSON object")
    extra = sorted(set(d) - FIELDS)
    if extra:
        raise _refuse(f"it has fields fusuma does not write ({_names(extra)})")
    missing = sorted(FIELDS - OPTIONAL - set(d))
    if missing:
        raise _refuse(f"it lacks {', '.join(missing)}")
    _int(d["version"], "version", DEVICE_SET_VERSION, DEVICE_SET_VERSION)
    machine = _machine(d["machine"])
    machine_props = _pairs(d["machine_props"], "machine_props", 8)
    want_props = tuple((k, v) for k, _, v in (o.partition("=")
                                              for o in MACHINE_OPTS.split(",")))
    if machine_props != want_props:
        raise _refuse(f"machine options {machine_props} are not fusuma's {MACHINE_OPTS}")
    cpu = _str(d["cpu"], "cpu", 64)
    if cpu not in CPUS:
        raise _refuse(f"cpu {cpu!r} is not one fusuma gives ({', '.join(CPUS)})")
    smp = _int(d["smp"], "smp", 1, MAX_VCPUS)
    serial = d["serial"] if d["serial"] is None else _str(d["serial"], "serial", 16)
    if serial not in SERIALS:
        raise _refuse(f"serial {serial!r} is not con0")
    devices = _devices(d["devices"])
    _nic_queues(devices, smp)
    memory = _memory(d["memory"], sum(x.driver == "virtio-pmem-pci" for x in devices))
    features = tuple(_str(f, "a CPU feature", 48) for f in _list(
        d.get("cpu_features", []), "cpu_features", MAX_CPU_FEATURES))
    bad = [f for f in features if not FEATURE_RE.match(f)]
    if bad:
        raise _refuse(f"CPU feature {bad[0]!r} is not a feature name")
    if len(set(features)) != len(features):
        raise _refuse("a CPU feature is named twice")
    if features and not cpu.startswith("max"):
        raise _refuse("CPU features are recorded for a CPU that is not TCG's max")
    firmware = _firmware(d.get("firmware"), devices)
    return DeviceSet(machine=machine, machine_props=machine_props, cpu=cpu, smp=smp,
                     memory=memory, serial=serial, devices=devices, cpu_features=features,
                     firmware=firmware)


def _firmware(value: object, devices: tuple[Device, ...]) -> str | None:
    if value is None:
        return None
    firmware = _str(value, "firmware", 8)
    if firmware not in FIRMWARES:
        raise _refuse(f"firmware {firmware!r} is not bios or uefi")
    if not any(("drive", BOOT_DRIVE) in d.props for d in devices
               if d.driver == "virtio-blk-pci"):
        raise _refuse(f"it boots by {firmware} but has no boot disk ({BOOT_DRIVE})")
    return firmware


def check_carried(record: Mapping[str, object]) -> dict[str, str]:
    """What a move carries from the source's VM record (``CARRIED``), checked: the
    fields to set on the destination's record; DeviceSetRefused otherwise."""
    extra = sorted(set(record) - set(CARRIED) - {CARRIED_NICS})
    if extra:
        raise _refuse(f"the move's record has fields fusuma does not carry "
                      f"({_names(extra)})")
    out: dict[str, str] = {}
    if record.get("accel_used") is not None:
        out["accel_used"] = _accel(record["accel_used"])
    if record.get("machine") is not None:
        out["machine"] = _machine(record["machine"])
    if record.get("devices") is not None:
        ds = parse_device_set(record["devices"])
        if out.get("machine", ds.machine) != ds.machine:
            raise _refuse(f"the record's machine type {out['machine']} is not its "
                          f"device set's {ds.machine}")
        out["devices"] = ds.dumps()
    return out


def _machine(value: object) -> str:
    machine = _str(value, "machine", 32)
    if not MACHINE_RE.match(machine):
        raise _refuse(f"machine {machine!r} is not a versioned q35 machine type")
    return machine


def _accel(value: object) -> str:
    accel = _str(value, "accel_used", 8)
    if accel not in ACCELS:
        raise _refuse(f"accelerator {accel!r} is not kvm or tcg")
    return accel


def carried_nics(record: Mapping[str, object]) -> list[tuple[int, str, str, str | None]]:
    """The NICs a move's record carries, checked: (index, network, MAC, address) each,
    indexes 0.. in order; DeviceSetRefused otherwise."""
    out = []
    for i, raw in enumerate(_list(record.get(CARRIED_NICS) or [], "nics", 8)):
        if not isinstance(raw, dict) or not {"index", "network", "mac"} <= set(raw) or \
                not set(raw) <= {"index", "network", "mac", "ip"}:
            raise _refuse(f"NIC {i} is not an object of index, network, mac and ip")
        index = _int(raw["index"], f"NIC {i}'s index", i, i)
        network = _str(raw["network"], f"NIC {i}'s network", 64)
        mac = _str(raw["mac"], f"NIC {i}'s MAC", 17)
        ip = raw.get("ip")
        if not re.match(f"^{_NAME}\\Z", network):
            raise _refuse(f"NIC {i}'s network {network!r} is not a name")
        if not re.match(f"^{MAC}\\Z", mac) or int(mac[:2], 16) & 1:
            raise _refuse(f"NIC {i}'s MAC {mac!r} is not a unicast MAC")
        if ip is not None:
            ip = _str(ip, f"NIC {i}'s address", 15)
            if not IPV4_RE.match(ip) or any(int(x) > 255 for x in ip.split(".")):
                raise _refuse(f"NIC {i}'s address {ip!r} is not an IPv4 address")
        out.append((index, network, mac, ip))
    return out
