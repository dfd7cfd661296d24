"""The store of QEMUs fusuma unpacked: ``FUSUMA_CACHE/qemu`` and its install lock.

Below both of its users: fusuma.qemu.versions reads the store (and removes from it),
fusuma.qemu.fetch fills it; each takes the lock here, so neither imports the other
for it.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path

from fusuma.paths import Paths, ensure_dir, exclusive


def qemu_dir(paths: Paths) -> Path:
    return paths.cache / "qemu"


def ensure_qemu_dir(paths: Paths) -> Path:
    """``FUSUMA_CACHE/qemu``, 0755 (unpacked trees are for every VM's uid)."""
    if not paths.cache.exists():
        ensure_dir(paths.cache, 0o755)
    return ensure_dir(qemu_dir(paths), 0o755)


@contextlib.contextmanager
def install_lock(paths: Paths) -> Iterator[None]:
    """One install or removal at a time in this cache (other namespaces share it)."""
    with exclusive(ensure_qemu_dir(paths) / ".lock", 0o644):
        yield
