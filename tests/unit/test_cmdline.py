"""The rendered QEMU argv, tested as data without starting QEMU."""

from __future__ import annotations

from pathlib import Path

from fusuma.qemu.cmdline import DiskConfig, VmConfig, build_argv, overhead_mib


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
    assert opt(argv, "-accel") == ["tcg,tb-size=128"]
    assert opt(argv, "-machine") == ["q35,memory-backend=ram0"]
    assert opt(argv, "-smp") == ["2"] and opt(argv, "-m") == ["256M"]
    assert opt(argv, "-object") == [
        "memory-backend-file,id=ram0,size=256M,mem-path=/dev/shm/fusuma/vm0.ram,share=on"]
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
    assert opt(argv, "-object") == ["memory-backend-ram,id=ram0,size=256M"]
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
