"""The rendered QEMU argv, tested as data without starting QEMU."""

from __future__ import annotations

from pathlib import Path

from fusuma.qemu.cmdline import (
    DiskConfig,
    SegmentConfig,
    VmConfig,
    build_argv,
    overhead_mib,
)


def cfg(**kw: object) -> VmConfig:
    base: dict[str, object] = dict(
        name="vm0", vcpus=2, memory_mib=256, accel="tcg", kernel=Path("/k"),
        initrd=Path("/i"), append="console=ttyS0", qmp_socket=Path("/r/qmp.sock"),
        qga_socket=Path("/r/qga.sock"), console_socket=Path("/r/console.sock"),
        console_log=Path("/h/console.log"), pidfile=Path("/r/qemu.pid"),
        ram_file=Path("/dev/shm/fusuma/vm0.ram"))
    base.update(kw)
    return VmConfig(**base)  # type: ignore[arg-type]


def opt(argv: list[str], flag: str) -> list[str]:
    return [argv[i + 1] for i, a in enumerate(argv) if a == flag]


def test_shared_file_ram_and_tcg() -> None:
    argv = build_argv(cfg())
    assert argv[0] == "qemu-system-x86_64"
    assert opt(argv, "-accel") == ["tcg,tb-size=32"]
    assert opt(argv, "-machine") == [
        "q35,sata=off,smbus=off,vmport=off,i8042=off,memory-backend=ram0"]
    assert opt(argv, "-smp") == ["2"] and opt(argv, "-m") == ["256M"]
    assert opt(argv, "-object") == [
        "memory-backend-file,id=ram0,size=256M,mem-path=/dev/shm/fusuma/vm0.ram,share=on,"
        "merge=off"]
    assert opt(argv, "-append") == ["console=ttyS0 fusuma.name=vm0"]
    assert "guest=vm0,debug-threads=on" in argv
    assert "-nodefaults" in argv and opt(argv, "-pidfile") == ["/r/qemu.pid"]
    assert "-incoming" not in argv


def test_kvm_private_ram_disks_incoming() -> None:
    argv = build_argv(cfg(accel="kvm", ram_file=None, incoming="defer",
                          disks=[DiskConfig("d0", Path("/d0.img")),
                                 DiskConfig("seg", Path("/s.img"), readonly=True)]),
                      "/opt/qemu/bin/qemu-system-x86_64")
    assert argv[0] == "/opt/qemu/bin/qemu-system-x86_64"
    assert opt(argv, "-accel") == ["kvm"] and opt(argv, "-cpu") == ["host"]
    assert opt(argv, "-object") == ["memory-backend-ram,id=ram0,size=256M,merge=off"]
    assert opt(argv, "-drive") == ["file=/d0.img,format=raw,if=none,id=disk-d0",
                                   "file=/s.img,format=raw,if=none,id=disk-seg,readonly=on"]
    assert "virtio-blk-pci,drive=disk-d0,serial=d0" in opt(argv, "-device")
    assert opt(argv, "-incoming") == ["defer"]


def test_sockets_and_agent_port() -> None:
    argv = build_argv(cfg())
    chardevs = opt(argv, "-chardev")
    assert "socket,id=qmp0,path=/r/qmp.sock,server=on,wait=off" in chardevs
    assert "socket,id=qga0,path=/r/qga.sock,server=on,wait=off" in chardevs
    assert any(c.startswith("socket,id=con0,path=/r/console.sock") and
               "logfile=/h/console.log" in c for c in chardevs)
    assert "virtserialport,bus=vser0.0,chardev=qga0,name=org.qemu.guest_agent.0" in opt(
        argv, "-device")
    assert opt(argv, "-mon") == ["chardev=qmp0,mode=control"]


def test_overhead_is_larger_under_tcg() -> None:
    assert overhead_mib("tcg") > overhead_mib("kvm") > 0


def test_mergeable_private_ram() -> None:
    argv = build_argv(cfg(ram_file=None, mergeable=True))
    assert opt(argv, "-object") == ["memory-backend-ram,id=ram0,size=256M,merge=on"]


def test_segments_are_readonly_shared_pmem_with_device_memory() -> None:
    seg = [SegmentConfig("usr", Path("/h/segments/usr.erofs"), 4 * 2**20, "/usr"),
           SegmentConfig("tools", Path("/h/segments/tools.erofs"), 2 * 2**20, "/mnt/tools")]
    argv = build_argv(cfg(segments=seg))
    assert opt(argv, "-m") == [f"256M,slots=2,maxmem={(256 + 6) * 2**20}"]
    objects = opt(argv, "-object")
    assert "memory-backend-file,id=seg-usr,mem-path=/h/segments/usr.erofs,size=4194304," \
           "share=on,readonly=on,merge=off" in objects
    devices = opt(argv, "-device")
    pmem = [d for d in devices if d.startswith("virtio-pmem-pci")]
    # the guest numbers pmem devices in this order, which fusuma.seg= follows
    assert pmem == ["virtio-pmem-pci,memdev=seg-usr,id=pmem-usr",
                    "virtio-pmem-pci,memdev=seg-tools,id=pmem-tools"]
    append = opt(argv, "-append")[0]
    assert append.endswith("fusuma.seg=usr:/usr fusuma.seg=tools:/mnt/tools "
                           "swiotlb=noforce")


def test_ports_bound_at_start_but_not_on_a_migration_destination() -> None:
    argv = build_argv(cfg(ports=[(8080, 80), (2222, 22)]))
    assert opt(argv, "-netdev") == ["user,id=net0,hostfwd=tcp:127.0.0.1:8080-:80,"
                                    "hostfwd=tcp:127.0.0.1:2222-:22"]
    assert "virtio-net-pci,netdev=net0,romfile=" in opt(argv, "-device")
    dest = build_argv(cfg(ports=[(8080, 80)], bind_ports=False, incoming="defer"))
    assert opt(dest, "-netdev") == ["user,id=net0"]
    assert "-netdev" not in build_argv(cfg())


def test_debian_usr_disk_is_readonly_with_a_known_serial() -> None:
    argv = build_argv(cfg(usr_disk=Path("/c/usr.erofs")))
    assert opt(argv, "-drive") == [
        "file=/c/usr.erofs,format=raw,if=none,id=disk-fusuma-usr,readonly=on"]
    assert "virtio-blk-pci,drive=disk-fusuma-usr,serial=fusuma-usr" in opt(argv, "-device")
