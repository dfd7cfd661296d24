"""Unit tests for fusuma.host.cgroups: both drivers against a fake cgroupfs in tmp_path.

The fake imitates the two kernel behaviours the drivers depend on: ``mkdir`` makes the
control files appear (copied from a per-hierarchy template) and ``rmdir`` refuses a
cgroup that still has children. Plain files stand in for control files, so a write is
seen as the file's content afterwards, and every write is also recorded in order.
"""

from __future__ import annotations

import logging
import os
import shutil
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from fusuma.errors import CgroupError, HostError, SpecError
from fusuma.host.cgroups import (
    CgroupDriver,
    Limits,
    check_name,
    detect,
    parse_mountinfo,
)
from fusuma.host.cgroups.v1 import CgroupV1Driver
from fusuma.host.cgroups.v2 import CgroupV2Driver

MIB = 1024 * 1024

V1_ROOT: dict[str, dict[str, str]] = {
    "cpuset": {"cgroup.procs": "1\n", "cpuset.cpus": "0-3\n", "cpuset.mems": "0\n",
               "cpuset.cpu_exclusive": "1\n", "cpuset.effective_cpus": "0-3\n"},
    "cpu,cpuacct": {"cgroup.procs": "1\n", "cpu.shares": "1024\n"},
    "memory": {"cgroup.procs": "1\n", "memory.limit_in_bytes": "9223372036854771712\n",
               "memory.usage_in_bytes": "999\n"},
    "blkio": {"cgroup.procs": "1\n"},
}
V1_CHILD: dict[str, dict[str, str]] = {
    "cpuset": {"cgroup.procs": "", "cpuset.cpus": "", "cpuset.mems": "",
               "cpuset.cpu_exclusive": "0\n", "cpuset.effective_cpus": ""},
    "cpu,cpuacct": {"cgroup.procs": "", "cpu.shares": "1024\n"},
    "memory": {"cgroup.procs": "", "memory.limit_in_bytes": "9223372036854771712\n",
               "memory.usage_in_bytes": "0\n"},
    "blkio": {"cgroup.procs": "", "blkio.bfq.weight": "100\n"},
}
V2_ROOT = {"cgroup.controllers": "cpuset cpu io memory hugetlb pids\n",
           "cgroup.subtree_control": "", "cgroup.procs": "1\n",
           "cpuset.cpus.effective": "0-3\n", "cpuset.mems.effective": "0\n"}
V2_CHILD = {"cgroup.controllers": "cpuset cpu io memory\n", "cgroup.subtree_control": "",
            "cgroup.procs": "", "cpuset.cpus": "", "cpuset.mems": "",
            "cpuset.cpus.effective": "0-3\n", "cpuset.mems.effective": "0\n",
            "cpuset.cpus.exclusive": "", "memory.max": "max\n", "memory.current": "4096\n",
            "io.weight": "default 100\n"}


@dataclass
class FakeCgroupFs:
    """Mount points with template control files; records every write the driver makes."""

    templates: dict[Path, dict[str, str]]
    writes: list[tuple[Path, str]] = field(default_factory=list)

    def _template(self, path: Path) -> dict[str, str]:
        for mount, files in self.templates.items():
            if path.is_relative_to(mount):
                return files
        raise AssertionError(f"{path} is outside every fake mount")

    def make_dir(self, path: Path) -> None:
        os.mkdir(path)
        for name, content in self._template(path).items():
            (path / name).write_text(content)

    def remove_dir(self, path: Path) -> None:
        if not path.exists():
            return
        if any(p.is_dir() for p in path.iterdir()):
            raise OSError(16, "Device or resource busy")
        shutil.rmtree(path)

    def install(self, driver: CgroupDriver, monkeypatch: pytest.MonkeyPatch) -> None:
        monkeypatch.setattr(driver, "_make_dir", self.make_dir)
        monkeypatch.setattr(driver, "_remove_dir", self.remove_dir)
        real_write = driver._write

        def recording_write(path: Path, value: str) -> None:
            real_write(path, value)
            self.writes.append((path, value))

        monkeypatch.setattr(driver, "_write", recording_write)


def read(path: Path) -> str:
    return path.read_text().strip()


def make_v1(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, *, exclusive: bool = True,
            child: dict[str, dict[str, str]] | None = None,
            with_blkio: bool = True) -> tuple[CgroupV1Driver, FakeCgroupFs, Path]:
    base = tmp_path / "cgroup"
    children = child or V1_CHILD
    templates: dict[Path, dict[str, str]] = {}
    mounts: dict[str, Path] = {}
    for name, files in V1_ROOT.items():
        if name == "blkio" and not with_blkio:
            continue
        mount = base / name
        mount.mkdir(parents=True)
        for fname, content in files.items():
            (mount / fname).write_text(content)
        templates[mount] = children[name]
        for ctrl in name.split(","):
            mounts[ctrl] = mount
    fake = FakeCgroupFs(templates)
    driver = CgroupV1Driver(mounts, "fusuma", exclusive=exclusive)
    fake.install(driver, monkeypatch)
    return driver, fake, base


def make_v2(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, *,
            child: dict[str, str] | None = None,
            prefix: str = "fusuma") -> tuple[CgroupV2Driver, FakeCgroupFs, Path]:
    mount = tmp_path / "unified"
    mount.mkdir()
    for fname, content in V2_ROOT.items():
        (mount / fname).write_text(content)
    fake = FakeCgroupFs({mount: child or V2_CHILD})
    driver = CgroupV2Driver(mount, prefix)
    fake.install(driver, monkeypatch)
    return driver, fake, mount


LIMITS = Limits(cpus=[1, 2], mems=[0], memory_bytes=256 * MIB, io_weight=300)


# -- Limits and names --------------------------------------------------------------------


@pytest.mark.parametrize(
    "kwargs",
    [
        {"cpus": [], "mems": [0], "memory_bytes": MIB},
        {"cpus": [0], "mems": [], "memory_bytes": MIB},
        {"cpus": [0], "mems": [0], "memory_bytes": 0},
        {"cpus": [0], "mems": [0], "memory_bytes": MIB, "io_weight": 0},
        {"cpus": [0], "mems": [0], "memory_bytes": MIB, "io_weight": 10001},
    ],
)
def test_limits_reject_impossible_values(kwargs: dict[str, object]) -> None:
    with pytest.raises(SpecError):
        Limits(**kwargs)  # type: ignore[arg-type]


@pytest.mark.parametrize("name", ["", ".", "..", "a/b", ".hidden", "-x", "a b", "x" * 129])
def test_bad_names_are_refused(name: str) -> None:
    with pytest.raises(SpecError):
        check_name("partition", name)


@pytest.mark.parametrize("name", ["p0", "vm.web-1", "supervisor", "a_b:c"])
def test_good_names_pass(name: str) -> None:
    check_name("leaf", name)


# -- v1 ----------------------------------------------------------------------------------


def test_v1_ensure_parent_gives_all_cpus_and_is_idempotent(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    driver, fake, base = make_v1(tmp_path, monkeypatch)
    driver.ensure_parent()
    parent = base / "cpuset" / "fusuma"
    assert read(parent / "cpuset.cpus") == "0-3"
    assert read(parent / "cpuset.mems") == "0"
    assert read(parent / "cpuset.cpu_exclusive") == "1"
    for name in ("cpu,cpuacct", "memory", "blkio"):
        assert (base / name / "fusuma").is_dir()
    fake.writes.clear()
    driver.ensure_parent()
    assert fake.writes == []


def test_v1_create_writes_limits(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    driver, _fake, base = make_v1(tmp_path, monkeypatch)
    driver.create("p0", Limits(cpus=[1, 2], mems=[0], memory_bytes=256 * MIB, io_weight=5000))
    cs = base / "cpuset/fusuma/p0"
    assert read(cs / "cpuset.cpus") == "1-2"
    assert read(cs / "cpuset.mems") == "0"
    assert read(cs / "cpuset.cpu_exclusive") == "1"
    assert read(base / "memory/fusuma/p0/memory.limit_in_bytes") == str(256 * MIB)
    # BFQ's weight scale stops at 1000.
    assert read(base / "blkio/fusuma/p0/blkio.bfq.weight") == "1000"
    assert (base / "cpu,cpuacct/fusuma/p0").is_dir()
    assert driver.exists("p0")
    assert driver.groups() == ["p0"]
    assert driver.version == 1


def test_v1_create_twice_is_refused(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    driver, _fake, _base = make_v1(tmp_path, monkeypatch)
    driver.create("p0", LIMITS)
    with pytest.raises(CgroupError, match="already exists"):
        driver.create("p0", LIMITS)


def test_v1_create_failure_leaves_nothing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    child = dict(V1_CHILD)
    child["memory"] = {"cgroup.procs": ""}  # no memory.limit_in_bytes: the write fails
    driver, _fake, base = make_v1(tmp_path, monkeypatch, child=child)
    with pytest.raises(CgroupError, match="memory limit of cgroup fusuma/p0"):
        driver.create("p0", LIMITS)
    assert not driver.exists("p0")
    assert not any((base / name / "fusuma/p0").exists() for name in V1_ROOT)


def test_v1_not_exclusive_when_disabled(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                        caplog: pytest.LogCaptureFixture) -> None:
    driver, _fake, base = make_v1(tmp_path, monkeypatch, exclusive=False)
    driver.create("p0", LIMITS)
    assert read(base / "cpuset/fusuma/cpuset.cpu_exclusive") == "0"
    assert read(base / "cpuset/fusuma/p0/cpuset.cpu_exclusive") == "0"


def test_v1_partitions_not_exclusive_when_parent_cannot_be(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    driver, _fake, base = make_v1(tmp_path, monkeypatch)
    driver.ensure_parent()
    (base / "cpuset/fusuma/cpuset.cpu_exclusive").write_text("0\n")
    with caplog.at_level(logging.WARNING):
        driver.create("p0", LIMITS)
        driver.create("p1", Limits(cpus=[3], mems=[0], memory_bytes=MIB))
    assert read(base / "cpuset/fusuma/p0/cpuset.cpu_exclusive") == "0"
    assert sum("not exclusive" in r.getMessage() for r in caplog.records) == 1


def test_v1_missing_io_weight_warns_once(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                         caplog: pytest.LogCaptureFixture) -> None:
    child = dict(V1_CHILD)
    child["blkio"] = {"cgroup.procs": ""}
    driver, _fake, _base = make_v1(tmp_path, monkeypatch, child=child)
    with caplog.at_level(logging.WARNING):
        driver.create("p0", LIMITS)
        driver.create("p1", Limits(cpus=[3], mems=[0], memory_bytes=MIB, io_weight=50))
        driver.update("p0", LIMITS)
    assert sum("io weight" in r.getMessage() for r in caplog.records) == 1
    assert driver.groups() == ["p0", "p1"]


def test_v1_without_blkio_mount(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    driver, _fake, base = make_v1(tmp_path, monkeypatch, with_blkio=False)
    driver.create("p0", LIMITS)
    assert not (base / "blkio").exists()
    assert driver.exists("p0")


def test_v1_leaf_gets_partition_cpuset(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    driver, _fake, base = make_v1(tmp_path, monkeypatch)
    driver.create("p0", LIMITS)
    driver.create_leaf("p0", "supervisor")
    driver.create_leaf("p0", "supervisor")  # idempotent
    leaf = base / "cpuset/fusuma/p0/supervisor"
    assert read(leaf / "cpuset.cpus") == "1-2"
    assert read(leaf / "cpuset.mems") == "0"
    for name in V1_ROOT:
        assert (base / name / "fusuma/p0/supervisor").is_dir()


def test_v1_attach_writes_pid_in_every_hierarchy(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    driver, fake, base = make_v1(tmp_path, monkeypatch)
    driver.create("p0", LIMITS)
    driver.create_leaf("p0", "vm.a")
    fake.writes.clear()
    driver.attach("p0", "vm.a", 4242)
    procs = sorted(p for p, _v in fake.writes)
    assert procs == sorted(base / name / "fusuma/p0/vm.a/cgroup.procs" for name in V1_ROOT)
    assert all(v == "4242" for _p, v in fake.writes)
    assert driver.pids("p0") == [4242]


def test_attach_to_missing_leaf(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    driver, _fake, _base = make_v1(tmp_path, monkeypatch)
    driver.create("p0", LIMITS)
    with pytest.raises(CgroupError, match="create the leaf"):
        driver.attach("p0", "vm.nope", 1)


def test_v1_update_moves_leaves_in_a_legal_order(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    driver, fake, base = make_v1(tmp_path, monkeypatch)
    driver.create("p0", Limits(cpus=[0], mems=[0], memory_bytes=256 * MIB))
    driver.create_leaf("p0", "supervisor")
    fake.writes.clear()
    driver.update("p0", Limits(cpus=[1], mems=[0], memory_bytes=512 * MIB, io_weight=200))
    part = base / "cpuset/fusuma/p0"
    leaf = part / "supervisor"
    cpu_writes = [(p, v) for p, v in fake.writes if p.name == "cpuset.cpus"]
    # Grow to old+new, move the leaf, then settle: each step keeps child within parent.
    assert cpu_writes == [
        (part / "cpuset.cpus", "0-1"),
        (leaf / "cpuset.cpus", "1"),
        (part / "cpuset.cpus", "1"),
    ]
    assert read(part / "cpuset.cpus") == "1"
    assert read(base / "memory/fusuma/p0/memory.limit_in_bytes") == str(512 * MIB)
    assert read(base / "blkio/fusuma/p0/blkio.bfq.weight") == "200"


def test_v1_update_missing_group(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    driver, _fake, _base = make_v1(tmp_path, monkeypatch)
    with pytest.raises(CgroupError, match="does not exist"):
        driver.update("nope", LIMITS)


def test_v1_readings(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    driver, _fake, base = make_v1(tmp_path, monkeypatch)
    driver.create("p0", LIMITS)
    (base / "memory/fusuma/p0/memory.usage_in_bytes").write_text("123456\n")
    (base / "cpuset/fusuma/p0/cpuset.effective_cpus").write_text("1-2\n")
    assert driver.memory_current("p0") == 123456
    assert driver.cpus("p0") == [1, 2]


# -- v2 ----------------------------------------------------------------------------------


def test_v2_ensure_parent_enables_controllers(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    driver, fake, mount = make_v2(tmp_path, monkeypatch)
    driver.ensure_parent()
    parent = mount / "fusuma"
    assert read(mount / "cgroup.subtree_control") == "+cpuset +cpu +memory +io"
    assert read(parent / "cgroup.subtree_control") == "+cpuset +cpu +memory +io"
    assert read(parent / "cpuset.cpus") == "0-3"
    assert read(parent / "cpuset.mems") == "0"
    assert read(parent / "cpuset.cpus.exclusive") == "0-3"
    fake.writes.clear()
    driver.ensure_parent()
    assert fake.writes == []


def test_v2_nested_prefix(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    driver, _fake, mount = make_v2(tmp_path, monkeypatch, prefix="machine.slice/fusuma")
    driver.create("p0", LIMITS)
    for path in (mount, mount / "machine.slice", mount / "machine.slice/fusuma"):
        assert read(path / "cgroup.subtree_control") == "+cpuset +cpu +memory +io"
    assert read(mount / "machine.slice/fusuma/p0/cpuset.cpus") == "1-2"


def test_v2_create_writes_limits(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    driver, _fake, mount = make_v2(tmp_path, monkeypatch)
    driver.create("p0", LIMITS)
    group = mount / "fusuma/p0"
    assert read(group / "cpuset.cpus") == "1-2"
    assert read(group / "cpuset.mems") == "0"
    assert read(group / "cpuset.cpus.exclusive") == "1-2"
    assert read(group / "memory.max") == str(256 * MIB)
    assert read(group / "io.weight") == "default 300"
    # The leaves share the partition's cpuset: a cgroup with cpusets below it cannot
    # become a cpuset partition.
    assert read(group / "cgroup.subtree_control") == "+cpu +memory +io"
    assert driver.version == 2


def test_v2_leaf_and_attach(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    driver, fake, mount = make_v2(tmp_path, monkeypatch)
    driver.create("p0", LIMITS)
    fake.writes.clear()
    driver.create_leaf("p0", "vm.a")
    assert fake.writes == []  # a v2 leaf inherits the partition's cpuset
    driver.attach("p0", "vm.a", 777)
    assert fake.writes == [(mount / "fusuma/p0/vm.a/cgroup.procs", "777")]
    assert driver.pids("p0") == [777]


def test_v2_update_releases_exclusive_before_cpus(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    driver, fake, mount = make_v2(tmp_path, monkeypatch)
    driver.create("p0", LIMITS)
    fake.writes.clear()
    driver.update("p0", Limits(cpus=[1], mems=[0], memory_bytes=128 * MIB, io_weight=50))
    names = [p.name for p, _v in fake.writes]
    assert names.index("cpuset.cpus.exclusive") < names.index("cpuset.cpus")
    group = mount / "fusuma/p0"
    assert read(group / "cpuset.cpus") == "1"
    assert read(group / "memory.max") == str(128 * MIB)
    assert read(group / "io.weight") == "default 50"


def test_v2_old_kernel_without_exclusive_or_io_weight(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    child = {k: v for k, v in V2_CHILD.items()
             if k not in ("cpuset.cpus.exclusive", "io.weight")}
    child["io.bfq.weight"] = "default 100\n"
    driver, _fake, mount = make_v2(tmp_path, monkeypatch, child=child)
    with caplog.at_level(logging.WARNING):
        driver.create("p0", Limits(cpus=[0], mems=[0], memory_bytes=MIB, io_weight=5000))
        driver.create("p1", Limits(cpus=[1], mems=[0], memory_bytes=MIB, io_weight=5000))
    assert read(mount / "fusuma/p0/io.bfq.weight") == "1000"
    assert sum("cpuset.cpus.exclusive" in r.getMessage() for r in caplog.records) == 1


def test_v2_without_memory_controller(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    driver, _fake, mount = make_v2(tmp_path, monkeypatch)
    (mount / "cgroup.controllers").write_text("cpuset cpu io\n")
    with pytest.raises(CgroupError, match="memory controller"):
        driver.create("p0", LIMITS)
    assert not (mount / "fusuma").exists()


def test_v2_readings(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    driver, _fake, mount = make_v2(tmp_path, monkeypatch)
    driver.create("p0", LIMITS)
    (mount / "fusuma/p0/cpuset.cpus.effective").write_text("1-2\n")
    assert driver.memory_current("p0") == 4096
    assert driver.cpus("p0") == [1, 2]


# -- shared behaviour, both drivers ------------------------------------------------------


@pytest.fixture(params=[1, 2])
def any_driver(request: pytest.FixtureRequest, tmp_path: Path,
               monkeypatch: pytest.MonkeyPatch) -> tuple[CgroupDriver, Path]:
    if request.param == 1:
        driver1, _f1, base = make_v1(tmp_path, monkeypatch)
        return driver1, base
    driver2, _f2, mount = make_v2(tmp_path, monkeypatch)
    return driver2, mount


def test_delete_refuses_while_processes_remain(any_driver: tuple[CgroupDriver, Path]) -> None:
    driver, _base = any_driver
    driver.create("p0", LIMITS)
    driver.create_leaf("p0", "vm.a")
    driver.attach("p0", "vm.a", 31337)
    with pytest.raises(CgroupError, match="processes 31337 are still in it"):
        driver.delete("p0")
    assert driver.exists("p0")


def test_delete_removes_leaves_then_group(any_driver: tuple[CgroupDriver, Path]) -> None:
    driver, base = any_driver
    driver.create("p0", LIMITS)
    driver.create("p1", Limits(cpus=[3], mems=[0], memory_bytes=MIB))
    driver.create_leaf("p0", "supervisor")
    driver.create_leaf("p0", "vm.a")
    driver.delete("p0")
    assert not driver.exists("p0")
    assert driver.groups() == ["p1"]
    assert not list(base.rglob("p0"))
    driver.delete("p0")  # already gone: no error
    driver.remove_parent_if_empty()
    assert list(base.rglob("fusuma"))  # p1 is still there
    driver.delete("p1")
    driver.remove_parent_if_empty()
    assert not list(base.rglob("fusuma"))
    driver.remove_parent_if_empty()  # nothing to do


def test_pids_cover_group_and_leaves(any_driver: tuple[CgroupDriver, Path]) -> None:
    driver, _base = any_driver
    driver.create("p0", LIMITS)
    driver.create_leaf("p0", "supervisor")
    driver.create_leaf("p0", "vm.a")
    driver.attach("p0", "supervisor", 20)
    driver.attach("p0", "vm.a", 10)
    assert driver.pids("p0") == [10, 20]


def test_create_makes_the_parent_when_missing(any_driver: tuple[CgroupDriver, Path]) -> None:
    driver, _base = any_driver
    assert driver.groups() == []
    driver.create("p0", LIMITS)
    assert driver.groups() == ["p0"]


def test_group_name_is_checked(any_driver: tuple[CgroupDriver, Path]) -> None:
    driver, _base = any_driver
    with pytest.raises(SpecError):
        driver.create("../etc", LIMITS)
    with pytest.raises(SpecError):
        driver.create_leaf("p0", "a/b")


# -- detection ---------------------------------------------------------------------------


def mountinfo_line(n: int, mountpoint: Path, fstype: str, opts: str) -> str:
    escaped = str(mountpoint).replace(" ", "\\040")
    return f"{n} 23 0:{n} / {escaped} rw,relatime - {fstype} {fstype} {opts}\n"


def write_mountinfo(tmp_path: Path, lines: list[str]) -> Path:
    path = tmp_path / "mountinfo"
    path.write_text("22 1 0:21 / /proc rw,nosuid - proc proc rw\n" + "".join(lines))
    return path


def test_detect_v2_when_cpuset_offered(tmp_path: Path) -> None:
    mount = tmp_path / "cg 2"  # a space, escaped as \040 in mountinfo
    mount.mkdir()
    (mount / "cgroup.controllers").write_text("cpuset cpu io memory pids\n")
    info = write_mountinfo(tmp_path, [mountinfo_line(30, mount, "cgroup2", "rw,nsdelegate")])
    driver = detect("fz", tmp_path / "nowhere", info)
    assert isinstance(driver, CgroupV2Driver)
    assert driver.mount == mount
    assert driver.prefix == "fz"


def test_detect_v1_on_hybrid_host(tmp_path: Path) -> None:
    unified = tmp_path / "unified"
    unified.mkdir()
    (unified / "cgroup.controllers").write_text("hugetlb\n")
    lines = [mountinfo_line(40, tmp_path / "cpu,cpuacct", "cgroup", "rw,cpu,cpuacct"),
             mountinfo_line(41, tmp_path / "cpuset", "cgroup", "rw,cpuset"),
             mountinfo_line(42, tmp_path / "memory", "cgroup", "rw,memory"),
             mountinfo_line(43, tmp_path / "blkio", "cgroup", "rw,blkio"),
             mountinfo_line(44, tmp_path / "systemd", "cgroup", "rw,xattr,name=systemd"),
             mountinfo_line(45, unified, "cgroup2", "rw")]
    driver = detect(mountinfo=write_mountinfo(tmp_path, lines))
    assert isinstance(driver, CgroupV1Driver)
    assert driver.mounts == {"cpu": tmp_path / "cpu,cpuacct", "cpuset": tmp_path / "cpuset",
                             "memory": tmp_path / "memory", "blkio": tmp_path / "blkio"}
    assert driver.version == 1


def test_detect_without_cpuset_is_host_error(tmp_path: Path) -> None:
    unified = tmp_path / "unified"
    unified.mkdir()
    (unified / "cgroup.controllers").write_text("cpu io memory pids\n")
    info = write_mountinfo(tmp_path, [mountinfo_line(30, unified, "cgroup2", "rw")])
    with pytest.raises(HostError, match="cpuset"):
        detect(root=tmp_path / "nowhere", mountinfo=info)


def test_detect_falls_back_to_root_without_mountinfo(tmp_path: Path) -> None:
    (tmp_path / "cgroup.controllers").write_text("cpuset memory\n")
    driver = detect(root=tmp_path, mountinfo=tmp_path / "missing")
    assert isinstance(driver, CgroupV2Driver)
    assert driver.mount == tmp_path


def test_parse_mountinfo_skips_other_filesystems() -> None:
    text = ("22 1 0:21 / /proc rw - proc proc rw\n"
            "31 23 0:28 / /sys/fs/cgroup rw - tmpfs tmpfs rw,mode=755\n"
            "34 31 0:31 / /sys/fs/cgroup/cpuset rw,relatime shared:9 - cgroup cgroup rw,cpuset\n")
    mounts = parse_mountinfo(text)
    assert len(mounts) == 1
    assert mounts[0].mountpoint == Path("/sys/fs/cgroup/cpuset")
    assert "cpuset" in mounts[0].options


def test_detect_this_host() -> None:
    try:
        driver = detect()
    except HostError as exc:
        pytest.skip(str(exc))
    assert driver.version in (1, 2)


def test_real_remove_dir_tolerates_missing(tmp_path: Path) -> None:
    driver = CgroupV2Driver(tmp_path)
    (tmp_path / "empty").mkdir()
    driver._remove_dir(tmp_path / "empty")
    driver._remove_dir(tmp_path / "empty")
    assert not (tmp_path / "empty").exists()


def test_real_write_never_creates_files(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError):
        CgroupDriver._write(tmp_path / "cpuset.cpus", "0")
    assert not (tmp_path / "cpuset.cpus").exists()


def test_v1_update_restores_memory_when_cpus_are_refused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    driver, _fake, base = make_v1(tmp_path, monkeypatch)
    driver.create("p0", Limits(cpus=[0], mems=[0], memory_bytes=256 * MIB))
    recording = driver._write

    def refuse_cpus(path: Path, value: str) -> None:
        if path.name == "cpuset.cpus":
            raise OSError(22, "Invalid argument")
        recording(path, value)

    monkeypatch.setattr(driver, "_write", refuse_cpus)
    with pytest.raises(CgroupError, match="shrink it first"):
        driver.update("p0", Limits(cpus=[0, 1], mems=[0], memory_bytes=512 * MIB))
    assert read(base / "memory/fusuma/p0/memory.limit_in_bytes") == str(256 * MIB)
    assert read(base / "cpuset/fusuma/p0/cpuset.cpus") == "0"
