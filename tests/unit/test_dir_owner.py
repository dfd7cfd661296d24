"""The shm and runtime directories must be root's and not writable by others: one made
by another user (here ``nobody``) is refused with one sentence, and nothing in or
about it changes."""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from fusuma.errors import HostError
from fusuma.paths import Paths, check_root_owned

NOBODY = 65534
pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="making another user's dirs needs root")


@pytest.fixture
def top() -> Iterator[Path]:
    """A root-owned 0755 dir below /tmp (pytest's tmp_path is 0700: not a place for
    the runtime dir)."""
    d = Path(tempfile.mkdtemp(prefix="fusuma-owner-", dir="/tmp"))
    d.chmod(0o755)
    yield d
    shutil.rmtree(d, ignore_errors=True)


def paths(top: Path, **kw: Path) -> Paths:
    return Paths(**{"home": top / "home", "runtime": top / "run", "shm": top / "shm",
                    "cache": top / "cache", "cgroup_prefix": "t", **kw})


def by_nobody(path: Path, mode: int = 0o755) -> Path:
    path.mkdir()
    os.chown(path, NOBODY, NOBODY)
    path.chmod(mode)
    return path


def snapshot(path: Path) -> tuple[int, int, int, list[str]]:
    st = os.lstat(path)
    return st.st_uid, st.st_gid, st.st_mode, sorted(os.listdir(path))


@pytest.mark.parametrize("which", ["runtime", "shm"])
@pytest.mark.parametrize("mode", [0o700, 0o755, 0o777])
def test_a_dir_another_user_made_is_refused_and_left_alone(top: Path, which: str,
                                                            mode: int) -> None:
    evil = by_nobody(top / "evil", mode)
    p = paths(top, **{which: evil})
    before = snapshot(evil)
    calls = [p.ensure_parents, p.ensure_runtime, p.check_owned]
    for call in calls + ([p.ensure_shm] if which == "shm" else []):
        with pytest.raises(HostError) as err:
            call()
        said = str(err.value)
        assert said.count(". ") == 0 and said.endswith("."), said
        assert f"{evil} belongs to nobody (uid 65534) with mode {mode:04o}, not to " \
               "root" in said, said
        assert f"`rm -r {evil}`" in said
        assert ("FUSUMA_RUNTIME_DIR" if which == "runtime" else "FUSUMA_SHM_DIR") in said
        assert snapshot(evil) == before
    # Nothing made anywhere: not the state root, nor the other directories.
    assert sorted(os.listdir(top)) == ["evil"]


def test_root_owned_but_writable_by_others_is_refused(top: Path) -> None:
    shm = top / "shm"
    shm.mkdir(mode=0o700)
    for mode in (0o777, 0o1777, 0o770):
        shm.chmod(mode)
        if mode == 0o770:
            os.chown(shm, 0, NOBODY)      # group-writable by a group that is not root's
        with pytest.raises(HostError, match=f"is writable by other users .*mode "
                                            f"{mode:04o}.*chmod go-w {shm}"):
            paths(top).ensure_shm()
        assert os.lstat(shm).st_mode & 0o7777 == mode
    os.chown(shm, 0, 0)
    shm.chmod(0o750)                       # root's, others cannot write: fixed to 0700
    assert paths(top).ensure_shm() == shm and shm.stat().st_mode & 0o777 == 0o700


def test_a_dir_below_another_users_dir_is_refused(top: Path) -> None:
    evil = by_nobody(top / "evil")
    run = evil / "run"
    run.mkdir()                            # root's own, but nobody can swap it away
    with pytest.raises(HostError, match=f"runtime directory {run} is below {evil}, which "
                                        "belongs to nobody"):
        paths(top, runtime=run).ensure_runtime()
    # A world-writable parent without the sticky bit is as bad; with it (/tmp) it is fine.
    open_dir = top / "open"
    open_dir.mkdir()
    open_dir.chmod(0o777)
    with pytest.raises(HostError, match="which is writable by other users"):
        check_root_owned(open_dir / "shm", "shared-memory directory", "FUSUMA_SHM_DIR")
    open_dir.chmod(0o1777)
    check_root_owned(open_dir / "shm", "shared-memory directory", "FUSUMA_SHM_DIR")


def test_a_symlink_another_user_planted_is_refused(top: Path) -> None:
    target = top / "target"
    target.mkdir(mode=0o700)               # root's: the link is the trap
    link = top / "shm"
    link.symlink_to(target)
    os.lchown(link, NOBODY, NOBODY)
    with pytest.raises(HostError, match=f"{link} belongs to nobody"):
        paths(top).ensure_shm()
    assert target.stat().st_mode & 0o777 == 0o700 and link.is_symlink()


def test_the_usual_places_pass(top: Path) -> None:
    p = paths(top, runtime=top / "a" / "run")
    p.ensure_runtime()
    assert p.ensure_shm().stat().st_mode & 0o777 == 0o700
    check_root_owned(Path("/dev/shm/fusuma-owner-never-made"), "shared-memory directory",
                     "FUSUMA_SHM_DIR")
