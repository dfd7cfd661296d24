"""Installed QEMU versions: the distribution's own and those fusuma unpacked beside it.

A partition names its hypervisor by version (``"10.0"``), by path (root's CLI and spec
only: :func:`check_version_name` is what the API and the cluster get), or not at all
(the system's QEMU). :func:`resolve` is the one place that turns such a name into a
:class:`Qemu`: the binary, the ``-L`` data directories and environment it needs, its
versioned machine types and the features fusuma uses. Everyone calls it.

Layout under FUSUMA_CACHE (``fusuma qemu install`` fills it, see fusuma.qemu.fetch)::

    qemu/<series>/root/...          Debian's packages, unpacked with dpkg-deb -x
    qemu/<series>/manifest.json     version, machine types, features, packages
    qemu/probes.json                probes of other binaries (the system's, a path),
                                    keyed by path, mtime and size

A probe (``BINARY --version`` and ``BINARY -machine help``) is cached, so resolving on a
hot path (every QEMU start) runs no subprocess.

An unpacked QEMU's compiled-in firmware and module paths point at the system's files, so
it runs with ``-L ROOT/usr/share/qemu -L ROOT/usr/share/seabios`` (then the system's
directories as fallbacks: QEMU searches -L directories in order) and
``QEMU_MODULE_DIR=ROOT/usr/lib/x86_64-linux-gnu/qemu``.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
from collections.abc import Callable
from dataclasses import field
from pathlib import Path
from typing import Any

from fusuma.errors import HostError, NotFoundError, SpecError, StateError
from fusuma.frozen import frozen
from fusuma.paths import Paths
from fusuma.qemu.store import ensure_qemu_dir, install_lock, qemu_dir
from fusuma.state.db import VmRecord

DEFAULT_BINARY = "qemu-system-x86_64"
# Firmware the system's QEMU packages install: an unpacked QEMU falls back on them.
SYSTEM_DATA_DIRS = (Path("/usr/share/qemu"), Path("/usr/share/seabios"),
                    Path("/usr/lib/ipxe/qemu"))
MODULE_DIR = Path("usr/lib/x86_64-linux-gnu/qemu")
BINARY_IN_ROOT = Path("usr/bin") / DEFAULT_BINARY
SERIES_RE = re.compile(r"\A([0-9]+)\.([0-9]+)\Z")     # ASCII digits, no final newline
Q35_RE = re.compile(r"^pc-q35-(\d+)\.(\d+)(?:\.(\d+))?\Z")
PROBE_VERSION = 2   # bump when the probe's content changes: old caches are re-probed

# Features fusuma uses, by the first QEMU version that has them.
FEATURES: dict[str, tuple[int, int]] = {
    "x-ignore-shared": (2, 12),   # zero-copy moves: RAM in a shared file is not sent
    "live-copy-tcg": (9, 0),      # TCG dirty-bitmap fix (supervisor_ops.TCG_DIRTY_FIX)
    "aux-ram-share": (10, 0),     # -machine aux-ram-share=on, which cpr-transfer needs
    "cpr-transfer": (10, 0),      # migration mode: the new QEMU gets the RAM's fds
}


def parse_version(text: str) -> tuple[int, ...]:
    """``"10.0.2"`` -> (10, 0, 2); anything unparsable sorts first."""
    try:
        return tuple(int(x) for x in text.split("."))
    except ValueError:
        return (0,)


def series_of(version: str) -> str:
    return ".".join(version.split(".")[:2])


def features_for(version: str) -> dict[str, bool]:
    have = parse_version(version)[:2]
    return {name: have >= first for name, first in FEATURES.items()}


def machine_version(machine: str) -> tuple[int, ...] | None:
    """The QEMU version a versioned q35 machine type belongs to (None: not one)."""
    m = Q35_RE.match(machine)
    return tuple(int(x) for x in m.groups() if x is not None) if m else None


def check_machine_name(machine: str) -> str:
    if machine_version(machine) is None:
        raise SpecError(f"machine type {machine!r} is not a versioned q35 machine type; "
                        "give one like pc-q35-7.2 (`fusuma qemu list` shows what each "
                        "installed QEMU has).")
    return machine


@frozen
class Qemu:
    """One QEMU fusuma can start, and what fusuma needs to know about it."""

    series: str                       # "7.2", "10.0"
    version: str                      # "10.0.2"
    binary: Path
    data_dirs: tuple[Path, ...]       # each becomes -L, in order (empty: its own)
    env: dict[str, str]               # e.g. QEMU_MODULE_DIR
    machines: tuple[str, ...]         # every machine type it has, e.g. "pc-q35-7.2"
    features: dict[str, bool]
    system: bool                      # the distribution's own QEMU
    aliases: dict[str, str] = field(default_factory=dict)   # "q35" -> "pc-q35-7.2"
    root: Path | None = None          # the unpacked tree (fusuma qemu install)
    # CPUID features of its ``-cpu max`` under TCG, on or off (None: unknown).
    cpu_tcg: dict[str, bool] | None = None

    @property
    def cpu_on(self) -> frozenset[str] | None:
        """The features its TCG can give a guest (None: unknown)."""
        if self.cpu_tcg is None:
            return None
        return frozenset(k for k, v in self.cpu_tcg.items() if v)

    @property
    def q35(self) -> str:
        """Its newest versioned q35 machine type (what the alias ``q35`` names)."""
        alias = self.aliases.get("q35")
        if alias:
            return alias
        q35 = [m for m in self.machines if machine_version(m)]
        return max(q35, key=lambda m: machine_version(m) or ()) if q35 else "q35"

    @property
    def q35_machines(self) -> list[str]:
        return sorted((m for m in self.machines if machine_version(m)),
                      key=lambda m: machine_version(m) or ())

    def has_machine(self, machine: str) -> bool:
        return machine in self.machines

    @property
    def name(self) -> str:
        """How a user names it: its series, or its path when it is not one fusuma
        manages."""
        return self.series if self.system or self.root else str(self.binary)

    def as_json(self) -> dict[str, Any]:
        return {"series": self.series, "version": self.version,
                "binary": str(self.binary), "system": self.system,
                "root": str(self.root) if self.root else None,
                "data_dirs": [str(d) for d in self.data_dirs], "env": self.env,
                "q35": self.q35, "machines": self.q35_machines,
                "features": self.features}


# -- probing ------------------------------------------------------------------------
@frozen
class Probe:
    version: str
    machines: tuple[str, ...]
    aliases: dict[str, str]
    # The CPUID feature flags of ``-cpu max`` under TCG, on or off (QMP
    # query-cpu-model-expansion, static); None if the binary would not say.
    cpu_tcg: dict[str, bool] | None = None

    def as_json(self) -> dict[str, Any]:
        return {"probe": PROBE_VERSION, "version": self.version,
                "machines": list(self.machines), "aliases": self.aliases,
                "cpu_tcg": self.cpu_tcg}

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> Probe | None:
        # An older probe lacks what this fusuma needs; a newer one (written by a newer
        # fusuma beside a supervisor still running this one) has it all.
        if not isinstance(d.get("probe"), int) or d["probe"] < PROBE_VERSION:
            return None
        cpu = d.get("cpu_tcg")
        return cls(str(d["version"]), tuple(d["machines"]), dict(d["aliases"]),
                   {str(k): bool(v) for k, v in cpu.items()} if isinstance(cpu, dict)
                   else None)


def parse_machine_help(text: str) -> tuple[tuple[str, ...], dict[str, str]]:
    """Machine names and aliases from ``-machine help``."""
    names: list[str] = []
    aliases: dict[str, str] = {}
    for line in text.splitlines():
        if not line or line.startswith("Supported machines") or line[0].isspace():
            continue
        name = line.split()[0]
        m = re.search(r"\(alias of ([^)]+)\)", line)
        if m:
            aliases[name] = m.group(1)
        else:
            names.append(name)
    return tuple(names), aliases


def probe(binary: Path, env: dict[str, str] | None = None, timeout: float = 20) -> Probe:
    """Ask ``binary`` its version and machine types (two short runs, no guest)."""
    import subprocess

    full_env = {**os.environ, **(env or {})}
    outs = []
    for args in (["--version"], ["-machine", "help"]):
        try:
            p = subprocess.run([str(binary), *args], capture_output=True, text=True,
                               timeout=timeout, env=full_env, check=False)
        except (OSError, subprocess.TimeoutExpired) as exc:
            raise HostError(f"cannot run the QEMU binary {binary} ({exc}); give the path "
                            "of a working qemu-system-x86_64.") from exc
        if p.returncode != 0:
            said = (p.stderr.strip().splitlines() or [f"exit status {p.returncode}"])[-1]
            raise HostError(f"the QEMU binary {binary} failed `{' '.join(args)}` "
                            f"({said}); give the path of a working qemu-system-x86_64.")
        outs.append(p.stdout)
    m = re.search(r"version (\d+\.\d+(?:\.\d+)?)", outs[0])
    if m is None:
        raise HostError(f"{binary} does not say which QEMU version it is; give the path "
                        "of a qemu-system-x86_64.")
    machines, aliases = parse_machine_help(outs[1])
    return Probe(m.group(1), machines, aliases, probe_cpu(binary, full_env, timeout))


def probe_cpu(binary: Path, env: dict[str, str], timeout: float = 20
              ) -> dict[str, bool] | None:
    """The feature flags of ``-cpu max`` under TCG: a QEMU with no machine, asked over
    QMP on its stdin (what libvirt does to learn a QEMU's CPU models)."""
    import subprocess

    cmds = [{"execute": "qmp_capabilities"},
            {"execute": "query-cpu-model-expansion",
             "arguments": {"type": "static", "model": {"name": "max"}}},
            {"execute": "quit"}]
    try:
        p = subprocess.run([str(binary), "-machine", "none", "-accel", "tcg", "-nodefaults",
                            "-display", "none", "-qmp", "stdio"],
                           input="".join(json.dumps(c) + "\n" for c in cmds),
                           capture_output=True, text=True, timeout=timeout, env=env,
                           check=False)
    except (OSError, subprocess.TimeoutExpired):
        return None
    for line in p.stdout.splitlines():
        with contextlib.suppress(ValueError, KeyError, TypeError, AttributeError):
            props = json.loads(line)["return"]["model"]["props"]
            return {str(k): v for k, v in props.items() if isinstance(v, bool)}
    return None


def write_json(path: Path, data: Any) -> None:
    """Atomically (rename), world-readable: QEMU trees are for every VM's uid."""
    import uuid

    tmp = path.with_name(f".{path.name}.{uuid.uuid4().hex[:8]}")
    tmp.write_text(json.dumps(data, indent=1, sort_keys=True) + "\n")
    os.chmod(tmp, 0o644)
    tmp.replace(path)


def _probes_file(paths: Paths) -> Path:
    return qemu_dir(paths) / "probes.json"


_MEMO: dict[tuple[str, int, int], Probe] = {}


def _cached_probe(paths: Paths, binary: Path, run: bool = True) -> Probe | None:
    """The probe of a binary fusuma does not manage, from the cache (by path, mtime and
    size) or, with ``run``, by running it."""
    try:
        st = binary.stat()
    except OSError as exc:
        raise HostError(f"QEMU binary {binary} does not exist ({exc.strerror}); give the "
                        "absolute path of a qemu-system-x86_64 or a version from "
                        "`fusuma qemu list`.") from exc
    key = (str(binary), st.st_mtime_ns, st.st_size)
    if key in _MEMO:
        return _MEMO[key]
    file = _probes_file(paths)
    cache: dict[str, Any] = {}
    with contextlib.suppress(OSError, ValueError):
        cache = json.loads(file.read_text())
    entry = cache.get(str(binary))
    if isinstance(entry, dict) and entry.get("mtime_ns") == st.st_mtime_ns \
            and entry.get("size") == st.st_size:
        found = Probe.from_json(entry)
        if found is not None:
            _MEMO[key] = found
            return found
    if not run:
        return None
    found = probe(binary)
    _MEMO[key] = found
    with contextlib.suppress(OSError, HostError):
        ensure_qemu_dir(paths)
        with contextlib.suppress(OSError, ValueError):
            cache = json.loads(file.read_text())
        cache[str(binary)] = {**found.as_json(), "mtime_ns": st.st_mtime_ns,
                              "size": st.st_size}
        write_json(file, cache)
    return found


def check_passable(paths: Paths) -> None:
    """Each VM's QEMU (a uid of its own) executes an unpacked binary and reads its
    firmware under FUSUMA_CACHE/qemu: every directory above must let other users pass.
    fusuma's own cache root is made so; another is refused with the fix."""
    for parent in [paths.cache, *paths.cache.parents]:
        try:
            mode = parent.stat().st_mode
        except OSError:
            continue
        if mode & 0o001:
            continue
        if parent == paths.cache:
            os.chmod(parent, mode | 0o011)
            continue
        raise HostError(f"{parent} cannot be passed by other users, so VMs' QEMUs (each "
                        f"under a uid of its own) could not reach {qemu_dir(paths)}; "
                        f"`chmod o+x {parent}` or set FUSUMA_CACHE elsewhere.")


# -- what is installed ------------------------------------------------------------------
def system_binary() -> Path | None:
    import shutil

    found = shutil.which(DEFAULT_BINARY)
    return Path(found) if found else None


def data_dirs_for(root: Path) -> tuple[Path, ...]:
    own = (root / "usr/share/qemu", root / "usr/share/seabios")
    return own + tuple(d for d in SYSTEM_DATA_DIRS if d.is_dir())


def _from_probe(p: Probe, binary: Path, *, system: bool, root: Path | None = None
                ) -> Qemu:
    env = {"QEMU_MODULE_DIR": str(root / MODULE_DIR)} if root is not None else {}
    return Qemu(series=series_of(p.version), version=p.version, binary=binary,
                data_dirs=data_dirs_for(root) if root is not None else (), env=env,
                machines=p.machines, features=features_for(p.version), system=system,
                aliases=p.aliases, root=root, cpu_tcg=p.cpu_tcg)


def system(paths: Paths) -> Qemu | None:
    """The distribution's QEMU (None if none is installed)."""
    binary = system_binary()
    if binary is None:
        return None
    found = _cached_probe(paths, binary)
    assert found is not None
    return _from_probe(found, binary, system=True)


def _manifest(install_dir: Path) -> dict[str, Any] | None:
    with contextlib.suppress(OSError, ValueError):
        data = json.loads((install_dir / "manifest.json").read_text())
        if isinstance(data, dict):
            return data
    return None


def _unpacked(install_dir: Path) -> Qemu | None:
    data = _manifest(install_dir)
    if data is None:
        return None
    root = install_dir / "root"
    found = Probe.from_json(data)
    if found is None:
        # Probed by an older fusuma: ask the binary again and keep the answer.
        try:
            found = probe(root / BINARY_IN_ROOT, {"QEMU_MODULE_DIR": str(root / MODULE_DIR)})
        except HostError:
            return None
        with contextlib.suppress(OSError):
            write_json(install_dir / "manifest.json", {**data, **found.as_json()})
    return _from_probe(found, root / BINARY_IN_ROOT, system=False, root=root)


def resolve_unpacked(paths: Paths, series: str) -> Qemu | None:
    """The QEMU ``series`` fusuma unpacked, if it did."""
    return _unpacked(qemu_dir(paths) / series)


def unpacked(paths: Paths) -> list[Qemu]:
    """The QEMUs fusuma unpacked under FUSUMA_CACHE, oldest first."""
    d = qemu_dir(paths)
    out = []
    if d.is_dir():
        for sub in d.iterdir():
            if sub.is_dir() and SERIES_RE.match(sub.name):
                q = _unpacked(sub)
                if q is not None:
                    out.append(q)
    return sorted(out, key=lambda q: parse_version(q.version))


def installed(paths: Paths) -> list[Qemu]:
    """The system's QEMU and each unpacked one, oldest first."""
    out = unpacked(paths)
    sysq = system(paths)
    if sysq is not None:
        out.append(sysq)
    return sorted(out, key=lambda q: parse_version(q.version))


def resolve(paths: Paths, wanted: str | None) -> Qemu:
    """The QEMU a partition names: None (the system's), a series such as "10.0" (the
    system's if it is that series, else one `fusuma qemu install` unpacked), or an
    absolute path (of a binary in an unpacked tree: that install)."""
    if wanted is None or wanted == DEFAULT_BINARY:
        sysq = system(paths)
        if sysq is None:
            raise HostError(f"QEMU ({DEFAULT_BINARY}) is not installed; install it "
                            "(`apt-get install qemu-system-x86`) or name one with "
                            "`fusuma partition create --qemu VERSION|PATH`.")
        return sysq
    if SERIES_RE.match(wanted):
        q = _unpacked(qemu_dir(paths) / wanted)
        if q is not None:
            return q
        sysq = system(paths)
        if sysq is not None and sysq.series == wanted:
            return sysq
        have = ", ".join(q.series for q in installed(paths)) or "none"
        raise NotFoundError(f"QEMU {wanted} is not installed (installed: {have}); install "
                            f"it with `fusuma qemu install {wanted}`.")
    path = Path(wanted)
    if not path.is_absolute():
        raise SpecError(f"QEMU {wanted!r} is neither a version (like 10.0) nor an "
                        "absolute path of a qemu-system-x86_64.")
    for q in unpacked(paths):
        if path == q.binary:
            return q
    sysq_bin = system_binary()
    if sysq_bin is not None and path == sysq_bin:
        sysq = system(paths)
        assert sysq is not None
        return sysq
    if not (os.access(path, os.X_OK) and path.is_file()):
        raise HostError(f"QEMU binary {wanted} does not exist or is not executable; give "
                        "the absolute path of a qemu-system-x86_64 or a version from "
                        "`fusuma qemu list`.")
    found = _cached_probe(paths, path)
    assert found is not None
    return _from_probe(found, path, system=False)


def check_version_name(paths: Paths, wanted: str | None) -> None:
    """A QEMU named by a caller that may not name a binary (the API, the cluster): an
    installed version or nothing, never a path, so that nothing such a caller sends
    is run (the probe runs a binary as root)."""
    if wanted is not None and not SERIES_RE.match(wanted):
        have = ", ".join(q.series for q in installed(paths)) or "none"
        raise SpecError(f"qemu {wanted!r} is not a QEMU version: here a partition's QEMU "
                        f"is a version `fusuma qemu list` shows (installed: {have}), and "
                        "a binary's path is taken only from root's CLI or spec file.")
    resolve(paths, wanted)


def known_version(paths: Paths, wanted: str | None) -> str | None:
    """The version a partition's QEMU name stands for, from cached probes only (never a
    subprocess: `ps` calls it)."""
    try:
        if wanted is not None and SERIES_RE.match(wanted):
            q = _unpacked(qemu_dir(paths) / wanted)
            if q is not None:
                return q.version
        binary = system_binary() if wanted is None or SERIES_RE.match(wanted) \
            else Path(wanted)
        if binary is None:
            return None
        if wanted is not None and not SERIES_RE.match(wanted):
            for q in unpacked(paths):
                if binary == q.binary:
                    return q.version
        found = _cached_probe(paths, binary, run=False)
        if found is None:
            return None
        if wanted is not None and SERIES_RE.match(wanted) and \
                series_of(found.version) != wanted:
            return None
        return found.version
    except (HostError, OSError):
        return None


def default_machine(paths: Paths, also: Qemu | None = None) -> str:
    """The machine type a new VM pins: the q35 machine type of the oldest installed
    QEMU (and of ``also``, the partition's, if it is older still), so that the VM can
    move to every QEMU installed here."""
    candidates = installed(paths) + ([also] if also is not None else [])
    if not candidates:
        raise HostError(f"QEMU ({DEFAULT_BINARY}) is not installed; install it "
                        "(`apt-get install qemu-system-x86`).")
    oldest = min(candidates, key=lambda q: parse_version(q.version))
    return oldest.q35


def machine_of(paths: Paths, rec: VmRecord) -> str:
    """The machine type of a VM's guest: the one it pinned or, for a VM defined by a
    fusuma that pinned none (it passed plain ``q35``), what ``q35`` named in the QEMU
    that booted it (the system's if the record does not say)."""
    if rec.machine:
        return rec.machine
    q = resolve(paths, rec.qemu_binary) if rec.qemu_binary else resolve(paths, None)
    return q.q35


# CPU features a QEMU's TCG once offered and later dropped: never shown to a guest, so a
# guest booted on an older QEMU can still move to a newer one. (PCOMMIT: deprecated by
# Intel in 2016 before any CPU had it, never used by Linux; QEMU 7.2's max has it,
# 10.0's does not.)
RETIRED_CPU_FEATURES = frozenset({"pcommit"})


# The CPU identity (CPUID family, model, stepping) a TCG guest is given, whichever QEMU
# boots it: QEMU 7.2's max says family 15 model 107 stepping 1, 10.0's family 6 model 6
# stepping 3. These are 7.2's, so a guest looks the same on both.
TCG_CPU_IDENTITY = "family=15,model=107,stepping=1"


def tcg_cpu_features(paths: Paths, q: Qemu) -> tuple[str, ...]:
    """The CPU features a guest booting on ``q`` under TCG gets: those of QEMU's ``max``
    that every installed QEMU's TCG can emulate too, so that the guest can move to each
    of them (and back) without losing an instruction it was told it has. () when
    unknown (the CPU is then plain ``max``)."""
    mine = q.cpu_on
    if mine is None:
        return ()
    common = set(mine) - RETIRED_CPU_FEATURES
    for other in installed(paths):
        if other.cpu_on is not None:
            common &= other.cpu_on
    return tuple(sorted(common))


def cpu_off(q: Qemu, features: tuple[str, ...]) -> tuple[str, ...]:
    """What ``-cpu max`` on ``q`` must switch off to show a guest exactly
    ``features`` (() when they are not recorded, or ``q``'s are unknown)."""
    if not features or q.cpu_on is None:
        return ()
    return tuple(sorted(q.cpu_on - set(features)))


def cpu_missing(q: Qemu, features: tuple[str, ...]) -> list[str]:
    """Recorded guest CPU features ``q``'s TCG cannot emulate."""
    if not features or q.cpu_on is None:
        return []
    return sorted(set(features) - q.cpu_on)


def cannot_run(q: Qemu, machine: str) -> str | None:
    """Why ``q`` cannot run a guest of machine type ``machine`` (None: it can)."""
    if q.has_machine(machine):
        return None
    mv = machine_version(machine)
    newer = mv is not None and mv[:2] > parse_version(q.version)[:2]
    why = (f"QEMU {q.version} predates machine type {machine}" if newer
           else f"QEMU {q.version} has no machine type {machine}")
    return why


# -- removal ------------------------------------------------------------------------
def users(paths: Paths, q: Qemu) -> list[str]:
    """What uses the unpacked QEMU ``q``: running QEMU processes of any fusuma namespace
    (by /proc/PID/exe) and this namespace's partitions that name it."""
    assert q.root is not None
    out = []
    root = str(q.root) + "/"
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            with contextlib.suppress(OSError):
                if os.readlink(d / "exe").startswith(root):
                    argv = (d / "cmdline").read_bytes().split(b"\0")
                    guest = next((a.decode(errors="replace") for a in argv
                                  if a.startswith(b"guest=")), "")
                    name = guest.removeprefix("guest=").split(",")[0]
                    out.append(f"VM {name} (pid {d.name})" if name else f"pid {d.name}")
    if paths.db.exists():
        from fusuma.state import Database

        with Database(paths.db) as db:
            for p in db.partitions():
                if p.qemu in (q.series, str(q.binary)):
                    out.append(f"partition {p.name}")
    return out


def remove(paths: Paths, series: str, progress: Callable[[str], None] = lambda s: None
           ) -> Qemu:
    """Remove an unpacked QEMU; refused while a VM runs on it or a partition names it."""
    import shutil
    import uuid

    if not SERIES_RE.match(series):
        raise SpecError(f"{series!r} is not a QEMU version like 10.0.")
    base = qemu_dir(paths)
    q = _unpacked(base / series)
    if q is None:
        sysq = system(paths)
        if sysq is not None and sysq.series == series:
            raise StateError(f"QEMU {series} is the system's own ({sysq.binary}); fusuma "
                             "removes only the versions it installed (remove that one with "
                             "apt-get).")
        raise NotFoundError(f"QEMU {series} is not installed by fusuma; see "
                            "`fusuma qemu list`.")
    with install_lock(paths):
        busy = users(paths, q)
        if busy:
            raise StateError(f"QEMU {q.version} is in use by {', '.join(busy)}; move or "
                             "stop those VMs and point those partitions at another QEMU "
                             "first (`fusuma maintain P --via Q --qemu VERSION`).")
        gone = base / f".rm-{series}-{uuid.uuid4().hex[:8]}"
        # One rename: a resolver sees the whole tree or nothing.
        (base / series).rename(gone)
        progress(f"removing {gone}")
        shutil.rmtree(gone, ignore_errors=True)
    return q


def manifest_of(q: Qemu) -> dict[str, Any]:
    """The manifest of an unpacked QEMU ({} for another)."""
    if q.root is None:
        return {}
    return _manifest(q.root.parent) or {}


# An in-place move's migration mode, and the first QEMU release with it and
# ``-machine aux-ram-share`` (fusuma.migration.inplace checks a move against them).
CPR_MODE = "cpr-transfer"
CPR_MIN_VERSION = "10.0"


def has_cpr(q: Qemu) -> bool:
    """True if this QEMU has cpr-transfer and ``-machine aux-ram-share``."""
    return bool(q.features.get(CPR_MODE)) and bool(q.features.get("aux-ram-share"))
