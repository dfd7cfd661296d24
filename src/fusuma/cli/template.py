"""`fusuma template ...`: booted guests kept to start clones from in milliseconds."""

from __future__ import annotations

import click

from fusuma.cli.common import Ctx, emit_json, pass_ctx, table
from fusuma.ops.templates import template_manager


@click.group()
def template() -> None:
    """Templates: a booted VM's RAM and device state, to start clones from.

    `template create T --from VM` stops running VM into template T: its RAM file
    becomes the template's and its device state is saved; the VM ends stopped (starting
    it again boots it fresh). `vm create X -p P --template T --start` starts a clone:
    its QEMU maps the template's RAM copy-on-write and loads its state, so it runs in
    milliseconds instead of booting, then gets its own hostname, machine-id, MAC and
    random seed through the guest agent.

    Clones share the template's pages they have not written (each page a clone writes
    becomes its own), start in milliseconds, and move by copy only (their RAM is a
    private copy-on-write mapping, which zero-copy and in-place moves cannot hand
    over). They have no page reporting: the template's file is opened read-only and
    must never have pages punched out of it. Templates and clones need QEMU >= 8.2
    (a partition on QEMU 10.0: `fusuma partition create P ... --qemu 10.0`).

    Side channel: page sharing lets a guest time copy-on-write faults to learn whether
    a page equals the template's, the same risk as KSM's (`vm create --mergeable`).
    And every clone starts with the template's whole memory, secrets included: make
    templates of guests that hold no key or token a clone must not have.

    \b
    Examples:
      fusuma template create web --from web0
      fusuma vm create web1 -p p10 --template web --start
      fusuma template delete web"""


@template.command("create")
@click.argument("name")
@click.option("--from", "from_vm", required=True, metavar="VM",
              help="The running VM to stop into the template (QEMU >= 8.2, shared RAM, no "
                   "disks).")
@click.option("--json", "as_json", is_flag=True)
@pass_ctx
def create(c: Ctx, name: str, from_vm: str, as_json: bool) -> None:
    """Stop running VM into template NAME; the VM ends stopped.

    Through the guest agent the guest first drops its caches (with page reporting, the
    freed pages go back to the host and its balloon driver is unbound, so no clone
    ever reports a page); then QEMU is stopped, its device state saved and its RAM
    file becomes the template's. On any failure before that, the VM runs on and nothing
    is left. Clones share the template's unwritten pages, start in milliseconds, move by
    copy only; page sharing lets a guest learn by timing whether a page equals the
    template's (the same side channel as KSM's)."""
    mgr = template_manager(c)
    t = mgr.create(name, from_vm)
    if as_json:
        emit_json(mgr.as_json(t))
    else:
        click.echo(f"template {name}: made from {from_vm} ({t.memory_mib} MiB, "
                   f"{t.vcpus} vCPU(s), {t.machine}); {from_vm} is stopped")


@template.command("list")
@click.option("--json", "as_json", is_flag=True)
@pass_ctx
def list_(c: Ctx, as_json: bool) -> None:
    """List templates and their clones."""
    mgr = template_manager(c)
    data = [mgr.as_json(t) for t in mgr.all()]
    if as_json:
        emit_json(data)
        return
    click.echo(table([[d["name"], d["source_vm"], str(d["memory_mib"]), str(d["vcpus"]),
                       d["machine"], str(d["ram_allocated_mib"]),
                       "yes" if d["intact"] else "DAMAGED", ",".join(d["clones"]) or "-"]
                      for d in data],
                     ["name", "from", "memory_mib", "vcpus", "machine", "ram_mib", "intact",
                      "clones"]))


@template.command("show")
@click.argument("name")
@click.option("--json", "as_json", is_flag=True)
@pass_ctx
def show(c: Ctx, name: str, as_json: bool) -> None:
    """Show template NAME: its guest, files (checked) and clones."""
    mgr = template_manager(c)
    data = mgr.as_json(c.db.template(name))
    if as_json:
        emit_json(data)
        return
    for key, value in data.items():
        click.echo(f"{key}: {value}")


@template.command("delete")
@click.argument("name")
@pass_ctx
def delete(c: Ctx, name: str) -> None:
    """Delete template NAME and its files; refused while any VM (even a stopped one)
    was cloned from it."""
    template_manager(c).delete(name)
    click.echo(f"deleted template {name}")
