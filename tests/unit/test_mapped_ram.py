"""The check that a RAM file is still mapped counts only this namespace's QEMUs, by
exact path and inode, in a fake /proc tree: impostors whose command line says
``debug-threads=on`` (or copies a whole QEMU argv) cannot keep a RAM file alive, and
a path that merely ends like it is not it."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from fusuma.paths import Paths
from fusuma.qemu import process

BASE = 1_600_000_000


def fake_paths(tmp: Path) -> Paths:
    return Paths(home=tmp / "home", runtime=tmp / "run", shm=tmp / "shm",
                 cache=tmp / "cache", cgroup_prefix="t", uid_base=BASE)


class Proc:
    """A fake /proc: one dir per pid with cmdline, status (Uid line) and maps."""

    def __init__(self, root: Path) -> None:
        self.root = root
        root.mkdir()

    def add(self, pid: int, argv: list[str], uid: int, maps: list[str]) -> None:
        d = self.root / str(pid)
        d.mkdir()
        (d / "cmdline").write_bytes(b"\0".join(a.encode() for a in argv) + b"\0")
        (d / "status").write_text(f"Name:\tx\nUid:\t{uid}\t{uid}\t{uid}\t{uid}\n")
        (d / "maps").write_text("".join(m + "\n" for m in maps))


def qemu_argv(paths: Paths, vm: str) -> list[str]:
    run = paths.vm_run_dir(vm)
    return ["qemu-system-x86_64", "-name", f"guest={vm},debug-threads=on", "-chardev",
            f"socket,id=qmp0,path={run}/qmp.sock,server=on,wait=off"]


def line(path: str, inode: int, deleted: bool = False) -> str:
    return (f"7f0000000000-7f0010000000 rw-s 00000000 00:1a {inode}"
            f"                     {path}{' (deleted)' if deleted else ''}")


@pytest.fixture
def world(tmp_path: Path) -> tuple[Paths, Proc, Path, int]:
    paths = fake_paths(tmp_path)
    paths.shm.mkdir()
    ram = paths.shm / "v.ram"
    ram.write_bytes(b"\0" * 4096)
    return paths, Proc(tmp_path / "proc"), ram, os.stat(ram).st_ino


def test_only_this_namespaces_qemus_by_exact_path(world: tuple[Paths, Proc, Path, int],
                                                  tmp_path: Path) -> None:
    paths, proc, ram, ino = world
    other = fake_paths(tmp_path / "elsewhere")
    # The VM's own QEMU (its uid), and a move's other QEMU running as root (older).
    proc.add(101, qemu_argv(paths, "v"), BASE + 1, [line(str(ram), ino)])
    proc.add(102, qemu_argv(paths, "w"), 0, [line(str(ram), ino)])
    # A local user: "debug-threads=on" in its argv and a path ending like the RAM file.
    proc.add(201, ["python3", "-c", "x", "guest=v,debug-threads=on"], 1000,
             [line(f"/home/evil{ram}", 77)])
    # A local user who copies the whole argv and maps a file of that very path
    # (it cannot open root's file; the fake tree says it anyway): wrong uid.
    proc.add(202, qemu_argv(paths, "v"), 1000, [line(str(ram), ino)])
    # A uid just outside the namespace's range.
    proc.add(203, qemu_argv(paths, "v"), BASE + 65536, [line(str(ram), ino)])
    # A QEMU of another namespace (its sockets in another runtime dir).
    proc.add(204, qemu_argv(other, "v"), BASE + 1, [line(str(ram), ino)])
    # Ours, but mapping a longer name, a file of that path that is not this one any
    # more (another inode), and a root process that is no QEMU at all.
    proc.add(301, qemu_argv(paths, "v"), BASE + 1, [line(f"{ram}.old", ino)])
    proc.add(302, qemu_argv(paths, "v"), BASE + 1, [line(str(ram), ino + 1, deleted=True)])
    proc.add(303, ["cat"], 0, [line(str(ram), ino)])
    # Two -name options: not a command line fusuma wrote.
    proc.add(304, [*qemu_argv(paths, "v"), "-name", "guest=x,debug-threads=on"],
             BASE + 1, [line(str(ram), ino)])
    assert process.qemu_vm(101, paths, proc.root) == "v"
    assert process.qemu_vm(201, paths, proc.root) is None
    assert process.mapped_by(ram, paths, proc.root) == [101, 102]


def test_impostors_cannot_keep_a_ram_file(world: tuple[Paths, Proc, Path, int]) -> None:
    paths, proc, ram, ino = world
    proc.add(201, ["python3", "-c", "x", "guest=v,debug-threads=on"], 1000,
             [line(f"/tmp/x{ram}", 77), line(str(ram), ino)])
    proc.add(202, qemu_argv(paths, "v"), 1000, [line(str(ram), ino)])
    assert process.remove_unmapped(ram, paths, proc.root) is True
    assert not ram.exists()


def test_a_qemu_of_ours_keeps_it(world: tuple[Paths, Proc, Path, int]) -> None:
    paths, proc, ram, ino = world
    proc.add(101, qemu_argv(paths, "v"), BASE + 3, [line(str(ram), ino)])
    assert process.remove_unmapped(ram, paths, proc.root) is False
    assert ram.exists()
    # Once it has gone, the file goes.
    (proc.root / "101" / "maps").write_text("")
    assert process.remove_unmapped(ram, paths, proc.root) is True
