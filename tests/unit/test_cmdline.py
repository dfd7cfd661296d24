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


def test_debian_root_disk_is_readonly_with_a_known_serial() -> None:
    argv = build_argv(cfg(root_disk=Path("/c/root.erofs")))
    assert opt(argv, "-drive") == [
        "file=/c/root.erofs,format=raw,if=none,id=disk-fusuma-root,readonly=on"]
    assert "virtio-blk-pci,drive=disk-fusuma-root,serial=fusuma-root" in opt(argv, "-device")


def test_seccomp_sandbox_denies_privileges_spawn_and_resource_control() -> None:
    argv = build_argv(cfg())
    assert opt(argv, "-sandbox") == [
        "on,obsolete=deny,elevateprivileges=deny,spawn=deny,resourcecontrol=deny"]
    # Privileges are dropped before exec, never by QEMU itself.
    assert "-runas" not in argv


def test_files_opened_for_qemu_are_named_by_fd() -> None:
    c = cfg(ram_fd=10, kernel_fd=11, initrd_fd=12, console_log_fd=13,
            disks=[DiskConfig("d0", Path("/d0.img"), fds=(14, 15)),
                   DiskConfig("ro", Path("/ro.img"), readonly=True, fds=(16,))],
            segments=[SegmentConfig("usr", Path("/h/s.erofs"), 2**21, "/usr", fd=17)],
            root_disk=Path("/c/root.erofs"), root_disk_fd=18)
    argv = build_argv(c)
    # Plain open() in QEMU: the inherited fd's magic link.
    objects = opt(argv, "-object")
    assert objects[0] == ("memory-backend-file,id=ram0,size=256M,mem-path=/proc/self/fd/10,"
                          "share=on,merge=off")
    assert objects[1].startswith("memory-backend-file,id=seg-usr,mem-path=/proc/self/fd/17,")
    assert opt(argv, "-kernel") == ["/proc/self/fd/11"]
    assert opt(argv, "-initrd") == ["/proc/self/fd/12"]
    # qemu_open(): fdsets, numbered in argv order; a read-write disk offers both modes.
    assert opt(argv, "-add-fd") == ["fd=13,set=1,opaque=console-log",
                                    "fd=18,set=2,opaque=disk-fusuma-root",
                                    "fd=14,set=3,opaque=disk-d0", "fd=15,set=3,opaque=disk-d0",
                                    "fd=16,set=4,opaque=disk-ro"]
    assert any("logfile=/dev/fdset/1,logappend=on" in c for c in opt(argv, "-chardev"))
    assert opt(argv, "-drive") == [
        "file=/dev/fdset/2,format=raw,if=none,id=disk-fusuma-root,readonly=on",
        "file=/dev/fdset/3,format=raw,if=none,id=disk-d0,file.locking=off",
        "file=/dev/fdset/4,format=raw,if=none,id=disk-ro,readonly=on"]
    # The -add-fd options come before any user of their sets.
    assert argv.index("-add-fd") < argv.index("-chardev")
    assert sorted(c.passed_fds()) == list(range(10, 19))
    # Sockets and the pidfile stay paths in the run dir (process.is_vm_process).
    assert "socket,id=qmp0,path=/r/qmp.sock,server=on,wait=off" in opt(argv, "-chardev")
    assert opt(argv, "-pidfile") == ["/r/qemu.pid"]


def test_no_fds_means_no_fdsets() -> None:
    argv = build_argv(cfg())
    assert "-add-fd" not in argv
    assert cfg().passed_fds() == []
