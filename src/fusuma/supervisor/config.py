"""From a VM's record to its QEMU's configuration, in one partition: the devices the
guest sees and the files, sockets and disks its QEMU gets (rendered to argv by
``fusuma.qemu.cmdline``)."""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any, Protocol

from fusuma.errors import HostError, SegmentError, StateError
from fusuma.host import cgroups, storage
from fusuma.memshare import clones, reporting
from fusuma.network import addr, ifnames, link, queues
from fusuma.paths import MAX_SOCKET_PATH, Paths
from fusuma.qemu import recorded, versions
from fusuma.qemu.cmdline import (
    DeviceSet,
    DiskConfig,
    NicConfig,
    SegmentConfig,
    ThinDisk,
    Uefi,
    VmConfig,
    device_set,
    new_vmgenid,
)
from fusuma.qemu.consolelog import FIFO_NAME, LOG_NAME
from fusuma.state import Database, VmRecord


class Where(Protocol):
    """The partition a QEMU is configured for."""

    paths: Paths
    db: Database
    cg: cgroups.CgroupDriver
    partition: str


def devices(h: Where, vm: VmRecord, cfg: VmConfig, q: versions.Qemu,
            incoming: str | None) -> DeviceSet:
    """What the guest sees: for a boot, today's devices on the VM's pinned machine
    type; for a move's destination, the set recorded when the guest booted."""
    if incoming is None and clones.resumes(h.paths, vm):
        # A clone: the template's devices (fusuma.memshare.templates).
        ds = clones.clone_devices(h.db, h.partition, vm, q)
    elif incoming is not None and vm.devices:
        # A move's record may come from another host: only the devices fusuma makes
        # reach the argv (fusuma.qemu.recorded).
        try:
            ds = recorded.parse_device_set(vm.devices)
        except recorded.DeviceSetRefused as exc:
            raise StateError(f"VM {vm.name!r}: {exc}; stop and start it to record "
                             "it anew.") from exc
    else:
        # A boot, or a guest booted by a fusuma that recorded no device set: what
        # that fusuma gave it (the same devices, in the same order).
        machine = vm.machine or (versions.machine_of(h.paths, vm) if incoming
                                 else versions.default_machine(h.paths, q))
        # A boot gets a vmgenid of its own: the recorded set keeps it for moves.
        ds = device_set(replace(cfg, machine=machine,
                                vmgenid=new_vmgenid() if incoming is None else None))
        if incoming is None and ds.cpu == "max":
            # TCG's CPU, trimmed to what every installed QEMU emulates (the guest
            # must never be told of an instruction a QEMU it moves to lacks), with
            # one identity on every QEMU version (each names its max differently).
            ds = replace(ds, cpu=f"max,{versions.TCG_CPU_IDENTITY}",
                         cpu_features=versions.tcg_cpu_features(h.paths, q))
    why = versions.cannot_run(q, ds.machine)
    missing = versions.cpu_missing(q, ds.cpu_features)
    if why is None and missing:
        why = f"its TCG lacks the guest's CPU features {', '.join(missing)}"
    if why is not None:
        raise StateError(f"VM {vm.name!r} has machine type {ds.machine}, and partition "
                         f"{h.partition!r} runs QEMU {q.version}: {why}; run it in "
                         "a partition whose QEMU has it (`fusuma qemu list`).")
    return ds


def vm_config(h: Where, vm: VmRecord, accel: str, run: Path, ram_file: Path | None,
              incoming: str | None = None, disk_owner: str | None = None) -> VmConfig:
    from fusuma.images import find_image  # the image builder: only a VM's start needs it

    image = find_image(h.paths.cache, kind=vm.image) if vm.boot == "kernel" else None
    vdir = h.paths.vm_dir(vm.name)
    disks = []
    for dname in vm.disks:
        d = h.db.disk(dname)
        if d.partition != (disk_owner or h.partition):
            raise StateError(f"disk {dname!r} belongs to partition {d.partition!r}, not "
                             f"{h.partition!r}; a VM can only use its partition's disks.")
        # A disk an older fusuma registered gets its identity recorded now; a file
        # swapped since registration is refused before anything of the start is done.
        d = storage.take_over(h.paths, h.db, d)
        os.close(storage.check_registered(dname, Path(d.path), d.dev, d.ino))
        disks.append(DiskConfig(dname, Path(d.path), dev=d.dev, ino=d.ino))
    segments = []
    for item in vm.segments:
        sname, _, mount = item.partition(":")
        seg = h.db.find_segment(sname)
        if seg is None:
            raise SegmentError(f"VM {vm.name!r} needs segment {sname!r}, which does not "
                               "exist; create it with `fusuma segment create`.")
        try:
            size = Path(seg.path).stat().st_size
        except OSError as exc:
            raise SegmentError(f"segment {sname!r}: its file {seg.path} is unreadable "
                               f"({exc.strerror}); delete and re-create the segment."
                               ) from exc
        segments.append(SegmentConfig(sname, Path(seg.path), size, mount or
                                      f"/mnt/{sname}"))
    root_disk = None
    if image is not None and image.root is not None and not any(
            s.mount == "/" for s in segments):
        root_disk = image.root
    nics = nic_configs(h.db, vm)
    # Forwards of a VM with NICs are the network's (nftables DNAT: fusuma.network.nft);
    # without, QEMU's user-mode network forwards from 127.0.0.1.
    ports = [] if nics else [(f.host_port, f.guest_port)
                             for f in map(addr.parse_forward, vm.ports)]
    qmp = run / "qmp.sock"
    if len(str(qmp)) > MAX_SOCKET_PATH - 4:
        raise HostError(f"socket path {qmp} is too long for a UNIX socket; set "
                        "FUSUMA_RUNTIME_DIR to a shorter directory.")
    return VmConfig(
        name=vm.name, vcpus=vm.vcpus, memory_mib=vm.memory_mib,
        accel="kvm" if accel == "kvm" else "tcg",
        kernel=image.kernel if image else None, initrd=image.initrd if image else None,
        append=image.append if image else "",
        qmp_socket=qmp, qga_socket=run / "qga.sock", console_socket=run / "console.sock",
        console_log=vdir / LOG_NAME, console_fifo=run / FIFO_NAME, pidfile=run / "qemu.pid",
        ram_file=ram_file, disks=disks, incoming=incoming, segments=segments,
        mergeable=vm.mergeable, ports=ports, bind_ports=incoming is None,
        page_reporting=reporting.wanted(vm, h.cg),
        root_disk=root_disk, nics=nics, **firmware_boot(h, vm))


def firmware_boot(h: Where, vm: VmRecord) -> dict[str, Any]:
    """A firmware boot's part of the config: the thin disk on its image, OVMF and the
    VM's NVRAM for UEFI, the cloud-init seed (none for a kernel boot)."""
    if vm.boot == "kernel":
        return {}
    from fusuma.images import layers, store
    from fusuma.memshare import templates
    from fusuma.qemu import firmware

    base = h.db.imported(vm.image)
    why = store.verify(base)
    if why is not None:
        raise StateError(f"VM {vm.name!r}: its image {base.name!r}: {why}; it cannot "
                         "start on a base that changed.")
    # A template's clone: its overlay is on the template's disk layer, on the base.
    layer = None if vm.template is None else \
        layers.layer_path(templates.template_dir(h.paths, vm.template))
    out: dict[str, Any] = {
        "thin_disk": ThinDisk(store.disk_path(h.paths, vm.name), Path(base.path),
                              base.format, layer=layer),
        "seed": store.seed_path(h.paths, vm.name)}
    if vm.boot == "uefi":
        code, _ = firmware.ovmf()
        out["uefi"] = Uefi(code, store.nvram_path(h.paths, vm.name))
    return out


def nic_configs(db: Database, vm: VmRecord) -> list[NicConfig]:
    """The NICs of ``vm`` as its QEMU gets them (the taps are opened at launch)."""
    out = []
    for n in db.nics(vm=vm.name):
        net = db.network(n.network)
        out.append(NicConfig(id=f"nic{n.index}", mac=n.mac,
                             queues=link.queues_for(vm.vcpus),
                             tap=ifnames.tap_name(vm.slot, n.index), bridge=net.bridge,
                             network=net.name))
    return out


def open_taps(cfg: VmConfig, uid: int, add: Callable[[int], int]) -> VmConfig:
    """Make each NIC's tap (owned by the QEMU's ``uid``, a port of its network's bridge)
    and give its descriptors to ``add`` (the QEMU's files, closed by the supervisor
    once QEMU has them: a tap then lives exactly as long as the QEMU)."""
    nics = []
    for nic in cfg.nics:
        if not link.is_bridge(nic.bridge):
            raise StateError(f"VM {cfg.name!r}: network {nic.network}'s bridge "
                             f"{nic.bridge} does not exist; bring it back with `fusuma up` "
                             f"or `fusuma network restart {nic.network}`.")
        fds = link.open_tap(nic.tap, nic.queues, uid, nic.bridge)
        nics.append(replace(nic, fds=tuple(add(fd) for fd in fds)))
    return replace(cfg, nics=nics)


def join_taps(cfg: VmConfig, add: Callable[[int], int]) -> tuple[VmConfig, dict[str, int]]:
    """A move's destination on this host: queues of each NIC's tap, which the VM's
    running QEMU holds (``link.join_tap``), to ``add``; and each tap's virtio-net
    header size now (the running QEMU's), which the new QEMU's start changes
    (``fusuma.network.queues.restore_header`` puts it back)."""
    nics, sizes = [], {}
    for nic in cfg.nics:
        fds = link.join_tap(nic.tap, nic.queues, nic.bridge)
        sizes[nic.tap] = queues.header_size(fds[0])
        nics.append(replace(nic, fds=tuple(add(fd) for fd in fds)))
    return replace(cfg, nics=nics), sizes
