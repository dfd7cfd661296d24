"""No import cycle between any two of fusuma's modules, package ``__init__``s included.

The ``acyclic_siblings`` contract in pyproject.toml (run by lint-imports in ``make lint``)
finds cycles between sibling modules and packages at every depth. A module that imports
its own package's ``__init__``, which imports it back (the way ``host/cgroups.py`` and
its drivers once did), is no sibling cycle, so this test walks the whole module graph.
It allows exactly the imports that contract ignores (the ones the core rebuild removes).
"""

from __future__ import annotations

import tomllib
from collections.abc import Iterable, Mapping
from pathlib import Path

import pytest

grimp = pytest.importorskip("grimp", reason="grimp comes with import-linter (the dev extras)")

PYPROJECT = Path(__file__).resolve().parents[2] / "pyproject.toml"


def allowed_imports() -> set[tuple[str, str]]:
    """The acyclic contract's ignore_imports as (importer, imported) pairs."""
    config = tomllib.loads(PYPROJECT.read_text())["tool"]["importlinter"]
    (contract,) = [c for c in config["contracts"] if c["type"] == "acyclic_siblings"]
    pairs = set()
    for entry in contract.get("ignore_imports", []):
        importer, _, imported = (part.strip() for part in entry.partition("->"))
        assert "*" not in entry, f"{entry!r}: name the import exactly"
        pairs.add((importer, imported))
    return pairs


def cycles(edges: Mapping[str, Iterable[str]]) -> list[list[str]]:
    """The strongly connected components of more than one node (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    for root in sorted(edges):
        if root in index:
            continue
        work = [(root, iter(sorted(edges.get(root, ()))))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(edges.get(child, ())))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                parent = work[-1][0]
                low[parent] = min(low[parent], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
    return found


def test_cycles_finds_a_cycle_and_only_a_cycle() -> None:
    edges = {"a": ["b"], "b": ["c"], "c": ["a"], "d": ["a"], "e": []}
    assert cycles(edges) == [["a", "b", "c"]]
    assert cycles({"a": ["b"], "b": []}) == []


def test_no_module_level_import_cycle() -> None:
    graph = grimp.build_graph("fusuma", cache_dir=None)
    allowed = allowed_imports()
    for importer, imported in sorted(allowed):
        assert graph.direct_import_exists(importer=importer, imported=imported), (
            f"{importer} no longer imports {imported}: delete that line from the "
            "acyclic contract's ignore_imports in pyproject.toml")
    edges = {
        module: {imported for imported in graph.find_modules_directly_imported_by(module)
                 if (module, imported) not in allowed}
        for module in graph.modules
    }
    found = cycles(edges)
    assert not found, "import cycles (break them; do not add to ignore_imports):\n" + "\n".join(
        " <-> ".join(component) for component in found)
