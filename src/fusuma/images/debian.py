"""Debian package plumbing: resolve, download and unpack a kernel .deb, query versions.

The kernel is never installed on the host: its .deb is fetched with ``apt-get download``
into the image cache and unpacked with ``dpkg-deb -x``. When apt cannot answer (no
network, stale lists) a .deb already in the cache is used instead.
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import shutil
import subprocess
import tempfile
from pathlib import Path

from fusuma.errors import ImageError
from fusuma.frozen import frozen

LOG = logging.getLogger(__name__)


@frozen
class KernelDeb:
    """A concrete kernel package, e.g. linux-image-6.1.0-56-cloud-amd64 6.1.192-2."""

    package: str
    version: str
    arch: str

    @property
    def filename(self) -> str:
        """The name ``apt-get download`` gives the file (':' of an epoch becomes %3a)."""
        return f"{self.package}_{self.version.replace(':', '%3a')}_{self.arch}.deb"


class ToolFailed(Exception):
    """A host tool exited non-zero; ``detail`` is the last line of its stderr."""

    def __init__(self, argv: list[str], detail: str) -> None:
        super().__init__(f"{' '.join(argv)}: {detail}")
        self.argv = argv
        self.detail = detail


def run(argv: list[str], *, cwd: Path | None = None, install_hint: str = "") -> str:
    """Run a host tool and return its stdout.

    A missing binary becomes an ImageError naming the Debian package to install; a
    non-zero exit becomes ToolFailed, which callers turn into a sentence of their own.
    """
    LOG.debug("run %s", argv)
    try:
        proc = subprocess.run(argv, cwd=cwd, capture_output=True, text=True, check=False)
    except FileNotFoundError as exc:
        hint = install_hint or "install it"
        raise ImageError(f"{argv[0]} is not on this host: {hint}") from exc
    if proc.returncode != 0:
        lines = proc.stderr.strip().splitlines()
        raise ToolFailed(argv, lines[-1] if lines else f"exit status {proc.returncode}")
    return proc.stdout


def _fields(stanza: str) -> dict[str, str]:
    out: dict[str, str] = {}
    for line in stanza.splitlines():
        if not line or line[0].isspace():
            continue
        key, sep, value = line.partition(":")
        if sep:
            out[key.strip()] = value.strip()
    return out


def package_version(package: str) -> str:
    """Installed version of ``package``; ImageError with the apt-get hint when absent."""
    try:
        version = run(["dpkg-query", "-W", "-f=${Status}\t${Version}", package],
                      install_hint="this builder needs a Debian-based host")
    except ToolFailed as exc:
        raise ImageError(f"{package} is not installed: run `apt-get install {package}`"
                         ) from exc
    status, _, version = version.partition("\t")
    if not status.endswith(" installed"):
        raise ImageError(f"{package} is not installed: run `apt-get install {package}`")
    return version.strip()


def resolve_kernel(meta: str) -> KernelDeb:
    """The concrete kernel package apt would install for the metapackage ``meta``."""
    hint = "run `apt-get install apt`"
    fields = _fields(run(["apt-cache", "show", "--no-all-versions", meta],
                         install_hint=hint).split("\n\n")[0])
    arch = fields.get("Architecture", "amd64")
    for dep in fields.get("Depends", "").split(","):
        # "linux-image-6.1.0-56-cloud-amd64 (= 6.1.192-2)"; alternatives after "|".
        match = re.fullmatch(r"\s*(linux-image-\S+)\s*(?:\(\s*=\s*(\S+)\s*\))?\s*",
                             dep.split("|")[0])
        if match is None:
            continue
        package, version = match.group(1), match.group(2)
        if version is None:  # each apt-cache call can take 0.5 s: only when needed
            version = _fields(run(["apt-cache", "show", "--no-all-versions", package],
                                  install_hint=hint).split("\n\n")[0])["Version"]
        return KernelDeb(package, version, arch)
    raise ToolFailed(["apt-cache", "show", meta], "no linux-image dependency")


def cached_kernels(debs: Path, meta: str) -> list[KernelDeb]:
    """Kernel .debs already in ``debs`` that could stand for ``meta``, newest first."""
    flavour = meta.removeprefix("linux-image-")
    found: list[KernelDeb] = []
    for path in debs.glob(f"linux-image-*-{flavour}_*.deb"):
        pkg, _, rest = path.name.partition("_")
        version, _, arch = rest.removesuffix(".deb").rpartition("_")
        found.append(KernelDeb(pkg, version.replace("%3a", ":"), arch))
    ordered: list[KernelDeb] = []
    for deb in found:  # insertion sort with dpkg's version comparison (few items)
        pos = 0
        while pos < len(ordered) and _newer(ordered[pos].version, deb.version):
            pos += 1
        ordered.insert(pos, deb)
    return ordered


def _newer(a: str, b: str) -> bool:
    try:
        run(["dpkg", "--compare-versions", a, "gt", b])
    except ToolFailed:
        return False
    return True


def download(deb: KernelDeb, debs: Path) -> Path:
    """``apt-get download`` the package into ``debs`` unless it is there already."""
    target = debs / deb.filename
    if target.exists():
        return target
    debs.mkdir(parents=True, exist_ok=True)
    argv = ["apt-get", "download", "-q"]
    if os.geteuid() == 0:
        # apt drops to _apt for downloads and warns when it cannot write the target dir.
        argv += ["-o", "APT::Sandbox::User=root"]
    argv.append(f"{deb.package}={deb.version}")
    with tempfile.TemporaryDirectory(prefix=".download-", dir=debs) as tmp:
        run(argv, cwd=Path(tmp), install_hint="run `apt-get install apt`")
        got = sorted(Path(tmp).glob(f"{deb.package}_*.deb"))
        if not got:
            raise ToolFailed(argv, "no .deb was written")
        os.replace(got[0], target)
    return target


def extract(deb: Path, dest: Path) -> None:
    """Unpack the .deb's files (not its scripts) into ``dest``."""
    try:
        run(["dpkg-deb", "-x", str(deb), str(dest)], install_hint="run `apt-get install dpkg`")
    except ToolFailed as exc:
        raise ImageError(f"cannot unpack {deb.name} ({exc.detail}): delete it and rebuild"
                         ) from exc


def shared_libraries(binary: Path) -> list[Path]:
    """The shared libraries and program interpreter ``binary`` loads, as ldd lists them."""
    try:
        out = run(["ldd", str(binary)], install_hint="run `apt-get install libc-bin`")
    except ToolFailed as exc:
        raise ImageError(f"cannot list the libraries of {binary} ({exc.detail}): "
                         "reinstall its package") from exc
    libs: list[Path] = []
    for line in out.splitlines():
        words = line.split()
        if "=>" in words:
            idx = words.index("=>")
            if idx + 1 < len(words) and words[idx + 1].startswith("/"):
                libs.append(Path(words[idx + 1]))
            elif idx + 1 < len(words) and words[idx + 1] == "not":
                raise ImageError(f"{binary} needs {words[0]}, which is missing: "
                                 "reinstall the package that provides it")
        elif words and words[0].startswith("/"):
            libs.append(Path(words[0]))
    return libs


def which(name: str) -> Path | None:
    """``shutil.which`` that also looks in the sbin directories a non-root PATH lacks."""
    path = os.environ.get("PATH", "") + ":/usr/local/sbin:/usr/sbin:/sbin"
    found = shutil.which(name, path=path)
    return Path(found) if found else None


def debootstrap(suite: str, mirror: str, packages: tuple[str, ...], dest: Path) -> None:
    """A minbase Debian ``suite`` in ``dest`` with ``packages`` installed."""
    argv = ["debootstrap", "--variant=minbase", f"--include={','.join(packages)}",
            suite, str(dest), mirror]
    try:
        run(argv, install_hint="run `apt-get install debootstrap`")
    except ToolFailed as exc:
        log = dest / "debootstrap" / "debootstrap.log"
        tail = ""
        with contextlib.suppress(OSError):
            tail = log.read_text().strip().splitlines()[-1]
        raise ImageError(f"debootstrap of Debian {suite} from {mirror} failed "
                         f"({tail or exc.detail}): check the network and the mirror "
                         "(FUSUMA_DEBIAN_MIRROR)") from exc
