"""Shared segments (z/VM DCSS on QEMU): named read-only erofs images in host files.

A segment is built once (``create``) into ``<FUSUMA_HOME>/segments/<name>.erofs`` and
given to any number of VMs as a read-only virtio-pmem device. Guests mount it with
``-o dax=always``, so reads and executed code come straight from the host's page cache
of that one file: one copy for every VM, no guest page cache. Because the file is named
and shared (``share=on``), zero-copy migration leaves it alone.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from fusuma.errors import ConflictError, SegmentError
from fusuma.images import erofs, find_image
from fusuma.names import check_name
from fusuma.paths import Paths
from fusuma.state.db import Database, SegmentRecord
from fusuma.state.lock import locked

Progress = Callable[[str], None]


class SegmentManager:
    def __init__(self, paths: Paths, db: Database) -> None:
        self.paths = paths
        self.db = db

    def all(self) -> list[SegmentRecord]:
        return self.db.segments()

    def users(self, name: str) -> list[str]:
        """VMs whose definition attaches segment ``name``."""
        return [v.name for v in self.db.vms()
                if any(s.partition(":")[0] == name for s in v.segments)]

    @locked
    def create(self, name: str, *, from_dir: Path | None = None,
               from_image: str | None = None,
               progress: Progress | None = None) -> SegmentRecord:
        """Build segment ``name`` from a directory, or from a guest image's root
        filesystem (``from_image="debian"``: its root.erofs, which a VM mounts at "/").
        Nothing is left behind when it fails."""
        check_name("segment", name)
        if self.db.find_segment(name) is not None:
            raise ConflictError(f"a segment named {name!r} already exists; delete it first "
                                f"with `fusuma segment delete {name}`.")
        if (from_dir is None) == (from_image is None):
            raise SegmentError("give exactly one of --from DIR and --from-image KIND.")
        say = progress or (lambda _msg: None)
        final = self.paths.segment_file(name)
        try:
            self.paths.segments_dir.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise SegmentError(f"cannot create {self.paths.segments_dir} ({exc.strerror}); "
                               "run as root or set FUSUMA_HOME.") from exc
        fd, tmp_name = tempfile.mkstemp(prefix=f".{name}-", suffix=".tmp",
                                        dir=self.paths.segments_dir)
        os.close(fd)
        tmp = Path(tmp_name)
        try:
            if from_dir is not None:
                if not from_dir.is_dir():
                    raise SegmentError(f"{from_dir} is not a directory; --from needs the "
                                       "directory tree the segment should hold.")
                source = str(from_dir.resolve())
                say(f"building erofs image of {source}")
                size = erofs.make_image(from_dir, tmp, label=name)
            else:
                assert from_image is not None
                image = find_image(self.paths.cache, kind=from_image)
                if image.root is None:
                    raise SegmentError(f"the {from_image} image has no root filesystem "
                                       "image to share; use --from-image debian or "
                                       "--from DIR.")
                source = f"image:{from_image}:{image.digest[:16]}"
                say(f"taking {image.root.name} of the {from_image} image")
                _copy(image.root, tmp)
                size = tmp.stat().st_size
            tmp.chmod(0o444)
            os.replace(tmp, final)
            rec = SegmentRecord(name=name, path=str(final), size_bytes=size,
                                source=source, created_at=time.time())
            try:
                self.db.add_segment(rec)
            except BaseException:
                final.unlink(missing_ok=True)
                raise
        finally:
            tmp.unlink(missing_ok=True)
        say(f"segment {name}: {size / 2**20:.0f} MiB in {final}")
        return rec

    @locked
    def delete(self, name: str) -> None:
        rec = self.db.segment(name)
        users = self.users(name)
        if users:
            raise ConflictError(f"segment {name!r} is attached to VM(s) {', '.join(users)}; "
                                "delete those VMs first.")
        self.db.remove_segment(name)
        with contextlib.suppress(FileNotFoundError):
            Path(rec.path).unlink()


def _copy(src: Path, dst: Path) -> None:
    """Hard-link ``src`` to ``dst`` when both are on one filesystem (no second copy on
    disk or in the page cache), else copy it."""
    dst.unlink(missing_ok=True)
    try:
        os.link(src, dst)
        return
    except OSError:
        pass
    try:
        shutil.copyfile(src, dst)
    except OSError as exc:
        if exc.errno == 28:
            raise SegmentError(f"no space left on the device holding {dst.parent}: free "
                               "some space and try again") from exc
        raise SegmentError(f"cannot copy {src} to {dst} ({exc.strerror}).") from exc
