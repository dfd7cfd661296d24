"""oom_score_adj for fusuma's processes (fusuma.host.oom) against a fake /proc: the
scores by role and class, and the kernel's refusal (no CAP_SYS_RESOURCE) said once."""

from __future__ import annotations

import errno
import logging
import os
from pathlib import Path

import pytest

from fusuma.host import oom


def test_scores_order_supervisor_guaranteed_burstable() -> None:
    assert oom.SUPERVISOR < oom.GUARANTEED_QEMU < oom.BURSTABLE_QEMU < 0
    assert oom.qemu_score("guaranteed") == oom.GUARANTEED_QEMU
    assert oom.qemu_score("burstable") == oom.BURSTABLE_QEMU


def test_a_score_is_written(tmp_path: Path) -> None:
    (tmp_path / "42").mkdir()
    (tmp_path / "42" / "oom_score_adj").write_text("0\n")
    assert oom.set_score(42, -800, "the QEMU of g", proc=tmp_path)
    assert oom.score_of(42, proc=tmp_path) == -800
    assert not oom.set_score(43, -800, "a gone process", proc=tmp_path)
    assert oom.score_of(43, proc=tmp_path) is None


def test_a_refused_score_is_said_once(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                      caplog: pytest.LogCaptureFixture) -> None:
    """The kernel answers EACCES to a lower score without CAP_SYS_RESOURCE (as in this
    lab's sandbox): one warning for the process, then quiet; nothing raised."""
    monkeypatch.setattr(oom, "_refused", False)
    real_open = open

    def refusing(path: object, mode: str = "r", *a: object, **kw: object) -> object:
        if str(path).endswith("oom_score_adj") and "w" in mode:
            raise PermissionError(errno.EACCES, os.strerror(errno.EACCES))
        return real_open(path, mode, *a, **kw)  # type: ignore[call-overload]
    monkeypatch.setattr("builtins.open", refusing)
    with caplog.at_level(logging.DEBUG, logger="fusuma.host.oom"):
        assert not oom.set_score(1, oom.SUPERVISOR, "the supervisor of p0", proc=tmp_path)
        assert not oom.set_score(2, oom.BURSTABLE_QEMU, "the QEMU of b", proc=tmp_path)
    warned = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warned) == 1, caplog.records
    assert "needs CAP_SYS_RESOURCE" in warned[0].getMessage()
    assert "oom_score_adj -900 for the supervisor of p0" in warned[0].getMessage()
