"""`fusuma image ...`: the built-in guest image."""

from __future__ import annotations

import time

import click

from fusuma.cli.common import Ctx, emit_json, pass_ctx, progress, table
from fusuma.views.images import images_data


@click.group()
def image() -> None:
    """Build and inspect guest images (kept under FUSUMA_CACHE)."""


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


@image.command("show")
@click.option("--kind", default="minimal", show_default=True)
@click.option("--json", "as_json", is_flag=True)
@pass_ctx
def show(c: Ctx, kind: str, as_json: bool) -> None:
    """Show the cached image, or say how to build it."""
    from fusuma.images import find_image

    img = find_image(c.paths.cache, kind=kind)
    data = {"kind": img.kind, "kernel": str(img.kernel), "initrd": str(img.initrd),
            "kernel_version": img.kernel_version, "digest": img.digest,
            "append": img.append}
    if as_json:
        emit_json(data)
    else:
        for k, v in data.items():
            click.echo(f"{k}: {v}")


@image.command("list")
@click.option("--json", "as_json", is_flag=True)
@pass_ctx
def list_(c: Ctx, as_json: bool) -> None:
    """List the image kinds and whether each is built in the cache."""
    rows = images_data(c)
    if as_json:
        emit_json(rows)
        return
    click.echo(table([[r["kind"], "yes" if r["built"] else "no",
                       r.get("kernel_version", "-")] for r in rows],
                     ["kind", "built", "kernel"]))
