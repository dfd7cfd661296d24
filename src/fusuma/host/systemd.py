"""fusuma on a host whose PID 1 is systemd: supervisors run as units, and fusuma writes
only inside the cgroups systemd delegated to them.

systemd owns the cgroup tree on such a host and expects to be the only writer above
what it delegated (systemd.io/CGROUP_DELEGATION). fusuma installs, once (what
`fusuma up` prints)::

    fusuma.slice                 all of fusuma; a cgroup prefix P other than "fusuma"
                                 (a test namespace) gets a slice of its own below it
    fusuma-supervisor@.service   one unit per partition: Delegate=yes, KillMode=process
    fusuma-ram@.service          the holder of the guest RAM cgroups, one per prefix
    fusuma-network@.service      one unit per managed network: its dnsmasq's keeper
                                 (fusuma.network.keeper), restarted when it dies

and per instance runtime drop-ins (``/run/systemd/system/UNIT.d/50-fusuma*.conf``) with
the slice, the supervisor's command line, environment and log, and the partition's
limits as the unit's properties (AllowedCPUs=, AllowedMemoryNodes=, MemoryMax=,
IOWeight=; changed live with ``systemctl set-property --runtime``): the unit's own
cgroup attributes are systemd's; only the cgroups below it are fusuma's.

Restarting a supervisor's unit never touches its VMs: KillMode=process signals only the
supervisor, and the VMs' QEMUs live in the unit's sub-cgroups (``vm.NAME``), where the
next supervisor adopts them. Those sub-cgroups are *threaded*: systemd before 254 (no
DelegateSubgroup=) starts a unit's new main process in the unit's own cgroup, which the
kernel refuses (EBUSY, status 219/CGROUP) while children with domain controllers hold
processes; with threaded children and only the thread-mode controllers (cpu, cpuset)
enabled below it, the unit's cgroup takes the new supervisor beside its running VMs.

Guest RAM needs memory cgroups that outlive every process, and systemd removes an empty
unit's cgroup: ``fusuma-ram@`` runs a keeper (``sleep infinity``) that moves itself into
the leaf ``keeper``, and the RAM groups are its siblings.

The kernel's cpuset partitions are out of reach here: a partition root needs its parent
to be one up to the root cgroup (or, 6.7+, ``cpuset.cpus.exclusive`` on every
ancestor), and those ancestors are systemd's slices. Partitions then hold their cores
with a plain cpuset (AllowedCPUs=), and fusuma says so.
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from fusuma.errors import HostError
from fusuma.host.limits import Limits
from fusuma.host.topology import format_cpulist

LOG = logging.getLogger(__name__)

SLICE = "fusuma.slice"
SUPERVISOR_TEMPLATE = "fusuma-supervisor@.service"
RAM_TEMPLATE = "fusuma-ram@.service"
NETWORK_TEMPLATE = "fusuma-network@.service"
UNIT_DIR = Path("/etc/systemd/system")
RUNTIME_UNIT_DIR = Path("/run/systemd/system")
DROPIN = "50-fusuma.conf"
LIMITS_DROPIN = "50-fusuma-limits.conf"
KEEPER = "keeper"
SETTINGS = ("auto", "1", "0")
_PREFIX = re.compile(r"^[A-Za-z0-9_]+(-[A-Za-z0-9_]+)*\Z")
_TIMEOUT_S = 60.0
ACTIVE_POLL_S = 1.0

# A command's result: (exit code, stdout, stderr). Tests replace the runner.
Runner = Callable[[list[str]], tuple[int, str, str]]


def _run(argv: list[str]) -> tuple[int, str, str]:
    try:
        p = subprocess.run(argv, capture_output=True, text=True, timeout=_TIMEOUT_S,
                           check=False)
    except FileNotFoundError as exc:
        raise HostError(f"{argv[0]} is not on this host, though PID 1 is systemd; install "
                        "systemd's tools or set FUSUMA_SYSTEMD=0") from exc
    except subprocess.TimeoutExpired as exc:
        raise HostError(f"`{' '.join(argv)}` did not answer in {_TIMEOUT_S:.0f} s; "
                        "see `systemctl list-jobs`") from exc
    return p.returncode, p.stdout, p.stderr


def pid1(proc: Path = Path("/proc")) -> str:
    """The name of PID 1's program ("systemd", "init", ...); "" when unreadable."""
    try:
        return (proc / "1" / "comm").read_text().strip()
    except OSError:
        return ""


def booted(proc: Path = Path("/proc"), run: Path = RUNTIME_UNIT_DIR.parent) -> bool:
    """True when systemd is PID 1 (sd_booted(): /run/systemd/system exists)."""
    return pid1(proc) == "systemd" and (run / "system").is_dir()


def wanted(setting: str, unified: bool, proc: Path = Path("/proc"),
           run: Path = RUNTIME_UNIT_DIR.parent) -> bool:
    """Whether supervisors run as systemd units: FUSUMA_SYSTEMD ("auto", "1", "0") on a
    host with (``unified``) or without a cgroup v2 hierarchy with cpuset."""
    if setting not in SETTINGS:
        raise HostError(f"FUSUMA_SYSTEMD={setting!r} is not a setting; use auto, 1 or 0")
    if setting == "0":
        return False
    if setting == "1":
        if not booted(proc, run):
            raise HostError(f"FUSUMA_SYSTEMD=1 but PID 1 is {pid1(proc) or 'unknown'!r}, "
                            "not systemd; unset it (or set FUSUMA_SYSTEMD=0)")
        if not unified:
            raise HostError("FUSUMA_SYSTEMD=1 needs the cgroup v2 hierarchy with the "
                            "cpuset controller, which this host does not offer; boot with "
                            "systemd.unified_cgroup_hierarchy=1 or set FUSUMA_SYSTEMD=0")
        return True
    return unified and booted(proc, run)


def named_netns(what: str, proc: Path = Path("/proc"),
                run: Path = Path("/run/netns")) -> Path | None:
    """The path (``/run/netns/NAME``) of the network namespace this process runs in,
    None when it is PID 1's; one sentence when it is another without a name: systemd
    starts a unit (``what``) in a namespace only if it can open it by path, and a
    unit that ran in PID 1's instead would make its taps, or bind its dnsmasq, where
    fusuma's bridges are not."""
    def ident(path: Path) -> tuple[int, int]:
        st = path.stat()
        return st.st_dev, st.st_ino

    try:
        mine = ident(proc / "self" / "ns" / "net")
        if mine == ident(proc / "1" / "ns" / "net"):
            return None
    except OSError:
        return None
    for named in sorted(run.glob("*")) if run.is_dir() else []:
        with contextlib.suppress(OSError):
            if ident(named) == mine:
                return named
    raise HostError(f"fusuma runs in a network namespace without a name, and systemd "
                    f"starts {what} only in the host's or a named one (`ip netns add "
                    "NAME`, then `nsenter --net=/run/netns/NAME`); or set FUSUMA_SYSTEMD=0")


def slice_path(name: str) -> str:
    """The cgroup path of slice ``name`` below the root: each dash opens a level
    (``a-b.slice`` is ``a.slice/a-b.slice``)."""
    stem = name.removesuffix(".slice")
    parts = stem.split("-")
    return "/".join("-".join(parts[:i + 1]) + ".slice" for i in range(len(parts)))


def _netns(netns: Path | None) -> list[str]:
    return [f"NetworkNamespacePath={netns}"] if netns is not None else []


def _quote(value: str) -> str:
    """A unit-file word: specifiers (%) and variables ($) escaped, then double-quoted."""
    value = value.replace("%", "%%").replace("$", "$$")
    return '"' + value.replace("\\", "\\\\").replace('"', '\\"') + '"'


@dataclass
class Units:
    """fusuma's systemd units for one cgroup prefix, and what systemctl does with them."""

    prefix: str
    python: str = field(default_factory=lambda: sys.executable)
    unit_dir: Path = UNIT_DIR
    runtime_dir: Path = RUNTIME_UNIT_DIR
    run: Runner = _run
    # A drop-in was written since the last daemon-reload. systemd reads drop-ins only
    # at a reload, and a reload takes seconds on a slow host (~5 s in a TCG guest): the
    # next verb that needs them (start, set-property) reloads once for all of them, so
    # that a partition's limits and its supervisor's command line cost one reload. A
    # process killed between its write and that verb left the reload undone: when this
    # one wrote nothing new, that verb asks systemd whether the unit needs one.
    stale: bool = field(default=False, init=False)

    def __post_init__(self) -> None:
        if not _PREFIX.match(self.prefix):
            raise HostError(f"the cgroup prefix {self.prefix!r} cannot name a systemd slice; "
                            "use letters, digits, '_' and single '-' (FUSUMA_CGROUP_PREFIX)")

    # -- names ---------------------------------------------------------------------------
    @property
    def slice(self) -> str:
        if self.prefix == "fusuma":
            return SLICE
        if self.prefix.startswith("fusuma-"):
            return f"{self.prefix}.slice"
        return f"fusuma-{self.prefix}.slice"

    def instance(self, partition: str) -> str:
        return partition if self.prefix == "fusuma" else f"{self.prefix}:{partition}"

    def supervisor(self, partition: str) -> str:
        return f"fusuma-supervisor@{self.instance(partition)}.service"

    def partition_of(self, unit: str) -> str | None:
        """The partition a supervisor unit (or its cgroup's name) belongs to, if ours."""
        head, tail = "fusuma-supervisor@", ".service"
        if not (unit.startswith(head) and unit.endswith(tail)):
            return None
        inst = unit[len(head):-len(tail)]
        if self.prefix == "fusuma":
            return inst if ":" not in inst else None
        mine, _, part = inst.partition(":")
        return part if mine == self.prefix and part else None

    def network(self, name: str) -> str:
        """The unit of managed network ``name``'s keeper (and its dnsmasq)."""
        return f"fusuma-network@{self.instance(name)}.service"

    @property
    def ram(self) -> str:
        return f"fusuma-ram@{self.prefix}.service"

    def cgroup(self, unit: str) -> str:
        """The unit's cgroup path below the cgroup2 mount."""
        return f"{slice_path(self.slice)}/{unit}"

    # -- the unit files ------------------------------------------------------------------
    def files(self) -> dict[Path, str]:
        """The unit files fusuma installs (the same for every prefix)."""
        python = _quote(self.python)
        supervisor = f"""\
# Installed by fusuma (`fusuma up`, `fusuma partition create`); rewritten when it changes.
[Unit]
Description=fusuma supervisor of partition %i
Documentation=file://{self.unit_dir}/{SUPERVISOR_TEMPLATE}
After=local-fs.target

[Service]
Type=exec
ExecStart={python} -P -m fusuma.supervisor %i
WorkingDirectory=/
Slice={SLICE}
# fusuma makes the cgroups below the unit's own: the supervisor's and one per VM.
Delegate=yes
# A stop or restart signals the supervisor only; the VMs' QEMUs keep running in the
# unit's sub-cgroups and the next supervisor adopts them. `fusuma partition delete`
# ends them.
KillMode=process
TimeoutStopSec=20
UMask=0077
"""
        ram = f"""\
# Installed by fusuma; rewritten when it changes.
[Unit]
Description=fusuma guest RAM cgroups of %i
Documentation=file://{self.unit_dir}/{RAM_TEMPLATE}

[Service]
Type=exec
Slice={SLICE}
Delegate=yes
# systemd removes an empty unit's cgroup, and the RAM groups must outlive every
# process: the keeper parks in the leaf "{KEEPER}" so that the unit's cgroup can enable
# the memory controller for them.
ExecStart=/bin/sh -c 'c=/sys/fs/cgroup$$(sed -n "s/^0:://p" /proc/self/cgroup); \\
mkdir -p "$$c/{KEEPER}" && echo $$$$ > "$$c/{KEEPER}/cgroup.procs" && exec sleep infinity'
"""
        network = f"""\
# Installed by fusuma (`fusuma network create`, `fusuma up`); rewritten when it changes.
[Unit]
Description=fusuma network %i: the keeper of its dnsmasq
Documentation=file://{self.unit_dir}/{NETWORK_TEMPLATE}

[Service]
Type=exec
ExecStart={python} -P -m fusuma.network.keeper %i
WorkingDirectory=/
Slice={SLICE}
# The keeper starts its dnsmasq again when it dies; systemd starts a keeper that died
# again, and the new one adopts the dnsmasq still serving (KillMode=process: a stop
# signals the keeper only, and the keeper ends its dnsmasq).
Restart=on-failure
RestartSec=1
KillMode=process
TimeoutStopSec=15
UMask=0077
"""
        slice_ = """\
# Installed by fusuma.
[Unit]
Description=fusuma: hypervisor partitions and their VMs
Before=slices.target
"""
        return {self.unit_dir / SLICE: slice_,
                self.unit_dir / SUPERVISOR_TEMPLATE: supervisor,
                self.unit_dir / RAM_TEMPLATE: ram,
                self.unit_dir / NETWORK_TEMPLATE: network}

    def missing(self) -> list[Path]:
        """Unit files not installed yet or different from what fusuma would write."""
        out = []
        for path, text in self.files().items():
            try:
                same = path.read_text() == text
            except OSError:
                same = False
            if not same:
                out.append(path)
        return out

    def install(self) -> list[Path]:
        """Write the unit files that are missing or out of date; returns those written."""
        todo = self.missing()
        if not todo:
            return []
        files = self.files()
        try:
            self.unit_dir.mkdir(parents=True, exist_ok=True)
            for path in todo:
                tmp = path.with_name(f".{path.name}.fusuma-tmp")
                tmp.write_text(files[path])
                tmp.chmod(0o644)
                os.replace(tmp, path)
        except OSError as exc:
            raise HostError(f"cannot install fusuma's systemd units into {self.unit_dir}: "
                            f"{exc.strerror or exc}; run as root") from exc
        self.stale = True
        self.reload()
        LOG.info("installed %s", ", ".join(str(p) for p in todo))
        return todo

    def reload(self, unit: str | None = None) -> None:
        """``systemctl daemon-reload`` if this process changed a unit file or drop-in
        since the last, or if systemd says ``unit``'s files changed since it read them
        (another process wrote a drop-in and was killed before its reload)."""
        if self.stale or (unit is not None and self.needs_reload(unit)):
            self.systemctl("daemon-reload", what="reload its units")
            self.stale = False

    def needs_reload(self, unit: str) -> bool:
        """systemd's NeedDaemonReload of ``unit``: one `systemctl show`, no reload. True
        also when systemd cannot say (a reload too many is only slow)."""
        code, out, _ = self.run(["systemctl", "show", unit, "--property=NeedDaemonReload"])
        return code != 0 or out.strip() != "NeedDaemonReload=no"

    # -- systemctl ---------------------------------------------------------------------
    def systemctl(self, *args: str, what: str) -> str:
        code, out, err = self.run(["systemctl", *args])
        if code != 0:
            lines = [ln.strip() for ln in (err or out).strip().splitlines() if ln.strip()]
            said = lines[0] if lines else f"exit status {code}"
            raise HostError(f"systemd refused to {what}: {said}")
        return out

    def show(self, unit: str, *props: str) -> dict[str, str]:
        out = self.systemctl("show", unit, *(f"--property={p}" for p in props),
                             what=f"describe {unit}")
        values: dict[str, str] = {}
        for line in out.splitlines():
            key, sep, value = line.partition("=")
            if sep:
                values[key] = value
        return values

    def active(self, unit: str) -> bool:
        return self.run(["systemctl", "is-active", "--quiet", unit])[0] == 0

    def active_check(self, unit: str, every: float = ACTIVE_POLL_S) -> Callable[[], bool]:
        """``active(unit)`` for a loop that waits for the unit's process to answer: asks
        systemctl at most every ``every`` seconds and says what it last heard between.
        Each ask is a process of its own, whose CPU (~0.1-0.5 s on a slow host, a TCG
        guest) a poll every 50 ms takes from the very start it waits for."""
        asked, was = float("-inf"), True

        def check() -> bool:
            nonlocal asked, was
            if time.monotonic() - asked >= every:
                asked, was = time.monotonic(), self.active(unit)
            return was
        return check

    def main_pid(self, unit: str) -> int | None:
        try:
            pid = int(self.show(unit, "MainPID").get("MainPID", "0"))
        except ValueError:
            return None
        return pid or None

    def why_failed(self, unit: str) -> str:
        """systemd's account of a unit that did not start: its result and last words."""
        info = self.show(unit, "Result", "ExecMainStatus", "LoadError")
        said = ""
        code, out, _ = self.run(["journalctl", "--unit", unit, "--lines", "4",
                                 "--output", "cat", "--no-pager", "--quiet"])
        if code == 0:
            lines = [ln for ln in out.strip().splitlines() if ln.strip()]
            said = lines[-1].strip() if lines else ""
        parts = [f"result {info.get('Result', '?')}"]
        if info.get("ExecMainStatus", "0") not in ("", "0"):
            parts.append(f"exit status {info['ExecMainStatus']}")
        if said:
            parts.append(said)
        return "; ".join(parts)

    # -- one partition's supervisor -------------------------------------------------------
    def dropin_path(self, unit: str, name: str = DROPIN) -> Path:
        return self.runtime_dir / f"{unit}.d" / name

    def write_supervisor(self, partition: str, env: dict[str, str], log: Path,
                         netns: Path | None = None) -> None:
        """The drop-in that makes ``fusuma-supervisor@INSTANCE`` run ``partition``'s
        supervisor in this prefix's slice, with this namespace's environment, and in
        network namespace ``netns`` (a path under /run/netns) when fusuma runs in one:
        the supervisor makes its VMs' taps and puts them on the networks' bridges,
        which live there."""
        self._write_service(self.supervisor(partition), "partition",
                            f"fusuma supervisor of partition {partition}",
                            "fusuma.supervisor", partition, env, log, _netns(netns))

    def write_network(self, network: str, env: dict[str, str], log: Path,
                      netns: Path | None = None) -> None:
        """The drop-in that makes ``fusuma-network@INSTANCE`` run managed network
        ``network``'s keeper in this prefix's slice, with this namespace's environment,
        and in network namespace ``netns`` (a path under /run/netns) when fusuma runs in
        one: dnsmasq binds the network's bridge, which lives there."""
        self._write_service(self.network(network), "network",
                            f"fusuma network {network}: the keeper of its dnsmasq",
                            "fusuma.network.keeper", network, env, log, _netns(netns))

    def _write_service(self, unit: str, what: str, description: str, module: str,
                       arg: str, env: dict[str, str], log: Path,
                       extra: list[str] | None = None) -> None:
        lines = [f"# Written by fusuma for this {what}; removed when it is deleted.",
                 "[Unit]", f"Description={description} ({self.prefix})", "",
                 "[Service]", f"Slice={self.slice}", *(extra or []), "ExecStart=",
                 f"ExecStart={_quote(self.python)} -P -m {module} {_quote(arg)}"]
        lines += [f"Environment={_quote(f'{k}={v}')}" for k, v in sorted(env.items())]
        lines += [f"StandardOutput=append:{log}", f"StandardError=append:{log}"]
        self._write_dropin(unit, "\n".join(lines) + "\n")

    def write_ram(self) -> None:
        lines = ["# Written by fusuma.", "[Service]", f"Slice={self.slice}"]
        self._write_dropin(self.ram, "\n".join(lines) + "\n")

    def _write_dropin(self, unit: str, text: str, name: str = DROPIN) -> None:
        path = self.dropin_path(unit, name)
        try:
            if path.exists() and path.read_text() == text:
                return
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(text)
            path.chmod(0o644)
        except OSError as exc:
            raise HostError(f"cannot write {path}: {exc.strerror or exc}; run as root") \
                from exc
        self.stale = True

    @staticmethod
    def _props(limits: Limits) -> list[str]:
        props = [f"AllowedCPUs={format_cpulist(limits.cpus)}",
                 f"AllowedMemoryNodes={format_cpulist(limits.mems)}",
                 f"MemoryMax={limits.memory_bytes}"]
        if limits.io_weight is not None:
            props.append(f"IOWeight={limits.io_weight}")
        return props

    def write_limits(self, unit: str, limits: Limits) -> None:
        """The partition's limits in the unit's drop-in, for its next start (which
        reloads). (Not set-property: on a unit that is not running it makes an empty
        cgroup that nothing removes.)"""
        text = "\n".join(["# Written by fusuma: the partition's limits.", "[Service]",
                          *self._props(limits)]) + "\n"
        self._write_dropin(unit, text, LIMITS_DROPIN)

    def set_limits(self, unit: str, limits: Limits) -> None:
        """Change the limits of a partition whose cgroup exists, at once."""
        self.write_limits(unit, limits)
        self.reload(unit)
        props = self._props(limits)
        self.systemctl("set-property", "--runtime", unit, *props,
                       what=f"set the limits of {unit} ({' '.join(props)})")

    def start(self, unit: str) -> None:
        self.reload(unit)
        self.systemctl("start", unit, what=f"start {unit} in {self.slice}")

    def stop(self, unit: str) -> None:
        self.systemctl("stop", unit, what=f"stop {unit}")

    def forget(self, unit: str) -> None:
        """Stop ``unit`` and remove every drop-in fusuma or set-property wrote for it."""
        for args in (("stop", unit), ("reset-failed", unit)):
            code, _, err = self.run(["systemctl", *args])
            if code != 0 and "not loaded" not in err:
                LOG.debug("systemctl %s: %s", " ".join(args), err.strip())
        folder = self.dropin_path(unit).parent
        try:
            for name in (DROPIN, LIMITS_DROPIN):
                (folder / name).unlink(missing_ok=True)
            folder.rmdir()
        except OSError:
            pass
        # `revert` removes set-property's drop-ins and reloads (one reload for ours too);
        # when it fails, nothing reloaded.
        code, _, err = self.run(["systemctl", "revert", unit])
        if code != 0:
            LOG.debug("systemctl revert %s: %s", unit, err.strip())
            self.run(["systemctl", "daemon-reload"])
        self.stale = False

    def wait_gone(self, path: Path, timeout: float = 10.0) -> bool:
        """Wait for systemd to remove a stopped unit's cgroup ``path``."""
        deadline = time.monotonic() + timeout
        while path.exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        return not path.exists()
