"""Unit tests of the guest image builder's pure parts (no apt, no QEMU)."""

from __future__ import annotations

import dataclasses
import hashlib
import io
import json
import lzma
import os
import shutil
import stat
import struct
import subprocess
from pathlib import Path
from typing import Any

import pytest

from fusuma.errors import ImageError, ImageMissing, NotFoundError, SpecError
from fusuma.images import builder, debian, elf, modules
from fusuma.images.initramfs import Tree

FAKE_DEP = """\
kernel/drivers/virtio/virtio_ring.ko:
kernel/drivers/virtio/virtio.ko: kernel/drivers/virtio/virtio_ring.ko
kernel/drivers/virtio/virtio_pci_modern_dev.ko:
kernel/drivers/virtio/virtio_pci.ko: kernel/drivers/virtio/virtio_ring.ko \
kernel/drivers/virtio/virtio_pci_modern_dev.ko kernel/drivers/virtio/virtio.ko
kernel/drivers/char/virtio_console.ko: kernel/drivers/virtio/virtio.ko \
kernel/drivers/virtio/virtio_ring.ko
kernel/drivers/char/hw_random/virtio-rng.ko.xz: kernel/drivers/virtio/virtio.ko
kernel/lib/libcrc32c.ko:
kernel/fs/erofs/erofs.ko: kernel/lib/libcrc32c.ko
"""
FAKE_BUILTIN = "kernel/fs/ext4/ext4.ko\nkernel/drivers/dax/dax.ko\n"


def fake_elf(modinfo: dict[str, str] | None = None, interp: str | None = None) -> bytes:
    """A minimal little-endian ELF64 with an optional .modinfo section and PT_INTERP."""
    ehdr_size, phdr_size, shdr_size = 64, 56, 64
    phnum = 1 if interp else 0
    body = bytearray()
    offset = ehdr_size + phnum * phdr_size
    interp_off = offset
    interp_bytes = (interp.encode() + b"\0") if interp else b""
    body += interp_bytes
    info = b"".join(f"{k}={v}".encode() + b"\0" for k, v in (modinfo or {}).items())
    info_off = offset + len(body)
    body += info
    shstrtab = b"\0.modinfo\0.shstrtab\0"
    shstr_off = offset + len(body)
    body += shstrtab
    shoff = offset + len(body)
    ident = b"\x7fELF" + bytes([2, 1, 1, 0]) + bytes(8)
    out = bytearray(struct.pack("<16sHHIQQQIHHHHHH", ident, 1, 62, 1, 0,
                                ehdr_size if phnum else 0, shoff, 0, ehdr_size,
                                phdr_size, phnum, shdr_size, 3, 2))
    if interp:
        out += struct.pack("<IIQQQQQQ", 3, 4, interp_off, 0, 0, len(interp_bytes),
                           len(interp_bytes), 1)
    out += body
    out += bytes(shdr_size)  # the null section
    out += struct.pack("<IIQQQQIIQQ", 1, 1, 0, 0, info_off, len(info), 0, 0, 1, 0)
    out += struct.pack("<IIQQQQIIQQ", 10, 3, 0, 0, shstr_off, len(shstrtab), 0, 0, 1, 0)
    return bytes(out)


# -- module dependencies -------------------------------------------------------------

def test_module_name_normalises_dashes_and_suffixes() -> None:
    assert modules.module_name("kernel/drivers/char/hw_random/virtio-rng.ko.xz") == "virtio_rng"
    assert modules.module_name("erofs.ko") == "erofs"


def test_resolve_orders_dependencies_first_and_skips_builtin() -> None:
    deps = modules.parse_modules_dep(FAKE_DEP)
    builtin = modules.parse_modules_builtin(FAKE_BUILTIN)
    order = modules.resolve(["virtio_pci", "virtio_console", "ext4", "erofs"], deps, builtin)
    assert order == ["virtio_ring", "virtio_pci_modern_dev", "virtio", "virtio_pci",
                     "virtio_console", "libcrc32c", "erofs"]
    for name in order:  # every module comes after everything it needs
        assert all(order.index(d) < order.index(name) for d in deps[name])


def test_resolve_reports_unknown_module_and_cycles() -> None:
    deps = modules.parse_modules_dep(FAKE_DEP)
    with pytest.raises(KeyError, match="virtio_gpu"):
        modules.resolve(["virtio_gpu"], deps)
    with pytest.raises(ValueError, match="cycle"):
        modules.resolve(["a"], {"a": ["b"], "b": ["a"]})


def _fake_moddir(tmp_path: Path, with_dep_file: bool) -> Path:
    moddir = tmp_path / "lib/modules/6.1.0-99-cloud-amd64"
    for line in FAKE_DEP.replace("\\\n", "").splitlines():
        rel, _, deps = line.partition(":")
        path = moddir / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        names = ",".join(modules.module_name(d) for d in deps.split())
        data = fake_elf({"license": "GPL", "depends": names, "name": modules.module_name(rel)})
        path.write_bytes(lzma.compress(data) if rel.endswith(".xz") else data)
    (moddir / "modules.builtin").write_text(FAKE_BUILTIN)
    if with_dep_file:
        (moddir / "modules.dep").write_text(FAKE_DEP)
    return moddir


@pytest.mark.parametrize("with_dep_file", [True, False], ids=["modules.dep", "modinfo"])
def test_select_reads_modules_dep_or_modinfo(tmp_path: Path, with_dep_file: bool) -> None:
    moddir = _fake_moddir(tmp_path, with_dep_file)
    sel = modules.select(moddir, ["virtio_rng", "dax", "erofs"])
    assert sel.load_order == ["virtio_ring", "virtio", "virtio_rng", "libcrc32c", "erofs"]
    assert sel.builtin == ["dax"]
    # compressed modules are stored decompressed, under a .ko name
    assert sel.relpath("virtio_rng", moddir) == "kernel/drivers/char/hw_random/virtio-rng.ko"
    assert modules.read_module(sel.files["virtio_rng"]).startswith(b"\x7fELF")


def test_select_missing_module_is_an_image_error(tmp_path: Path) -> None:
    moddir = _fake_moddir(tmp_path, with_dep_file=False)
    with pytest.raises(ImageError, match="virtio_gpu is neither"):
        modules.select(moddir, ["virtio_gpu"])


def test_elf_reads_modinfo_and_interp() -> None:
    data = fake_elf({"depends": "virtio,virtio_ring", "name": "virtio_blk"})
    assert elf.modinfo(data)["depends"] == ["virtio,virtio_ring"]
    assert elf.is_static(data)
    assert not elf.is_static(fake_elf(interp="/lib64/ld-linux-x86-64.so.2"))
    with pytest.raises(elf.ElfError):
        elf.modinfo(b"#!/bin/sh\n")


# -- digest, cache lookup ------------------------------------------------------------

def _inputs() -> builder.Inputs:
    return builder.Inputs(
        kind="minimal", kernel_deb="linux-image-6.1.0-56-cloud-amd64_6.1.192-2_amd64.deb",
        busybox_version="1:1.35.0-4", qemu_ga_version="1:7.2+dfsg-7",
        init_sha256="a" * 64, shutdown_sha256="b" * 64, probe_sha256="e" * 64,
        modules=("virtio_pci", "virtio_console"), append="console=ttyS0")


def test_digest_is_stable_and_changes_with_every_input() -> None:
    base = _inputs()
    assert base.digest() == _inputs().digest()
    changed: dict[str, Any] = {
        "kernel_deb": "linux-image-6.1.0-57-cloud-amd64_6.1.193-1_amd64.deb",
        "busybox_version": "1:1.36.0-1",
        "qemu_ga_version": "1:8.0+dfsg-1",
        "init_sha256": "c" * 64,
        "shutdown_sha256": "d" * 64,
        "probe_sha256": "f" * 64,
        "modules": ("virtio_pci", "virtio_console", "virtio_blk"),
        "append": "console=ttyS0 quiet",
        "builder_version": builder.BUILDER_VERSION + 1,
        "kind": "other",
        "scripts_sha256": "e" * 64,
        "rootfs": "bookworm http://deb.debian.org/debian apache2",
        "module_tree": True,
        "pycs_zero_mtime": True,
    }
    assert set(changed) == {f.name for f in dataclasses.fields(base)}
    digests = {base.digest()}
    for field, value in changed.items():
        digests.add(dataclasses.replace(base, **{field: value}).digest())
    assert len(digests) == len(changed) + 1


def test_digest_of_a_kind_without_the_module_tree_is_what_it_was() -> None:
    # Images cached before the fields existed keep their names (no rebuild of them).
    base = _inputs()
    before = {k: v for k, v in dataclasses.asdict(base).items()
              if k not in ("module_tree", "pycs_zero_mtime")}
    assert base.digest() == hashlib.sha256(
        json.dumps(before, sort_keys=True).encode()).hexdigest()
    assert [k.name for k in builder.KINDS.values() if k.module_tree] == ["debian-host"]
    assert [k.name for k in builder.KINDS.values() if "python3" in k.packages] == \
        ["debian-host"]


def test_pycs_made_valid_for_a_root_whose_files_all_have_mtime_0(tmp_path: Path) -> None:
    """What mkfs.erofs -T0 does to a root's mtimes: a pyc fresh for its source gets
    mtime 0 and Python then uses it (no compile at import); a stale one is left."""
    import py_compile
    import sys

    root = tmp_path / "root"
    lib = root / "usr" / "lib" / "py"
    lib.mkdir(parents=True)
    for name in ("fresh", "stale"):
        (lib / f"{name}.py").write_text(f"WHO = {name!r}\n")
        os.utime(lib / f"{name}.py", (1_700_000_000, 1_700_000_000))
        for opt in (-1, 1):
            py_compile.compile(str(lib / f"{name}.py"), optimize=opt, doraise=True)
    (lib / "stale.py").write_text("WHO = 'changed'\n")   # its pycs no longer match
    stale = {p: p.read_bytes() for p in (lib / "__pycache__").glob("stale.*.pyc")}
    assert builder._pycs_for_zero_mtimes(root) == 2
    for p in (lib / "__pycache__").glob("fresh.*.pyc"):
        assert p.read_bytes()[8:12] == bytes(4), p
    assert {p: p.read_bytes() for p in stale} == stale
    # The root as the guest sees it: every mtime 0, nothing writable for a new pyc.
    for p in lib.iterdir():
        if p.is_file():
            os.utime(p, (0, 0))
    run = subprocess.run([sys.executable, "-v", "-c", "import fresh, stale"],
                         env={**os.environ, "PYTHONPATH": str(lib),
                              "PYTHONDONTWRITEBYTECODE": "1"},
                         capture_output=True, text=True, check=True)
    assert f"matches {lib}/fresh.py" in run.stderr, run.stderr[-2000:]
    assert "bytecode is stale for 'stale'" in run.stderr, run.stderr[-2000:]


@pytest.mark.skipif(shutil.which("depmod") is None, reason="needs kmod's depmod")
def test_module_tree_goes_into_the_root_indexed_for_modprobe(tmp_path: Path) -> None:
    moddir = tmp_path / "deb" / "lib" / "modules" / "6.1.0-9-cloud-amd64"
    for rel, alias in (("kernel/net/bridge/bridge.ko", "rtnl-link-bridge"),
                       ("kernel/drivers/net/tun.ko", "char-major-10-200")):
        (moddir / rel).parent.mkdir(parents=True, exist_ok=True)
        (moddir / rel).write_bytes(fake_elf({"license": "GPL", "alias": alias,
                                             "name": modules.module_name(rel)}))
    (moddir / "modules.builtin").write_text(FAKE_BUILTIN)
    root = tmp_path / "root"
    (root / "usr" / "lib").mkdir(parents=True)
    (root / "lib").symlink_to("usr/lib")          # a merged /usr, as Debian 12's
    old = os.umask(0o077)                         # as fusuma runs
    try:
        target = modules.install_tree(moddir, root)
    finally:
        os.umask(old)
    assert target == root / "usr" / "lib" / "modules" / "6.1.0-9-cloud-amd64"
    assert (target / "kernel/net/bridge/bridge.ko").read_bytes() == \
        (moddir / "kernel/net/bridge/bridge.ko").read_bytes()
    assert "alias rtnl-link-bridge bridge" in (target / "modules.alias").read_text()
    assert "kernel/drivers/net/tun.ko:" in (target / "modules.dep").read_text()
    for name in ("modules.dep.bin", "modules.alias.bin", "modules.builtin.bin"):
        assert stat.S_IMODE((target / name).stat().st_mode) == 0o644, name
    assert stat.S_IMODE(target.parent.stat().st_mode) == 0o755


def test_digest_covers_the_shipped_init_script() -> None:
    script = builder.guest_script("init.sh")
    assert script.startswith(b"#!/bin/sh")
    assert b"fusuma-guest: ready" in script


def test_find_image_on_empty_cache_says_how_to_build(tmp_path: Path) -> None:
    with pytest.raises(ImageError, match=r"not built: run `fusuma image build`"):
        builder.find_image(tmp_path)


def test_find_image_rejects_incomplete_image(tmp_path: Path) -> None:
    images = tmp_path / "images"
    (images / "minimal-0123").mkdir(parents=True)
    (images / "minimal.json").write_text(json.dumps({"dir": "minimal-0123"}))
    with pytest.raises(ImageError, match="incomplete: run `fusuma image build`"):
        builder.find_image(tmp_path)


def test_find_image_returns_the_pointed_image(tmp_path: Path) -> None:
    d = tmp_path / "images" / "minimal-0123"
    d.mkdir(parents=True)
    (d / "vmlinuz").write_bytes(b"k")
    (d / "initrd.img").write_bytes(b"i")
    (d / "image.json").write_text(json.dumps({
        "kind": "minimal", "digest": "0123" * 16, "kernel_version": "6.1.0-56-cloud-amd64",
        "append": "console=ttyS0"}))
    builder._point(tmp_path / "images", "minimal", d.name)
    image = builder.find_image(tmp_path)
    assert image.kernel == d / "vmlinuz" and image.initrd == d / "initrd.img"
    assert image.kernel_version == "6.1.0-56-cloud-amd64"


def _debian_image(tmp_path: Path, **meta: Any) -> Path:
    d = tmp_path / "images" / "debian-0123"
    d.mkdir(parents=True)
    for f in ("vmlinuz", "initrd.img", "root.erofs", "usr.erofs"):
        (d / f).write_bytes(b"x")
    (d / "image.json").write_text(json.dumps({
        "kind": "debian", "digest": "0123" * 16, "kernel_version": "6.1.0-56-cloud-amd64",
        "append": "console=ttyS0", **meta}))
    builder._point(tmp_path / "images", "debian", d.name)
    return d


def test_debian_image_has_its_root_as_one_erofs(tmp_path: Path) -> None:
    d = _debian_image(tmp_path, root="root.erofs")
    assert builder.find_image(tmp_path, kind="debian").root == d / "root.erofs"
    (d / "root.erofs").unlink()
    with pytest.raises(ImageError, match="incomplete: run `fusuma image build`"):
        builder.find_image(tmp_path, kind="debian")


def test_debian_image_of_the_old_usr_layout_must_be_rebuilt(tmp_path: Path) -> None:
    _debian_image(tmp_path, usr="usr.erofs")
    with pytest.raises(ImageError, match="incomplete: run `fusuma image build`"):
        builder.find_image(tmp_path, kind="debian")


def test_only_the_debian_kind_gets_overlay() -> None:
    assert "overlay" in builder.KINDS["debian"].modules
    assert "overlay" not in builder.KINDS["minimal"].modules
    assert builder.KINDS["debian-host"].modules == builder.KINDS["minimal"].modules


def test_unknown_kind_is_bad_input_and_an_unbuilt_one_not_found(tmp_path: Path) -> None:
    with pytest.raises(SpecError, match="no guest image kind 'huge'"):
        builder.find_image(tmp_path, kind="huge")
    with pytest.raises(SpecError, match="use one of debian, debian-host, minimal"):
        builder.build_image(tmp_path, kind="huge")
    # Not built: an ImageError (the CLI's exit code) that the API answers with 404.
    with pytest.raises(ImageMissing, match="the minimal guest image is not built") as err:
        builder.find_image(tmp_path, kind="minimal")
    assert isinstance(err.value, ImageError) and isinstance(err.value, NotFoundError)
    assert err.value.exit_code == ImageError.exit_code


# -- apt plumbing that needs no network ----------------------------------------------

def test_kernel_deb_filename_quotes_epoch() -> None:
    deb = debian.KernelDeb("linux-image-6.1.0-56-cloud-amd64", "1:6.1.192-2", "amd64")
    assert deb.filename == "linux-image-6.1.0-56-cloud-amd64_1%3a6.1.192-2_amd64.deb"


@pytest.mark.skipif(shutil.which("dpkg") is None, reason="needs dpkg")
def test_cached_kernels_newest_first(tmp_path: Path) -> None:
    for name in ("linux-image-6.1.0-9-cloud-amd64_6.1.27-1_amd64.deb",
                 "linux-image-6.1.0-56-cloud-amd64_6.1.192-2_amd64.deb",
                 "linux-image-6.1.0-10-cloud-amd64_6.1.38-1_amd64.deb",
                 "linux-image-cloud-amd64_6.1.192-2_amd64.deb",        # the metapackage
                 "linux-image-6.1.0-56-amd64_6.1.192-2_amd64.deb"):    # another flavour
        (tmp_path / name).write_bytes(b"")
    found = debian.cached_kernels(tmp_path, "linux-image-cloud-amd64")
    assert [d.version for d in found] == ["6.1.192-2", "6.1.38-1", "6.1.27-1"]


def test_missing_tool_is_an_image_error_with_hint() -> None:
    with pytest.raises(ImageError, match="run `apt-get install nothing`"):
        debian.run(["/nonexistent/tool"], install_hint="run `apt-get install nothing`")


# -- initramfs -----------------------------------------------------------------------

def test_cpio_is_aligned_and_lists_parents_first() -> None:
    tree = Tree()
    tree.file("/usr/sbin/qemu-ga", b"\x7fELF...", 0o755)
    tree.symlink("/bin/sh", "/bin/busybox")
    tree.chardev("/dev/console", 5, 1)
    buf = io.BytesIO()
    tree.write_cpio(buf)
    data = buf.getvalue()
    assert data.startswith(b"070701") and len(data) % 4 == 0
    names = []
    pos = 0
    while True:
        header = data[pos: pos + 110]
        fields = [int(header[6 + 8 * i: 14 + 8 * i], 16) for i in range(13)]
        mode, filesize, namesize = fields[1], fields[6], fields[11]
        name = data[pos + 110: pos + 110 + namesize - 1].decode()
        pos += 110 + namesize
        pos += -pos % 4
        pos += filesize + (-filesize % 4)
        if name == "TRAILER!!!":
            break
        names.append(name)
        if name == "dev/console":
            assert stat.S_ISCHR(mode) and (fields[9], fields[10]) == (5, 1)
    assert pos == len(data)
    assert names == ["bin", "bin/sh", "dev", "dev/console", "usr", "usr/sbin",
                     "usr/sbin/qemu-ga"]


@pytest.mark.skipif(shutil.which("cpio") is None, reason="needs cpio")
def test_cpio_is_readable_by_gnu_cpio() -> None:
    tree = Tree()
    tree.file("/init", b"#!/bin/sh\n", 0o755)
    tree.symlink("/bin/sh", "/bin/busybox")
    buf = io.BytesIO()
    tree.write_cpio(buf)
    listing = subprocess.run(["cpio", "-it", "--quiet"], input=buf.getvalue(),
                             capture_output=True, check=True).stdout.decode().split()
    assert listing == ["bin", "bin/sh", "init"]


@pytest.mark.skipif(shutil.which("busybox") is None, reason="needs busybox")
def test_guest_scripts_parse_as_busybox_sh(tmp_path: Path) -> None:
    for name in ("init.sh", "shutdown.sh", "init-debian.sh", "init-debian-host.sh",
                 "lib.sh"):
        script = tmp_path / name
        script.write_bytes(builder.guest_script(name))
        subprocess.run(["busybox", "sh", "-n", str(script)], check=True)


def test_unwritable_cache_is_an_image_error(tmp_path: Path) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    with pytest.raises(ImageError, match="cannot write the image cache"):
        builder.build_image(blocker)


def test_host_tree_keeps_owners_modes_symlinks_and_skips(tmp_path: Path) -> None:
    root = tmp_path / "root"
    (root / "etc").mkdir(parents=True)
    (root / "etc" / "shadow").write_text("x")
    os.chown(root / "etc" / "shadow", 0, 42)
    (root / "etc" / "shadow").chmod(0o640)
    (root / "usr" / "bin").mkdir(parents=True)
    (root / "usr" / "bin" / "big").write_bytes(b"\0" * 100)
    (root / "bin").symlink_to("usr/bin")
    tree = Tree()
    tree.add_host_tree(root, "/", skip=lambda p: p.startswith("/usr/"))
    shadow = tree.entries["/etc/shadow"]
    assert (shadow.gid, stat.S_IMODE(shadow.mode), shadow.data) == (42, 0o640, b"x")
    assert tree.entries["/bin"].data == b"usr/bin"
    assert stat.S_ISLNK(tree.entries["/bin"].mode)
    assert "/usr" in tree and "/usr/bin" not in tree and "/usr/bin/big" not in tree
    out = io.BytesIO()
    tree.write_cpio(out)
    # the gid travels in the newc header (8 hex digits after mode and uid)
    assert b"%08x%08x" % (0, 42) in out.getvalue()
