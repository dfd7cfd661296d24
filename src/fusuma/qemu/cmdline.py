"""Render a QEMU command line from a typed VM configuration, without starting QEMU.

Pure functions only: the argv is tested as data (tests/unit/test_cmdline.py).

QEMU runs under a uid of its own behind a seccomp sandbox (fusuma.qemu.privilege), so
files it may not open itself are opened by the supervisor and passed as descriptors;
a config then carries the fd numbers beside the paths, and the argv names the fds:
``/proc/self/fd/N`` where QEMU opens a path with plain open() (memory-backend-file,
-kernel, -initrd: the magic link needs no directory traversal, only the file's own
permission), an fdset (``-add-fd`` + ``/dev/fdset/K``) where QEMU uses qemu_open()
(-drive, a chardev's logfile: QEMU dups the fd, no permission check at all).
"""

from __future__ import annotations

import json
import os
import uuid
from dataclasses import field
from pathlib import Path
from typing import Literal

from fusuma.frozen import frozen

QGA_PORT_NAME = "org.qemu.guest_agent.0"
# TCG's translation cache defaults to 1 GiB on 64-bit hosts; bound it so a VM's host
# memory stays small and predictable. 32 MiB holds the code of an idle or apache2-
# serving Debian guest: against 128 MiB it saved 90 MiB of host memory per VM with no
# loss of requests/s (`fusuma bench dcss --modes none --loads apache2`, 273-277 vs
# 220-253 requests/s). A whole OS booted by firmware (a user's image: systemd, udev,
# Python's cloud-init) runs far more code than fits 32 MiB, and TCG then flushes and
# translates again all the boot long: its VMs get FIRMWARE_TCG_TB_MIB. Measured side
# by side, one core each, on a 2-core TCG host with fusuma's Debian test image under
# SeaBIOS (noisy: other work ran on the host): raw QEMU to the login prompt, 32 MiB
# 120 s, 256 MiB 95 s; fusuma to the guest agent / cloud-init's end, 32 MiB 170 / 227 s
# against 256 MiB 120 / 148 s, and in another run 128 MiB 174 / 222 s against 256 MiB
# 172 / 221 s. Both sizes count in the VM's overhead (overhead_mib), so 128 MiB, not
# 256. FUSUMA_TCG_TB_MIB overrides both.
TCG_TB_MIB = 32
FIRMWARE_TCG_TB_MIB = 128
# QEMU's seccomp filter: no obsolete syscalls, no set*id (fusuma drops privileges before
# exec; QEMU's -runas would need them), no fork/exec, no scheduler or affinity changes
# (the supervisor pins threads from outside).
SANDBOX = "on,obsolete=deny,elevateprivileges=deny,spawn=deny,resourcecontrol=deny"


# Free page reporting: the guest reports free blocks of 2^order pages, and QEMU hands
# them back to the host (a hole punched in a shared RAM file, MADV_DONTNEED for private
# RAM). The kernel's default order is pageblock_order (9: 2 MiB blocks), which leaves
# what boot frees in smaller pieces (and the whole 16 MiB DMA zone) resident: an idle
# 256 MiB minimal guest held ~100 MiB of host memory at order 9, 78.6 MiB at order 5
# (128 KiB blocks) and 78.2 MiB at order 0 (single pages, many more reports). The
# guest's /init writes it (fusuma.images lib.sh: the 6.1 kernel ignores it on its
# command line). FUSUMA_PAGE_REPORTING_ORDER overrides it.
PAGE_REPORTING_ORDER = 5


def _env_int(name: str, default: int, low: int, high: int) -> int:
    """Integer environment setting ``name`` within [low, high], else ``default``."""
    try:
        value = int(os.environ.get(name, default))
    except ValueError:
        return default
    return value if low <= value <= high else default


def page_reporting_order() -> int:
    """The guest's page_reporting_order: FUSUMA_PAGE_REPORTING_ORDER, else the default."""
    return _env_int("FUSUMA_PAGE_REPORTING_ORDER", PAGE_REPORTING_ORDER, 0, 10)


BALLOON_ID = "balloon0"


def new_vmgenid() -> str | None:
    """The vmgenid guid for a VM booting now: a new one, or None (no vmgenid device, as
    fusuma gave guests before templates) when FUSUMA_VMGENID is "0"."""
    if os.environ.get("FUSUMA_VMGENID", "1") == "0":
        return None
    return str(uuid.uuid4())


def tcg_tb_mib(firmware: bool = False) -> int:
    """The TCG translation cache size: FUSUMA_TCG_TB_MIB, else FIRMWARE_TCG_TB_MIB for a
    VM booted by firmware and TCG_TB_MIB for a kernel boot."""
    return _env_int("FUSUMA_TCG_TB_MIB", FIRMWARE_TCG_TB_MIB if firmware else TCG_TB_MIB,
                    1, 2048)


@frozen
class DiskConfig:
    name: str
    path: Path
    readonly: bool = False
    # Descriptors of the image opened for QEMU, one per access mode it may ask for:
    # its block layer opens a read-write image read-only first, then read-write, and
    # takes from the fdset the fd of the matching mode.
    fds: tuple[int, ...] = ()
    # The file's identity when it was registered: the open refuses another file.
    dev: int | None = None
    ino: int | None = None


@frozen
class ThinDisk:
    """A VM's boot disk: a qcow2 overlay of its own on a read-only base image (an
    imported image, fusuma.images.store). QEMU gets both as descriptors; the base's
    path recorded in the overlay is overridden by its fdset."""

    path: Path
    base: Path
    base_format: str                 # "qcow2" | "raw"
    fds: tuple[int, ...] = ()        # the overlay, read-write and read-only
    base_fd: int | None = None       # the base, read-only
    # A template's clone: its overlay is on the template's disk layer (a read-only
    # qcow2 whose backing file is the base): overlay -> layer -> base.
    layer: Path | None = None
    layer_fd: int | None = None


@frozen
class Uefi:
    """OVMF: its code (read-only, shared by every VM) and the VM's own NVRAM
    variables file (read-write)."""

    code: Path
    vars: Path
    code_fd: int | None = None
    vars_fds: tuple[int, ...] = ()   # read-write and read-only, as for disks


BOOTS = ("kernel", "bios", "uefi")


@frozen
class SegmentConfig:
    """A shared segment: a read-only virtio-pmem device backed by ``path``."""

    name: str
    path: Path
    size_bytes: int       # the file's size, a multiple of 2 MiB
    mount: str            # where the guest mounts it
    fd: int | None = None  # the file opened read-only for QEMU


@frozen
class NicConfig:
    """A NIC on a tap (fusuma.network): the supervisor makes the tap and passes one
    descriptor per queue (``fds``); QEMU never opens /dev/net/tun itself."""

    id: str                    # the netdev's id: "nic0", "nic1", ...
    mac: str
    queues: int
    tap: str                   # the tap's name (for messages; QEMU gets the fds)
    bridge: str
    network: str
    fds: tuple[int, ...] = ()

    def device(self) -> Device:
        props: list[tuple[str, str]] = [("netdev", self.id), ("mac", self.mac),
                                        ("romfile", "")]
        if self.queues > 1:
            # One MSI-X vector per queue (rx and tx) plus config and control.
            props += [("mq", "on"), ("vectors", str(2 * self.queues + 2))]
        return Device("virtio-net-pci", tuple(props))

    def netdev(self) -> str:
        if not self.fds:
            raise ValueError(f"NIC {self.id} ({self.tap}) has no tap descriptors")
        fds = f"fd={self.fds[0]}" if len(self.fds) == 1 else \
            f"fds={':'.join(map(str, self.fds))}"
        return f"tap,id={self.id},{fds},vhost=off"


@frozen
class VmConfig:
    """Everything QEMU needs to know about one VM."""

    name: str
    vcpus: int
    memory_mib: int
    accel: Literal["kvm", "tcg"]
    kernel: Path | None              # None: boot by firmware from ``thin_disk``
    initrd: Path | None
    append: str
    qmp_socket: Path
    qga_socket: Path
    console_socket: Path
    console_log: Path
    pidfile: Path
    ram_file: Path | None            # None: private anonymous RAM
    disks: list[DiskConfig] = field(default_factory=list)
    incoming: str | None = None      # "defer" or a URI, for the destination of a migration
    segments: list[SegmentConfig] = field(default_factory=list)
    mergeable: bool = False          # private RAM: let KSM merge it (madvise MERGEABLE)
    ports: list[tuple[int, int]] = field(default_factory=list)   # (host, guest) tcp
    # False on a migration's destination: the source still holds the host ports, so
    # they are added (hostfwd_add) once the source has gone.
    bind_ports: bool = True
    root_disk: Path | None = None    # Debian image: its root on a read-only virtio-blk
    # A virtio-balloon with free page reporting: pages the guest frees go back to the
    # host (a VM booting now; a recorded device set says it for a moving one).
    page_reporting: bool = False
    # The guid of a ``vmgenid`` device for a VM booted now (None: no such device). The
    # recorded device set keeps it, so a move keeps the guest's generation; a clone of a
    # template gets a new one (fusuma.memshare.templates.clone_devices).
    vmgenid: str | None = None
    # A clone of a template (fusuma.memshare.templates): its RAM is the template's file
    # mapped privately and read-only (copy-on-write: QEMU >= 8.2, ``readonly=on`` with
    # ``rom=off``), and its device state comes from the template's state file, read
    # from an fdset (TEMPLATE_STATE_FDSET) by ``migrate-incoming``.
    template_ram: Path | None = None
    # The machine type of a VM booted now (its record pins a versioned one); ignored
    # when ``devices`` is given: a recorded device set names its own.
    machine: str = "q35"
    # What the guest sees, as recorded when it booted (None: derive it from this
    # config, as for a VM booting now). A move's destination gets the source's.
    devices: DeviceSet | None = None
    # Firmware directories (-L, searched in order) of a QEMU unpacked beside the
    # system's (fusuma.qemu.versions); empty: the QEMU's compiled-in ones.
    data_dirs: tuple[Path, ...] = ()
    # CPU features this QEMU's model would show but the recorded set lacks: switched
    # off, so the guest sees exactly ``devices.cpu_features`` on every QEMU version.
    cpu_off: tuple[str, ...] = ()
    # RAM QEMU allocates implicitly (ROMs, firmware) in memfds, so that a cpr-transfer
    # can hand every RAM block to a new QEMU process (QEMU >= 10.0; the guest cannot
    # see it). fusuma.supervisor.moves.cpr
    aux_ram_share: bool = False
    # An in-place move's new QEMU: it reads the guest's RAM descriptors from this UNIX
    # socket (cpr channel) before it creates its devices; ``incoming`` is then "defer".
    cpr_socket: Path | None = None
    # The console log's FIFO (fusuma.qemu.consolelog): QEMU writes the console there
    # and the supervisor writes ``console_log``, capped (None: QEMU writes the file).
    console_fifo: Path | None = None
    # NICs on taps (fusuma.network); none: the user-mode network when ``ports`` asks.
    nics: list[NicConfig] = field(default_factory=list)
    # Boot by firmware (``kernel`` None): the thin disk SeaBIOS or OVMF boots, OVMF's
    # files for "uefi", and the cloud-init seed (a read-only ISO labelled cidata).
    thin_disk: ThinDisk | None = None
    uefi: Uefi | None = None
    seed: Path | None = None
    seed_fd: int | None = None
    # Files opened for QEMU by the supervisor (None: QEMU opens the path itself).
    ram_fd: int | None = None
    kernel_fd: int | None = None
    initrd_fd: int | None = None
    console_log_fd: int | None = None
    root_disk_fd: int | None = None
    template_ram_fd: int | None = None
    template_state_fd: int | None = None

    def passed_fds(self) -> list[int]:
        """Every descriptor the argv names: QEMU must inherit exactly these."""
        fds = [self.ram_fd, self.kernel_fd, self.initrd_fd, self.console_log_fd,
               self.root_disk_fd, self.template_ram_fd, self.template_state_fd,
               self.seed_fd, *(s.fd for s in self.segments)]
        if self.thin_disk is not None:
            fds += [*self.thin_disk.fds, self.thin_disk.base_fd, self.thin_disk.layer_fd]
        if self.uefi is not None:
            fds += [self.uefi.code_fd, *self.uefi.vars_fds]
        return [fd for fd in fds if fd is not None] + [fd for d in self.disks
                                                       for fd in d.fds] + [
            fd for n in self.nics for fd in n.fds]


NET_ID = "net0"
BOOT_DRIVE = "disk-fusuma-boot"
SEED_DRIVE = "disk-fusuma-seed"
VMGENID_ID = "vmgenid0"
# The fdset a clone's QEMU reads its template's state file from: numbered apart from the
# ones build_argv numbers in argv order, so ``migrate-incoming`` can name it.
TEMPLATE_STATE_FDSET = 90
MACHINE_OPTS = "sata=off,smbus=off,vmport=off,i8042=off"
DEVICE_SET_VERSION = 1
# What build_argv names in devices' properties: the backends they attach to.
BACKEND_PROPS = ("chardev", "drive", "netdev", "memdev")


@frozen
class Device:
    """One guest-visible device: a ``-device`` driver and its properties, in order."""

    driver: str
    props: tuple[tuple[str, str], ...] = ()

    def option(self) -> str:
        return ",".join([self.driver, *(f"{k}={v}" for k, v in self.props)])

    def backends(self) -> list[str]:
        return [v for k, v in self.props if k in BACKEND_PROPS]


@frozen
class DeviceSet:
    """What a guest sees of its virtual machine, recorded when it boots.

    Every move's destination is started from the recorded set, whatever fusuma version
    or image build came since, so its devices, their order (which fixes their PCI
    addresses) and properties are the source's. Host-side options (backends, fds,
    ``aux-ram-share``, the TCG cache size) are not part of it and may differ."""

    machine: str                                  # a versioned type: "pc-q35-7.2"
    machine_props: tuple[tuple[str, str], ...]    # guest-visible machine properties
    cpu: str
    smp: int
    memory: str                                   # the -m argument
    serial: str | None                            # chardev of the ISA serial port
    devices: tuple[Device, ...]
    # The CPUID features the guest was shown (under TCG: ``max`` trimmed to what
    # every installed QEMU emulates); () when not recorded: plain ``cpu``.
    cpu_features: tuple[str, ...] = ()
    # The firmware a guest booted from its disk by: "bios" (SeaBIOS) or "uefi" (OVMF
    # in two pflash devices, code and the VM's NVRAM); None for a kernel boot or a set
    # recorded before fusuma wrote it. A move's destination must boot the same.
    firmware: str | None = None

    def as_json(self) -> dict[str, object]:
        out: dict[str, object] = {
            "version": DEVICE_SET_VERSION, "machine": self.machine,
            "machine_props": [list(p) for p in self.machine_props], "cpu": self.cpu,
            "smp": self.smp, "memory": self.memory, "serial": self.serial,
            "devices": [{"driver": d.driver, "props": [list(p) for p in d.props]}
                        for d in self.devices],
            "cpu_features": list(self.cpu_features)}
        if self.firmware is not None:      # a kernel boot's record stays as it was
            out["firmware"] = self.firmware
        return out

    def dumps(self) -> str:
        return json.dumps(self.as_json(), separators=(",", ":"))

    @classmethod
    def loads(cls, text: str) -> DeviceSet:
        d = json.loads(text)
        if d.get("version") != DEVICE_SET_VERSION:
            raise ValueError(f"device set version {d.get('version')!r} is not "
                             f"{DEVICE_SET_VERSION}")
        return cls(machine=str(d["machine"]),
                   machine_props=tuple((str(k), str(v)) for k, v in d["machine_props"]),
                   cpu=str(d["cpu"]), smp=int(d["smp"]), memory=str(d["memory"]),
                   serial=None if d["serial"] is None else str(d["serial"]),
                   devices=tuple(Device(str(x["driver"]),
                                        tuple((str(k), str(v)) for k, v in x["props"]))
                                 for x in d["devices"]),
                   cpu_features=tuple(str(f) for f in d.get("cpu_features", ())),
                   firmware=None if d.get("firmware") is None else str(d["firmware"]))


def _pairs(opts: str) -> tuple[tuple[str, str], ...]:
    return tuple((k, v) for k, _, v in (o.partition("=") for o in opts.split(",")))


def memory_arg(cfg: VmConfig) -> str:
    mem = f"{cfg.memory_mib}M"
    if cfg.segments:
        # virtio-pmem devices live in the device-memory region above RAM.
        extra = sum(seg.size_bytes for seg in cfg.segments)
        mem += f",slots={len(cfg.segments)},maxmem={cfg.memory_mib * 2**20 + extra}"
    return mem


def device_set(cfg: VmConfig) -> DeviceSet:
    """The devices a VM booting now with ``cfg`` gets (what fusuma records)."""
    devs = [Device("virtio-serial-pci", (("id", "vser0"),)),
            Device("virtserialport", (("bus", "vser0.0"), ("chardev", "qga0"),
                                      ("name", QGA_PORT_NAME)))]
    devs += [Device("virtio-pmem-pci", (("memdev", f"seg-{seg.name}"),
                                        ("id", f"pmem-{seg.name}")))
             for seg in cfg.segments]
    if cfg.root_disk is not None:
        devs.append(Device("virtio-blk-pci", (("drive", "disk-fusuma-root"),
                                              ("serial", "fusuma-root"))))
    # The thin disk first of the disks: with no bootindex, SeaBIOS and OVMF boot the
    # first disk that has a boot sector or an EFI system partition.
    if cfg.thin_disk is not None:
        devs.append(Device("virtio-blk-pci", (("drive", BOOT_DRIVE), ("serial", "fusuma-boot"))))
    if cfg.seed is not None:
        devs.append(Device("virtio-blk-pci", (("drive", SEED_DRIVE), ("serial", "fusuma-seed"))))
    if cfg.ports and not cfg.nics:
        devs.append(Device("virtio-net-pci", (("netdev", NET_ID), ("romfile", ""))))
    devs += [nic.device() for nic in cfg.nics]
    devs += [Device("virtio-blk-pci", (("drive", f"disk-{d.name}"), ("serial", d.name)))
             for d in cfg.disks]
    if cfg.page_reporting:
        devs.append(Device("virtio-balloon-pci", (("id", BALLOON_ID),
                                                  ("free-page-reporting", "on"))))
    if cfg.vmgenid is not None:
        # Not a PCI device (an ACPI one): last, it moves no other device's address.
        devs.append(Device("vmgenid", (("id", VMGENID_ID), ("guid", cfg.vmgenid))))
    return DeviceSet(machine=cfg.machine, machine_props=_pairs(MACHINE_OPTS),
                     cpu="host" if cfg.accel == "kvm" else "max", smp=cfg.vcpus,
                     memory=memory_arg(cfg), serial="con0", devices=tuple(devs),
                     firmware=firmware_of(cfg))


def firmware_of(cfg: VmConfig) -> str | None:
    """The firmware ``cfg`` boots its disk by (None: a kernel boot)."""
    if cfg.uefi is not None:
        return "uefi"
    return "bios" if cfg.thin_disk is not None else None


def has_page_reporting(ds: DeviceSet) -> bool:
    """Whether the guest sees a virtio-balloon with free page reporting."""
    return any(d.driver == "virtio-balloon-pci" and ("free-page-reporting", "on") in d.props
               for d in ds.devices)


class DeviceSetMismatch(ValueError):
    """A recorded device set names a backend the VM's configuration lacks."""


def hostfwd(host: int, guest: int) -> str:
    """The hostfwd rule for one forward (also what HMP ``hostfwd_add`` takes)."""
    return f"tcp:127.0.0.1:{host}-:{guest}"

def fd_path(fd: int | None, path: Path) -> str:
    """What QEMU opens with plain open(): the inherited fd's magic link, or the path."""
    return f"/proc/self/fd/{fd}" if fd is not None else str(path)


class _FdSets:
    """Numbers fdsets in argv order and renders their ``-add-fd`` options."""

    def __init__(self) -> None:
        self.argv: list[str] = []
        self.count = 0

    def path(self, fds: int | tuple[int, ...] | None, opaque: str, path: Path) -> str:
        """``/dev/fdset/K`` holding ``fds``, or ``path`` when there are none."""
        if fds is None or fds == ():
            return str(path)
        self.count += 1
        for fd in (fds,) if isinstance(fds, int) else fds:
            self.argv += ["-add-fd", f"fd={fd},set={self.count},opaque={opaque}"]
        return f"/dev/fdset/{self.count}"


def overhead_mib(accel: str, firmware: bool = False) -> int:
    """Host memory a VM's QEMU needs beyond guest RAM (used for admission checks);
    ``firmware``: the VM boots by firmware (its larger translation cache)."""
    return 96 + (tcg_tb_mib(firmware) if accel == "tcg" else 0)


def build_argv(cfg: VmConfig, binary: str = "qemu-system-x86_64") -> list[str]:
    """Return the argv that starts ``cfg``: host-side backends from ``cfg``, what the
    guest sees from ``cfg.devices`` (its recorded device set) or, for a VM booting
    now, from :func:`device_set`."""
    ds = cfg.devices if cfg.devices is not None else device_set(cfg)
    argv = [binary, "-name", f"guest={cfg.name},debug-threads=on",
            "-nodefaults", "-no-user-config", "-display", "none", "-sandbox", SANDBOX]
    for data_dir in cfg.data_dirs:
        argv += ["-L", str(data_dir)]
    fdsets = _FdSets()
    fdsets_at = len(argv)
    cpu = ",".join([ds.cpu, *(f"{f}=off" for f in cfg.cpu_off)])
    if cfg.accel == "kvm":
        argv += ["-accel", "kvm", "-cpu", cpu]
    else:
        argv += ["-accel", f"tcg,tb-size={tcg_tb_mib(firmware_of(cfg) is not None)}", "-cpu", cpu]
    # No SATA controller, SMBus, VMware port or PS/2 controller (MACHINE_OPTS): the
    # guest uses none of them, and every device is state to save and load in a
    # migration's downtime. The memory backend and aux-ram-share are host-side.
    aux = ",aux-ram-share=on" if cfg.aux_ram_share else ""
    machine = ",".join([ds.machine, *(f"{k}={v}" for k, v in ds.machine_props)])
    argv += ["-machine", f"{machine},memory-backend=ram0{aux}",
             "-smp", str(ds.smp), "-m", ds.memory]
    if cfg.template_ram is not None:
        # A clone: the template's pages, mapped privately (copy-on-write) from a
        # read-only descriptor: the clone's writes never reach the file, and a discard
        # (balloon, page reporting) fails instead of punching a hole in it.
        merge = "on" if cfg.mergeable else "off"
        argv += ["-object", f"memory-backend-file,id=ram0,size={cfg.memory_mib}M,"
                 f"mem-path={fd_path(cfg.template_ram_fd, cfg.template_ram)},"
                 f"share=off,readonly=on,rom=off,merge={merge}"]
    elif cfg.ram_file is not None:
        # A named shared file (not a memfd): another QEMU can map the same pages,
        # which is what zero-copy migration (x-ignore-shared) relies on.
        argv += ["-object", f"memory-backend-file,id=ram0,size={cfg.memory_mib}M,"
                 f"mem-path={fd_path(cfg.ram_fd, cfg.ram_file)},share=on,merge=off"]
    else:
        merge = "on" if cfg.mergeable else "off"
        argv += ["-object", f"memory-backend-ram,id=ram0,size={cfg.memory_mib}M,"
                 f"merge={merge}"]
    segs = "".join(f" fusuma.seg={seg.name}:{seg.mount}" for seg in cfg.segments)
    if cfg.segments:
        # Device memory sits above 4 GiB, so the guest kernel would set up a 64 MiB
        # SWIOTLB bounce buffer (zeroed, so it costs host memory) for devices that
        # cannot reach it; no device DMAs there, so it is not needed.
        segs += " swiotlb=noforce"
    if has_page_reporting(ds):
        segs += f" page_reporting.page_reporting_order={page_reporting_order()}"
    if cfg.nics:
        # The guest's /init asks DHCP for every NIC (fusuma.images lib.sh net_up).
        segs += " fusuma.net=dhcp"
    if cfg.kernel is not None and cfg.initrd is not None:
        argv += ["-kernel", fd_path(cfg.kernel_fd, cfg.kernel),
                 "-initrd", fd_path(cfg.initrd_fd, cfg.initrd),
                 "-append", f"{cfg.append} fusuma.name={cfg.name}{segs}"]
    if cfg.uefi is not None:
        code = fdsets.path(cfg.uefi.code_fd, "uefi-code", cfg.uefi.code)
        nvram = fdsets.path(cfg.uefi.vars_fds, "uefi-vars", cfg.uefi.vars)
        lock = ",file.locking=off" if len(cfg.uefi.vars_fds) > 1 else ""  # as for disks
        argv += ["-drive", f"if=pflash,format=raw,unit=0,readonly=on,file={code}",
                 "-drive", f"if=pflash,format=raw,unit=1,file={nvram}{lock}"]
    argv += ["-chardev", f"socket,id=qmp0,path={cfg.qmp_socket},server=on,wait=off",
             "-mon", "chardev=qmp0,mode=control"]
    logfile = fdsets.path(cfg.console_log_fd, "console-log", cfg.console_log)
    backends = ["con0", "qga0"]
    argv += ["-chardev", f"socket,id=con0,path={cfg.console_socket},server=on,wait=off,"
             f"logfile={logfile},logappend=on",
             "-chardev", f"socket,id=qga0,path={cfg.qga_socket},server=on,wait=off"]
    for seg in cfg.segments:
        # share=on: every VM maps the same host pages (and x-ignore-shared skips them
        # in a zero-copy migration); readonly=on: no guest can change them.
        argv += ["-object", f"memory-backend-file,id=seg-{seg.name},"
                 f"mem-path={fd_path(seg.fd, seg.path)},"
                 f"size={seg.size_bytes},share=on,readonly=on,merge=off"]
        backends.append(f"seg-{seg.name}")
    if cfg.root_disk is not None:
        root = fdsets.path(cfg.root_disk_fd, "disk-fusuma-root", cfg.root_disk)
        argv += ["-drive", f"file={root},format=raw,if=none,id=disk-fusuma-root,readonly=on"]
        backends.append("disk-fusuma-root")
    if cfg.thin_disk is not None:
        t = cfg.thin_disk
        image = fdsets.path(t.fds, BOOT_DRIVE, t.path)
        base = fdsets.path(t.base_fd, "disk-fusuma-base", t.base)
        lock = ",file.locking=off" if len(t.fds) > 1 else ""   # see the disks below
        chain = f"backing.driver={t.base_format},backing.file.filename={base}"
        if t.layer is not None:
            layer = fdsets.path(t.layer_fd, "disk-fusuma-layer", t.layer)
            chain = (f"backing.driver=qcow2,backing.file.filename={layer},"
                     + chain.replace("backing.", "backing.backing."))
        argv += ["-drive", f"file={image},format=qcow2,if=none,id={BOOT_DRIVE}{lock},"
                 + chain]
        backends.append(BOOT_DRIVE)
    if cfg.seed is not None:
        seed = fdsets.path(cfg.seed_fd, SEED_DRIVE, cfg.seed)
        argv += ["-drive", f"file={seed},format=raw,if=none,id={SEED_DRIVE},readonly=on"]
        backends.append(SEED_DRIVE)
    # A clone of a template with a network card has it whether it forwards ports or not.
    if (cfg.ports and not cfg.nics) or any(NET_ID in dev.backends() for dev in ds.devices):
        fwd = "".join(f",hostfwd={hostfwd(h, g)}" for h, g in cfg.ports) \
            if cfg.bind_ports else ""
        argv += ["-netdev", f"user,id={NET_ID}{fwd}"]
        backends.append(NET_ID)
    for nic in cfg.nics:
        argv += ["-netdev", nic.netdev()]
        backends.append(nic.id)
    for d in cfg.disks:
        ro = ",readonly=on" if d.readonly else ""
        image = fdsets.path(d.fds, f"disk-{d.name}", d.path)
        # A read-write image offered as two descriptors (read-only and read-write, two
        # open file descriptions): QEMU's image locks (OFD locks) stay on the one it
        # switches away from, which the fdset keeps open, so the switch a migration
        # makes (inactivate at the source, activate at the destination's `cont`) fails
        # with 'Failed to get "write" lock' against the QEMU's own other descriptor.
        # fusuma itself keeps a disk to one VM and one running QEMU (state machine,
        # move decision), which is what the lock would guard.
        lock = ",file.locking=off" if len(d.fds) > 1 else ""
        argv += ["-drive", f"file={image},format=raw,if=none,id=disk-{d.name}{ro}{lock}"]
        backends.append(f"disk-{d.name}")
    missing = [b for dev in ds.devices for b in dev.backends() if b not in backends]
    if ds.serial is not None and ds.serial not in backends:
        missing.append(ds.serial)
    if missing:
        raise DeviceSetMismatch(f"VM {cfg.name}'s recorded devices attach to "
                                f"{', '.join(missing)}, which its definition no longer "
                                "has")
    if ds.firmware is not None and ds.firmware != firmware_of(cfg):
        # The pflash devices (OVMF's) are guest-visible: a destination without them,
        # or with them for a SeaBIOS guest, cannot take the guest's state.
        raise DeviceSetMismatch(f"VM {cfg.name} booted by {ds.firmware}, and its "
                                "definition now boots by "
                                f"{firmware_of(cfg) or 'its kernel'}")
    # The guest-visible part, in the recorded order (the order fixes PCI addresses).
    if ds.serial is not None:
        argv += ["-serial", f"chardev:{ds.serial}"]
    for dev in ds.devices:
        argv += ["-device", dev.option()]
    argv += ["-pidfile", str(cfg.pidfile)]
    if cfg.template_state_fd is not None:
        fdsets.argv += ["-add-fd", f"fd={cfg.template_state_fd},set={TEMPLATE_STATE_FDSET},"
                        "opaque=template-state"]
    argv[fdsets_at:fdsets_at] = fdsets.argv
    if cfg.incoming is not None:
        # -S: a move's destination stays paused when the stream completes, until the
        # move's outcome is recorded ("forward"), so a source is never resumed after
        # its destination has run (fusuma.migration.supervisor_ops).
        argv += ["-S", "-incoming", cfg.incoming]
        if cfg.cpr_socket is not None:
            argv += ["-incoming", cpr_channel(cfg.cpr_socket)]
    return argv


def cpr_channel(path: Path) -> str:
    """The cpr channel of a cpr-transfer as ``-incoming`` takes it (QAPI
    MigrationChannel as JSON: a channel given that way can only be a UNIX socket, the
    one transport that carries descriptors)."""
    return json.dumps({"channel-type": "cpr", "addr": {
        "transport": "socket", "type": "unix", "path": str(path)}})
