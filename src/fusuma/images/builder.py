"""Build and find guest images: a Debian cloud kernel plus a busybox + qemu-ga initramfs.

Cache layout under ``cache``::

    debs/<kernel package>.deb                 downloaded once, reused offline
    images/<kind>-<digest[:16]>/vmlinuz       the kernel
    images/<kind>-<digest[:16]>/initrd.img    newc cpio, uncompressed
    images/<kind>-<digest[:16]>/probe         the static probe, also /usr/bin/probe inside
    images/debian-<digest[:16]>/root.erofs    the Debian kinds' root (see below)
    images/<kind>-<digest[:16]>/image.json    what was built from what
    images/<kind>.json                        points at the current image of that kind

The ``debian`` kind is a real Debian system made by debootstrap (apache2 and qemu-ga
installed). Debian's whole root is the erofs image ``root.erofs``, which a VM gets
either as a read-only virtio-blk disk (a page-cache copy per VM) or as a shared segment
at "/" mounted with DAX (one host copy for all VMs: the DCSS layout; ``fusuma segment
create NAME --from-image debian``). Its initramfs is small: a static busybox, the
kernel modules and /init, which mounts that root read-only under an overlayfs whose
upper layer is a small tmpfs (so /etc, /var and /tmp are writable and private to each
VM) and switch_roots into it. The ``debian-host`` kind (systemd as init) keeps Debian's
root without /usr in its initramfs and takes only /usr from its root.erofs.

An image is built in a temporary directory next to its final place and renamed into
place, and the pointer is replaced atomically, so an interrupted build leaves nothing
that ``find_image`` would return.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import logging
import os
import shutil
import stat
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict
from pathlib import Path
from typing import Any

from fusuma import guest
from fusuma.errors import ImageError, ImageMissing, SpecError
from fusuma.frozen import frozen
from fusuma.host import distro
from fusuma.images import debian, elf, erofs, modules
from fusuma.images.initramfs import Tree

LOG = logging.getLogger(__name__)

# Bump when the builder's output changes for the same inputs.
BUILDER_VERSION = 4
KERNEL_META = "linux-image-cloud-amd64"
BUILD_HINT = "run `fusuma image build`"

Progress = Callable[[str], None]


@frozen
class ImageKind:
    """What goes into one kind of image."""

    name: str
    modules: tuple[str, ...]
    append: str
    # Debian packages debootstrap installs into a root filesystem; () = no rootfs
    # (the minimal kind: a busybox initramfs only).
    packages: tuple[str, ...] = ()
    # A rootfs kind's /init; "init-debian-host.sh" hands PID 1 to the guest's systemd.
    init: str = "init-debian.sh"
    # A rootfs kind with the kernel's whole module tree in its root (/usr/lib/modules,
    # indexed by depmod): the guest's kernel loads what it asks for through modprobe,
    # as a stock host's does (nftables' expressions, bridge, tun). ``modules`` are
    # still loaded by /init, before the root is there.
    module_tree: bool = False

    @property
    def systemd(self) -> bool:
        """True when the guest's own systemd is its init (no busybox /init after boot)."""
        return self.init == "init-debian-host.sh"


# Kernel options: quiet console on the first serial port, reboot at once on panic (QEMU
# runs with -no-reboot, so a panic ends the VM), and skip probes that cost seconds
# under TCG and that a VM without a keyboard or real TSC does not need.
_APPEND = ("console=ttyS0 quiet panic=-1 i8042.noaux i8042.nomux i8042.nopnp "
           "i8042.dumbkbd 8250.nr_uarts=1 tsc=reliable no_timer_check")

_MODULES = (
    # the guest agent's transport first
    "virtio_pci", "virtio_console",
    "virtio_blk", "virtio_net", "virtio_rng", "virtio_balloon",
    # shared segments: virtio-pmem -> nd_pmem -> erofs with DAX
    "virtio_pmem", "nd_pmem", "dax", "erofs",
    # a rootfs on virtio-blk
    "ext4",
)

KINDS: dict[str, ImageKind] = {
    "minimal": ImageKind(name="minimal", modules=_MODULES, append=_APPEND),
    # overlay: the writable layer over the read-only root
    "debian": ImageKind(
        name="debian", modules=(*_MODULES, "overlay"), append=_APPEND,
        packages=("apache2", "qemu-guest-agent", "iproute2", "procps", "iperf3"),
    ),
    # A stock-host stand-in for testing fusuma itself on cgroup v2 (tests/cgroup2):
    # Debian with systemd as init (unified hierarchy), udev, QEMU and python3; fusuma
    # comes on a disk of the test. Kept apart from "debian" so that one stays small.
    "debian-host": ImageKind(
        name="debian-host", modules=_MODULES,
        append=_APPEND + " systemd.unified_cgroup_hierarchy=1 systemd.show_status=0",
        packages=("systemd-sysv", "udev", "qemu-guest-agent", "qemu-system-x86",
                  "python3", "iproute2", "procps", "kmod", "dnsmasq-base", "nftables"),
        init="init-debian-host.sh", module_tree=True,
    ),
}
# The guest scripts that go into every image (their hashes name the image); a kind's
# own /init beyond these is hashed into that kind's images only.
SCRIPTS = ("init.sh", "init-debian.sh", "lib.sh", "shutdown.sh")


@frozen
class GuestImage:
    """A built image: the files to pass to QEMU's -kernel / -initrd / -append."""

    kind: str
    kernel: Path
    initrd: Path
    append: str
    digest: str
    kernel_version: str
    root: Path | None = None    # debian kinds: the erofs image of Debian's whole root


# Inputs added after images were cached (see Inputs.digest).
_LATER_FIELDS = ("module_tree", "pycs_zero_mtime")


@frozen
class Inputs:
    """Everything that decides an image's bytes; its hash names the image."""

    kind: str
    kernel_deb: str
    busybox_version: str
    qemu_ga_version: str
    init_sha256: str
    shutdown_sha256: str
    probe_sha256: str
    modules: tuple[str, ...]
    append: str
    scripts_sha256: str = ""
    rootfs: str = ""            # debian kind: "suite mirror pkg,pkg,..."
    builder_version: int = BUILDER_VERSION
    module_tree: bool = False   # ImageKind.module_tree
    # Debian's byte-compiled Python modules made valid for the erofs root (whose files
    # all have mtime 0): the kinds with python3 (see _pycs_for_zero_mtimes).
    pycs_zero_mtime: bool = False

    def digest(self) -> str:
        import hashlib

        fields = asdict(self)
        # Added after images were cached: left out while unset, so that the kinds
        # without it keep their images (and their names).
        for name in _LATER_FIELDS:
            if not fields[name]:
                del fields[name]
        blob = json.dumps(fields, sort_keys=True).encode()
        return hashlib.sha256(blob).hexdigest()


def guest_script(name: str) -> bytes:
    """A script shipped as package data (init.sh, shutdown.sh)."""
    from importlib import resources

    return resources.files("fusuma.images").joinpath(name).read_bytes()


def _kind(kind: str) -> ImageKind:
    try:
        return KINDS[kind]
    except KeyError:
        known = ", ".join(sorted(KINDS))
        raise SpecError(f"there is no guest image kind {kind!r}: use one of {known}"
                        ) from None


def find_image(cache: Path, *, kind: str = "minimal") -> GuestImage:
    """The current image of ``kind`` in ``cache``; ImageError when none is built."""
    _kind(kind)
    pointer = cache / "images" / f"{kind}.json"
    try:
        target = json.loads(pointer.read_text())["dir"]
    except FileNotFoundError:
        raise ImageMissing(f"the {kind} guest image is not built: {BUILD_HINT}") from None
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise ImageError(f"{pointer} is unreadable ({exc}): {BUILD_HINT}") from exc
    image = _load(cache / "images" / str(target))
    if image is None:
        raise ImageError(f"the {kind} guest image in {cache / 'images' / str(target)} "
                         f"is incomplete: {BUILD_HINT}")
    return image


def probe_path(cache: Path, *, kind: str = "minimal") -> Path:
    """The host copy of the probe in the current image (the same binary as the guest's
    /usr/bin/probe); ImageError when the image predates the probe's current source."""
    image = find_image(cache, kind=kind)
    path = image.kernel.parent / "probe"
    try:
        built_from = json.loads((path.parent / "image.json").read_text())["inputs"]
    except (OSError, ValueError, KeyError, TypeError):
        built_from = {}
    if built_from.get("probe_sha256") != guest.source_sha256() or not path.is_file():
        raise ImageError(f"the {kind} guest image was built without the current probe: "
                         f"{BUILD_HINT}")
    return path


def _load(path: Path, digest: str | None = None) -> GuestImage | None:
    """The image in ``path`` if it is complete (and has ``digest``), else None."""
    try:
        meta = json.loads((path / "image.json").read_text())
        root = path.resolve() / "root.erofs" if meta.get("root") else None
        image = GuestImage(kind=meta["kind"], kernel=path.resolve() / "vmlinuz",
                           initrd=path.resolve() / "initrd.img", append=meta["append"],
                           digest=meta["digest"], kernel_version=meta["kernel_version"],
                           root=root)
    except (OSError, ValueError, KeyError, TypeError):
        return None
    if meta.get("usr"):     # builder 3's layout (usr.erofs): rebuild
        return None
    if digest is not None and image.digest != digest:
        return None
    if not (image.kernel.is_file() and image.initrd.is_file()):
        return None
    if image.root is not None and not image.root.is_file():
        return None
    return image


def build_image(cache: Path, *, kind: str = "minimal", force: bool = False,
                progress: Progress | None = None) -> GuestImage:
    """Build the ``kind`` image into ``cache``, or return the cached one if up to date.

    Needs busybox-static and qemu-guest-agent installed on the host, and apt (or a
    kernel .deb already in ``cache/debs``). ``force`` rebuilds even when cached.
    """
    spec = _kind(kind)

    def say(msg: str) -> None:
        LOG.info("%s", msg)
        if progress is not None:
            progress(msg)

    images = cache / "images"
    with _locked(images):
        _remove_stale(images)
        inputs, deb = _inputs(spec, cache / "debs", say)
        if not force and (done := _load(_final_dir(images, inputs), inputs.digest())):
            _point(images, kind, done.kernel.parent.name)
            LOG.debug("image %s is up to date", done.digest[:16])
            return done
        deb_path, deb = _fetch(deb, cache / "debs", say)
        if deb.filename != inputs.kernel_deb:
            inputs = _replace_kernel(inputs, deb)
            if not force and (done := _load(_final_dir(images, inputs), inputs.digest())):
                _point(images, kind, done.kernel.parent.name)
                return done
        image = _build(spec, inputs, deb_path, images, say)
        _point(images, kind, image.kernel.parent.name)
        return image


def _final_dir(images: Path, inputs: Inputs) -> Path:
    return images / f"{inputs.kind}-{inputs.digest()[:16]}"


def _replace_kernel(inputs: Inputs, deb: debian.KernelDeb) -> Inputs:
    fields = asdict(inputs)
    fields["kernel_deb"] = deb.filename
    fields["modules"] = tuple(fields["modules"])
    return Inputs(**fields)


def _inputs(spec: ImageKind, debs: Path,
            say: Progress) -> tuple[Inputs, debian.KernelDeb]:
    import hashlib

    busybox = debian.package_version("busybox-static")
    qemu_ga = debian.package_version("qemu-guest-agent")
    try:
        deb = debian.resolve_kernel(KERNEL_META)
    except debian.ToolFailed as exc:
        cached = debian.cached_kernels(debs, KERNEL_META)
        if not cached:
            raise ImageError(f"apt cannot find the kernel package {KERNEL_META} "
                             f"({exc.detail}): run `apt-get update`") from exc
        deb = cached[0]
        say(f"apt-cache failed ({exc.detail}); using cached {deb.filename}")
    rootfs = ""
    if spec.packages:
        suite, mirror = distro.debian_source()
        rootfs = f"{suite} {mirror} {','.join(spec.packages)}"
    scripts = hashlib.sha256()
    for name in SCRIPTS + tuple(n for n in (spec.init,) if n not in SCRIPTS):
        scripts.update(guest_script(name))
    inputs = Inputs(
        kind=spec.name, kernel_deb=deb.filename, busybox_version=busybox,
        qemu_ga_version=qemu_ga,
        init_sha256=hashlib.sha256(guest_script("init.sh")).hexdigest(),
        shutdown_sha256=hashlib.sha256(guest_script("shutdown.sh")).hexdigest(),
        probe_sha256=guest.source_sha256(),
        modules=spec.modules, append=spec.append,
        scripts_sha256=scripts.hexdigest(), rootfs=rootfs, module_tree=spec.module_tree,
        pycs_zero_mtime="python3" in spec.packages)
    return inputs, deb


def _fetch(deb: debian.KernelDeb, debs: Path,
           say: Progress) -> tuple[Path, debian.KernelDeb]:
    """The .deb for ``deb``, downloaded if needed; a cached older one if apt fails."""
    if not (debs / deb.filename).exists():
        say(f"downloading {deb.package} {deb.version}")
    try:
        return debian.download(deb, debs), deb
    except debian.ToolFailed as exc:
        cached = debian.cached_kernels(debs, KERNEL_META)
        if not cached:
            raise ImageError(f"cannot download {deb.package} ({exc.detail}): check the "
                             "network and apt sources, then run `apt-get update`") from exc
        say(f"download failed ({exc.detail}); using cached {cached[0].filename}")
        return debs / cached[0].filename, cached[0]


def _build(spec: ImageKind, inputs: Inputs, deb_path: Path, images: Path,
           say: Progress) -> GuestImage:
    import tempfile

    digest = inputs.digest()
    final = _final_dir(images, inputs)
    started = time.monotonic()
    tmp = Path(tempfile.mkdtemp(prefix=f".build-{spec.name}-", dir=images))
    try:
        say(f"extracting {deb_path.name}")
        root = tmp / "deb"
        debian.extract(deb_path, root)
        vmlinuz, moddir = _kernel_files(root, deb_path)
        say("compiling the probe")
        guest.build_static(tmp / "probe")
        if spec.packages:
            tree = _debian(spec, inputs, moddir, digest, tmp, say)
        else:
            say("collecting kernel modules, busybox and qemu-ga")
            tree = _tree(spec, moddir, digest)
            tree.file("/usr/bin/probe", (tmp / "probe").read_bytes(), 0o755)
        say(f"packing initramfs ({len(tree.entries)} entries, "
            f"{tree.size() / 2**20:.1f} MiB)")
        # Uncompressed: under TCG the guest unpacks a ~10 MB cpio faster than it
        # inflates a 4 MB gzip (median boot-to-agent 2.27 s vs 2.42 s, 6 boots each).
        with (tmp / "initrd.img").open("wb") as out:
            tree.write_cpio(out)
        shutil.copyfile(vmlinuz, tmp / "vmlinuz")
        if spec.packages:
            (tmp / "root.erofs").chmod(0o644)
        shutil.rmtree(root)
        meta: dict[str, Any] = {
            "kind": spec.name, "digest": digest, "kernel_version": moddir.name,
            "append": spec.append, "inputs": asdict(inputs),
            "initrd_bytes": (tmp / "initrd.img").stat().st_size,
            "root": "root.erofs" if spec.packages else None,
            "built_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        }
        (tmp / "image.json").write_text(json.dumps(meta, indent=2) + "\n")
        # fusuma runs with umask 077; an image is public (each VM's QEMU runs under its
        # own uid and reads the kernel and initrd).
        for f in ("vmlinuz", "initrd.img", "image.json"):
            (tmp / f).chmod(0o644)
        tmp.chmod(0o755)
        if final.exists():
            old = Path(tempfile.mkdtemp(prefix=".old-", dir=images))
            final.rename(old / final.name)
            shutil.rmtree(old)
        tmp.rename(final)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    say(f"built {final.name} in {time.monotonic() - started:.1f} s "
        f"(initrd {meta['initrd_bytes'] / 2**20:.1f} MiB)")
    image = _load(final, digest)
    if image is None:  # a check that can fail: the files we just wrote must load
        raise ImageError(f"the image just built in {final} does not load: {BUILD_HINT}")
    return image


def _kernel_files(root: Path, deb: Path) -> tuple[Path, Path]:
    kernels = sorted((root / "boot").glob("vmlinuz-*"))
    moddirs = sorted(p for base in ("lib/modules", "usr/lib/modules")
                     for p in (root / base).glob("*") if p.is_dir())
    if len(kernels) != 1 or len(moddirs) != 1:
        raise ImageError(f"{deb.name} does not hold exactly one kernel and one module "
                         "tree: delete it from the cache and rebuild")
    return kernels[0], moddirs[0]


def _tree(spec: ImageKind, moddir: Path, digest: str) -> Tree:
    tree = Tree()
    for d in ("/proc", "/sys", "/dev", "/run", "/tmp", "/root", "/mnt", "/etc/fusuma"):
        tree.mkdir(d, 0o1777 if d == "/tmp" else 0o755)
    tree.symlink("/var/run", "/run")
    # The kernel opens /dev/console for init before /init can mount devtmpfs.
    tree.chardev("/dev/console", 5, 1)
    tree.chardev("/dev/null", 1, 3, 0o666)
    tree.file("/etc/passwd", b"root:x:0:0:root:/root:/bin/sh\n")
    tree.file("/etc/group", b"root:x:0:\ntty:x:5:\n")
    tree.file("/etc/fusuma/image", f"{spec.name} {digest}\n".encode())
    tree.file("/init", guest_script("init.sh"), 0o755)
    tree.file("/fusuma/lib.sh", guest_script("lib.sh"))
    tree.file("/sbin/shutdown", guest_script("shutdown.sh"), 0o755)
    _add_busybox(tree)
    _add_qemu_ga(tree)
    _add_modules(tree, spec, moddir)
    return tree


# Debian's shutdown comes with an init system, which this guest does not run; qemu-ga's
# guest-shutdown calls /sbin/shutdown, so /usr/sbin/shutdown is this script.
_DEBIAN_SHUTDOWN = b"""#!/bin/sh
# fusuma Debian guest: no init system, so sync and power off (or reboot) at once.
sync
for arg in "$@"; do
    [ "$arg" = -r ] && exec /fusuma/bin/busybox reboot -f
done
exec /fusuma/bin/busybox poweroff -f
"""
# What debootstrap leaves that a guest does not need: downloaded .debs, apt lists.
_DEBIAN_PRUNE = ("var/cache/apt/archives", "var/lib/apt/lists", "var/cache/apt",
                 "var/cache/debconf", "var/log")


def _pycs_for_zero_mtimes(root: Path) -> int:
    """Make the byte-compiled Python modules under ``root`` valid in its erofs image,
    where every file has mtime 0 (``mkfs.erofs -T0``). A ``.pyc`` records its source's
    mtime and size; one that no longer matches is compiled again at every import, and
    a read-only root cannot keep the new one: under TCG that costs each Python program
    in the guest seconds. A ``.pyc`` that matches its source here gets mtime 0; the
    others (stale already, hash-based, or with no source) are left as they are.
    Returns how many were rewritten."""
    n = 0
    for pyc in root.rglob("__pycache__/*.pyc"):
        # __pycache__/NAME.cpython-311[.opt-1].pyc is the code of ./NAME.py
        src = pyc.parent.parent / (pyc.name.split(".", 1)[0] + ".py")
        try:
            st = src.lstat()
            head = pyc.read_bytes()[:16]
        except OSError:
            continue
        if not stat.S_ISREG(st.st_mode) or pyc.is_symlink() or len(head) < 16:
            continue
        flags, mtime, size = (int.from_bytes(head[i:i + 4], "little") for i in (4, 8, 12))
        if flags != 0 or (mtime, size) != (int(st.st_mtime) & 0xFFFFFFFF,
                                           st.st_size & 0xFFFFFFFF):
            continue
        with open(pyc, "r+b") as f:
            f.seek(8)
            f.write(bytes(4))
        n += 1
    return n


def _debian(spec: ImageKind, inputs: Inputs, moddir: Path, digest: str, tmp: Path,
            say: Progress) -> Tree:
    """Bootstrap Debian into ``tmp/rootfs``, write ``tmp/root.erofs`` from it and
    return the initramfs tree: /fusuma (busybox, modules, lib.sh) and /init, plus for
    a systemd kind Debian's root without /usr (see the module docstring)."""
    suite, mirror, _ = inputs.rootfs.split(" ", 2)
    rootfs = tmp / "rootfs"
    started = time.monotonic()
    say(f"debootstrap {suite} from {mirror} with {', '.join(spec.packages)} "
        "(about a minute)")
    debian.debootstrap(suite, mirror, spec.packages, rootfs)
    say(f"debootstrap done in {time.monotonic() - started:.0f} s")
    # /dev's nodes too: the guest mounts devtmpfs there.
    for rel in (*_DEBIAN_PRUNE, "dev"):
        target = rootfs / rel
        if target.is_dir():
            for child in target.iterdir():
                if child.is_dir() and not child.is_symlink():
                    shutil.rmtree(child)
                else:
                    child.unlink()
    (rootfs / "etc/hostname").write_text("fusuma\n")
    (rootfs / "etc/hosts").write_text("127.0.0.1 localhost\n")
    conf = rootfs / "etc/apache2/conf-available/fusuma.conf"
    if conf.parent.is_dir():
        conf.write_text("ServerName localhost\n")
        (rootfs / "etc/apache2/conf-enabled/fusuma.conf").symlink_to(
            "../conf-available/fusuma.conf")
    if spec.module_tree:
        say(f"installing the kernel's modules ({moddir.name}) and indexing them")
        modules.install_tree(moddir, rootfs)
    shutil.copyfile(tmp / "probe", rootfs / "usr/local/bin/probe")
    (rootfs / "usr/local/bin/probe").chmod(0o755)
    if not spec.systemd:    # with systemd as init, its own shutdown is the right one
        (rootfs / "usr/sbin/shutdown").unlink(missing_ok=True)
        (rootfs / "usr/sbin/shutdown").write_bytes(_DEBIAN_SHUTDOWN)
        (rootfs / "usr/sbin/shutdown").chmod(0o755)
    # fusuma runs with umask 077: every mode is set.
    (rootfs / "etc/fusuma").mkdir()
    (rootfs / "etc/fusuma").chmod(0o755)
    _write(rootfs / "etc/fusuma/image", f"{spec.name} {digest}\n".encode(), 0o644)
    # The init's stage 2 runs from the root: busybox, lib.sh and the init itself.
    (rootfs / "fusuma/bin").mkdir(parents=True)
    for d in ("fusuma", "fusuma/bin"):
        (rootfs / d).chmod(0o755)
    _write(rootfs / "fusuma/bin/busybox", _busybox_binary(), 0o755)
    for applet in _busybox_applets():
        (rootfs / "fusuma/bin" / applet).symlink_to("busybox")
    _write(rootfs / "fusuma/lib.sh", guest_script("lib.sh"), 0o644)
    _write(rootfs / "fusuma/init", guest_script(spec.init), 0o755)
    fixed = _pycs_for_zero_mtimes(rootfs)
    if fixed:
        say(f"{fixed} byte-compiled Python modules made valid for the erofs root")
    say("writing root.erofs from Debian's root")
    erofs.make_image(rootfs, tmp / "root.erofs", label="debian-root")

    tree = Tree()
    if spec.systemd:
        say("collecting Debian's root without /usr, kernel modules and busybox")
        tree.add_host_tree(rootfs, "/", skip=lambda p: p.startswith(("/usr/", "/dev/",
                                                                      "/proc/", "/sys/")))
    else:
        say("collecting kernel modules and busybox")
        for d in ("/proc", "/sys", "/dev", "/run", "/newroot"):
            tree.mkdir(d)
    tree.chardev("/dev/console", 5, 1)
    tree.chardev("/dev/null", 1, 3, 0o666)
    tree.file("/init", guest_script(spec.init), 0o755)
    _add_fusuma_dir(tree)
    selection = modules.select(moddir, spec.modules)
    order = []
    for name in selection.load_order:
        rel = selection.relpath(name, moddir)
        tree.file(f"/fusuma/modules/{rel}", modules.read_module(selection.files[name]))
        order.append(rel)
    tree.file("/fusuma/modules.list", "".join(f"{r}\n" for r in order).encode())
    shutil.rmtree(rootfs)
    return tree


def _write(path: Path, data: bytes, mode: int) -> None:
    path.write_bytes(data)
    path.chmod(mode)


def _add_fusuma_dir(tree: Tree) -> None:
    """/fusuma of a Debian guest: a static busybox with its applets, and lib.sh."""
    tree.file("/fusuma/lib.sh", guest_script("lib.sh"))
    tree.file("/fusuma/bin/busybox", _busybox_binary(), 0o755)
    for applet in _busybox_applets():
        tree.symlink(f"/fusuma/bin/{applet}", "busybox")


def _busybox_binary() -> bytes:
    busybox = Path("/bin/busybox")
    try:
        data = busybox.read_bytes()
        static = elf.is_static(data)
    except (OSError, elf.ElfError):
        static = False
    if not static:
        raise ImageError("/bin/busybox is missing or not statically linked: run "
                         "`apt-get install busybox-static`")
    return data


def _busybox_applets() -> list[str]:
    try:
        applets = debian.run(["/bin/busybox", "--list"])
    except debian.ToolFailed as exc:
        raise ImageError(f"/bin/busybox cannot list its applets ({exc.detail}): "
                         "run `apt-get install --reinstall busybox-static`") from exc
    return [a for a in applets.split() if a and "/" not in a and a != "busybox"]


def _add_busybox(tree: Tree) -> None:
    busybox = Path("/bin/busybox")
    tree.file("/bin/busybox", _busybox_binary(), 0o755)
    try:
        applets = debian.run([str(busybox), "--list-full"])
    except debian.ToolFailed as exc:
        raise ImageError(f"/bin/busybox cannot list its applets ({exc.detail}): "
                         "run `apt-get install --reinstall busybox-static`") from exc
    for rel in applets.split():
        path = "/" + rel
        if "/" in rel and path not in tree:
            tree.symlink(path, "/bin/busybox")


def _add_qemu_ga(tree: Tree) -> None:
    qemu_ga = debian.which("qemu-ga")
    if qemu_ga is None:
        raise ImageError("qemu-ga is not on this host: run `apt-get install qemu-guest-agent`")
    tree.file("/usr/sbin/qemu-ga", qemu_ga.read_bytes(), 0o755)
    for lib in debian.shared_libraries(qemu_ga):
        # Copy the file a soname link points at, under the soname ldd printed.
        tree.file(str(lib), lib.read_bytes(), 0o755)


def _add_modules(tree: Tree, spec: ImageKind, moddir: Path) -> None:
    selection = modules.select(moddir, spec.modules)
    kver = moddir.name
    order: list[str] = []
    for name in selection.load_order:
        rel = selection.relpath(name, moddir)
        tree.file(f"/lib/modules/{kver}/{rel}", modules.read_module(selection.files[name]))
        order.append(rel)
    tree.file("/etc/fusuma/modules", "".join(f"{r}\n" for r in order).encode())
    LOG.debug("modules %s; built in: %s", selection.load_order, selection.builtin)


def _point(images: Path, kind: str, dirname: str) -> None:
    """Atomically make ``images/<kind>.json`` name ``dirname``."""
    pointer = images / f"{kind}.json"
    with contextlib.suppress(OSError, ValueError):
        if json.loads(pointer.read_text()).get("dir") == dirname:
            return
    tmp = pointer.with_name(f".{kind}.json.tmp")
    tmp.write_text(json.dumps({"dir": dirname}) + "\n")
    os.replace(tmp, pointer)


def _remove_stale(images: Path) -> None:
    """Delete leftovers of builds killed before their cleanup ran (we hold the lock)."""
    for stale in images.glob(".build-*"):
        shutil.rmtree(stale, ignore_errors=True)
    for stale in images.glob(".old-*"):
        shutil.rmtree(stale, ignore_errors=True)


@contextlib.contextmanager
def _locked(images: Path) -> Iterator[None]:
    """Serialise builds into one cache (a second builder waits for the first)."""
    try:
        images.mkdir(parents=True, exist_ok=True)
        fh = (images / ".lock").open("a")
    except OSError as exc:
        raise ImageError(f"cannot write the image cache {images} ({exc.strerror}): "
                         "run as root or set FUSUMA_CACHE to a writable directory") from exc
    with fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)
