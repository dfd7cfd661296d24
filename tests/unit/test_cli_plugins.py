"""Commands from other packages: `fusuma bench` comes from the fusuma_bench package
through the `fusuma.commands` entry point, and the runtime never imports it.

Entry points exist only in an installed distribution's metadata, so these tests
"install" one: a dist-info directory on sys.path with the entry points that
pyproject.toml declares (importlib.metadata reads any such directory on the path).
"""

from __future__ import annotations

import ast
import tomllib
from collections.abc import Iterator
from pathlib import Path

import click
import pytest
from click.testing import CliRunner

from fusuma.cli import main as cli_main

REPO = Path(__file__).resolve().parents[2]
RESULTS = REPO / "docs" / "results"


def declared_entry_points() -> dict[str, dict[str, str]]:
    """pyproject.toml's [project.entry-points] tables."""
    with (REPO / "pyproject.toml").open("rb") as f:
        return dict(tomllib.load(f)["project"]["entry-points"])


def install_entry_points(dest: Path, groups: dict[str, dict[str, str]],
                         name: str = "fusuma_plugins_under_test") -> Path:
    """A dist-info for distribution NAME in DEST with GROUPS' entry points; DEST is
    the directory to put on sys.path / PYTHONPATH."""
    info = dest / f"{name}-0.dist-info"
    info.mkdir(parents=True, exist_ok=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: 0\n")
    (info / "entry_points.txt").write_text("".join(
        f"[{group}]\n" + "".join(f"{k} = {v}\n" for k, v in eps.items()) + "\n"
        for group, eps in groups.items()))
    return dest


@click.command("hello")
def hello() -> None:
    """Say hello (a package's command, in a test)."""
    click.echo("hello from a package")


@pytest.fixture
def installed(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """fusuma's declared entry points, plus a `hello` command and one that tries to
    take the built-in name `ps`, as if installed."""
    groups = declared_entry_points()
    groups[cli_main.PLUGIN_GROUP] = {**groups[cli_main.PLUGIN_GROUP],
                                     "hello": f"{__name__}:hello",
                                     "ps": f"{__name__}:hello"}
    monkeypatch.syspath_prepend(str(install_entry_points(tmp_path / "site", groups)))
    cli_main.plugin_commands.cache_clear()
    yield tmp_path
    cli_main.plugin_commands.cache_clear()


def test_bench_is_declared_as_an_entry_point_not_a_builtin() -> None:
    assert declared_entry_points()[cli_main.PLUGIN_GROUP]["bench"] == "fusuma_bench.cli:bench"
    assert "bench" not in cli_main.COMMANDS


def test_the_runtime_never_imports_the_benchmarks() -> None:
    """Not even lazily inside a function: no import of fusuma_bench anywhere in
    src/fusuma."""
    found = []
    for path in sorted((REPO / "src" / "fusuma").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            names = ([a.name for a in node.names] if isinstance(node, ast.Import)
                     else [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
            found += [f"{path.relative_to(REPO)}:{node.lineno}" for n in names
                      if n == "fusuma_bench" or n.startswith("fusuma_bench.")]
    assert found == []


def test_a_packages_command_runs_and_is_listed(installed: Path) -> None:
    res = CliRunner().invoke(cli_main.cli, ["hello"])
    assert res.exit_code == 0 and res.output == "hello from a package\n"
    listing = CliRunner().invoke(cli_main.cli, ["--help"], prog_name="fusuma").output
    assert "  hello " in listing and "Say hello (a package's command, in a test)." in listing
    assert "  bench " in listing and "Run benchmarks; each writes a JSON result file" in listing


def test_a_builtin_name_cannot_be_taken(installed: Path) -> None:
    assert "ps" not in cli_main.plugin_commands()
    assert cli_main.cli.get_command(click.Context(cli_main.cli), "ps") is \
        cli_main.load_command("ps")


def test_a_builtin_command_does_not_scan_entry_points(installed: Path) -> None:
    ctx = click.Context(cli_main.cli)
    assert cli_main.cli.get_command(ctx, "vm") is not None
    assert cli_main.plugin_commands.cache_info().currsize == 0
    assert cli_main.cli.get_command(ctx, "no-such-command") is None
    assert cli_main.plugin_commands.cache_info().currsize == 1


def test_fusuma_bench_is_found_through_the_entry_point(installed: Path) -> None:
    from fusuma_bench.cli import bench

    assert cli_main.cli.get_command(click.Context(cli_main.cli), "bench") is bench
    res = CliRunner().invoke(cli_main.cli, ["bench", "--help"])
    assert res.exit_code == 0
    for name in ("api", "boot", "cli", "cluster", "dcss", "density", "maintain", "mint",
                 "report", "scheduler", "vmbeam"):
        assert f"  {name} " in res.output


def test_without_the_package_bench_is_no_command(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(cli_main, "plugin_commands", lambda: {})
    res = CliRunner().invoke(cli_main.cli, ["bench", "--help"])
    assert res.exit_code == 2 and "No such command 'bench'" in res.output


# -- the generic `bench report NAME` ---------------------------------------------------
def test_every_report_has_its_command() -> None:
    from fusuma_bench.cli import bench
    from fusuma_bench.report import REPORTS

    res = CliRunner().invoke(bench, ["report", "--help"])
    assert res.exit_code == 0
    for name in REPORTS:
        assert f"  {name} " in res.output
    assert set(REPORTS) == {"vmbeam", "maintain", "mint", "scheduler", "dcss", "density",
                            "network", "memory"}


@pytest.mark.parametrize("name, pngs", [
    ("vmbeam", ["vmbeam.png"]), ("maintain", ["maintain.png"]),
    ("mint", ["mint-register.png", "mint-copy.png", "mint-io.png"]),
    ("scheduler", ["scheduler.png"]), ("dcss", ["dcss.png"]), ("density", ["density.png"]),
    ("memory", ["memory-fit.png", "memory-burst.png"]),
])
def test_report_command_renders_a_result_file(tmp_path: Path, name: str,
                                              pngs: list[str]) -> None:
    from fusuma_bench.cli import bench

    out = tmp_path / "out"
    res = CliRunner().invoke(bench, ["report", name, str(RESULTS / f"{name}.json"), str(out)])
    assert res.exit_code == 0, res.output
    paths = [out / "report.md", *(out / p for p in pngs)]
    assert res.output == f"report: {', '.join(str(p) for p in paths)}\n"
    assert all(p.stat().st_size > 0 for p in paths)


def test_report_command_refuses_another_benchmarks_file(tmp_path: Path) -> None:
    from fusuma_bench.report import render_report

    with pytest.raises(Exception, match=r"not a `fusuma bench maintain` result file .*"
                                        r"its benchmark is 'vmbeam'"):
        render_report("maintain", RESULTS / "vmbeam.json", tmp_path)
