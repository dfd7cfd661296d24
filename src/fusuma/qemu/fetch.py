"""`fusuma qemu install SERIES`: a QEMU from Debian's backports suite, beside the system's.

The ordinary package tools do the work, with an apt configuration of fusuma's own (its
sources list names the host's release, its updates, security and backports suites; its
package lists and downloads live in a private directory), so the host's apt sources,
lists and installed packages are never touched. The packages are unpacked with
``dpkg-deb -x`` into a temporary directory inside FUSUMA_CACHE/qemu and renamed into
place only once everything worked: a failed download leaves nothing half unpacked.

Debian 12's backports carry QEMU 10.0, whose ``qemu-system-x86`` needs a SeaBIOS newer
than bookworm's: the firmware comes from the backports suite too.
"""

from __future__ import annotations

import logging
import os
import re
import shutil
import stat
import subprocess
import time
import uuid
from collections.abc import Callable
from pathlib import Path

from fusuma.errors import HostError, NotFoundError, SpecError
from fusuma.host import distro
from fusuma.paths import Paths, ensure_dir
from fusuma.qemu import versions
from fusuma.qemu.store import ensure_qemu_dir, install_lock
from fusuma.qemu.versions import BINARY_IN_ROOT, MODULE_DIR, SERIES_RE, Qemu

LOG = logging.getLogger(__name__)

KEYRING = Path("/usr/share/keyrings/debian-archive-keyring.gpg")
SECURITY_MIRROR = "http://deb.debian.org/debian-security"
# The same source package's binaries, all of one version.
PACKAGES = ("qemu-system-x86", "qemu-system-common", "qemu-system-data")
# Firmware taken from the backports suite when it carries it (newer QEMUs need it).
FIRMWARE = ("seabios",)
APT_TIMEOUT_S = 600


class Apt:
    """apt-get / apt-cache with a private configuration under ``root``."""

    def __init__(self, root: Path, release: str, mirror: str) -> None:
        self.root = root
        self.release = release
        self.mirror = mirror
        etc = root / "etc/apt"
        for d in (etc / "sources.list.d", etc / "preferences.d", root / "state/lists/partial",
                  root / "cache/archives/partial", root / "debs"):
            ensure_dir(d, 0o755)
        signed = f"[signed-by={KEYRING}]"
        lines = [f"deb {signed} {mirror} {release} main",
                 f"deb {signed} {mirror} {release}-updates main",
                 f"deb {signed} {SECURITY_MIRROR} {release}-security main",
                 f"deb {signed} {mirror} {self.backports} main"]
        (etc / "sources.list").write_text("\n".join(lines) + "\n")
        self.options = [
            "-o", f"Dir::Etc={etc}", "-o", f"Dir::Etc::sourcelist={etc}/sources.list",
            "-o", f"Dir::Etc::sourceparts={etc}/sources.list.d",
            "-o", f"Dir::Etc::preferencesparts={etc}/preferences.d",
            "-o", f"Dir::State={root}/state", "-o", f"Dir::Cache={root}/cache",
            "-o", "Debug::NoLocking=1", "-o", "Acquire::Retries=0",
            "-o", "Acquire::http::Timeout=30", "-o", "APT::Sandbox::User=root"]

    @property
    def backports(self) -> str:
        return f"{self.release}-backports"

    def run(self, tool: str, *args: str, cwd: Path | None = None) -> str:
        argv = [tool, "-q", *self.options, *args]
        LOG.debug("run %s", argv)
        try:
            p = subprocess.run(argv, capture_output=True, text=True, cwd=cwd,
                               timeout=APT_TIMEOUT_S, check=False,
                               env={**os.environ, "DEBIAN_FRONTEND": "noninteractive",
                                    "LC_ALL": "C"})
        except FileNotFoundError as exc:
            raise HostError(f"{tool} is not on this host; fusuma installs QEMU versions "
                            "with Debian's package tools.") from exc
        except subprocess.TimeoutExpired as exc:
            raise FetchFailed(f"{tool} {args[-1]} took more than {APT_TIMEOUT_S} s"
                              ) from exc
        if p.returncode != 0:
            errors = [" ".join(ln[2:].split()) for ln in p.stderr.splitlines()
                      if ln.startswith("E:")]
            raise FetchFailed(errors[0] if errors else
                              (p.stderr.strip().splitlines() or
                               [f"{tool} exited {p.returncode}"])[-1])
        return p.stdout

    def update(self) -> None:
        self.run("apt-get", "--error-on=any", "update")

    def versions(self, package: str) -> list[tuple[str, str]]:
        """(version, suite) of every candidate of ``package`` the sources offer."""
        out = []
        for line in self.run("apt-cache", "madison", package).splitlines():
            cols = [c.strip() for c in line.split("|")]
            if len(cols) >= 3 and cols[0] == package:
                where = cols[2].split()     # URI SUITE/COMPONENT ARCH Packages
                suite = where[1].split("/")[0] if len(where) >= 2 else ""
                out.append((cols[1], suite))
        return out

    def download(self, specs: list[str]) -> list[Path]:
        dest = self.root / "debs"
        self.run("apt-get", "download", *specs, cwd=dest)
        return sorted(dest.glob("*.deb"))


class FetchFailed(Exception):
    """An apt step failed; the text is apt's own reason."""


def upstream(version: str) -> str:
    """Debian version -> upstream: ``1:10.0.2+ds-2+deb13u1~bpo12+1`` -> ``10.0.2``."""
    v = version.split(":", 1)[-1]
    return re.split(r"[+~-]", v, maxsplit=1)[0]


def matches(series: str, version: str) -> bool:
    up = upstream(version)
    return up == series or up.startswith(series + ".")


def open_up(root: Path) -> None:
    """Directories 0755, files world-readable (executables world-executable): every
    VM's QEMU runs under a uid of its own and must read the tree."""
    for dirpath, dirnames, filenames in os.walk(root):
        os.chmod(dirpath, 0o755)
        for name in filenames:
            p = os.path.join(dirpath, name)
            st = os.lstat(p)
            if stat.S_ISLNK(st.st_mode):
                continue
            mode = stat.S_IMODE(st.st_mode) | 0o444
            if mode & 0o100:
                mode |= 0o011
            os.chmod(p, mode & ~0o022)
        del dirnames   # os.walk descends on its own


def _sweep(base: Path) -> None:
    """Temporary trees of installs or removals that died (the caller holds the lock)."""
    for d in base.iterdir():
        if d.name.startswith((".tmp-", ".rm-")) and d.is_dir():
            shutil.rmtree(d, ignore_errors=True)


def install(paths: Paths, series: str,
            progress: Callable[[str], None] = lambda s: None) -> Qemu:
    """Fetch and unpack QEMU ``series``; an installed one is returned as it is."""
    if not SERIES_RE.match(series):
        raise SpecError(f"{series!r} is not a QEMU version; give MAJOR.MINOR, like 10.0.")
    sysq = versions.system(paths)
    if sysq is not None and sysq.series == series:
        progress(f"QEMU {sysq.version} is the system's own ({sysq.binary})")
        return sysq
    versions.check_passable(paths)
    base = ensure_qemu_dir(paths)
    with install_lock(paths):
        have = versions.resolve_unpacked(paths, series)
        if have is not None:
            progress(f"QEMU {have.version} is already installed in {have.root}")
            return have
        _sweep(base)
        release, mirror = distro.debian_source()
        tmp = ensure_dir(base / f".tmp-{series}-{uuid.uuid4().hex[:8]}", 0o755)
        try:
            q = _fetch(tmp, series, release, mirror, progress)
            tmp.rename(base / series)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        found = versions.resolve_unpacked(paths, series)
        assert found is not None, q
        progress(f"installed QEMU {found.version} in {found.root}")
        return found


def _fetch(tmp: Path, series: str, release: str, mirror: str,
           progress: Callable[[str], None]) -> Qemu:
    apt = Apt(tmp / "apt", release, mirror)
    where = f"Debian's {apt.backports} suite at {mirror}"
    try:
        progress(f"reading the package lists of {release}, its updates, security and "
                 f"backports from {mirror}")
        apt.update()
        offered = apt.versions(PACKAGES[0])
        wanted = [v for v, suite in offered if suite == apt.backports and matches(series, v)]
        wanted = wanted or [v for v, _ in offered if matches(series, v)]
        if not wanted:
            have = sorted({upstream(v) for v, _ in offered}) or ["none"]
            raise NotFoundError(f"{where} has no QEMU {series} (it offers "
                                f"{', '.join(have)}); pick one of those.")
        version = wanted[0]
        specs = [f"{p}={version}" for p in PACKAGES]
        for fw in FIRMWARE:
            bpo = [v for v, suite in apt.versions(fw) if suite == apt.backports]
            if bpo:
                specs.append(f"{fw}={bpo[0]}")
        progress(f"downloading {', '.join(specs)}")
        debs = apt.download(specs)
    except FetchFailed as exc:
        raise HostError(f"cannot fetch QEMU {series} from {where} ({exc}); check the "
                        "network, or set FUSUMA_DEBIAN_MIRROR to a reachable Debian "
                        "mirror.") from exc
    root = tmp / "root"
    ensure_dir(root, 0o755)
    for deb in debs:
        progress(f"unpacking {deb.name}")
        p = subprocess.run(["dpkg-deb", "-x", str(deb), str(root)], capture_output=True,
                           text=True, check=False)
        if p.returncode != 0:
            raise HostError(f"cannot unpack {deb.name} ({p.stderr.strip() or p.returncode})"
                            "; the download may be damaged: run the install again.")
    open_up(root)
    binary = root / BINARY_IN_ROOT
    progress(f"probing {binary}")
    found = versions.probe(binary, env={"QEMU_MODULE_DIR": str(root / MODULE_DIR)})
    if versions.series_of(found.version) != series:
        raise HostError(f"the package {PACKAGES[0]} {version} holds QEMU {found.version}, "
                        f"not {series}; report this.")
    shutil.rmtree(tmp / "apt")
    manifest = {**found.as_json(), "series": series, "suite": apt.backports,
                "mirror": mirror, "installed_at": time.time(),
                "packages": [d.name for d in debs]}
    versions.write_json(tmp / "manifest.json", manifest)
    return versions.Qemu(series, found.version, binary, versions.data_dirs_for(root),
                         {"QEMU_MODULE_DIR": str(root / MODULE_DIR)}, found.machines,
                         versions.features_for(found.version), False, found.aliases, root)
