"""The files of a VM that boots by firmware from an imported image, kept with its
state (FUSUMA_HOME/vms/NAME): its thin disk (a qcow2 overlay on the image), its NVRAM
for UEFI (a copy of OVMF's variables template) and its cloud-init seed."""

from __future__ import annotations

import contextlib
import os
import shutil
import uuid
from collections.abc import Sequence
from pathlib import Path

from fusuma.errors import HostError, NotFoundError, SpecError, StateError
from fusuma.images import seed, store
from fusuma.images.store import (  # where a firmware VM's files live (the supervisor's too)
    FILES,
    SEED_INPUTS,
    disk_path,
    nvram_path,
    seed_path,
)
from fusuma.paths import PRIVATE_DIR, Paths
from fusuma.state import Database, VmRecord
from fusuma.state.records import ImageRecord


def resolve(db: Database, image: str, boot: str | None) -> tuple[str, ImageRecord | None]:
    """The boot of a VM of ``image`` and, for a firmware boot, the imported image;
    one sentence when the two do not go together."""
    from fusuma.images import KINDS

    if image in KINDS:
        if boot not in (None, "kernel"):
            raise SpecError(f"image {image!r} is built by fusuma and boots its kernel "
                            f"directly; --boot {boot} needs an imported disk image "
                            "(`fusuma image import`).")
        return "kernel", None
    rec = db.find_imported(image)
    if rec is None:
        raise NotFoundError(f"there is no image named {image!r}: neither a kind fusuma "
                            f"builds ({', '.join(sorted(KINDS))}) nor an imported one; "
                            "see `fusuma image list`.")
    if boot == "kernel":
        raise SpecError(f"image {image!r} is an imported disk image, booted by firmware: "
                        "use --boot bios or --boot uefi.")
    return boot or "bios", rec


def check_inputs(base: ImageRecord, disk_size: str | None,
                 ssh_keys: Sequence[str]) -> tuple[int | None, list[str]]:
    """The thin disk's size and the SSH keys, checked before anything is made."""
    size = None if disk_size is None else store.parse_size(disk_size)
    if size is not None and size < base.virtual_size:
        raise SpecError(f"disk size {disk_size} is smaller than image {base.name!r} "
                        f"({base.virtual_size / 2**30:.2f} GiB); a thin disk can only be "
                        "as large or larger.")
    why = store.verify(base)
    if why is not None:
        raise StateError(f"image {base.name!r}: {why}; delete it and import it again.")
    return size, seed.check_keys(ssh_keys)


def prepare(paths: Paths, rec: VmRecord, base: ImageRecord, size: int | None,
            keys: Sequence[str], user_data: str | None, macs: Sequence[str],
            mtus: Sequence[tuple[str, int]] = ()) -> None:
    """Make ``rec``'s thin disk, NVRAM (UEFI) and seed (``mtus``: MAC -> MTU of the
    NICs whose network's is not 1500); on failure remove them."""
    vdir = paths.vm_dir(rec.name)
    vdir.mkdir(mode=PRIVATE_DIR, parents=True, exist_ok=True)
    try:
        store.create_overlay(base, disk_path(paths, rec.name), size, rec.uid)
        if rec.boot == "uefi":
            from fusuma.qemu.firmware import ovmf

            _, template = ovmf()
            nvram = nvram_path(paths, rec.name)
            shutil.copyfile(template, nvram)
            os.chown(nvram, rec.uid, rec.uid)
            os.chmod(nvram, 0o600)
        said = seed.Seed(instance_id=f"{rec.name}-{uuid.uuid4().hex[:12]}",
                         hostname=rec.name, ssh_keys=tuple(keys), user_data=user_data,
                         macs=tuple(macs), mtus=tuple(mtus))
        seed.write(said, seed_path(paths, rec.name))
        seed.save_inputs(said, paths.vm_dir(rec.name) / SEED_INPUTS)
    except BaseException:
        remove(paths, rec.name)
        raise


def remove(paths: Paths, vm: str) -> None:
    """Remove what :func:`prepare` made (the VM's directory too, if nothing else is
    in it)."""
    for name in FILES:
        with contextlib.suppress(FileNotFoundError):
            (paths.vm_dir(vm) / name).unlink()
    shutil.rmtree(paths.vm_dir(vm) / store.SNAPSHOTS, ignore_errors=True)
    with contextlib.suppress(OSError):
        paths.vm_dir(vm).rmdir()


def check_spec_fields(boot: str, *, disk_size: str | None, ssh_keys: Sequence[str],
                      user_data: str | None, segments: Sequence[str]) -> None:
    """Refuse the options that only one kind of boot has."""
    if boot == "kernel":
        given = [o for o, v in (("--disk-size", disk_size), ("--ssh-key", ssh_keys),
                                ("--user-data", user_data)) if v]
        if given:
            raise SpecError(f"{', '.join(given)} apply to a VM of an imported image "
                            "(cloud-init and a thin disk); fusuma's own images have "
                            "neither.")
        return
    if segments:
        raise SpecError("segments are mounted by fusuma's own images; a VM of an "
                        "imported image cannot have them.")


def check_clone_fields(template: str, given: Sequence[str]) -> None:
    """Refuse the boot options a clone does not take: its boot, disk, keys and
    user-data are its template's (``given``: the options the user gave)."""
    named = [o for o in ("--boot", "--disk-size", "--ssh-key", "--user-data")
             if o in given]
    if named:
        raise SpecError(f"a clone of template {template!r} boots as its template's guest "
                        f"did, with its disk, keys and user-data; leave out "
                        f"{', '.join(named)}.")


def prepare_clone(paths: Paths, rec: VmRecord, template_dir: Path,
                  macs: Sequence[str]) -> None:
    """Make clone ``rec``'s overlay on its template's layer, NVRAM, seed (a new
    instance id) and fresh marker (fusuma.images.layers); on failure remove them."""
    from fusuma.images import layers

    vdir = paths.vm_dir(rec.name)
    vdir.mkdir(mode=PRIVATE_DIR, parents=True, exist_ok=True)
    try:
        layers.make_clone_files(template_dir, vdir, rec.name, rec.uid, tuple(macs))
    except OSError as exc:
        remove(paths, rec.name)
        raise HostError(f"clone {rec.name!r}: its files could not be made from template "
                        f"{rec.template!r} ({exc.strerror or exc}); nothing was kept."
                        ) from exc
    except BaseException:
        remove(paths, rec.name)
        raise


def check_host_move(rec: VmRecord, host: str) -> None:
    """Refuse a move to another host of a VM that boots by firmware: its thin disk,
    NVRAM and seed are files of this host, and that host has not its image. (Moves on
    one host keep them: every kind of move's destination opens the same files.)"""
    if rec.boot != "kernel":
        raise StateError(f"VM {rec.name!r} boots by firmware from a thin disk on image "
                         f"{rec.image!r} of this host, which host {host!r} does not "
                         "have: it moves between partitions of this host only.")
