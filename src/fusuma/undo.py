"""Transactional set-up: each step that succeeded registers its undo.

    with Reverter() as rev:
        make_cgroup(); rev.add(remove_cgroup)
        spawn();       rev.add(kill)
        rev.commit()          # keep everything
    # leaving the block without commit() runs the undos, newest first
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from types import TracebackType

LOG = logging.getLogger(__name__)


class Reverter:
    def __init__(self) -> None:
        self._undo: list[tuple[str, Callable[[], object]]] = []
        self._committed = False

    def add(self, fn: Callable[[], object], what: str = "") -> None:
        self._undo.append((what or getattr(fn, "__name__", "step"), fn))

    def commit(self) -> None:
        self._committed = True

    def __enter__(self) -> Reverter:
        return self

    def __exit__(self, et: type[BaseException] | None, ev: BaseException | None,
                 tb: TracebackType | None) -> None:
        if self._committed:
            return
        for what, fn in reversed(self._undo):
            try:
                fn()
            except Exception as exc:
                LOG.warning("undo of %s failed: %s", what, exc)
                LOG.debug("undo failure", exc_info=True)
