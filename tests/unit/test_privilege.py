"""Per-VM uids, directory modes and the files opened for an unprivileged QEMU."""

from __future__ import annotations

import fcntl
import gc
import os
import shutil
import stat
import tempfile
from pathlib import Path

import pytest

from fusuma.errors import HostError, StateError
from fusuma.paths import DEFAULT_UID_BASE, Paths, ensure_dir
from fusuma.qemu import privilege
from fusuma.qemu.cmdline import DiskConfig, SegmentConfig, VmConfig, build_argv
from fusuma.state import VmRecord
from tests.opens import watch_opens

ROOT = os.geteuid() == 0


def paths(tmp: Path, uid_base: int = DEFAULT_UID_BASE) -> Paths:
    return Paths(home=tmp / "home", runtime=tmp / "run", shm=tmp / "shm", cache=tmp / "c",
                 cgroup_prefix="t", uid_base=uid_base)


def rec(uid: int, name: str = "vm0") -> VmRecord:
    return VmRecord(name=name, partition="p0", vcpus=1, memory_mib=256, uid=uid)


def mode(p: Path) -> int:
    return stat.S_IMODE(p.lstat().st_mode)


def test_uid_is_the_one_the_record_holds(tmp_path: Path) -> None:
    p = paths(tmp_path)
    assert privilege.uid_for(p, rec(DEFAULT_UID_BASE + 1)) == 0x7000_0001
    assert privilege.uid_for(p, rec(1_500_000_007, "vm1")) == 1_500_000_007   # legacy
    with pytest.raises(StateError, match="has no uid yet"):
        privilege.uid_for(paths(tmp_path), rec(0))


def test_uid_base_from_env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("FUSUMA_UID_BASE", raising=False)
    assert Paths.from_env().uid_base == DEFAULT_UID_BASE
    monkeypatch.setenv("FUSUMA_UID_BASE", "3000000")
    p = Paths.from_env()
    assert p.uid_base == 3_000_000 and p.as_env()["FUSUMA_UID_BASE"] == "3000000"
    for bad in ("x", "0", str(2**32 - 2)):
        monkeypatch.setenv("FUSUMA_UID_BASE", bad)
        with pytest.raises(HostError, match="FUSUMA_UID_BASE"):
            Paths.from_env()


def test_groups_only_for_kvm() -> None:
    assert privilege.groups_for("tcg") == []
    assert privilege.groups_for("kvm", kvm_group="no-such-group-fusuma") == []


def test_kvm_device_must_be_open_to_the_group(tmp_path: Path) -> None:
    dev = tmp_path / "kvm"
    dev.touch()
    gid = dev.stat().st_gid
    dev.chmod(0o600)
    with pytest.raises(HostError, match="give it to group kvm with mode 0660"):
        privilege.check_kvm_access([gid], dev)
    dev.chmod(0o660)
    privilege.check_kvm_access([gid], dev)
    with pytest.raises(HostError):
        privilege.check_kvm_access([], dev)
    dev.chmod(0o666)
    privilege.check_kvm_access([], dev)


def test_ensure_dir_creates_and_fixes_modes(tmp_path: Path) -> None:
    old = os.umask(0o077)
    try:
        d = ensure_dir(tmp_path / "a" / "b", 0o711)
        assert mode(d) == 0o711
        d.chmod(0o755)
        ensure_dir(d, 0o711)
        assert mode(d) == 0o711
        ensure_dir(d, 0o700)
        assert mode(d) == 0o700
    finally:
        os.umask(old)


def test_ensure_dir_refuses_a_symlink(tmp_path: Path) -> None:
    target = tmp_path / "elsewhere"
    target.mkdir(mode=0o755)
    (tmp_path / "link").symlink_to(target)
    with pytest.raises(HostError, match="must be a directory, not a symlink"):
        ensure_dir(tmp_path / "link", 0o700, owner=os.geteuid())
    assert mode(target) == 0o755


@pytest.mark.skipif(not ROOT, reason="chown to another uid needs root")
def test_ensure_dir_gives_the_dir_to_its_owner(tmp_path: Path) -> None:
    d = ensure_dir(tmp_path / "run" / "vm0", 0o700, owner=1_500_000_001)
    st = d.stat()
    assert (st.st_uid, st.st_gid, mode(d)) == (1_500_000_001, 1_500_000_001, 0o700)


def test_runtime_dirs_are_passable_not_listable(tmp_path: Path) -> None:
    # pytest's tmp_path sits below 0700 directories: refused with the fix named.
    with pytest.raises(HostError, match="which other users cannot pass"):
        paths(tmp_path).ensure_runtime()
    top = Path(tempfile.mkdtemp(prefix="fusuma-unit-", dir="/tmp"))
    try:
        top.chmod(0o711)
        p = paths(top / "missing" / "parents")
        p.ensure_runtime()
        assert [mode(d) for d in (p.runtime, p.runtime / "vms", p.runtime / "partitions")] \
            == [0o711] * 3
        # The parents fusuma had to make are passable too (umask 077 would make 0700).
        assert mode(top / "missing") == 0o711
    finally:
        shutil.rmtree(top, ignore_errors=True)


def test_ram_file_is_new_private_and_owned_by_the_vm(tmp_path: Path) -> None:
    uid = 1_500_000_003 if ROOT else os.geteuid()
    ram = tmp_path / "vm0.ram"
    privilege.create_ram_file(ram, uid)
    st = ram.stat()
    assert (st.st_uid, mode(ram), st.st_size) == (uid, 0o600, 0)
    assert st.st_gid == uid or not ROOT
    with pytest.raises(HostError, match="already exists, so another QEMU may still map"):
        privilege.create_ram_file(ram, uid)       # never two owners of one file
    with pytest.raises(HostError, match=r"cannot open the RAM file .*gone"):
        privilege.open_ram_file(tmp_path / "gone", uid, create=False)
    ram.chmod(0o644)
    fd = privilege.open_ram_file(ram, uid, create=False)
    try:
        assert fcntl.fcntl(fd, fcntl.F_GETFL) & os.O_ACCMODE == os.O_RDWR
        assert mode(ram) == 0o600, "an existing RAM file's mode is fixed"
    finally:
        os.close(fd)
    (tmp_path / "link.ram").symlink_to(ram)
    with pytest.raises(HostError):
        privilege.open_ram_file(tmp_path / "link.ram", uid, create=False)


def cfg(tmp: Path, **kw: object) -> VmConfig:
    for name in ("vmlinuz", "initrd.img", "d0.img", "seg.erofs"):
        (tmp / name).write_bytes(b"x" * 4096)
    d0 = (tmp / "d0.img").stat()
    base: dict[str, object] = dict(
        name="vm0", vcpus=1, memory_mib=256, accel="tcg", kernel=tmp / "vmlinuz",
        initrd=tmp / "initrd.img", append="console=ttyS0", qmp_socket=tmp / "qmp.sock",
        qga_socket=tmp / "qga.sock", console_socket=tmp / "console.sock",
        console_log=tmp / "console.log", pidfile=tmp / "qemu.pid",
        ram_file=tmp / "vm0.ram",
        disks=[DiskConfig("d0", tmp / "d0.img", dev=d0.st_dev, ino=d0.st_ino)],
        segments=[SegmentConfig("s", tmp / "seg.erofs", 4096, "/mnt/s")])
    base.update(kw)
    return VmConfig(**base)  # type: ignore[arg-type]


def open_fds() -> set[int]:
    gc.collect()    # an fd an unrelated dead object still holds closes now, not mid-test
    return {int(n) for n in os.listdir("/proc/self/fd")}


def test_open_for_qemu_passes_every_file_as_an_fd(tmp_path: Path) -> None:
    old = os.umask(0o077)
    try:
        c = cfg(tmp_path)
        (tmp_path / "vmlinuz").chmod(0o600)          # built under umask 077
        before = open_fds()
        opened, files = privilege.open_for_qemu(c, os.geteuid(), new_ram=True)
        with files:
            fds = opened.passed_fds()
            assert sorted(fds) == sorted(files.fds) and len(fds) == 7
            for fd in fds:
                assert os.get_inheritable(fd) is False   # only QEMU gets them (pass_fds)
            flags = {fd: fcntl.fcntl(fd, fcntl.F_GETFL) for fd in fds}
            assert flags[opened.ram_fd] & os.O_ACCMODE == os.O_RDWR  # type: ignore[index]
            rw, ro = opened.disks[0].fds
            assert (flags[rw] & os.O_ACCMODE, flags[ro] & os.O_ACCMODE) == (os.O_RDWR,
                                                                            os.O_RDONLY)
            log = flags[opened.console_log_fd]  # type: ignore[index]
            assert log & os.O_ACCMODE == os.O_WRONLY and log & os.O_APPEND
            assert mode(tmp_path / "console.log") == 0o600
            assert mode(tmp_path / "vmlinuz") == 0o644, "kernel made readable for QEMU"
            argv = build_argv(opened)
            assert f"/proc/self/fd/{opened.kernel_fd}" in argv
        assert open_fds() == before
    finally:
        os.umask(old)


def test_open_for_qemu_leaves_nothing_open_on_failure(tmp_path: Path) -> None:
    c = cfg(tmp_path, disks=[DiskConfig("d0", tmp_path / "missing.img", dev=1, ino=2)])
    before = open_fds()
    with pytest.raises(HostError, match="disk 'd0': cannot open"):
        privilege.open_for_qemu(c, os.geteuid(), new_ram=True)
    assert open_fds() == before


@pytest.mark.parametrize("swap", ["symlink", "other file"])
def test_a_disk_swapped_after_registration_is_not_opened(tmp_path: Path, swap: str) -> None:
    """The registered d0.img is replaced by a symlink to another file, or by another
    file: refused with one sentence, and the file it now names was never opened
    (inotify sees no open of it) and no descriptor is left."""
    c = cfg(tmp_path)
    target = tmp_path / "host-secret"
    target.write_bytes(b"secret")
    # Kept aside, so that the new file cannot get its inode number again.
    (tmp_path / "d0.img").rename(tmp_path / "d0.orig")
    if swap == "symlink":
        (tmp_path / "d0.img").symlink_to(target)
    else:
        target = tmp_path / "d0.img"
        target.write_bytes(b"y" * 4096)
    before = open_fds()
    with watch_opens(target) as opens:
        with pytest.raises(HostError) as err:
            privilege.open_for_qemu(c, os.geteuid(), new_ram=True)
        assert opens.count() == 0, "the file the disk's path names now was opened"
    said = str(err.value)
    assert said.startswith("disk 'd0': ") and said.count(". ") == 0, said
    assert ("symbolic link" if swap == "symlink" else "another file") in said
    assert open_fds() == before
    with watch_opens(target) as opens:    # the watch sees an open (it can fail)
        target.open("rb").close()
        assert opens.count() == 1


def test_destination_never_creates_the_ram_file(tmp_path: Path) -> None:
    with pytest.raises(HostError, match="cannot open the RAM file"):
        privilege.open_for_qemu(cfg(tmp_path), os.geteuid(), new_ram=False)
    assert not (tmp_path / "vm0.ram").exists()


@pytest.mark.skipif(not ROOT, reason="changing uid needs root")
def test_drop_to_changes_every_id_for_good() -> None:
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            privilege.drop_to(1_500_000_009, [])
            ok = (os.getresuid() == (1_500_000_009,) * 3
                  and os.getresgid() == (1_500_000_009,) * 3 and os.getgroups() == [])
            try:
                os.setuid(0)
            except PermissionError:
                code = 0 if ok else 1
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
