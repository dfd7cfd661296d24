"""Guest images: a Debian cloud kernel and a small busybox + qemu-ga initramfs.

``build_image(cache)`` builds (or returns the cached) image; ``find_image(cache)``
returns the built one or raises ``ImageError`` telling the user to build it;
``probe_path(cache)`` is the host copy of the image's static probe (fusuma.guest).

Errors: every failure a user can cause is a ``fusuma.errors.ImageError`` whose text says
what is wrong and how to fix it (a missing host package, no network for the kernel
download, an image that was never built).
"""

from typing import TYPE_CHECKING, Any

__all__ = ["BUILDER_VERSION", "KINDS", "GuestImage", "build_image", "find_image",
           "probe_path"]

if TYPE_CHECKING:
    from fusuma.images.builder import (
        BUILDER_VERSION,
        KINDS,
        GuestImage,
        build_image,
        find_image,
        probe_path,
    )
else:
    def __getattr__(name: str) -> Any:
        """The builder's names, imported when first asked for: the image store
        (`fusuma down` deleting a VM) comes without the builder."""
        if name in __all__:
            from fusuma.images import builder

            return getattr(builder, name)
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
