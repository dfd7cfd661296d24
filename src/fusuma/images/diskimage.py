"""A bootable Debian disk image with cloud-init, built from Debian packages: what a
user would bring (a cloud image), made here because these machines have no internet.

It boots by BIOS and by UEFI. Two MBR partitions: an EFI system partition (FAT) with
a standalone GRUB as ``/EFI/BOOT/BOOTX64.EFI`` (what OVMF boots from any disk), and
the root (ext4, marked active) with a minbase Debian: Debian's cloud kernel, systemd,
cloud-init (NoCloud), qemu-guest-agent and openssh-server, booted under SeaBIOS by
SYSLINUX's ``extlinux`` (its ``mbr.bin`` in the first sector). Both load the same kernel
and initrd with the same command line. There is no udev on the host (and no vfat in
its kernel), so the root is reached by a loop device at its offset (``losetup -o``)
and debootstrap writes straight into it; the ESP is made as a file by the image's own
mkfs.fat and mtools, run in the image (chroot), and copied to its offset. The result
is a compressed qcow2, cached in FUSUMA_CACHE/images/cloud-DIGEST/ and rebuilt only
when an input changes.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import shutil
import struct
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

from fusuma.errors import ImageError
from fusuma.host import distro
from fusuma.images import debian

LOG = logging.getLogger(__name__)

VERSION = 4                    # of this recipe: a change rebuilds the image
SIZE = 2 * 2**30               # the disk the guest sees
ESP_START = 2048               # the ESP's first sector (1 MiB)
ESP_MIB = 16
START = ESP_START + ESP_MIB * 2048   # the root's first sector
# python3-cffi-backend: python3-cryptography (cloud-init's) depends on a virtual
# package it provides, which debootstrap's resolver does not follow.
PACKAGES = ("systemd-sysv", "udev", "linux-image-cloud-amd64", "cloud-init",
            "python3-cffi-backend", "qemu-guest-agent", "openssh-server", "extlinux",
            "ifupdown", "kmod", "grub-efi-amd64-bin", "dosfstools", "mtools")
# What the standalone GRUB holds: enough to find the root by its UUID and boot Linux.
GRUB_MODULES = ("part_msdos", "ext2", "fat", "search", "search_fs_uuid", "linux", "boot",
                "echo", "gzio", "serial", "terminal", "efi_gop", "all_video")
# Console on the serial port (what fusuma's console log holds), and the probes that
# cost seconds under TCG skipped (as for fusuma's own images).
APPEND = ("console=ttyS0 i8042.noaux i8042.nomux i8042.nopnp i8042.dumbkbd "
          "8250.nr_uarts=1 tsc=reliable no_timer_check")
# cloud-init's modules cut to what a fusuma VM's seed asks (hostname, users and keys,
# growing the disk, network, the user's scripts and write_files, runcmd), and one
# SSH host key type: under TCG each module and each RSA key costs seconds of a boot
# (measured by `cloud-init analyze blame` in the guest: locale, grub-dpkg, apt,
# keys-to-console and RSA keys were 17 s of 36 s). A user's own image keeps Debian's.
CLOUD_CFG = """\
# fusuma: NoCloud only (a seed disk labelled cidata), no waiting for other sources.
datasource_list: [ NoCloud, None ]
ssh_genkeytypes: [ ed25519 ]
cloud_init_modules: [ seed_random, bootcmd, write-files, growpart, resizefs, disk_setup,
  mounts, set_hostname, update_hostname, update_etc_hosts, users-groups, ssh ]
cloud_config_modules: [ set-passwords, runcmd ]
cloud_final_modules: [ write-files-deferred, scripts-vendor, scripts-per-once,
  scripts-per-boot, scripts-per-instance, scripts-user, final-message,
  power-state-change ]
"""
# Units of a minbase Debian that only spend a TCG guest's one CPU at boot (e2scrub_reap
# alone took 40 s) or later (timers for apt, man-db, fstrim): masked. The root is not
# checked at boot (fstab's pass 0): 6 s, and the image is made fresh.
MASKED = ("e2scrub_reap.service", "e2scrub_all.timer", "apt-daily.timer",
          "apt-daily-upgrade.timer", "man-db.timer", "fstrim.timer", "logrotate.timer",
          "dpkg-db-backup.timer", "getty-static.service",
          # File systems and modules for what a cloud guest of fusuma's tests never
          # uses (binfmt, debugfs, tracefs, configfs, mqueue, hugetlbfs, fuse, pstore):
          # each a unit systemd starts at every boot.
          "systemd-binfmt.service", "proc-sys-fs-binfmt_misc.automount",
          "sys-kernel-debug.mount", "sys-kernel-tracing.mount", "sys-kernel-config.mount",
          "dev-mqueue.mount", "dev-hugepages.mount", "sys-fs-fuse-connections.mount",
          "modprobe@fuse.service", "modprobe@configfs.service", "modprobe@drm.service",
          "modprobe@efi_pstore.service", "systemd-pstore.service")
# The journal kept in memory (/run): no flush to the disk at each boot.
JOURNALD = "[Journal]\nStorage=volatile\n"

Progress = Callable[[str], None]


def _digest(suite: str, mirror: str) -> str:
    text = json.dumps([VERSION, suite, mirror, PACKAGES, APPEND, CLOUD_CFG, MASKED, JOURNALD,
                       SIZE])
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def cached(cache: Path) -> Path | None:
    """The built image for this host's Debian release, if there is one."""
    suite, mirror = distro.debian_source()
    path = cache / "images" / f"cloud-{_digest(suite, mirror)}" / "disk.qcow2"
    return path if path.is_file() else None


def build(cache: Path, progress: Progress = LOG.info) -> Path:
    """The disk image (built now unless cached): a compressed qcow2."""
    suite, mirror = distro.debian_source()
    final = cache / "images" / f"cloud-{_digest(suite, mirror)}"
    images = cache / "images"
    images.mkdir(parents=True, exist_ok=True)
    with _lock(images):
        if (final / "disk.qcow2").is_file():
            return final / "disk.qcow2"
        tmp = images / f".cloud-build-{os.getpid()}"
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(mode=0o700)
        try:
            t0 = time.monotonic()
            _build(suite, mirror, tmp, progress)
            (tmp / "disk.raw").unlink()
            (tmp / "mnt").rmdir()
            (tmp / "image.json").write_text(json.dumps(
                {"suite": suite, "mirror": mirror, "packages": PACKAGES,
                 "version": VERSION, "seconds": round(time.monotonic() - t0, 1)}) + "\n")
            os.rename(tmp, final)
            progress(f"disk image built in {time.monotonic() - t0:.0f} s: {final}")
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    return final / "disk.qcow2"


@contextlib.contextmanager
def _lock(images: Path) -> Iterator[None]:
    import fcntl

    with (images / ".cloud.lock").open("a") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        yield


def mbr_partition(start: int, sectors: int, kind: int = 0x83, active: bool = True
                  ) -> bytes:
    """The 16-byte MBR entry of one partition (LBA only: CHS fields saturated, as for
    any disk past 8 GiB)."""
    return struct.pack("<B3sB3sII", 0x80 if active else 0, b"\xfe\xff\xff", kind,
                       b"\xfe\xff\xff", start, sectors)


def _run(argv: list[str], what: str) -> str:
    try:
        return debian.run(argv)
    except debian.ToolFailed as exc:
        raise ImageError(f"building the disk image: {what} failed: {exc.detail}") from exc


def _build(suite: str, mirror: str, tmp: Path, say: Progress) -> None:
    raw = tmp / "disk.raw"
    with open(raw, "wb") as f:
        f.truncate(SIZE)
        sectors = SIZE // 512 - START
        f.seek(446)
        f.write(mbr_partition(ESP_START, ESP_MIB * 2048, 0xEF, active=False)
                + mbr_partition(START, sectors) + bytes(32) + b"\x55\xaa")
    root_uuid = str(uuid.uuid4())
    mnt = tmp / "mnt"
    mnt.mkdir()
    loop = _run(["losetup", "--find", "--show", "--offset", str(START * 512),
                 "--sizelimit", str(sectors * 512), str(raw)], "losetup").strip()
    try:
        _run(["mkfs.ext4", "-q", "-L", "root", "-U", root_uuid,
              "-O", "^64bit,^metadata_csum,^orphan_file", loop], "mkfs.ext4")
        _run(["mount", loop, str(mnt)], "mount")
        try:
            t0 = time.monotonic()
            say(f"debootstrap {suite} with {', '.join(PACKAGES)} (a minute or two)")
            debian.debootstrap(suite, mirror, PACKAGES, mnt)
            say(f"debootstrap done in {time.monotonic() - t0:.0f} s")
            cmdline = _configure(mnt, root_uuid)
            _run([str(mnt / "usr/bin/extlinux"), "--install", str(mnt / "boot/extlinux")],
                 "extlinux --install")
            _esp(mnt, root_uuid, cmdline, tmp / "esp.img")
        finally:
            _run(["umount", str(mnt)], "umount")
    finally:
        _run(["losetup", "-d", loop], "losetup -d")
    _write_mbr(raw, tmp)
    with open(raw, "r+b") as f:
        f.seek(ESP_START * 512)
        f.write((tmp / "esp.img").read_bytes())
    say("writing the compressed qcow2")
    _run(["qemu-img", "convert", "-c", "-O", "qcow2", str(raw), str(tmp / "disk.qcow2")],
         "qemu-img convert")


def _esp(root: Path, root_uuid: str, cmdline: tuple[str, str, str], out: Path) -> None:
    """The EFI system partition as a file: a standalone GRUB (the image's own
    grub-mkimage, its configuration embedded) in a FAT file system (the image's own
    mkfs.fat and mtools), all run in the image."""
    kernel, initrd, append = cmdline
    (root / "tmp/early.cfg").write_text(
        f"search --no-floppy --fs-uuid --set=root {root_uuid}\n"
        f"linux /boot/{kernel} root=UUID={root_uuid} ro {append}\n"
        f"initrd /boot/{initrd}\nboot\n")
    chroot = ["chroot", str(root)]
    _run([*chroot, "grub-mkimage", "-O", "x86_64-efi", "-d", "/usr/lib/grub/x86_64-efi",
          "-p", "/EFI/BOOT", "-c", "/tmp/early.cfg", "-o", "/tmp/BOOTX64.EFI",
          *GRUB_MODULES], "grub-mkimage")
    _run([*chroot, "mkfs.fat", "-C", "-n", "ESP", "/tmp/esp.img", str(ESP_MIB * 1024)],
         "mkfs.fat")
    _run([*chroot, "mmd", "-i", "/tmp/esp.img", "::/EFI", "::/EFI/BOOT"], "mmd")
    _run([*chroot, "mcopy", "-i", "/tmp/esp.img", "/tmp/BOOTX64.EFI",
          "::/EFI/BOOT/BOOTX64.EFI"], "mcopy")
    shutil.move(root / "tmp/esp.img", out)
    for f in ("early.cfg", "BOOTX64.EFI"):
        (root / "tmp" / f).unlink()


def _configure(root: Path, root_uuid: str) -> tuple[str, str, str]:
    """fstab, the bootloader's configuration, cloud-init's sources, and nothing of
    this build left for every guest to share (machine id, SSH host keys, apt lists);
    returns the kernel's and initrd's names in /boot and the command line."""
    (root / "etc/fstab").write_text(f"UUID={root_uuid} / ext4 defaults,errors=remount-ro 0 0\n")
    for unit in MASKED:
        link = root / "etc/systemd/system" / unit
        link.unlink(missing_ok=True)
        link.symlink_to("/dev/null")
    journald = root / "etc/systemd/journald.conf.d"
    journald.mkdir(parents=True, exist_ok=True)
    (journald / "90-fusuma.conf").write_text(JOURNALD)
    (root / "etc/hostname").write_text("debian\n")
    (root / "etc/hosts").write_text("127.0.0.1 localhost\n")
    (root / "etc/cloud/cloud.cfg.d/90_fusuma.cfg").write_text(CLOUD_CFG)
    (root / "etc/network/interfaces").write_text(
        "auto lo\niface lo inet loopback\nsource /etc/network/interfaces.d/*\n")
    kernels = sorted((root / "boot").glob("vmlinuz-*"))
    initrds = sorted((root / "boot").glob("initrd.img-*"))
    if not kernels or not initrds:
        raise ImageError("building the disk image: debootstrap installed no kernel and "
                         "initrd in /boot.")
    ext = root / "boot/extlinux"
    ext.mkdir(exist_ok=True)
    (ext / "extlinux.conf").write_text(
        "DEFAULT debian\nPROMPT 0\nTIMEOUT 0\nLABEL debian\n"
        f"  LINUX /boot/{kernels[-1].name}\n  INITRD /boot/{initrds[-1].name}\n"
        f"  APPEND root=UUID={root_uuid} ro {APPEND}\n")
    # The MBR code comes from the image's own syslinux: kept beside the build.
    shutil.copyfile(root / "usr/lib/EXTLINUX/mbr.bin", root.parent / "mbr.bin")
    (root / "etc/machine-id").write_text("")
    for key in (root / "etc/ssh").glob("ssh_host_*"):
        key.unlink()
    for d in ("var/cache/apt/archives", "var/lib/apt/lists"):
        for child in (root / d).glob("*"):
            if child.is_file():
                child.unlink()
    return kernels[-1].name, initrds[-1].name, APPEND


def _write_mbr(raw: Path, tmp: Path) -> None:
    """SYSLINUX's boot code into the first 440 bytes (the partition table stays)."""
    code = (tmp / "mbr.bin").read_bytes()[:440]
    with open(raw, "r+b") as f:
        f.write(code)


def main() -> None:
    """``python -m fusuma.images.diskimage [CACHE]``: build (or find) the image."""
    import sys

    logging.basicConfig(level=logging.INFO, format="%(message)s")
    cache = Path(sys.argv[1] if len(sys.argv) > 1 else
                 os.environ.get("FUSUMA_CACHE", "/var/cache/fusuma"))
    print(build(cache))


if __name__ == "__main__":
    main()
