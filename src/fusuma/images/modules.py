"""Pick kernel modules and their dependencies out of an extracted kernel package.

Debian's kernel .deb ships no ``modules.dep`` (its postinst runs ``depmod``), so when the
file is absent the dependencies are read from each module's ``.modinfo`` ``depends=``
line, which is what depmod itself uses. Modules compiled into the kernel (listed in
``modules.builtin``) need no file. Compressed modules (.ko.xz/.zst/.gz) are decompressed
at build time because busybox ``insmod`` cannot always read them.

A root filesystem can instead get the whole tree (:func:`install_tree`), indexed by
depmod, for the guest's kmod to load modules on demand as a stock host does.
"""

from __future__ import annotations

import logging
import os
import shutil
import subprocess
from collections.abc import Iterable, Iterator, Mapping
from pathlib import Path

from fusuma.errors import ImageError
from fusuma.frozen import frozen
from fusuma.images import elf

LOG = logging.getLogger(__name__)

_SUFFIXES = (".ko", ".ko.xz", ".ko.zst", ".ko.gz")


def module_name(path: str) -> str:
    """Kernel module name of a file path: basename without suffix, '-' read as '_'."""
    base = path.rsplit("/", 1)[-1]
    for suffix in _SUFFIXES:
        if base.endswith(suffix):
            base = base[: -len(suffix)]
            break
    return base.replace("-", "_")


def parse_modules_dep(text: str) -> dict[str, list[str]]:
    """Parse ``modules.dep`` into {module name: [dependency names]}."""
    deps: dict[str, list[str]] = {}
    for line in text.splitlines():
        target, sep, rest = line.partition(":")
        if not sep:
            continue
        deps[module_name(target.strip())] = [module_name(d) for d in rest.split()]
    return deps


def parse_modules_builtin(text: str) -> set[str]:
    """Names of the modules compiled into the kernel, from ``modules.builtin``."""
    return {module_name(line.strip()) for line in text.splitlines() if line.strip()}


def resolve(wanted: Iterable[str], deps: Mapping[str, Iterable[str]],
            builtin: Iterable[str] = ()) -> list[str]:
    """Load order for ``wanted`` plus all dependencies, each after what it needs.

    Built-in modules are left out. An unknown module raises KeyError naming it; a
    dependency cycle (which the kernel would refuse too) raises ValueError.
    """
    inside = set(builtin)
    order: list[str] = []
    done: set[str] = set()
    visiting: set[str] = set()

    def visit(name: str) -> None:
        if name in done or name in inside:
            return
        if name in visiting:
            raise ValueError(f"dependency cycle through module {name}")
        if name not in deps:
            raise KeyError(name)
        visiting.add(name)
        for dep in deps[name]:
            visit(dep)
        visiting.discard(name)
        done.add(name)
        order.append(name)

    for name in wanted:
        visit(name)
    return order


def read_module(path: Path) -> bytes:
    """The uncompressed ELF bytes of a module file."""
    import gzip
    import lzma

    name = path.name
    try:
        if name.endswith(".ko.xz"):
            return lzma.decompress(path.read_bytes())
        if name.endswith(".ko.gz"):
            return gzip.decompress(path.read_bytes())
        if name.endswith(".ko.zst"):
            return subprocess.run(["zstd", "-dcq", str(path)], check=True,
                                  capture_output=True).stdout
        return path.read_bytes()
    except FileNotFoundError as exc:
        raise ImageError(
            f"cannot decompress {name}: zstd is not installed: run `apt-get install zstd`"
        ) from exc
    except (OSError, lzma.LZMAError, subprocess.CalledProcessError) as exc:
        raise ImageError(f"cannot read kernel module {path}: {exc}; rebuild with force"
                         ) from exc


@frozen
class ModuleSelection:
    """The modules to put in the initramfs, in load order, and those built in."""

    load_order: list[str]       # module names
    files: dict[str, Path]      # module name -> file in the extracted package
    builtin: list[str]          # wanted modules that need no file

    def relpath(self, name: str, moddir: Path) -> str:
        """Path of the (uncompressed) module inside /lib/modules/<version>/."""
        rel = self.files[name].relative_to(moddir).as_posix()
        for suffix in _SUFFIXES[1:]:
            if rel.endswith(suffix):
                return rel[: -len(suffix)] + ".ko"
        return rel


def select(moddir: Path, wanted: Iterable[str]) -> ModuleSelection:
    """Resolve ``wanted`` against the module tree ``moddir`` (/lib/modules/<version>)."""
    wanted = list(wanted)
    files: dict[str, Path] = {}
    for path in sorted(moddir.rglob("*.ko*")):
        if path.name.endswith(_SUFFIXES):
            files.setdefault(module_name(path.name), path)
    builtin_file = moddir / "modules.builtin"
    builtin = (parse_modules_builtin(builtin_file.read_text())
               if builtin_file.exists() else set())
    dep_file = moddir / "modules.dep"
    if dep_file.exists():
        deps: Mapping[str, list[str]] = parse_modules_dep(dep_file.read_text())
    else:
        deps = _ModinfoDeps(files)
    try:
        order = resolve(wanted, deps, builtin)
    except KeyError as exc:
        raise ImageError(
            f"kernel module {exc.args[0]} is neither in the kernel package nor built in: "
            "remove it from the image's module list or pick another kernel") from exc
    return ModuleSelection(order, {n: files[n] for n in order},
                           [n for n in wanted if n in builtin])


class _ModinfoDeps(Mapping[str, list[str]]):
    """modules.dep stand-in that reads ``depends=`` lazily from module files."""

    def __init__(self, files: Mapping[str, Path]) -> None:
        self._files = files
        self._cache: dict[str, list[str]] = {}

    def __getitem__(self, name: str) -> list[str]:
        if name not in self._cache:
            path = self._files[name]
            try:
                info = elf.modinfo(read_module(path))
            except elf.ElfError as exc:
                raise ImageError(f"kernel module {path} is not a valid ELF file: "
                                 "delete the cached .deb and rebuild") from exc
            self._cache[name] = [module_name(d) for line in info.get("depends", [])
                                 for d in line.split(",") if d]
        return self._cache[name]

    def __contains__(self, name: object) -> bool:
        return name in self._files

    def __iter__(self) -> Iterator[str]:
        return iter(self._files)

    def __len__(self) -> int:
        return len(self._files)


def install_tree(moddir: Path, root: Path) -> Path:
    """Copy the module tree ``moddir`` (``.../lib/modules/VERSION``) into the root
    filesystem ``root`` at ``usr/lib/modules/VERSION`` and index it there with the
    host's depmod (modules.dep, modules.alias, modules.devname: what the guest's modprobe
    and its kernel's requests for aliases such as ``nft-expr-masq`` or
    ``rtnl-link-bridge`` read, and what systemd's kmod-static-nodes makes /dev/net/tun
    from). Returns the installed directory."""
    version = moddir.name
    target = root / "usr" / "lib" / "modules" / version
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        target.parent.chmod(0o755)
        shutil.copytree(moddir, target, symlinks=True, dirs_exist_ok=True)
    except (OSError, shutil.Error) as exc:
        raise ImageError(f"cannot copy the kernel modules into {target}: {exc}") from exc
    # depmod -b reads BASE/lib/modules/VERSION: /usr/lib through a merged /usr's /lib.
    base = root if (root / "lib" / "modules" / version).is_dir() else root / "usr"
    try:
        proc = subprocess.run(["depmod", "-b", str(base), version], capture_output=True,
                              text=True, check=False)
    except FileNotFoundError:
        raise ImageError("depmod is not on this host: run `apt-get install kmod`") from None
    if proc.returncode != 0:
        lines = proc.stderr.strip().splitlines()
        raise ImageError(f"depmod could not index the modules in {target}: "
                         f"{lines[-1] if lines else f'exit status {proc.returncode}'}")
    # Readable like the rest of /usr (the builder runs with umask 077).
    for path in target.glob("modules.*"):
        os.chmod(path, 0o644)
    return target
