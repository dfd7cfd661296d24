"""fusuma's own Python children never import from the caller's working directory:
``python -m`` would put it first on ``sys.path`` (a ``fusuma/`` package a user left
there would run as root); ``fusuma.spawn``'s argv leaves it out even when the child
runs there, and every place that starts one of fusuma's modules uses it."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from fusuma import spawn

SRC = Path(__file__).resolve().parents[2] / "src"


def planted(tmp: Path) -> tuple[Path, Path]:
    """A directory holding a ``fusuma`` package and a ``fusuma.py`` that leave a marker
    when imported."""
    cwd = tmp / "cwd"
    marker = tmp / "imported"
    (cwd / "fusuma").mkdir(parents=True)
    code = f"open({str(marker)!r}, 'a').write(__file__ + '\\n')\n"
    (cwd / "fusuma" / "__init__.py").write_text(code)
    (cwd / "fusuma" / "spawn.py").write_text(code)
    (cwd / "fusuma.py").write_text(code)
    return cwd, marker


def test_python_m_alone_imports_the_planted_package(tmp_path: Path) -> None:
    """The flaw, shown: plain ``python -m`` in that directory imports the user's code."""
    cwd, marker = planted(tmp_path)
    subprocess.run([sys.executable, "-m", "fusuma.spawn"], cwd=cwd,
                   env={**os.environ, "PYTHONPATH": str(SRC)}, capture_output=True,
                   timeout=60)
    assert marker.exists() and str(cwd) in marker.read_text()


def test_the_spawn_argv_does_not_even_in_that_directory(tmp_path: Path) -> None:
    cwd, marker = planted(tmp_path)
    probe = "import fusuma.spawn, os; print(fusuma.spawn.__file__); print(os.getcwd())"
    argv = spawn.module_argv("fusuma.spawn")
    assert argv[:3] == [sys.executable, "-P", "-m"]
    env = spawn.child_env({**os.environ, "PYTHONPATH": str(SRC)})
    for where in (cwd, Path(spawn.CWD)):
        subprocess.run(argv, cwd=where, env=env, check=True, capture_output=True,
                       timeout=60)
        out = subprocess.run([sys.executable, "-P", "-c", probe], cwd=where, env=env,
                             check=True, capture_output=True, text=True, timeout=60)
        assert out.stdout.splitlines()[0] == str(SRC / "fusuma" / "spawn.py"), out.stdout
    assert not marker.exists(), marker.read_text()


def test_child_env_keeps_pythonpath_absolute_without_the_cwd(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    got = spawn.child_env({"PYTHONPATH": f"src{os.pathsep}{os.pathsep}/opt/x",
                           "FUSUMA_HOME": "/h"})
    # "" on PYTHONPATH is the working directory: dropped, never made absolute.
    assert got == {"PYTHONPATH": f"{tmp_path}/src{os.pathsep}/opt/x", "FUSUMA_HOME": "/h"}
    assert spawn.child_env({"PYTHONPATH": os.pathsep}) == {}
    assert spawn.child_env({"A": "b"}) == {"A": "b"}


def test_every_module_fusuma_starts_goes_through_spawn() -> None:
    """No ``sys.executable ... "-m"`` argv but spawn's own (the benchmark that times the
    CLI as a user types it is the one exception)."""
    exempt = {SRC / "fusuma" / "spawn.py", SRC / "fusuma_bench" / "clitime.py"}
    found = []
    for path in SRC.rglob("*.py"):
        if path in exempt:
            continue
        text = path.read_text()
        for m in re.finditer(r"sys\.executable,\s*\"-m\"", text):
            found.append(f"{path.relative_to(SRC)}:{text[:m.start()].count(chr(10)) + 1}")
    assert not found, found
    units = (SRC / "fusuma" / "host" / "systemd.py").read_text()
    assert " -m fusuma.supervisor" not in units.replace(" -P -m fusuma.supervisor", "")
