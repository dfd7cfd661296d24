"""cgroupfs primitives every driver shares: writes that never create a file, a removal
that waits out a cgroup still busy with its last task, and refusals turned into one
sentence naming the change. A test replaces ``_make_dir`` and ``_remove_dir`` on a
driver to run it against a fake directory tree.
"""

from __future__ import annotations

import errno
import logging
import os
import time
from collections.abc import Iterator
from pathlib import Path

from fusuma.errors import CgroupError

LOG = logging.getLogger(__name__)

_RMDIR_RETRY_S = 2.0


class CgroupFiles:
    """Reads, writes, makes and removes cgroupfs files and directories."""

    def __init__(self) -> None:
        self._warned: set[str] = set()

    def _make_dir(self, path: Path) -> None:
        os.mkdir(path)

    def _remove_dir(self, path: Path) -> None:
        # A cgroup whose last task just exited can stay busy for a moment (v1).
        deadline = time.monotonic() + _RMDIR_RETRY_S
        while True:
            try:
                os.rmdir(path)
                return
            except FileNotFoundError:
                return
            except OSError as exc:
                if exc.errno != errno.EBUSY or time.monotonic() > deadline:
                    raise
                time.sleep(0.05)

    @staticmethod
    def _write(path: Path, value: str) -> None:
        # No O_CREAT: cgroupfs files exist or the controller is missing; never create one.
        fd = os.open(path, os.O_WRONLY | os.O_TRUNC | os.O_CLOEXEC)
        try:
            os.write(fd, value.encode())
        finally:
            os.close(fd)

    @staticmethod
    def _read(path: Path) -> str:
        return path.read_text().strip()

    def _get(self, path: Path) -> str:
        """Read a control file, turning a failure into a CgroupError."""
        try:
            return self._read(path)
        except OSError as exc:
            raise CgroupError(f"cannot read {path}: {exc.strerror or exc}") from exc

    def _warn_once(self, key: str, message: str, *args: object) -> None:
        if key not in self._warned:
            self._warned.add(key)
            LOG.warning(message, *args)

    def _set(self, path: Path, value: str, what: str) -> None:
        """Write a control file, turning a refusal into one sentence naming the change."""
        try:
            self._write(path, value)
        except OSError as exc:
            raise CgroupError(
                f"cannot set {what} ({path.name} = {value.strip()!r} in {path.parent}): "
                f"{exc.strerror or exc}"
            ) from exc
        LOG.debug("%s <- %s", path, value.strip())

    def _try_set(self, path: Path, value: str, key: str, what: str) -> bool:
        """Best-effort write: warn once per ``key`` when the file is missing or refuses."""
        if not path.exists():
            self._warn_once(key, "%s: %s does not exist on this kernel; carrying on without it",
                            what, path.name)
            return False
        try:
            self._write(path, value)
        except OSError as exc:
            self._warn_once(key, "%s: writing %r to %s failed (%s); carrying on without it",
                            what, value.strip(), path, exc.strerror or exc)
            return False
        LOG.debug("%s <- %s", path, value.strip())
        return True

    def _mkdirs(self, dirs: list[Path], label: str, made: list[Path]) -> None:
        for path in dirs:
            if path.is_dir():
                continue
            try:
                self._make_dir(path)
            except OSError as exc:
                raise CgroupError(
                    f"cannot create cgroup {label} at {path}: {exc.strerror or exc}"
                ) from exc
            made.append(path)

    def _undo(self, made: list[Path]) -> None:
        for path in reversed(made):
            try:
                self._remove_dir(path)
            except OSError as exc:
                LOG.warning("cleanup: cannot remove %s: %s", path, exc.strerror or exc)

    @staticmethod
    def _walk_dirs(top: Path) -> Iterator[Path]:
        """``top`` and every cgroup below it, children before their parent."""
        for dirpath, _dirnames, _files in os.walk(top, topdown=False):
            yield Path(dirpath)

    def _procs_below(self, top: Path) -> set[int]:
        pids: set[int] = set()
        for path in self._walk_dirs(top):
            try:
                text = (path / "cgroup.procs").read_text()
            except FileNotFoundError:
                continue
            except OSError as exc:
                raise CgroupError(f"cannot read {path / 'cgroup.procs'}: "
                                  f"{exc.strerror or exc}") from exc
            pids.update(int(tok) for tok in text.split())
        return pids
