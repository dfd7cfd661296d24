"""Templates and clones without a VM: the state DB, file checks, what a clone must share
with its template, the clone's QEMU argv and device set, accounting, refusals."""

from __future__ import annotations

import hashlib
import os
import re
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from fusuma import capacity
from fusuma.errors import ConflictError, SpecError, StateError, TemplateError
from fusuma.host.topology import HostInfo
from fusuma.memshare import templates
from fusuma.memshare.report import vm_memory
from fusuma.memshare.smaps import parse_smaps, template_usage
from fusuma.memshare.templates import refuse
from fusuma.paths import Paths
from fusuma.qemu.cmdline import (
    TEMPLATE_STATE_FDSET,
    DeviceSet,
    VmConfig,
    build_argv,
    device_set,
)
from fusuma.state import Database, PartitionRecord, VmRecord
from fusuma.state.db import TemplateRecord
from tests.unit.memshare_fake import make_process, smap

MIB = 2**20


def cfg(**kw: Any) -> VmConfig:
    base: dict[str, Any] = dict(
        name="t0", vcpus=1, memory_mib=256, accel="tcg", kernel=Path("/k"),
        initrd=Path("/i"), append="console=ttyS0", qmp_socket=Path("/r/qmp.sock"),
        qga_socket=Path("/r/qga.sock"), console_socket=Path("/r/console.sock"),
        console_log=Path("/h/console.log"), pidfile=Path("/r/qemu.pid"),
        ram_file=Path("/dev/shm/fusuma/t0.ram"), machine="pc-q35-7.2")
    base.update(kw)
    return VmConfig(**base)


def opt(argv: list[str], flag: str) -> list[str]:
    return [argv[i + 1] for i, a in enumerate(argv) if a == flag]


@pytest.fixture
def paths(tmp_path: Path) -> Paths:
    return Paths(home=tmp_path / "home", runtime=tmp_path / "run", shm=tmp_path / "shm",
                 cache=tmp_path / "cache", cgroup_prefix="unused", uid_base=1_700_000_000)


@pytest.fixture
def db(paths: Paths) -> Database:
    return Database(paths.db)


def make_template(paths: Paths, name: str = "t", *, ports: bool = True,
                  vmgenid: str | None = "11111111-2222-3333-4444-555555555555",
                  ram_bytes: int = 4 * MIB, state: bytes = b"QEVM state") -> TemplateRecord:
    """A template record whose files exist (a small RAM file, a state file)."""
    ram = templates.ram_file(paths, name)
    st = templates.state_file(paths, name)
    ram.parent.mkdir(parents=True, exist_ok=True)
    st.parent.mkdir(parents=True, exist_ok=True)
    with open(ram, "wb") as f:
        f.truncate(ram_bytes)
    st.write_bytes(state)
    ds = device_set(cfg(ports=[(8080, 80)] if ports else [], page_reporting=True,
                        vmgenid=vmgenid))
    return TemplateRecord(name=name, ram_path=str(ram), state_path=str(st),
                          size_bytes=ram_bytes, memory_mib=256, vcpus=1,
                          machine=ds.machine, qemu_version="10.0.2", devices=ds.dumps(),
                          image="minimal", state_sha256=hashlib.sha256(state).hexdigest(),
                          source_vm="src")


# -- state DB ------------------------------------------------------------------------------
def test_templates_table_round_trips_and_names_are_unique(paths: Paths, db: Database) -> None:
    t = db.add_template(make_template(paths), paths.template_gids)
    assert t.gid in paths.template_gids
    got = db.template("t")
    assert got == replace(t, created_at=got.created_at) and got.gid == t.gid
    assert [x.name for x in db.templates()] == ["t"]
    with pytest.raises(ConflictError, match="already exists"):
        db.add_template(make_template(paths))
    with pytest.raises(Exception, match="no template named 'nope'"):
        db.template("nope")


def test_a_template_in_use_cannot_be_deleted_even_by_a_stopped_clone(
        paths: Paths, db: Database) -> None:
    db.add_template(make_template(paths))
    db.add_partition(PartitionRecord("p", [0], 1024))
    db.add_vm(VmRecord(name="c1", partition="p", vcpus=1, memory_mib=256, shared_ram=False,
                       template="t"))
    db.add_vm(VmRecord(name="c2", partition="p", vcpus=1, memory_mib=256, shared_ram=False,
                       template="t"))
    assert db.clones_of("t") == ["c1", "c2"]
    with pytest.raises(StateError, match="used by VM\\(s\\) c1, c2"):
        db.remove_template("t")
    db.remove_vm("c1")
    db.remove_vm("c2")
    db.remove_template("t")
    assert db.find_template("t") is None


def test_each_template_has_a_group_of_its_own_apart_from_vm_uids(paths: Paths,
                                                                 db: Database) -> None:
    a = db.add_template(make_template(paths, "a"), paths.template_gids)
    b = db.add_template(make_template(paths, "b"), paths.template_gids)
    ga, gb = templates.template_gid(paths, a), templates.template_gid(paths, b)
    assert ga != gb
    for g in (ga, gb):
        assert g in paths.template_gids and g not in paths.vm_uids
    with pytest.raises(StateError):
        templates.template_gid(paths, replace(a, gid=0))


# -- QEMU versions ---------------------------------------------------------------------------
@pytest.mark.parametrize(("version", "ok"), [("7.2.22", False), ("8.1.5", False),
                                              ("8.2.0", True), ("10.0.2", True),
                                              (None, False), ("x", False)])
def test_templates_need_qemu_8_2(version: str | None, ok: bool) -> None:
    assert templates.version_ok(version) is ok


def test_a_template_of_a_vm_on_an_old_qemu_is_refused_naming_the_version() -> None:
    rec = VmRecord(name="v", partition="p72", vcpus=1, memory_mib=256)
    with pytest.raises(TemplateError, match=r"runs QEMU 7\.2\.22.*QEMU >= 8\.2.*10\.0"):
        refuse(rec, "7.2.22")


@pytest.mark.parametrize(("rec", "match"), [
    (VmRecord(name="v", partition="p", vcpus=1, memory_mib=256, shared_ram=False),
     "private RAM"),
    (VmRecord(name="v", partition="p", vcpus=1, memory_mib=256, shared_ram=False,
              mergeable=True), "private RAM"),
    (VmRecord(name="v", partition="p", vcpus=1, memory_mib=256, shared_ram=False,
              template="t"), "is a clone of template 't'"),
    (VmRecord(name="v", partition="p", vcpus=1, memory_mib=256, disks=["d0"]),
     "has disks"),
])
def test_what_cannot_become_a_template(rec: VmRecord, match: str) -> None:
    with pytest.raises(TemplateError, match=match):
        refuse(rec, "10.0.2")


# -- files -----------------------------------------------------------------------------------
def test_intact_files_pass_and_damage_is_one_sentence(paths: Paths) -> None:
    t = make_template(paths)
    templates.check_files(t)
    ram_fd, state_fd = templates.open_files(t)
    os.close(ram_fd)
    os.close(state_fd)
    Path(t.state_path).write_bytes(b"QEVM statX")
    with pytest.raises(TemplateError, match=r"is damaged: its state file .* does not match"):
        templates.check_files(t)
    Path(t.state_path).write_bytes(b"QEVM state")
    os.truncate(t.ram_path, MIB)
    with pytest.raises(TemplateError, match=f"has {MIB} bytes, not {4 * MIB}"):
        templates.open_files(t)
    os.unlink(t.ram_path)
    with pytest.raises(TemplateError, match=r"its RAM file .* is missing"):
        templates.check_files(t)
    os.unlink(t.state_path)
    with pytest.raises(TemplateError, match="is missing"):
        templates.check_files(t)


def test_open_files_leaves_nothing_open_on_failure(paths: Paths) -> None:
    t = make_template(paths)
    Path(t.state_path).write_bytes(b"other")
    before = len(os.listdir("/proc/self/fd"))
    with pytest.raises(TemplateError):
        templates.open_files(t)
    assert len(os.listdir("/proc/self/fd")) == before


# -- what a clone shares --------------------------------------------------------------------
def clone_args(**kw: Any) -> dict[str, Any]:
    base: dict[str, Any] = dict(vcpus=1, memory_mib=256, disks=[], ports=[], segments=[],
                                image="minimal", accel="auto", shared_ram=False)
    base.update(kw)
    return base


@pytest.mark.parametrize(("kw", "match"), [
    ({"memory_mib": 512}, "256 MiB of guest RAM.*leave out --memory"),
    ({"vcpus": 2}, "1 vCPU.*leave out --vcpus"),
    ({"disks": ["d0"]}, "cannot have disks"),
    ({"image": "debian"}, "runs its image 'minimal'"),
    ({"accel": "kvm"}, "saved under tcg"),
    ({"shared_ram": True}, "private copy-on-write mapping"),
    ({"segments": ["s:/mnt/s"]}, "has its segments"),
])
def test_a_clone_that_differs_from_its_template_is_refused(paths: Paths, kw: dict[str, Any],
                                                           match: str) -> None:
    t = make_template(paths)
    with pytest.raises(SpecError, match=match) as err:
        templates.check_clone(t, **clone_args(**kw))
    assert str(err.value).endswith(".") and str(err.value).count(". ") == 0
    templates.check_clone(t, **clone_args())


def test_ports_need_a_template_with_a_network_card(paths: Paths) -> None:
    templates.check_clone(make_template(paths, "n"), **clone_args(ports=["8081:80"]))
    with pytest.raises(SpecError, match="no network card"):
        templates.check_clone(make_template(paths, "x", ports=False),
                              **clone_args(ports=["8081:80"]))


# -- device set and argv -------------------------------------------------------------------
def test_a_booted_vm_gets_vmgenid_last_and_keeps_it_in_its_recorded_set() -> None:
    ds = device_set(cfg(vmgenid="aaaaaaaa-0000-0000-0000-000000000001"))
    assert ds.devices[-1].driver == "vmgenid"
    assert ("guid", "aaaaaaaa-0000-0000-0000-000000000001") in ds.devices[-1].props
    assert DeviceSet.loads(ds.dumps()) == ds
    assert all(d.driver != "vmgenid" for d in device_set(cfg()).devices)
    argv = build_argv(cfg(devices=ds, incoming="defer"))
    assert "vmgenid,id=vmgenid0,guid=aaaaaaaa-0000-0000-0000-000000000001" in opt(argv,
                                                                                   "-device")


def test_a_clone_gets_its_templates_devices_and_a_new_vmgenid(paths: Paths) -> None:
    t = make_template(paths)
    base = DeviceSet.loads(t.devices)
    a, b = templates.clone_devices(t), templates.clone_devices(t)
    assert [d.driver for d in a.devices] == [d.driver for d in base.devices]
    assert a.machine == base.machine and a.memory == base.memory and a.smp == base.smp
    guids = {dict(ds.devices[-1].props)["guid"] for ds in (a, b, base)}
    assert len(guids) == 3
    assert [d for d in a.devices if d.driver != "vmgenid"] == \
        [d for d in base.devices if d.driver != "vmgenid"]
    old = make_template(paths, "old", vmgenid=None)
    assert templates.clone_devices(old) == DeviceSet.loads(old.devices)


def test_clone_argv_maps_the_template_read_only_and_loads_its_state(paths: Paths) -> None:
    t = make_template(paths)
    ds = templates.clone_devices(t)
    argv = build_argv(cfg(name="c1", ram_file=None, template_ram=Path(t.ram_path),
                          template_ram_fd=15, template_state_fd=16, devices=ds,
                          incoming="defer"))
    assert opt(argv, "-object") == [
        "memory-backend-file,id=ram0,size=256M,mem-path=/proc/self/fd/15,share=off,"
        "readonly=on,rom=off,merge=off"]
    assert f"fd=16,set={TEMPLATE_STATE_FDSET},opaque=template-state" in opt(argv, "-add-fd")
    assert opt(argv, "-incoming") == ["defer"] and "-S" in argv
    # The template had a network card: the clone has its backend, with no port forward.
    assert opt(argv, "-netdev") == ["user,id=net0"]
    c = cfg(template_ram_fd=15, template_state_fd=16, kernel_fd=3)
    assert {15, 16, 3} <= set(c.passed_fds())


def test_identity_script_and_macs() -> None:
    s = templates.identity_script("c1", "0" * 32, "52:54:00:01:02:03")
    assert "hostname c1" in s and f"echo {'0' * 32} > /etc/machine-id" in s
    assert "ip link set eth0 address 52:54:00:01:02:03" in s
    assert "head -c 64 > /dev/urandom" in s
    macs = {templates.clone_mac(f"c{i}") for i in range(50)}
    assert len(macs) == 50
    assert all(re.fullmatch(r"52:54:00(:[0-9a-f]{2}){3}", m) for m in macs)
    assert templates.clone_mac("c1") == templates.clone_mac("c1")


# -- accounting ------------------------------------------------------------------------------
def test_a_template_counts_once_host_wide_and_a_clone_in_its_partition(
        paths: Paths, db: Database) -> None:
    db.add_partition(PartitionRecord("p", [0], 1024))
    db.add_template(make_template(paths))
    clone = VmRecord(name="c1", partition="p", vcpus=1, memory_mib=256, shared_ram=False,
                     template="t", overhead_mib=128)
    db.add_vm(clone)
    need = capacity.host_now(db)
    assert [str(t) for t in need.terms] == ["p 1024", "template t 256"]
    assert capacity.partition_share(clone) == 256 + 128
    host = HostInfo(cpus=[0, 1], mems=[0], memory_total_mib=1500, memory_reserved_mib=150)
    with pytest.raises(Exception, match="template 'u' keeps 256 MiB"):
        capacity.check_template(db, host, "u", 256)
    capacity.check_template(db, replace(host, memory_total_mib=4000), "u", 256)


def test_smaps_attributes_the_template_file_apart_from_the_clones_copies(
        tmp_path: Path) -> None:
    tpl = "/dev/shm/fusuma/web.template"
    text = "".join([
        smap("55d0c2000000-55d0c4000000 rw-p 00000000 00:00 0 [heap]", 20000, 20000,
             anon=20000, private_dirty=20000),
        # 30 MiB resident: 10 MiB the clone wrote (anon), 20 MiB template pages that two
        # clones share (PSS 10 MiB).
        smap(f"7f0000000000-7f0010000000 rw-p 00000000 00:1a 77 {tpl}", 30720,
             10240 + 10240, anon=10240, shared_clean=20480, private_dirty=10240),
    ])
    use = template_usage(parse_smaps(text))
    assert use is not None and use.name == "web"
    assert (use.rss_kib, use.pss_kib, use.copied_kib) == (20480, 10240, 10240)
    assert template_usage(parse_smaps(text.replace(tpl, "/dev/shm/fusuma/v.ram"))) is None
    rollup = ("00400000-7fffffffffff ---p 00000000 00:00 0 [rollup]\nRss: 50720 kB\n"
              "Pss: 40480 kB\nPss_Anon: 30240 kB\nPss_File: 0 kB\nPss_Shmem: 10240 kB\n")
    make_process(tmp_path, 9, text, rollup=rollup)
    mem = vm_memory(9, {}, procfs=tmp_path, page_size=4096, clone=True)
    split = mem.split_kib()
    assert split == {"private": 40480 - 10240, "template": 10240, "segments": 0, "ksm": 0}
    assert sum(split.values()) == mem.split.pss_kib
    assert mem.as_json()["template"] == {"name": "web", "rss_mib": 20.0, "pss_mib": 10.0,
                                         "copied_mib": 10.0}
    # Not a clone: smaps_rollup only, no template.
    assert vm_memory(9, {}, procfs=tmp_path, page_size=4096).template is None


# -- a clone's definition -------------------------------------------------------------------
class _Q:
    def __init__(self, version: str) -> None:
        self.version = version


def test_a_clone_takes_its_templates_guest_and_refuses_what_differs(
        paths: Paths, db: Database, monkeypatch: pytest.MonkeyPatch) -> None:
    from fusuma.partition.manager import PartitionManager
    from fusuma.qemu import versions
    from fusuma.spec import VmSpec, build
    from fusuma.vm import VmManager

    host = HostInfo(cpus=[0, 1], mems=[0], memory_total_mib=8192, memory_reserved_mib=800)
    vms = VmManager(paths, db, PartitionManager(paths, db, host))
    db.add_template(replace(make_template(paths), vcpus=2, memory_mib=512,
                            segments=["s:/mnt/s"]))
    monkeypatch.setattr(versions, "resolve", lambda p, q: _Q("10.0.2" if q else "7.2.22"))
    spec = build(VmSpec, "vm", name="c1", partition="p", template="t", ports=["8081:80"])
    got = vms._clone_spec(spec, "10.0")
    assert (got.vcpus, got.memory_mib, got.segments, got.image) == (2, 512, ["s:/mnt/s"],
                                                                    "minimal")
    assert got.shared_ram is False and got.accel == "tcg" and got.machine == "pc-q35-7.2"
    with pytest.raises(SpecError, match="leave out --memory"):
        vms._clone_spec(build(VmSpec, "vm", name="c1", partition="p", template="t",
                              memory_mib=256), "10.0")
    with pytest.raises(SpecError, match="never a shared file"):
        vms._clone_spec(build(VmSpec, "vm", name="c1", partition="p", template="t",
                              shared_ram=True), "10.0")
    with pytest.raises(TemplateError, match=r"partition 'p' runs QEMU 7\.2\.22"):
        vms._clone_spec(spec, None)
    os.truncate(db.template("t").ram_path, MIB)
    with pytest.raises(TemplateError, match="is damaged"):
        vms._clone_spec(spec, "10.0")


# -- clones with NICs on fusuma's networks ---------------------------------------------------
def test_a_template_keeps_its_networks_and_a_clone_gets_nics_there(
        paths: Paths, db: Database, monkeypatch: pytest.MonkeyPatch) -> None:
    from fusuma.partition.manager import PartitionManager
    from fusuma.qemu import versions
    from fusuma.spec import NicSpec, VmSpec, build
    from fusuma.vm import VmManager

    host = HostInfo(cpus=[0, 1], mems=[0], memory_total_mib=8192, memory_reserved_mib=800)
    vms = VmManager(paths, db, PartitionManager(paths, db, host))
    db.add_template(replace(make_template(paths, ports=False), networks=["lan0", "lan1"]))
    assert db.template("t").networks == ["lan0", "lan1"]
    monkeypatch.setattr(versions, "resolve", lambda p, q: _Q("10.0.2"))
    got = vms._clone_spec(build(VmSpec, "vm", name="c1", partition="p", template="t",
                                ports=["8081:80"]), "10.0")
    assert got.nics == [NicSpec(network="lan0"), NicSpec(network="lan1")]
    asked = build(VmSpec, "vm", name="c1", partition="p", template="t",
                  nics=[{"network": "lan0", "ip": "10.0.5.9"}, {"network": "lan1"}])
    assert vms._clone_spec(asked, "10.0").nics == asked.nics
    with pytest.raises(SpecError, match=r"has 2 NIC\(s\) on network\(s\) lan0, lan1") as err:
        vms._clone_spec(build(VmSpec, "vm", name="c1", partition="p", template="t",
                              nics=[{"network": "lan0"}]), "10.0")
    assert str(err.value).count(". ") == 0
    plain = make_template(paths, "plain")
    with pytest.raises(SpecError, match="has no NIC on fusuma's networks"):
        templates.check_clone_nics(plain, 1)
    templates.check_clone_nics(plain, 0)


def test_a_clones_identity_gives_each_nic_its_mac_and_asks_dhcp_again() -> None:
    nics: list[tuple[str, str, str | None]] = [
        ("52:54:00:aa:00:01", "52:54:00:bb:00:01", "10.0.5.3"),
        ("52:54:00:aa:00:02", "52:54:00:bb:00:02", None)]
    s = templates.identity_script("c1", "0" * 32, templates.clone_mac("c1"), nics)
    # The user-mode NIC's step is not run: eth0 is a tap NIC, found by its MAC.
    assert templates.clone_mac("c1") not in s and "10.0.2.2" not in s
    assert s.index("kill $(pidof udhcpc dhclient)") < s.index("ip link set $d0 address "
                                                              "52:54:00:bb:00:01")
    assert '= 52:54:00:aa:00:02 ] && d1=' in s and "ip link set $d1 address 52:54:00:bb:00:02" in s
    assert s.count("udhcpc -i $d") == 2 and "hostname:c1" in s
    # A Debian image's client (ifupdown's files), when the guest has no udhcpc.
    assert s.count("elif command -v dhclient") == 2
    assert "dhclient -4 -1 -pf /run/dhclient.$d1.pid -lf /var/lib/dhcp/dhclient.$d1.leases $d1" \
        in s and "rm -f /var/lib/dhcp/dhclient.$d0.leases" in s
    assert "grep -q ' 10.0.5.3/' || exit 6" in s and s.count("exit 6") == 1
    assert s.endswith("head -c 64 > /dev/urandom || exit 4")
    for bad in [("52:54:00:aa:00:01", "52:54:00:bb:00:01; reboot", None),
                ("52:54:00:aa:00:01", "52:54:00:bb:00:01", "10.0.5.3; reboot")]:
        with pytest.raises(TemplateError, match="is not a MAC"):
            templates.identity_script("c1", "0" * 32, "52:54:00:01:02:03", [bad])


def test_nic_macs_are_the_tap_nics_of_a_device_set() -> None:
    from fusuma.qemu.cmdline import NicConfig

    ds = device_set(cfg(nics=[
        NicConfig("nic0", "52:54:00:aa:00:01", 1, "fzt-1-0", "fzb-lan0", "lan0"),
        NicConfig("nic1", "52:54:00:aa:00:02", 1, "fzt-1-1", "fzb-lan1", "lan1")]))
    assert templates.nic_macs(ds) == {"nic0": "52:54:00:aa:00:01",
                                      "nic1": "52:54:00:aa:00:02"}
    assert templates.nic_macs(device_set(cfg(ports=[(8080, 80)]))) == {}
