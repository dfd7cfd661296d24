"""Write read-only erofs filesystem images: the ones segments are made of
(fusuma.memshare.segments) and a Debian image's root (fusuma.images.builder).

A segment is an erofs image: uncompressed (DAX maps file blocks straight into the
guest, so they must be stored as they are), 4 KiB blocks (DAX needs block size = page
size), a fixed timestamp and a UUID derived from its label so the same tree gives the
same bytes. The file is padded to a multiple of 2 MiB, the alignment QEMU's
virtio-pmem device memory needs.
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

from fusuma.errors import SegmentError

ALIGN = 2 * 2**20
_NS = "5f1c0e2a-6a43-4c1e-9a6f-2f5d1b0c7e11"    # the namespace of its uuid5s
INSTALL_HINT = "run `apt-get install erofs-utils`"


def make_image(src: Path, out: Path, *, label: str) -> int:
    """Write ``src`` (a directory) as an erofs image to ``out``; return its size in
    bytes after padding. SegmentError (one sentence) when mkfs.erofs fails."""
    import uuid  # (and platform): not for every supervisor that imports the builder

    fs_uuid = uuid.uuid5(uuid.UUID(_NS), label)
    # noinline_data: erofs serves a file's tail packed into its inode block through
    # the page cache even under dax=always; stored in blocks of their own, whole
    # files are mapped in place.
    argv = ["mkfs.erofs", "--quiet", "-T0", "-Enoinline_data", f"-U{fs_uuid}", str(out),
            str(src)]
    try:
        proc = subprocess.run(argv, capture_output=True, text=True, check=False)
    except FileNotFoundError:
        raise SegmentError(f"mkfs.erofs is not on this host: {INSTALL_HINT}") from None
    if proc.returncode != 0:
        out.unlink(missing_ok=True)
        lines = (proc.stderr or proc.stdout).strip().splitlines()
        detail = lines[-1] if lines else f"exit status {proc.returncode}"
        if "No space left" in detail:
            raise SegmentError(f"no space left on the device holding {out.parent}: "
                               "free some space and try again")
        raise SegmentError(f"mkfs.erofs could not write a segment from {src} ({detail})")
    size = out.stat().st_size
    padded = -(-size // ALIGN) * ALIGN
    try:
        with out.open("r+b") as fh:
            os.posix_fallocate(fh.fileno(), 0, padded)
    except OSError as exc:
        out.unlink(missing_ok=True)
        raise SegmentError(f"cannot pad {out} to {padded} bytes ({exc.strerror}): "
                           "free some space and try again") from exc
    return padded
