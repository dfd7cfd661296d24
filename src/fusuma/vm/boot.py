"""The files of a VM that boots by firmware from an imported image, kept with its
state (FUSUMA_HOME/vms/NAME): its thin disk (a qcow2 overlay on the image), its NVRAM
for UEFI (a copy of OVMF's variables template) and its cloud-init seed."""

from __future__ import annotations

import base64
import binascii
import contextlib
import os
import re
import shutil
import uuid
import zlib
from collections.abc import Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any

from fusuma.errors import HostError, NotFoundError, SpecError, StateError
from fusuma.frozen import frozen
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
            mtus: Sequence[tuple[str, int]] = (), *, db: Database | None = None,
            storage_dir: str | None = None) -> None:
    """Make ``rec``'s thin disk, NVRAM (UEFI) and seed (``mtus``: MAC -> MTU of the
    NICs whose network's is not 1500), in shared storage directory ``storage_dir``
    if given (fusuma.vm.shared); on failure remove them."""
    vdir = paths.vm_dir(rec.name)
    vdir.mkdir(mode=PRIVATE_DIR, parents=True, exist_ok=True)
    if storage_dir is not None:
        from fusuma.vm import shared

        assert db is not None
        try:
            shared.place(paths, db, rec.name, storage_dir)
        except BaseException:
            remove(paths, rec.name)
            raise
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
    in it), its files in a shared storage directory too."""
    from fusuma.vm import shared

    shared.remove(paths, vm)
    for name in FILES:
        with contextlib.suppress(FileNotFoundError):
            (paths.vm_dir(vm) / name).unlink()
    shutil.rmtree(paths.vm_dir(vm) / store.SNAPSHOTS, ignore_errors=True)
    with contextlib.suppress(OSError):
        paths.vm_dir(vm).rmdir()


def check_spec_fields(boot: str, *, disk_size: str | None, ssh_keys: Sequence[str],
                      user_data: str | None, segments: Sequence[str],
                      storage: str | None = None) -> None:
    """Refuse the options that only one kind of boot has."""
    if boot == "kernel":
        given = [o for o, v in (("--disk-size", disk_size), ("--ssh-key", ssh_keys),
                                ("--user-data", user_data), ("--storage", storage)) if v]
        if given:
            raise SpecError(f"{', '.join(given)} apply to a VM of an imported image "
                            "(cloud-init and a thin disk); fusuma's own images have "
                            "neither (their disks are registered disks, `fusuma disk "
                            "add`).")
        return
    if segments:
        raise SpecError("segments are mounted by fusuma's own images; a VM of an "
                        "imported image cannot have them.")


def check_clone_fields(template: str, given: Sequence[str]) -> None:
    """Refuse the boot options a clone does not take: its boot, disk, keys and
    user-data are its template's (``given``: the options the user gave)."""
    named = [o for o in ("--boot", "--disk-size", "--ssh-key", "--user-data", "--storage")
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


def check_host_move(rec: VmRecord, host: str, running: bool,
                    snapshots: Sequence[str] = (), placed: bool = False) -> None:
    """Refuse the moves to another host that a VM cannot make: one with ``snapshots``
    (they are this host's files and internal snapshots of its disk, which a move does
    not carry, and the move removes the VM here), and, booting by firmware, a stopped
    one (its thin disk would be defined anew there, empty: it moves while it runs, its
    disk mirrored with it) and a clone of a template (its disk is a layer on the
    template's, which is a file of this host only)."""
    if snapshots:
        raise StateError(f"VM {rec.name!r} has snapshots ({', '.join(snapshots)}), which "
                         f"a move to host {host!r} would not carry: delete them (`fusuma "
                         "vm snapshot delete`) or keep it on this host.")
    if rec.boot == "kernel":
        return
    if rec.template is not None:
        raise StateError(f"VM {rec.name!r} is a clone of template {rec.template!r}, whose "
                         f"disk layer is a file of this host that host {host!r} does not "
                         "have: it moves between partitions of this host only.")
    if not running and placed:
        raise StateError(f"VM {rec.name!r} is stopped, and a stopped VM on shared storage "
                         f"does not move between hosts: start it, then move it to host "
                         f"{host!r} (its disk stays where it is).")
    if not running:
        raise StateError(f"VM {rec.name!r} boots by firmware from a thin disk of this "
                         f"host: start it, then move it to host {host!r} (its disk is "
                         "mirrored there as it runs).")


# A move between hosts carries a firmware VM's files under this key of its record
# (fusuma.cluster.hostmove): what its thin disk is an overlay of, how large it is, and
# its seed byte for byte (the disk the guest read cloud-init's data from). Its NVRAM
# travels in the migration stream itself: QEMU keeps a pflash device's whole content
# in a RAM block, and the destination writes that back to its file when the guest
# runs there (pflash_cfi01's post-load handler).
CARRIED_DISK = "thinDisk"
# The seed as carried (zlib, base64): an ISO of mostly zeros, a few KiB this way.
MAX_CARRIED_SEED = 512 * 2**10
MAX_SEED = 64 * 2**20
SHA256_RE = re.compile(r"^[0-9a-f]{64}\Z")


@frozen
class CarriedDisk:
    """A firmware VM's files as a move between hosts carries them, checked."""

    image: str            # the base image's name on the source host (for sentences)
    sha256: str           # and its checksum: the destination's base must have it
    virtual_size: int     # the thin disk's size in bytes
    seed_iso: bytes       # the seed disk, byte for byte
    seed_inputs: seed.Seed

    def as_record(self) -> dict[str, Any]:
        return {"image": self.image, "sha256": self.sha256,
                "virtualSize": self.virtual_size,
                "seed": base64.b64encode(zlib.compress(self.seed_iso, 9)).decode(),
                "seedInputs": asdict(self.seed_inputs)}


def carry(paths: Paths, db: Database, rec: VmRecord) -> CarriedDisk:
    """What a move of firmware VM ``rec`` to another host carries of its files."""
    base = db.imported(str(rec.image))
    return CarriedDisk(image=base.name, sha256=base.sha256,
                       virtual_size=store.probe(disk_path(paths, rec.name),
                                                "qcow2").virtual_size,
                       seed_iso=seed_path(paths, rec.name).read_bytes(),
                       seed_inputs=seed.load_inputs(paths.vm_dir(rec.name) / SEED_INPUTS))


def check_carried(d: object) -> CarriedDisk:
    """A move record's ``CARRIED_DISK``, checked (the source host's word); one
    sentence otherwise."""
    def refuse(what: str) -> StateError:
        return StateError(f"the move's record carries a thin disk with {what}")

    if not isinstance(d, dict):
        raise refuse("no fields")
    image, sha, size, text = (d.get(k) for k in ("image", "sha256", "virtualSize", "seed"))
    if not isinstance(image, str) or not 0 < len(image) <= 64:
        raise refuse("no image name")
    if not isinstance(sha, str) or not SHA256_RE.match(sha):
        raise refuse("no sha256 checksum")
    if type(size) is not int or not 0 < size <= 2**50:
        raise refuse("no size")
    if not isinstance(text, str) or len(text) > MAX_CARRIED_SEED:
        raise refuse("no seed, or one too large")
    try:
        z = zlib.decompressobj()
        raw = z.decompress(base64.b64decode(text, validate=True), MAX_SEED)
        if z.unconsumed_tail or not z.eof:
            raise ValueError("too large")
        inputs = seed.parse_inputs(d.get("seedInputs"))
    except (ValueError, TypeError, KeyError, zlib.error, binascii.Error) as exc:
        raise refuse(f"a malformed seed ({exc})") from exc
    return CarriedDisk(image, sha, size, raw, inputs)


def base_for(db: Database, carried: CarriedDisk, host: str) -> ImageRecord:
    """This host's image that a moving VM's thin disk goes on: the one with the same
    checksum (of the same name, if several); one sentence if there is none."""
    same = [i for i in db.images() if i.sha256 == carried.sha256]
    if not same:
        raise StateError(f"host {host} has no image with checksum sha256:"
                         f"{carried.sha256} (image {carried.image!r} of the VM's host); "
                         "import the same image there first.")
    return next((i for i in same if i.name == carried.image), same[0])


def adopt_carried(paths: Paths, rec: VmRecord, carried: CarriedDisk) -> None:
    """After :func:`prepare` made a moving VM's files here (its thin disk as large as
    at its source, checked): the seed the guest read there (the same bytes, the same
    inputs; on shared storage it is that very file already)."""
    size = store.probe(disk_path(paths, rec.name), "qcow2").virtual_size
    if size != carried.virtual_size:
        raise StateError(f"VM {rec.name!r}'s thin disk here has {size} bytes, at its "
                         f"source {carried.virtual_size}.")
    if store.placed_in(paths, rec.name) is None:
        write_seed(seed_path(paths, rec.name), carried.seed_iso)
    seed.save_inputs(carried.seed_inputs, paths.vm_dir(rec.name) / SEED_INPUTS)


def write_seed(path: Path, iso: bytes) -> None:
    """The seed disk ``iso`` at ``path``, replaced in one step, read-only."""
    tmp = path.with_name(f".{path.name}.in")
    try:
        tmp.write_bytes(iso)
        os.chmod(tmp, 0o400)
        os.replace(tmp, path)
    finally:
        with contextlib.suppress(FileNotFoundError):
            tmp.unlink()
