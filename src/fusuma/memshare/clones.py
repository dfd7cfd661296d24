"""What a template's clone starts with: the template's devices and files
(fusuma.memshare.templates), read when its QEMU is launched.

The template and disk layer modules are imported by the functions that use them: every
VM's start asks :func:`resumes`, and only a clone's needs them."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

from fusuma.errors import TemplateError
from fusuma.paths import Paths
from fusuma.qemu import versions
from fusuma.qemu.cmdline import DeviceSet, VmConfig
from fusuma.qemu.privilege import QemuFiles
from fusuma.state import Database, VmRecord
from fusuma.state.db import TemplateRecord


def resumes(paths: Paths, vm: VmRecord) -> bool:
    """Whether ``vm``'s start resumes its template's guest: a clone of a kernel boot's
    template always (it has no disk of its own); a clone of a firmware boot's while its
    disk is still the template's (fusuma.images.layers), after which it boots its own."""
    if vm.template is None:
        return False
    from fusuma.images import layers

    return vm.boot == "kernel" or layers.fresh(paths.vm_dir(vm.name))


def template_of(db: Database, vm: VmRecord) -> TemplateRecord:
    t = db.find_template(str(vm.template))
    if t is None:
        raise TemplateError(f"VM {vm.name!r} is a clone of template {vm.template!r}, which "
                            "no longer exists; delete the VM.")
    return t


def clone_devices(db: Database, partition: str, vm: VmRecord,
                  q: versions.Qemu) -> DeviceSet:
    """The devices a clone starts with (the template's, a vmgenid guid of its own), on
    a QEMU that can map the template read-only."""
    from fusuma.memshare import templates

    if not templates.version_ok(q.version):
        raise templates.too_old(f"partition {partition!r}", q.version)
    return templates.clone_devices(template_of(db, vm))


def clone_config(paths: Paths, db: Database, vm: VmRecord, cfg: VmConfig,
                 groups: list[int]) -> tuple[VmConfig, list[int]]:
    """A clone's QEMU: RAM from the template's file, ``-incoming defer``, and the
    template's group among its own (to reopen the RAM file's descriptor)."""
    from fusuma.memshare import templates

    t = template_of(db, vm)
    return (replace(cfg, template_ram=Path(t.ram_path), incoming="defer", ram_file=None),
            [*groups, templates.template_gid(paths, t)])


def open_files(db: Database, vm: VmRecord, cfg: VmConfig, files: QemuFiles) -> VmConfig:
    """Open the template's RAM and state files read-only for the clone's QEMU, checked
    (size, sha256) as QEMU will read them."""
    from fusuma.memshare import templates

    ram_fd, state_fd = templates.open_files(template_of(db, vm))
    files.add(ram_fd)
    files.add(state_fd)
    return replace(cfg, template_ram_fd=ram_fd, template_state_fd=state_fd)
