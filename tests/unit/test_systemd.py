"""fusuma on a systemd host, without one: unit names and files, systemctl's refusals as
one sentence, the systemd cgroup driver on a fake cgroupfs, and the partition manager
starting a supervisor as a unit (a fake systemctl). The real thing runs in a guest
(tests/cgroup2, test_4_systemd.py and test_5_failures.py)."""

from __future__ import annotations

import errno
import os
from pathlib import Path

import pytest

from fusuma.errors import CgroupError, HostError, SupervisorError
from fusuma.host import systemd
from fusuma.host.cgroups import Limits, detect
from fusuma.host.cgroups.systemd import CgroupSystemdDriver
from fusuma.host.systemd import Units, slice_path, wanted
from tests.unit.test_cgroups import FakeCgroupFs, read

MIB = 1 << 20


class FakeSystemctl:
    """Records every command; answers 0 unless ``fail`` names the verb. ``changed``:
    units whose files changed on disk since systemd read them (until a daemon-reload)."""

    def __init__(self, fail: dict[str, str] | None = None) -> None:
        self.calls: list[list[str]] = []
        self.fail = fail or {}
        self.active: set[str] = set()
        self.changed: set[str] = set()

    def __call__(self, argv: list[str]) -> tuple[int, str, str]:
        self.calls.append(argv)
        verb = argv[1] if len(argv) > 1 else ""
        if verb in self.fail:
            return 1, "", self.fail[verb]
        if verb == "is-active":
            return (0 if argv[-1] in self.active else 3), "", ""
        if verb == "daemon-reload":
            self.changed.clear()
        if verb == "show" and argv[3:] == ["--property=NeedDaemonReload"]:
            return 0, f"NeedDaemonReload={'yes' if argv[2] in self.changed else 'no'}\n", ""
        if verb == "show":
            return 0, "MainPID=4242\nResult=success\n", ""
        return 0, "", ""

    def verbs(self) -> list[str]:
        return [" ".join(c[1:3]) for c in self.calls if c[0] == "systemctl"]


def units(tmp_path: Path, prefix: str = "fusuma",
          run: FakeSystemctl | None = None) -> Units:
    return Units(prefix, python="/opt/fusuma/venv/bin/python3", unit_dir=tmp_path / "etc",
                 runtime_dir=tmp_path / "run", run=run or FakeSystemctl())


def test_names_and_slices(tmp_path: Path) -> None:
    u = units(tmp_path)
    assert (u.slice, u.supervisor("p0"), u.ram) == (
        "fusuma.slice", "fusuma-supervisor@p0.service", "fusuma-ram@fusuma.service")
    assert u.cgroup(u.supervisor("p0")) == "fusuma.slice/fusuma-supervisor@p0.service"
    t = units(tmp_path, "fusuma-test-ab12")
    assert t.slice == "fusuma-test-ab12.slice"
    assert slice_path(t.slice) == \
        "fusuma.slice/fusuma-test.slice/fusuma-test-ab12.slice"
    assert t.supervisor("p0") == "fusuma-supervisor@fusuma-test-ab12:p0.service"
    assert t.partition_of("fusuma-supervisor@fusuma-test-ab12:p0.service") == "p0"
    assert t.partition_of("fusuma-supervisor@p0.service") is None
    assert u.partition_of("fusuma-supervisor@x:p0.service") is None
    assert units(tmp_path, "lab").slice == "fusuma-lab.slice"
    with pytest.raises(HostError, match="cannot name a systemd slice"):
        units(tmp_path, "machine.slice/fusuma")


def test_unit_files_delegate_and_keep_vms_on_restart(tmp_path: Path) -> None:
    run = FakeSystemctl()
    u = units(tmp_path, run=run)
    written = u.install()
    assert sorted(p.name for p in written) == ["fusuma-network@.service", "fusuma-ram@.service",
                                                "fusuma-supervisor@.service", "fusuma.slice"]
    sup = (tmp_path / "etc" / "fusuma-supervisor@.service").read_text()
    for line in ("Delegate=yes", "KillMode=process", "Slice=fusuma.slice",
                 'ExecStart="/opt/fusuma/venv/bin/python3" -P -m fusuma.supervisor %i',
                 "WorkingDirectory=/"):
        assert line in sup.splitlines(), line
    ram = (tmp_path / "etc" / "fusuma-ram@.service").read_text()
    # Unit-file escapes: $$ is the shell's $, $$$$ its $$ (the keeper's pid).
    assert 'echo $$$$ > "$$c/keeper/cgroup.procs" && exec sleep infinity' in ram
    assert run.verbs() == ["daemon-reload"]
    assert u.install() == [] and run.verbs() == ["daemon-reload"]


def test_supervisor_dropin_and_limits(tmp_path: Path) -> None:
    run = FakeSystemctl()
    u = units(tmp_path, "fusuma-test-ab12", run=run)
    u.write_supervisor("p0", {"FUSUMA_HOME": "/var/lib/a b", "X": '50% "q"'},
                       Path("/var/log/sup.log"))
    text = u.dropin_path(u.supervisor("p0")).read_text().splitlines()
    assert "Slice=fusuma-test-ab12.slice" in text
    assert text.index("ExecStart=") + 1 == text.index(
        'ExecStart="/opt/fusuma/venv/bin/python3" -P -m fusuma.supervisor "p0"')
    assert 'Environment="FUSUMA_HOME=/var/lib/a b"' in text
    assert 'Environment="X=50%% \\"q\\""' in text
    assert "StandardOutput=append:/var/log/sup.log" in text
    lim = Limits(cpus=[1, 2], mems=[0], memory_bytes=384 * MIB, io_weight=300)
    u.write_limits(u.supervisor("p0"), lim)
    assert not any(c[1] == "set-property" for c in run.calls)   # not on a stopped unit
    u.set_limits(u.supervisor("p0"), lim)
    assert run.calls[-1] == ["systemctl", "set-property", "--runtime", u.supervisor("p0"),
                             "AllowedCPUs=1-2", "AllowedMemoryNodes=0",
                             f"MemoryMax={384 * MIB}", "IOWeight=300"]
    u.forget(u.supervisor("p0"))
    assert not u.dropin_path(u.supervisor("p0")).parent.exists()
    assert [v for v in run.verbs() if v.startswith(("stop", "revert"))] == \
        ["stop fusuma-supervisor@fusuma-test-ab12:p0.service",
            "revert fusuma-supervisor@fusuma-test-ab12:p0.service"]


def test_dropins_cost_one_reload_before_the_verb_that_needs_them(tmp_path: Path) -> None:
    # A daemon-reload takes seconds on a slow host: a partition's limits and its
    # supervisor's drop-in are read by one, just before the unit starts.
    run = FakeSystemctl()
    u = units(tmp_path, run=run)
    unit = u.supervisor("p0")
    lim = Limits(cpus=[1], mems=[0], memory_bytes=256 * MIB)
    u.write_limits(unit, lim)
    u.write_supervisor("p0", {}, Path("/var/log/sup.log"))
    assert run.verbs() == []
    u.start(unit)
    assert run.verbs() == ["daemon-reload", f"start {unit}"]
    u.start(unit)                       # nothing new: systemd is asked, no reload
    u.write_limits(unit, lim)                           # the same text: nothing new
    u.set_limits(unit, Limits(cpus=[0], mems=[0], memory_bytes=256 * MIB))
    assert run.verbs()[2:] == [f"show {unit}", f"start {unit}", "daemon-reload",
                               "set-property --runtime"]
    # forget: `revert` reloads (its own and our removed drop-ins); a failed one does not.
    run.calls.clear()
    u.forget(unit)
    assert run.verbs() == [f"stop {unit}", f"reset-failed {unit}", f"revert {unit}"]
    assert not u.dropin_path(unit).parent.exists()
    failing = FakeSystemctl({"revert": "Failed to revert unit: Unit file is masked."})
    units(tmp_path, run=failing).forget(unit)
    assert failing.verbs()[-2:] == [f"revert {unit}", "daemon-reload"]


def test_a_killed_writers_dropins_are_reloaded_before_the_unit_starts(
        tmp_path: Path) -> None:
    # A CLI killed between writing a drop-in and the reload: the next process writes
    # the same text (nothing new to it), and systemd still runs on the old one.
    run = FakeSystemctl()
    unit = units(tmp_path).supervisor("p0")
    lim = Limits(cpus=[1], mems=[0], memory_bytes=256 * MIB)
    killed = units(tmp_path, run=run)
    killed.write_limits(unit, lim)
    killed.write_supervisor("p0", {}, Path("/var/log/sup.log"))
    assert run.verbs() == []                            # killed here: no reload
    run.changed.add(unit)
    u = units(tmp_path, run=run)
    u.write_limits(unit, lim)
    u.write_supervisor("p0", {}, Path("/var/log/sup.log"))
    assert not u.stale
    u.start(unit)
    assert run.verbs() == [f"show {unit}", "daemon-reload", f"start {unit}"]
    assert run.calls[0] == ["systemctl", "show", unit, "--property=NeedDaemonReload"]
    # set-property too: a resize after the killed one reloads what it left.
    run.calls.clear()
    run.changed.add(unit)
    u.set_limits(unit, lim)
    assert run.verbs() == [f"show {unit}", "daemon-reload", "set-property --runtime"]
    # A systemd that cannot say gets the reload: one too many is only slow.
    mute = FakeSystemctl({"show": "Failed to connect to bus"})
    units(tmp_path, run=mute).start(unit)
    assert mute.verbs() == [f"show {unit}", "daemon-reload", f"start {unit}"]
    # This process's own drop-ins: one reload, systemd not asked.
    run.calls.clear()
    u.write_limits(unit, Limits(cpus=[2], mems=[0], memory_bytes=256 * MIB))
    u.start(unit)
    assert run.verbs() == ["daemon-reload", f"start {unit}"]


def test_a_wait_loop_asks_systemctl_once_a_second(tmp_path: Path,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    run = FakeSystemctl()
    u = units(tmp_path, run=run)
    unit = u.supervisor("p0")
    now = [100.0]
    monkeypatch.setattr(systemd.time, "monotonic", lambda: now[0])
    active = u.active_check(unit)
    run.active.add(unit)
    assert active() and active()
    now[0] += 0.5
    run.active.clear()
    assert active()                                      # what it heard 0.5 s ago
    now[0] += 0.5
    assert not active()
    assert run.verbs() == ["is-active --quiet"] * 2


def test_a_refusing_systemd_is_one_sentence(tmp_path: Path) -> None:
    run = FakeSystemctl({"start": "Failed to start fusuma-supervisor@p0.service: Unit "
                                  "fusuma.slice is masked.\n"})
    u = units(tmp_path, run=run)
    with pytest.raises(HostError) as err:
        u.start(u.supervisor("p0"))
    assert str(err.value) == ("systemd refused to start fusuma-supervisor@p0.service in "
                              "fusuma.slice: Failed to start fusuma-supervisor@p0.service: "
                              "Unit fusuma.slice is masked.")


def test_when_supervisors_run_as_units(tmp_path: Path) -> None:
    proc, run = tmp_path / "proc", tmp_path / "run-systemd"
    (proc / "1").mkdir(parents=True)
    (proc / "1" / "comm").write_text("systemd\n")
    assert not wanted("auto", True, proc, run)          # no /run/systemd/system
    (run / "system").mkdir(parents=True)
    assert wanted("auto", True, proc, run) and not wanted("auto", False, proc, run)
    assert not wanted("0", True, proc, run)
    with pytest.raises(HostError, match="needs the cgroup v2 hierarchy"):
        wanted("1", False, proc, run)
    (proc / "1" / "comm").write_text("init\n")
    assert not wanted("auto", True, proc, run)
    with pytest.raises(HostError, match="FUSUMA_SYSTEMD=1 but PID 1 is 'init', not systemd"):
        wanted("1", True, proc, run)
    with pytest.raises(HostError, match="not a setting"):
        wanted("yes", True, proc, run)


# -- detection ---------------------------------------------------------------------------

def _v2_host(tmp_path: Path, controllers: str) -> tuple[Path, Path]:
    root = tmp_path / "cgroup"
    root.mkdir()
    (root / "cgroup.controllers").write_text(controllers + "\n")
    mountinfo = tmp_path / "mountinfo"
    mountinfo.write_text(f"30 23 0:26 / {root} rw,nosuid - cgroup2 cgroup2 rw,nsdelegate\n")
    return root, mountinfo


def test_detect_picks_the_systemd_driver_on_a_systemd_host(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    root, mountinfo = _v2_host(tmp_path, "cpuset cpu io memory pids")
    monkeypatch.setattr(systemd, "booted", lambda *a: True)
    drv = detect("fusuma", root=root, mountinfo=mountinfo)
    assert isinstance(drv, CgroupSystemdDriver) and drv.partition_mode == "off"
    plain = detect("fusuma", root=root, mountinfo=mountinfo, systemd="0")
    assert not isinstance(plain, CgroupSystemdDriver)


def test_a_v2_host_without_cpuset_is_one_sentence(tmp_path: Path) -> None:
    root, mountinfo = _v2_host(tmp_path, "cpu io memory pids")
    with pytest.raises(HostError) as err:
        detect("fusuma", root=root, mountinfo=mountinfo)
    assert str(err.value) == (
        f"the cgroup v2 hierarchy at {root} does not offer the cpuset controller (it "
        "offers: cpu io memory pids), so partitions cannot be held to their cores; use a "
        "kernel with CONFIG_CPUSETS and make sure no cgroup v1 hierarchy binds cpuset")


# -- the driver on a fake cgroupfs ---------------------------------------------------------

UNIT_CG = {"cgroup.controllers": "cpuset cpu io memory pids\n", "cgroup.subtree_control": "",
           "cgroup.procs": "", "cgroup.threads": "", "cgroup.type": "domain\n",
           "cpuset.cpus": "", "cpuset.cpus.effective": "1\n",
           "cpuset.cpus.partition": "member\n", "memory.max": "max\n",
           "memory.current": "8192\n", "cpu.weight": "100\n", "cpu.max": "max 100000\n",
           "cpu.idle": "0\n"}


def make_driver(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                controllers: str = "cpuset cpu io memory pids"
                ) -> tuple[CgroupSystemdDriver, FakeSystemctl, Path]:
    mount = tmp_path / "cg"
    mount.mkdir()
    run = FakeSystemctl()
    u = units(tmp_path, run=run)
    drv = CgroupSystemdDriver(mount, "fusuma", u)
    FakeCgroupFs({mount: UNIT_CG}).install(drv, monkeypatch)
    # What systemd does when the unit starts: its cgroup, with what the slice offers.
    part = mount / "fusuma.slice" / "fusuma-supervisor@p0.service"
    part.mkdir(parents=True)
    for name, content in UNIT_CG.items():
        (part / name).write_text(content)
    (part / "cgroup.controllers").write_text(controllers + "\n")
    notices: list[str] = []
    drv.notice = notices.append
    return drv, run, part


def test_driver_limits_go_through_systemd(tmp_path: Path,
                                          monkeypatch: pytest.MonkeyPatch) -> None:
    drv, run, part = make_driver(tmp_path, monkeypatch)
    lim = Limits(cpus=[1], mems=[0], memory_bytes=256 * MIB)
    with pytest.raises(CgroupError, match="already exists"):
        drv.create("p0", lim)
    part.rename(part.with_name("x"))
    drv.create("p0", lim)
    dropin = drv.units.dropin_path(drv.units.supervisor("p0"), systemd.LIMITS_DROPIN)
    assert "AllowedCPUs=1" in dropin.read_text().splitlines()
    assert not any(c[1] == "set-property" for c in run.calls)
    part.with_name("x").rename(part)
    (part / "cpuset.cpus").write_text("1\n")
    drv.update("p0", lim)
    assert run.calls[-1][1:3] == ["set-property", "--runtime"]
    (part / "cpuset.cpus").write_text("0\n")
    with pytest.raises(CgroupError, match=r"systemd did not give fusuma-supervisor@p0\.service "
                       r"cores 1 \(its cpuset\.cpus is 0\)"):
        drv.update("p0", lim)
    assert drv.groups() == ["p0"] and drv.memory_current("p0") == 8192
    assert drv.cores_held_by("p0") == "shared"


def test_driver_leaves_are_threaded(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    drv, _run, part = make_driver(tmp_path, monkeypatch)
    drv.create_leaf("p0", "supervisor")
    drv.create_leaf("p0", "vm.a")
    assert read(part / "vm.a" / "cgroup.type") == "threaded"
    assert read(part / "cgroup.subtree_control") == "+cpu +cpuset"
    # A threaded cgroup's cgroup.procs cannot be read: its processes come from
    # cgroup.threads (this test's own thread stands for a QEMU thread).
    (part / "vm.a" / "cgroup.threads").write_text(f"{os.getpid()}\n")
    real = Path.read_text

    def read_text(self: Path, *a: object, **k: object) -> str:
        if self == part / "vm.a" / "cgroup.procs":
            raise OSError(errno.EOPNOTSUPP, "Operation not supported")
        return real(self)
    monkeypatch.setattr(Path, "read_text", read_text)
    assert drv.pids("p0") == [os.getpid()]


def test_driver_supervisor_leaf_gets_the_control_weight(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    drv, _run, part = make_driver(tmp_path, monkeypatch)
    drv.create_leaf("p0", "supervisor")
    drv.set_control_cpu("p0", "supervisor")
    assert read(part / "supervisor" / "cpu.weight") == "10000"
    assert read(part / "supervisor" / "cpu.max") == "max 100000"


def test_driver_without_cpuset_delegated(tmp_path: Path,
                                         monkeypatch: pytest.MonkeyPatch) -> None:
    drv, _run, part = make_driver(tmp_path, monkeypatch, controllers="cpu memory pids")
    with pytest.raises(CgroupError) as err:
        drv.create_leaf("p0", "supervisor")
    assert str(err.value) == (
        "systemd did not delegate the cpuset controller to fusuma-supervisor@p0.service (it "
        "offers: cpu memory pids), so the partition cannot be held to its cores; give the "
        "unit Delegate=yes on a kernel with cpusets, or set FUSUMA_SYSTEMD=0")
    assert not (part / "supervisor").exists()


# -- the partition manager starting a unit -------------------------------------------------

def test_manager_starts_the_supervisor_as_a_unit_or_says_why_not(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from fusuma.partition.manager import PartitionManager
    from fusuma.paths import Paths
    from fusuma.state import Database, PartitionRecord

    paths = Paths(home=tmp_path / "home", runtime=tmp_path / "rt", shm=tmp_path / "shm",
                  cache=tmp_path / "cache", cgroup_prefix="fusuma")
    paths.home.mkdir()
    monkeypatch.setattr(Paths, "ensure_runtime", lambda self: None)   # not its subject
    db = Database(paths.db)
    db.add_partition(PartitionRecord(name="p0", cpus=[1], memory_mib=256))
    run = FakeSystemctl({"start": "Unit fusuma.slice is masked.\n"})
    u = units(tmp_path, run=run)
    monkeypatch.setattr(PartitionManager, "units", property(lambda self: u))
    mgr = PartitionManager(paths, db)
    # fusuma in a named network namespace: the supervisor's unit runs there too.
    monkeypatch.setattr(systemd, "named_netns", lambda what: Path("/run/netns/t-1"))
    with pytest.raises(SupervisorError) as err:
        mgr.start_supervisor("p0")
    assert str(err.value) == ("the supervisor of partition 'p0' did not start: systemd "
                              "refused to start fusuma-supervisor@p0.service in "
                              "fusuma.slice: Unit fusuma.slice is masked.")
    assert run.verbs()[-2:] \
        == ["stop fusuma-supervisor@p0.service", "reset-failed fusuma-supervisor@p0.service"]
    dropin = u.dropin_path("fusuma-supervisor@p0.service").read_text()
    assert f'Environment="FUSUMA_HOME={paths.home}"' in dropin
    assert "NetworkNamespacePath=/run/netns/t-1" in dropin.splitlines()
    # Stopping: systemctl stop (KillMode=process spares the VMs), only when it runs.
    assert mgr.stop_supervisor("p0") is False
    run.active.add("fusuma-supervisor@p0.service")
    assert mgr.stop_supervisor("p0") is True and run.verbs()[-1] == \
        "stop fusuma-supervisor@p0.service"


def test_a_networks_keeper_runs_as_a_unit_or_says_why_not(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from fusuma.errors import NetworkError
    from fusuma.network import keeper
    from fusuma.network.manager import NetworkManager
    from fusuma.paths import Paths
    from fusuma.state import Database, NetworkRecord

    paths = Paths(home=tmp_path / "home", runtime=tmp_path / "rt", shm=tmp_path / "shm",
                  cache=tmp_path / "cache", cgroup_prefix="fusuma-test-ab12")
    paths.home.mkdir()
    db = Database(paths.db)
    rec = NetworkRecord("lan0", "managed", "fzb-lan0", "10.0.5.0/24", nat=True)
    db.add_network(rec)
    run = FakeSystemctl()
    u = units(tmp_path, "fusuma-test-ab12", run=run)
    monkeypatch.setattr(NetworkManager, "units", lambda self: u)
    dnsmasq_up: list[int] = []
    monkeypatch.setattr(keeper, "dnsmasq_pid", lambda f: dnsmasq_up[0] if dnsmasq_up else None)
    monkeypatch.setattr(keeper, "keeper_pid", lambda *a: None)
    nets = NetworkManager(paths, db)
    unit = "fusuma-network@fusuma-test-ab12:lan0.service"
    assert u.network("lan0") == unit
    # The unit starts; once its dnsmasq runs, the keeper's pid is the unit's main pid.
    run.active.add(unit)
    dnsmasq_up.append(777)
    assert nets.start_keeper(rec, timeout=2) == 4242
    text = (tmp_path / "etc" / "fusuma-network@.service").read_text()
    for line in ('ExecStart="/opt/fusuma/venv/bin/python3" -P -m fusuma.network.keeper %i',
                 "KillMode=process", "Restart=on-failure", "Slice=fusuma.slice"):
        assert line in text.splitlines(), line
    dropin = u.dropin_path(unit).read_text()
    assert "Slice=fusuma-test-ab12.slice" in dropin
    assert '-m fusuma.network.keeper "lan0"' in dropin
    assert f'Environment="FUSUMA_HOME={paths.home}"' in dropin
    assert f"StandardOutput=append:{paths.network_dir('lan0') / 'keeper.log'}" in dropin
    assert f"start {unit}" in run.verbs()
    # Stopping it stops the unit and removes its drop-ins.
    assert nets.stop_keeper(rec) is True
    assert f"stop {unit}" in run.verbs() and not u.dropin_path(unit).exists()
    # A unit that ends before its dnsmasq runs: one sentence, and it is stopped again.
    run.active.clear()
    dnsmasq_up.clear()
    with pytest.raises(NetworkError, match=r"the dnsmasq keeper of network 'lan0' "
                                           rf"\({unit}\) exited at start"):
        nets.start_keeper(rec, timeout=2)
    assert not u.dropin_path(unit).exists()
    refusing = FakeSystemctl({"start": "Unit fusuma-test-ab12.slice is masked.\n"})
    u.run = refusing
    with pytest.raises(NetworkError) as err:
        nets.start_keeper(rec, timeout=2)
    assert str(err.value) == ("the dnsmasq keeper of network 'lan0' did not start: systemd "
                              f"refused to start {unit} in fusuma-test-ab12.slice: Unit "
                              "fusuma-test-ab12.slice is masked.")


def test_keeper_and_supervisor_units_run_in_fusumas_named_network_namespace(
        tmp_path: Path) -> None:
    proc, run = tmp_path / "proc", tmp_path / "netns"
    for d in (proc / "self" / "ns", proc / "1" / "ns", run):
        d.mkdir(parents=True)
    (proc / "1" / "ns" / "net").write_text("host")
    (proc / "self" / "ns" / "net").write_text("test")
    with pytest.raises(HostError) as err:
        systemd.named_netns("a partition's supervisor", proc, run)
    assert str(err.value) == (
        "fusuma runs in a network namespace without a name, and systemd starts a "
        "partition's supervisor only in the host's or a named one (`ip netns add NAME`, "
        "then `nsenter --net=/run/netns/NAME`); or set FUSUMA_SYSTEMD=0")
    os.link(proc / "self" / "ns" / "net", run / "fusuma-t-1")    # the same inode
    assert systemd.named_netns("x", proc, run) == run / "fusuma-t-1"
    (proc / "self" / "ns" / "net").unlink()
    os.link(proc / "1" / "ns" / "net", proc / "self" / "ns" / "net")
    assert systemd.named_netns("x", proc, run) is None             # the host's own
    u = units(tmp_path)
    line = f"NetworkNamespacePath={run / 'fusuma-t-1'}"
    u.write_network("lan0", {}, tmp_path / "log", run / "fusuma-t-1")
    assert line in u.dropin_path(u.network("lan0")).read_text().splitlines()
    # The supervisor too: it makes the taps and puts them on the bridges there.
    u.write_supervisor("p0", {}, tmp_path / "log", run / "fusuma-t-1")
    assert line in u.dropin_path(u.supervisor("p0")).read_text().splitlines()
    u.write_supervisor("p1", {}, tmp_path / "log")
    assert "NetworkNamespacePath" not in u.dropin_path(u.supervisor("p1")).read_text()
