"""A partition's directory goes with the partition (fusuma.partition.files): every file
fusuma makes there is removed with it, the supervisor's start lock included (it once
kept the directory of every deleted partition), and so is what a supervisor killed
while writing its balloon targets left; a file fusuma did not make keeps the directory
and is said."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

from fusuma.governor import balloons
from fusuma.partition import files
from fusuma.partition.manager import PartitionManager
from fusuma.paths import Paths
from fusuma.state import Database
from tests.unit.test_image_store import db, paths  # noqa: F401 (fixtures)


def test_the_directory_a_supervisors_start_made_goes_with_the_partition(
        paths: Paths, db: Database, monkeypatch: pytest.MonkeyPatch) -> None:  # noqa: F811
    parts = PartitionManager(paths, db, host=object())  # type: ignore[arg-type]
    pdir = paths.partition_dir("p0")

    def start(name: str, pdir: Path, timeout: float) -> int:
        (pdir / files.SUPERVISOR_LOG).write_text("started\n")
        return 100

    monkeypatch.setattr(parts, "supervisor_pid", lambda name: None)
    monkeypatch.setattr(parts, "_start", start)
    assert parts.start_supervisor("p0") == 100
    (pdir / files.RECOVERY_LOG).write_text("")
    balloons.save(pdir / balloons.FILE_NAME, {"b": balloons.Target(4242, 192)})
    assert (pdir / files.START_LOCK).exists()
    assert files.remove(pdir) == [] and not pdir.exists()
    assert files.remove(pdir) == []          # already gone: nothing to say


def test_a_killed_writers_temporary_balloon_file_goes_too(tmp_path: Path) -> None:
    pdir = tmp_path / "a"
    pdir.mkdir()
    balloons.save(pdir / balloons.FILE_NAME, {"b": balloons.Target(4242, 192)})
    # What a supervisor killed between its write and its rename leaves.
    (pdir / f".{balloons.FILE_NAME}.4243").write_text("{")
    assert [p.name for p in balloons.temp_files(pdir)] == [".balloons.json.4243"]
    assert files.remove(pdir) == [] and not pdir.exists()


def test_a_file_fusuma_did_not_make_keeps_the_directory_and_is_said(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    pdir = tmp_path / "a"
    pdir.mkdir()
    (pdir / files.SUPERVISOR_LOG).write_text("")
    (pdir / "notes.txt").write_text("mine")
    with caplog.at_level(logging.WARNING, logger="fusuma.partition.files"):
        assert files.remove(pdir) == ["notes.txt"]
    assert sorted(p.name for p in pdir.iterdir()) == ["notes.txt"]
    assert f"kept {pdir}" in caplog.text and "notes.txt" in caplog.text
