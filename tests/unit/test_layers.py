"""The layers, read from the source: every import counts, at module level, in a function
or under TYPE_CHECKING.

- The front doors (``cli``, ``api``, ``cluster``) never import one another; they share
  ``fusuma.ops`` (operations, the context), ``fusuma.views`` (read models) and
  ``fusuma.console`` (what every command prints).
- Those shared layers import no front door.
- Inside the API and the cluster package no two modules import each other, directly or
  through others (the daemon's parts and the agent's protocols sit below the rest).
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[2] / "src"
DOORS = ("fusuma.cli", "fusuma.api", "fusuma.cluster")
SHARED = ("fusuma.ops", "fusuma.views", "fusuma.console")


def _modules() -> dict[str, Path]:
    out = {}
    for path in (SRC / "fusuma").rglob("*.py"):
        parts = list(path.relative_to(SRC).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = path
    return out


MODULES = _modules()


def _resolve(name: str) -> str | None:
    while name and name not in MODULES:
        name = name.rpartition(".")[0]
    return name or None


def parse(text: str) -> ast.Module:
    """``ast.parse``, asked again when CPython 3.11.7 raises its spurious "AST constructor
    recursion depth mismatch" (cpython#106905: the depth is counted per interpreter, so
    another thread of the process building an AST at the same moment breaks the count;
    fixed in later releases). Seen once in a suite run, in an xdist worker."""
    for attempt in range(3):
        try:
            return ast.parse(text)
        except SystemError as exc:
            if "recursion depth mismatch" not in str(exc) or attempt == 2:
                raise
    raise AssertionError("unreachable")


def imports(module: str) -> set[str]:
    """The fusuma modules ``module`` imports anywhere in its text."""
    path = MODULES[module]
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found: set[str] = set()
    for node in ast.walk(parse(path.read_text())):
        names: list[str] = []
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                up = package.split(".")[:len(package.split(".")) - node.level + 1]
                base = ".".join([*up, base] if base else up)
            names = [base, *(f"{base}.{a.name}" for a in node.names)]
        for name in names:
            got = _resolve(name)
            if got is not None and got != module:
                found.add(got)
    return found


def _under(module: str, packages: tuple[str, ...]) -> str | None:
    return next((p for p in packages if module == p or module.startswith(p + ".")), None)


def test_no_front_door_imports_another() -> None:
    crossing = sorted(f"{m} imports {t}" for m in MODULES if _under(m, DOORS)
                      for t in imports(m)
                      if _under(t, DOORS) and _under(t, DOORS) != _under(m, DOORS))
    assert crossing == []


def test_shared_layers_import_no_front_door() -> None:
    upward = sorted(f"{m} imports {t}" for m in MODULES if _under(m, SHARED)
                    for t in imports(m) if _under(t, DOORS))
    assert upward == []


@pytest.mark.parametrize("package", ["fusuma.api", "fusuma.cluster"])
def test_no_import_cycle_inside(package: str) -> None:
    inside = {m for m in MODULES if _under(m, (package,))}
    graph = {m: imports(m) & inside for m in inside}

    def reaches(start: str) -> set[str]:
        seen: set[str] = set()
        todo = list(graph[start])
        while todo:
            m = todo.pop()
            if m not in seen:
                seen.add(m)
                todo.extend(graph[m])
        return seen

    cycles = sorted(m for m in inside if m in reaches(m))
    assert cycles == []
