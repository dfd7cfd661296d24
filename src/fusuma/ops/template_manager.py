"""The CLI's operations on templates (fusuma.memshare.templates): checks, then the
VM's supervisor saves it (``template-save``); listing and deletion."""

from __future__ import annotations

import contextlib
import os
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from fusuma import capacity
from fusuma.errors import ConflictError, StateError, TemplateError
from fusuma.images.store import DISK
from fusuma.memshare import holes, templates
from fusuma.names import check_name
from fusuma.paths import Paths
from fusuma.qemu import process
from fusuma.state import Database, vm_obj
from fusuma.state.db import TemplateRecord, VmRecord
from fusuma.state.lock import locked
from fusuma.supervisor import rpc
from fusuma.vm.view import VmView

if TYPE_CHECKING:
    from fusuma.partition.manager import PartitionManager

# Fault injection (tests): the supervisor fails the save after this phase
# (fusuma.supervisor.templates.FAULT_PHASES), so a test can check that nothing is left.
FAULT = "FUSUMA_FAULT_TEMPLATE"


class TemplateManager:
    def __init__(self, paths: Paths, db: Database, parts: PartitionManager) -> None:
        self.paths = paths
        self.db = db
        self.parts = parts

    @locked
    def create(self, name: str, vm: str) -> TemplateRecord:
        """Stop running VM ``vm`` into template ``name`` (refused, one sentence, with
        nothing changed, unless it can be)."""
        rec = self.check(name, vm)
        self.parts.client(rec.partition).send(
            rpc.TemplateSave(vm, name, fault=os.environ.get(FAULT, "")), timeout=300)
        return self.db.template(name)

    def check(self, name: str, vm: str) -> VmRecord:
        """Every refusal of ``create`` (a sentence each), without making anything;
        VM ``vm``'s record when it may be made."""
        check_name("template", name)
        if self.db.find_template(name) is not None:
            raise ConflictError(f"a template named {name!r} already exists; delete it or "
                                "pick another name.")
        self.parts.ensure_recovered(vm_obj(vm))
        rec = self.db.vm(vm)
        state = VmView(rec).state
        if state != "running":
            raise StateError(f"VM {vm!r} is {state}; a template is made from a running "
                             f"VM: start it (`fusuma vm start {vm}`) and try again.")
        from fusuma.memshare.templates import refuse

        # NICs on taps are fine: the template keeps their networks, and each clone gets
        # NICs of its own there (a MAC, an address, a tap), given to its guest by its
        # identity step (with the guest's own DHCP client: busybox's udhcpc, or the
        # dhclient of a firmware-booted Debian or Ubuntu image).
        refuse(rec, rec.qemu_version)
        capacity.check_template(self.db, self.parts.host, name, rec.memory_mib)
        return rec

    def all(self) -> list[TemplateRecord]:
        return self.db.templates()

    @locked
    def delete(self, name: str) -> None:
        """Remove template ``name``'s record and files: refused while a VM (even a
        stopped one) was cloned from it, or a QEMU still maps its RAM file."""
        t = self.db.template(name)
        users = self.db.clones_of(name)
        if users:
            raise StateError(f"template {name!r} is used by VM(s) {', '.join(users)} (cloned "
                             "from it); delete them first.")
        pids = process.mapped_by(Path(t.ram_path), self.paths)
        if pids:
            raise StateError(f"template {name!r}'s RAM file is still mapped by QEMU pid(s) "
                             f"{', '.join(map(str, pids))}; end them first.")
        self.db.remove_template(name)
        process.remove_unmapped(t.ram_path, self.paths)
        with contextlib.suppress(FileNotFoundError):
            os.unlink(t.state_path)
        # A firmware VM's disk layer and more; the record of the RAM file's holes.
        for left in (*templates.FIRMWARE_FILES, holes.HOLES_NAME):
            with contextlib.suppress(FileNotFoundError):
                (templates.template_dir(self.paths, name) / left).unlink()
        with contextlib.suppress(OSError):
            templates.template_dir(self.paths, name).rmdir()
        with contextlib.suppress(OSError):
            templates.template_dir(self.paths, name).parent.rmdir()

    def as_json(self, t: TemplateRecord) -> dict[str, Any]:
        ram = _stat(t.ram_path)
        st = _stat(t.state_path)
        ds = templates.devices_of(t)
        return {"name": t.name, "source_vm": t.source_vm, "memory_mib": t.memory_mib,
                "vcpus": t.vcpus, "machine": t.machine, "qemu_version": t.qemu_version,
                "accel": t.accel, "image": t.image, "segments": t.segments,
                "boot": ds.firmware or "kernel", "disk_layer": None if ds.firmware is None
                else str(templates.template_dir(self.paths, t.name) / DISK),
                "network": templates.has_nic(ds) or bool(t.networks),
                "networks": t.networks,
                "devices": [d.driver for d in ds.devices],
                "ram_path": t.ram_path, "ram_size_mib": round(t.size_bytes / 2**20, 1),
                "ram_allocated_mib": None if ram is None
                else round(ram.st_blocks * 512 / 2**20, 1),
                "state_path": t.state_path, "state_bytes": None if st is None else st.st_size,
                "state_sha256": t.state_sha256, "intact": self.intact(t),
                "clones": self.db.clones_of(t.name),
                "created_at": time.strftime("%Y-%m-%dT%H:%M:%S%z",
                                            time.localtime(t.created_at))}

    @staticmethod
    def intact(t: TemplateRecord) -> bool:
        try:
            templates.check_files(t)
        except TemplateError:
            return False
        return True


def _stat(path: str) -> os.stat_result | None:
    try:
        return os.stat(path)
    except OSError:
        return None
