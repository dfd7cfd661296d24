"""cgroup v2 cpuset partitions on a fake cgroupfs: the order of the writes, the fallback
to plain cpusets with a notice, and the refusals (a kernel without partitions, a layout
the kernel cannot hold, a partition the kernel marks invalid). The real kernel's side is
tests/cgroup2 (in a guest)."""

from __future__ import annotations

from pathlib import Path

import pytest

from fusuma.errors import CgroupError
from fusuma.host.cgroups import (
    HELD_EXCLUSIVE,
    HELD_PARTITION_ISOLATED,
    HELD_PARTITION_ROOT,
    HELD_SHARED,
    Limits,
)
from fusuma.host.cgroups.v2 import CgroupV2Driver
from fusuma.host.topology import format_cpulist, parse_cpulist
from tests.unit.test_cgroups import V2_CHILD, V2_ROOT, FakeCgroupFs, read

MIB = 1 << 20
WITH_PARTITIONS = {**{k: v for k, v in V2_CHILD.items() if k != "cpuset.cpus.exclusive"},
                   "cpuset.cpus.partition": "member\n"}


def limits(cpus: list[int]) -> Limits:
    return Limits(cpus=cpus, mems=[0], memory_bytes=256 * MIB)


def make(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, *, mode: str = "auto",
         child: dict[str, str] | None = None,
         refuse: str | None = None) -> tuple[CgroupV2Driver, FakeCgroupFs, Path, list[str]]:
    """A 4-CPU fake; ``refuse``: a cgroup name whose partition the fake kernel marks
    invalid, as the real one does when it cannot give it its CPUs."""
    mount = tmp_path / "cg"
    mount.mkdir(parents=True)
    for name, content in V2_ROOT.items():
        (mount / name).write_text(content)
    fake = FakeCgroupFs({mount: child if child is not None else WITH_PARTITIONS})
    driver = CgroupV2Driver(mount, "fusuma", partition=mode)
    fake.install(driver, monkeypatch)
    write = driver._write

    def kernel(path: Path, value: str) -> None:
        write(path, value)
        if path.name == "cpuset.cpus.partition" and path.parent.name == refuse and \
                value in ("root", "isolated"):
            path.write_text(f"{value} invalid (Parent unable to distribute cpu downstream)\n")
        if path.name == "cpuset.cpus.partition" and path.parent == mount / "fusuma":
            # The root cgroup gives the partition's CPUs away (or takes them back).
            held = parse_cpulist(read(path.parent / "cpuset.cpus")) if value == "root" \
                else []
            rest = sorted(set(range(4)) - set(held))
            (mount / "cpuset.cpus.effective").write_text(format_cpulist(rest) + "\n")

    monkeypatch.setattr(driver, "_write", kernel)
    notices: list[str] = []
    driver.notice = notices.append
    return driver, fake, mount, notices


def test_partitions_take_their_cores_in_order(tmp_path: Path,
                                              monkeypatch: pytest.MonkeyPatch) -> None:
    driver, fake, mount, notices = make(tmp_path, monkeypatch)
    driver.create("a", limits([1]))
    parent = mount / "fusuma"
    writes = [(p.relative_to(mount).as_posix(), v) for p, v in fake.writes
              if p.name in ("cpuset.cpus", "cpuset.cpus.partition")]
    # The parent becomes a root holding the partitions' union before a partition does.
    assert writes[-4:] == [("fusuma/cpuset.cpus", "1"), ("fusuma/cpuset.cpus.partition", "root"),
                           ("fusuma/a/cpuset.cpus", "1"),
                           ("fusuma/a/cpuset.cpus.partition", "root")]
    assert driver.cores_held_by("a") == HELD_PARTITION_ROOT and notices == []
    driver.create("b", limits([2, 3]))
    assert read(parent / "cpuset.cpus") == "1-3"
    assert driver.cores_held_by("b") == HELD_PARTITION_ROOT
    assert driver.disturbed == set()
    # A core moves from b to a: b gives it up before a takes it.
    fake.writes.clear()
    driver.update("b", limits([3]))
    driver.update("a", limits([1, 2]))
    order = [p.parent.name for p, v in fake.writes if p.name == "cpuset.cpus"]
    assert order.index("b") < order.index("a")
    assert read(parent / "cpuset.cpus") == "1-3"
    assert read(mount / "fusuma/a/cpuset.cpus") == "1-2"


def test_partitions_covering_every_core_fall_back_with_a_notice(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    driver, _fake, mount, notices = make(tmp_path, monkeypatch)
    driver.create("a", limits([1, 2]))
    driver.create("b", limits([0, 3]))
    assert driver.cores_held_by("a") == HELD_SHARED == driver.cores_held_by("b")
    assert read(mount / "fusuma/cpuset.cpus.partition") == "member"
    assert read(mount / "fusuma/cpuset.cpus") == "0-3"
    assert driver.disturbed == {"a"}
    assert notices == ["fusuma: notice: partition 'b' holds its cores with a plain cpuset "
                       "(other processes may run there), not a cpuset partition: the "
                       "partitions cover every core (0-3) and the kernel keeps at least one "
                       "for the rest of the host; leave a core out of fusuma's partitions."]
    driver.delete("b")
    assert driver.cores_held_by("a") == HELD_PARTITION_ROOT
    driver.delete("a")
    assert read(mount / "fusuma/cpuset.cpus.partition") == "member"
    assert read(mount / "cpuset.cpus.effective") == "0-3"


def test_isolated_partitions(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    driver, _fake, mount, _ = make(tmp_path, monkeypatch, mode="isolated")
    driver.create("a", limits([2]))
    assert read(mount / "fusuma/a/cpuset.cpus.partition") == "isolated"
    assert read(mount / "fusuma/cpuset.cpus.partition") == "root"
    assert driver.cores_held_by("a") == HELD_PARTITION_ISOLATED


def test_explicit_mode_refuses_a_layout_the_kernel_cannot_hold(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    driver, _fake, mount, _ = make(tmp_path, monkeypatch, mode="root")
    driver.create("a", limits([1]))
    with pytest.raises(CgroupError) as err:
        driver.create("b", limits([0, 2, 3]))
    assert str(err.value) == ("cannot hold cores 0-3 with cpuset partitions: the partitions "
                              "cover every core (0-3) and the kernel keeps at least one for "
                              "the rest of the host; leave a core out of fusuma's partitions "
                              "(FUSUMA_CPU_PARTITION=root; auto falls back to plain cpusets)")
    assert not (mount / "fusuma/b").exists()
    assert driver.cores_held_by("a") == HELD_PARTITION_ROOT


def test_kernel_without_cpuset_partitions(tmp_path: Path,
                                          monkeypatch: pytest.MonkeyPatch) -> None:
    driver, _fake, _mount, notices = make(tmp_path, monkeypatch, child=V2_CHILD)
    driver.create("a", limits([1]))
    assert driver.cores_held_by("a") == HELD_EXCLUSIVE     # cpuset.cpus.exclusive (6.7+)
    assert len(notices) == 1 and "this kernel has no cgroup v2 cpuset partitions" in \
        notices[0]
    strict, _f, mount2, _ = make(tmp_path / "strict", monkeypatch, mode="root",
                                 child=V2_CHILD)
    with pytest.raises(CgroupError, match=r"^cannot hold cores 1 with cpuset partitions: "
                       r"this kernel has no cgroup v2 cpuset partitions \(no "
                       r"cpuset.cpus.partition; Linux 5.11 or later has them\)"):
        strict.create("a", limits([1]))
    assert not (mount2 / "fusuma/a").exists()


def test_a_partition_the_kernel_refuses(tmp_path: Path,
                                        monkeypatch: pytest.MonkeyPatch) -> None:
    driver, _fake, mount, notices = make(tmp_path, monkeypatch, refuse="b")
    driver.create("a", limits([1]))
    driver.create("b", limits([2]))
    # Every partition is undone, not just b: plain cpusets throughout, and why.
    assert driver.cores_held_by("a") == HELD_SHARED == driver.cores_held_by("b")
    assert read(mount / "fusuma/cpuset.cpus.partition") == "member"
    assert notices[-1].endswith("not a cpuset partition: the kernel refused cpuset partition "
                                "fusuma/b: Parent unable to distribute cpu downstream.")
    strict, _f, mount2, _ = make(tmp_path / "strict", monkeypatch, mode="root", refuse="b")
    strict.create("a", limits([1]))
    with pytest.raises(CgroupError, match="the kernel refused cpuset partition fusuma/b"):
        strict.create("b", limits([2]))
    assert not (mount2 / "fusuma/b").exists()


def test_off_keeps_plain_cpusets(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    driver, _fake, mount, notices = make(tmp_path, monkeypatch, mode="off")
    driver.create("a", limits([1]))
    assert read(mount / "fusuma/a/cpuset.cpus.partition") == "member"
    assert driver.cores_held_by("a") == HELD_SHARED
    assert notices == []        # the user's choice: nothing to tell
    with pytest.raises(CgroupError, match="not a mode"):
        CgroupV2Driver(mount, "fusuma", partition="sometimes")
