"""`fusuma image ...`: the images fusuma builds, and disk images users import."""

from __future__ import annotations

import time

import click

from fusuma.cli.common import Ctx, emit_json, pass_ctx, progress, table
from fusuma.views.images import images_data


@click.group()
def image() -> None:
    """Build guest images, and import your own disk images.

    fusuma builds two kinds (kept under FUSUMA_CACHE), booted by QEMU's direct kernel
    boot. Your own disk images (a Debian, Ubuntu or Fedora cloud image, an appliance:
    qcow2 or raw) are imported into the image store, kept read-only, and booted by
    firmware (SeaBIOS or UEFI); each VM gets a thin disk of its own on the image
    (`fusuma vm create NAME --image IMAGE`)."""


@image.command("build")
@click.option("--kind", default="minimal", show_default=True,
              help="minimal: Debian cloud kernel + busybox + qemu-guest-agent initramfs.")
@click.option("--force", is_flag=True, help="Rebuild even if the cached image is current.")
@click.option("--json", "as_json", is_flag=True)
@pass_ctx
def build(c: Ctx, kind: str, force: bool, as_json: bool) -> None:
    """Build the guest image from Debian packages, or reuse the cached one.

    The kernel comes from Debian's linux-image-cloud-amd64 (downloaded once into the
    cache, never installed on the host), with only the modules guests need; userspace
    is busybox-static and Debian's qemu-guest-agent. The image is rebuilt only when an
    input changes, and works offline once cached."""
    from fusuma.images import build_image

    t0 = time.monotonic()
    img = build_image(c.paths.cache, kind=kind, force=force, progress=progress)
    data = {"kind": img.kind, "kernel": str(img.kernel), "initrd": str(img.initrd),
            "kernel_version": img.kernel_version, "digest": img.digest,
            "seconds": round(time.monotonic() - t0, 2)}
    if as_json:
        emit_json(data)
    else:
        click.echo(f"image {img.kind}: kernel {img.kernel_version}, {img.initrd} "
                   f"({data['seconds']} s)")


@image.command("import")
@click.argument("name")
@click.argument("file", type=click.Path(dir_okay=False))
@click.option("--format", "fmt", type=click.Choice(["qcow2", "raw"]), default=None,
              help="Read FILE as this format (default: what qemu-img finds).")
@click.option("--json", "as_json", is_flag=True)
@pass_ctx
def import_(c: Ctx, name: str, file: str, fmt: str | None, as_json: bool) -> None:
    """Import disk image FILE (qcow2 or raw) as image NAME.

    FILE is copied into the image store (FUSUMA_HOME/images), its SHA-256 recorded,
    and the copy checked with `qemu-img info`: a backing file, an external data file,
    encryption or another format are refused (convert such an image with `qemu-img
    convert -O qcow2` first). The stored copy is read-only; VMs get thin disks on it.
    Over the API only files inside storage directories can be imported."""
    from fusuma.images import store

    t0 = time.monotonic()
    rec = store.import_image(c.paths, c.db, name, file, anywhere=True, fmt=fmt)
    if as_json:
        from fusuma.views.images import imported_data

        emit_json({**imported_data(c, name), "seconds": round(time.monotonic() - t0, 2)})
    else:
        click.echo(f"image {rec.name}: {rec.format}, {rec.virtual_size / 2**30:.2f} GiB, "
                   f"sha256 {rec.sha256[:16]}… ({time.monotonic() - t0:.1f} s)")


@image.command("delete")
@click.argument("name")
@pass_ctx
def delete(c: Ctx, name: str) -> None:
    """Delete imported image NAME (refused while a VM's disk is on it)."""
    from fusuma.images import store

    store.delete_image(c.db, name)
    click.echo(f"deleted image {name}")


@image.command("show")
@click.argument("name", required=False)
@click.option("--kind", default="minimal", show_default=True,
              help="Without NAME: the built image of this kind.")
@click.option("--json", "as_json", is_flag=True)
@pass_ctx
def show(c: Ctx, name: str | None, kind: str, as_json: bool) -> None:
    """Show imported image NAME, or the cached built image (or say how to build it)."""
    from fusuma.images import KINDS

    if name is not None and name not in KINDS:
        from fusuma.views.images import imported_data

        data = imported_data(c, name)
    else:
        from fusuma.images import find_image
        from fusuma.views.images import image_json

        data = image_json(find_image(c.paths.cache, kind=name or kind))
    if as_json:
        emit_json(data)
    else:
        for k, v in data.items():
            click.echo(f"{k}: {', '.join(v) if isinstance(v, list) else v}")


@image.command("list")
@click.option("--json", "as_json", is_flag=True)
@pass_ctx
def list_(c: Ctx, as_json: bool) -> None:
    """List the image kinds fusuma builds (and whether each is built), then the
    imported images. What an import killed mid-way left in the image store is removed
    first."""
    from fusuma.images import store

    store.sweep(c.paths, c.db)
    rows = images_data(c)
    if as_json:
        emit_json(rows)
        return

    def detail(r: dict[str, object]) -> str:
        if r["kind"] == "imported":
            return f"{r['format']} {int(str(r['virtual_size'])) / 2**30:.2f} GiB"
        return str(r.get("kernel_version", "-"))

    click.echo(table([[str(r["name"]), str(r["kind"]), str(r["boot"]),
                       "yes" if r["built"] else "no", detail(r),
                       ",".join(r.get("vms", [])) or "-"]
                      for r in rows],
                     ["name", "kind", "boot", "built", "detail", "vms"]))
