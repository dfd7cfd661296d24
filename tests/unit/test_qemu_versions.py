"""QEMU versions side by side, without starting a guest: probing (cached), resolving a
partition's QEMU, removal refusals, the install's clean failure, the recorded device
set and the argv rebuilt from it."""

from __future__ import annotations

import json
import os
from dataclasses import replace
from pathlib import Path

import pytest

from fusuma.errors import HostError, NotFoundError, SpecError, StateError
from fusuma.paths import Paths
from fusuma.qemu import fetch, versions
from fusuma.qemu.cmdline import (
    DeviceSet,
    DeviceSetMismatch,
    DiskConfig,
    VmConfig,
    build_argv,
    device_set,
)
from fusuma.state import Database, PartitionRecord, VmRecord

MACHINES_72 = """Supported machines are:
microvm              microvm (i386)
pc                   Standard PC (i440FX + PIIX, 1996) (alias of pc-i440fx-7.2)
pc-i440fx-7.2        Standard PC (i440FX + PIIX, 1996) (default)
q35                  Standard PC (Q35 + ICH9, 2009) (alias of pc-q35-7.2)
pc-q35-7.2           Standard PC (Q35 + ICH9, 2009)
pc-q35-7.1           Standard PC (Q35 + ICH9, 2009)
none                 empty machine
"""


def fake_qemu(path: Path, version: str, machines: str, calls: Path) -> Path:
    """A script that answers like qemu-system-x86_64 and counts its runs."""
    path.parent.mkdir(parents=True, exist_ok=True)
    (path.parent / "machines.txt").write_text(machines)
    path.write_text("#!/bin/sh\n"
                    f"echo run >> {calls}\n"
                    f"if [ \"$1\" = --version ]; then echo 'QEMU emulator version {version} "
                    "(Debian 1:x)'; exit 0; fi\n"
                    f"cat {path.parent}/machines.txt\n")
    path.chmod(0o755)
    return path


@pytest.fixture
def paths(tmp_path: Path) -> Paths:
    cache = tmp_path / "cache"
    cache.mkdir()
    os.chmod(tmp_path, 0o711)
    return Paths(home=tmp_path / "home", runtime=tmp_path / "run", shm=tmp_path / "shm",
                 cache=cache, cgroup_prefix="t")


@pytest.fixture
def system(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    binary = fake_qemu(tmp_path / "sys" / "qemu-system-x86_64", "7.2.22", MACHINES_72,
                       tmp_path / "calls")
    monkeypatch.setattr(versions, "system_binary", lambda: binary)
    versions._MEMO.clear()
    return binary


def unpack(paths: Paths, series: str, version: str, machines: list[str]) -> Path:
    """What `qemu install` leaves: a root with the binary and a manifest."""
    d = paths.cache / "qemu" / series
    binary = d / "root" / versions.BINARY_IN_ROOT
    binary.parent.mkdir(parents=True)
    binary.write_text("#!/bin/sh\nexit 0\n")
    binary.chmod(0o755)
    probe = versions.Probe(version, tuple(machines), {"q35": machines[0]})
    (d / "manifest.json").write_text(json.dumps({**probe.as_json(), "series": series}))
    return binary


def test_parse_machine_help_and_features() -> None:
    names, aliases = versions.parse_machine_help(MACHINES_72)
    assert "pc-q35-7.2" in names and "q35" not in names and "none" in names
    assert aliases == {"pc": "pc-i440fx-7.2", "q35": "pc-q35-7.2"}
    assert versions.features_for("7.2.22") == {
        "x-ignore-shared": True, "live-copy-tcg": False, "aux-ram-share": False,
        "cpr-transfer": False}
    assert all(versions.features_for("10.0.2").values())
    assert versions.features_for("9.0.0")["live-copy-tcg"]
    assert versions.machine_version("pc-q35-10.0") == (10, 0)
    assert versions.machine_version("q35") is None
    assert fetch.upstream("1:10.0.2+ds-2+deb13u1~bpo12+1") == "10.0.2"
    assert fetch.matches("10.0", "1:10.0.2+ds-2") and not fetch.matches("10.0", "1:10.1.0")
    assert not fetch.matches("7.2", "1:7.20.1")


def test_the_system_qemu_is_probed_once(paths: Paths, system: Path, tmp_path: Path) -> None:
    q = versions.resolve(paths, None)
    assert (q.series, q.version, q.system, q.q35) == ("7.2", "7.2.22", True, "pc-q35-7.2")
    assert q.data_dirs == () and q.env == {}
    runs = (tmp_path / "calls").read_text().count("run")
    assert runs == 3      # --version, -machine help, the CPU model over QMP
    assert q.cpu_tcg is None      # the fake does not speak QMP: plain `max` then
    versions._MEMO.clear()     # a new process: the cache file answers
    assert versions.resolve(paths, "7.2") == q
    assert versions.resolve(paths, str(system)) == q
    assert (tmp_path / "calls").read_text().count("run") == runs
    # A changed binary (a package upgrade) is probed again.
    os.utime(system, ns=(0, 0))
    versions._MEMO.clear()
    versions.resolve(paths, None)
    assert (tmp_path / "calls").read_text().count("run") == runs + 3


def test_resolve_an_unpacked_version_a_path_and_refusals(paths: Paths, system: Path,
                                                        tmp_path: Path) -> None:
    binary = unpack(paths, "10.0", "10.0.2", ["pc-q35-10.0", "pc-q35-7.2"])
    q = versions.resolve(paths, "10.0")
    root = binary.parents[2]
    assert (q.version, q.system, q.root, q.binary) == ("10.0.2", False, root, binary)
    assert q.data_dirs[:2] == (root / "usr/share/qemu", root / "usr/share/seabios")
    assert q.env == {"QEMU_MODULE_DIR": str(root / "usr/lib/x86_64-linux-gnu/qemu")}
    assert q.features["cpr-transfer"] and q.has_machine("pc-q35-7.2")
    assert versions.resolve(paths, str(binary)) == q
    assert [x.series for x in versions.installed(paths)] == ["7.2", "10.0"]
    # The oldest installed QEMU's q35 is what a new VM pins.
    assert versions.default_machine(paths, q) == "pc-q35-7.2"
    assert versions.known_version(paths, "10.0") == "10.0.2"
    with pytest.raises(NotFoundError, match=r"QEMU 9\.9 is not installed.*`fusuma qemu "
                                            r"install 9\.9`"):
        versions.resolve(paths, "9.9")
    with pytest.raises(SpecError):
        versions.resolve(paths, "qemu-ten")
    with pytest.raises(HostError, match="does not exist"):
        versions.resolve(paths, str(tmp_path / "nope"))
    # A machine type an older QEMU predates, and one it simply lacks.
    sysq = versions.resolve(paths, None)
    assert "predates" in str(versions.cannot_run(sysq, "pc-q35-10.0"))
    assert versions.cannot_run(sysq, "pc-q35-7.2") is None
    assert "has no machine type" in str(versions.cannot_run(sysq, "pc-q35-2.3"))


def test_known_version_never_runs_a_binary(paths: Paths, system: Path,
                                           tmp_path: Path) -> None:
    assert versions.known_version(paths, None) is None      # never probed yet
    assert not (tmp_path / "calls").exists()
    versions.resolve(paths, None)
    assert versions.known_version(paths, None) == "7.2.22"
    assert versions.known_version(paths, "9.9") is None


def test_machine_of_a_vm_defined_before_machine_types_were_pinned(
        paths: Paths, system: Path) -> None:
    rec = VmRecord("old", "p0", 1, 256, qemu_binary=str(system))
    assert versions.machine_of(paths, rec) == "pc-q35-7.2"
    assert versions.machine_of(paths, rec.with_(machine="pc-q35-7.1")) == "pc-q35-7.1"


def test_remove_is_refused_while_a_partition_names_it(paths: Paths, system: Path) -> None:
    unpack(paths, "10.0", "10.0.2", ["pc-q35-10.0"])
    with Database(paths.db) as db:
        db.add_partition(PartitionRecord("p1", [1], 1024, qemu="10.0"))
    with pytest.raises(StateError, match="in use by partition p1"):
        versions.remove(paths, "10.0")
    assert (paths.cache / "qemu" / "10.0").is_dir()
    with Database(paths.db) as db:
        db.remove_partition("p1")
    versions.remove(paths, "10.0")
    assert not (paths.cache / "qemu" / "10.0").exists()
    assert not [p for p in (paths.cache / "qemu").iterdir() if p.name.startswith(".rm-")]
    with pytest.raises(StateError, match="system's own"):
        versions.remove(paths, "7.2")
    with pytest.raises(NotFoundError):
        versions.remove(paths, "10.0")


def test_a_failed_install_leaves_nothing_half_unpacked(
        paths: Paths, system: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    said: list[str] = []

    def broken(self: fetch.Apt, tool: str, *args: str, cwd: Path | None = None) -> str:
        (self.root / "state/lists/partial/half").write_text("x")
        raise fetch.FetchFailed("Could not connect to 127.0.0.1:9")

    monkeypatch.setattr(fetch.Apt, "run", broken)
    monkeypatch.setattr(versions, "check_passable", lambda paths: None)
    monkeypatch.setenv("FUSUMA_DEBIAN_MIRROR", "http://127.0.0.1:9/debian")
    with pytest.raises(HostError, match=r"cannot fetch QEMU 10\.0 from Debian's "
                                        r"\S+-backports suite at http://127\.0\.0\.1:9"):
        fetch.install(paths, "10.0", progress=said.append)
    assert said and "reading the package lists" in said[0]
    left = sorted(p.name for p in (paths.cache / "qemu").iterdir())
    assert [n for n in left if n not in (".lock", "probes.json")] == []
    # The system's own series is not fetched.
    assert fetch.install(paths, "7.2").system
    with pytest.raises(SpecError):
        fetch.install(paths, "latest")


def test_open_up_makes_the_tree_readable_by_other_users(tmp_path: Path) -> None:
    root = tmp_path / "root"
    (root / "usr/bin").mkdir(parents=True)
    os.chmod(root / "usr", 0o700)
    (root / "usr/bin/qemu").write_text("x")
    os.chmod(root / "usr/bin/qemu", 0o700)
    (root / "usr/lib.so").write_text("x")
    os.chmod(root / "usr/lib.so", 0o600)
    fetch.open_up(root)
    assert (root / "usr").stat().st_mode & 0o777 == 0o755
    assert (root / "usr/bin/qemu").stat().st_mode & 0o777 == 0o755
    assert (root / "usr/lib.so").stat().st_mode & 0o777 == 0o644


# -- the recorded device set -----------------------------------------------------------
def cfg(**kw: object) -> VmConfig:
    base: dict[str, object] = dict(
        name="vm0", vcpus=1, memory_mib=256, accel="tcg", kernel=Path("/k"),
        initrd=Path("/i"), append="console=ttyS0", qmp_socket=Path("/r/qmp.sock"),
        qga_socket=Path("/r/qga.sock"), console_socket=Path("/r/console.sock"),
        console_log=Path("/h/console.log"), pidfile=Path("/r/qemu.pid"),
        ram_file=Path("/dev/shm/fusuma/vm0.ram"))
    base.update(kw)
    return VmConfig(**base)  # type: ignore[arg-type]


def opt(argv: list[str], flag: str) -> list[str]:
    return [argv[i + 1] for i, a in enumerate(argv) if a == flag]


def test_device_set_round_trips_and_fixes_the_machine() -> None:
    c = cfg(machine="pc-q35-7.2", ports=[(8080, 80)],
            disks=[DiskConfig("d0", Path("/d0.img"))], root_disk=Path("/root.img"))
    ds = device_set(c)
    assert DeviceSet.loads(ds.dumps()) == ds
    assert [d.driver for d in ds.devices] == [
        "virtio-serial-pci", "virtserialport", "virtio-blk-pci", "virtio-net-pci",
        "virtio-blk-pci"]
    argv = build_argv(replace(c, devices=ds, data_dirs=(Path("/q/share"), Path("/s"))),
                      "/q/bin/qemu-system-x86_64")
    assert opt(argv, "-machine") == [
        "pc-q35-7.2,sata=off,smbus=off,vmport=off,i8042=off,memory-backend=ram0"]
    assert opt(argv, "-L") == ["/q/share", "/s"]
    assert opt(argv, "-device") == [d.option() for d in ds.devices]
    assert opt(argv, "-serial") == ["chardev:con0"]


def test_a_destination_rebuilds_the_recorded_devices_not_todays() -> None:
    """A device set recorded by an older fusuma (say, without the root disk, and a CPU
    model of its own) is what the destination gets, whatever today's code would do."""
    old = DeviceSet(machine="pc-q35-7.2", machine_props=(("sata", "off"),), cpu="qemu64",
                    smp=1, memory="256M", serial="con0",
                    devices=device_set(cfg()).devices)
    argv = build_argv(cfg(devices=old, machine="pc-q35-10.0", root_disk=Path("/root.img"),
                          incoming="defer"))
    assert opt(argv, "-machine") == ["pc-q35-7.2,sata=off,memory-backend=ram0"]
    assert opt(argv, "-cpu") == ["qemu64"]
    assert opt(argv, "-device") == ["virtio-serial-pci,id=vser0",
                                    "virtserialport,bus=vser0.0,chardev=qga0,"
                                    "name=org.qemu.guest_agent.0"]
    # Host-side options that the guest cannot see may differ.
    argv = build_argv(cfg(devices=old, aux_ram_share=True))
    assert opt(argv, "-machine") == ["pc-q35-7.2,sata=off,memory-backend=ram0,"
                                     "aux-ram-share=on"]


def test_a_recorded_device_whose_backend_is_gone_is_refused() -> None:
    ds = device_set(cfg(disks=[DiskConfig("d0", Path("/d0.img"))]))
    with pytest.raises(DeviceSetMismatch, match="disk-d0"):
        build_argv(cfg(devices=ds))
    with pytest.raises(ValueError):
        DeviceSet.loads(json.dumps({"version": 99}))


def test_a_guest_booted_with_the_usr_disk_is_not_given_the_root_disk() -> None:
    """A Debian guest booted by builder 3's layout (its /usr on disk-fusuma-usr) moves
    only with that disk: today's config has the root disk instead, so it is refused."""
    ds = device_set(cfg(root_disk=Path("/root.erofs")))
    old = replace(ds, devices=tuple(
        replace(d, props=(("drive", "disk-fusuma-usr"), ("serial", "fusuma-usr")))
        if ("drive", "disk-fusuma-root") in d.props else d for d in ds.devices))
    with pytest.raises(DeviceSetMismatch, match="disk-fusuma-usr"):
        build_argv(cfg(devices=old, root_disk=Path("/root.erofs"), incoming="defer"))


def test_spec_machine_must_be_a_versioned_q35() -> None:
    from fusuma.spec import VmSpec, build

    assert build(VmSpec, "vm", name="a", partition="p0", machine="pc-q35-7.2").machine \
        == "pc-q35-7.2"
    with pytest.raises(SpecError, match="versioned q35"):
        build(VmSpec, "vm", name="a", partition="p0", machine="q35")


# -- the guest's CPU under TCG -----------------------------------------------------------
def with_cpu(q: versions.Qemu, on: set[str], off: set[str] = frozenset()) -> versions.Qemu:
    return replace(q, cpu_tcg={**{f: True for f in on}, **{f: False for f in off}})


def test_a_guest_is_shown_only_cpu_features_every_installed_qemu_emulates(
        paths: Paths, system: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    q72 = with_cpu(versions.resolve(paths, None), {"sse2", "avx2", "pcommit"}, {"rdpid"})
    q10 = replace(q72, version="10.0.2", series="10.0",
                  cpu_tcg={"sse2": True, "avx2": True, "rdpid": True, "sha-ni": True,
                           "pcommit": False})
    monkeypatch.setattr(versions, "installed", lambda paths: [q72, q10])
    # Booted on 10.0: 7.2 lacks rdpid and sha-ni, so the guest is not told of them;
    # PCOMMIT (7.2 only, retired) is never shown.
    feats = versions.tcg_cpu_features(paths, q10)
    assert feats == ("avx2", "sse2")
    assert versions.tcg_cpu_features(paths, q72) == feats
    assert versions.cpu_off(q10, feats) == ("rdpid", "sha-ni")
    assert versions.cpu_off(q72, feats) == ("pcommit",)
    assert versions.cpu_missing(q72, ("avx2", "rdpid")) == ["rdpid"]
    assert versions.cpu_missing(q72, ()) == [] and versions.cpu_off(q72, ()) == ()
    c = cfg(machine="pc-q35-7.2")
    ds = replace(device_set(c), cpu_features=feats)
    assert DeviceSet.loads(ds.dumps()) == ds
    argv = build_argv(replace(c, devices=ds, cpu_off=versions.cpu_off(q10, feats)))
    assert opt(argv, "-cpu") == ["max,rdpid=off,sha-ni=off"]


def test_a_move_to_a_qemu_without_the_guests_cpu_features_is_refused(
        paths: Paths, system: Path) -> None:
    from fusuma.migration.compat import check_runs_on

    q72 = with_cpu(versions.resolve(paths, None), {"sse2"}, {"rdpid"})
    ds = replace(device_set(cfg(machine="pc-q35-7.2")), cpu_features=("rdpid", "sse2"))
    rec = VmRecord("vm0", "p1", 1, 256, machine="pc-q35-7.2", devices=ds.dumps())
    with pytest.raises(StateError, match=r"CPU has rdpid, which QEMU 7\.2\.22's TCG cannot"):
        check_runs_on(paths, rec, q72, "p0")
    ok = replace(ds, cpu_features=("sse2",))
    assert check_runs_on(paths, rec.with_(devices=ok.dumps()), q72, "p0") == "pc-q35-7.2"
    newer = rec.with_(machine="pc-q35-10.0",
                      devices=replace(ok, machine="pc-q35-10.0").dumps())
    with pytest.raises(StateError, match=r"predates machine type pc-q35-10\.0"):
        check_runs_on(paths, newer, q72, "p0")
