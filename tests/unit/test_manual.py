"""The manual beside the dashboard: ``fusuma serve`` serves the built docs site at
``/manual/`` (Swagger UI stays at ``/docs``) to a viewer and above; a site that is not
built is one sentence; nothing outside the site is ever served. And the manual's
tooling: the reference pages are written from the code (every command of the click
tree with its very ``--help``, every route of the OpenAPI document, every spec key,
metric and error class), and the tutorial checker compares for structure, not for
numbers, without passing anything."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

import click
import pytest
from fastapi import FastAPI

from fusuma.api.app import create_app
from fusuma.paths import Paths
from fusuma.state.roles import Role
from tests import docs_session
from tests.conftest import REPO
from tests.unit import test_api, test_api_roles

paths = test_api.paths


@pytest.fixture
def site(tmp_path: Path) -> Path:
    root = tmp_path / "site"
    (root / "tutorials" / "first-host").mkdir(parents=True)
    (root / "index.html").write_text("<h1>fusuma manual</h1>")
    (root / "tutorials" / "first-host" / "index.html").write_text("<h1>Your first host</h1>")
    (root / "assets").mkdir()
    (root / "assets" / "main.css").write_text("body{}")
    (tmp_path / "secret.txt").write_text("not part of the manual")
    (root / "escape").symlink_to(tmp_path / "secret.txt")
    return root


@pytest.fixture
def app(paths: Paths, site: Path, monkeypatch: pytest.MonkeyPatch) -> FastAPI:
    monkeypatch.setenv("FUSUMA_MANUAL_DIR", str(site))
    return create_app(paths)


def test_the_manual_is_served_beside_the_dashboard(app: FastAPI) -> None:
    c = test_api_roles.client_as(app, Role.VIEWER)
    r = c.get("/manual/")
    assert r.status_code == 200 and "fusuma manual" in r.text
    assert "frame-ancestors 'none'" in r.headers["content-security-policy"]
    r = c.get("/manual/tutorials/first-host/")
    assert r.status_code == 200 and "Your first host" in r.text
    r = c.get("/manual/assets/main.css")
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/css")
    r = c.get("/manual")
    assert r.status_code == 308 and r.headers["location"] == "/manual/"
    # A page's directory without its slash: its relative links need the slash.
    r = c.get("/manual/tutorials/first-host")
    assert r.status_code == 308 and r.headers["location"] == "/manual/tutorials/first-host/"
    # Swagger UI stays where it was.
    r = c.get("/docs")
    assert r.status_code == 200 and "swagger-ui" in r.text


def test_nothing_outside_the_site_is_served(app: FastAPI) -> None:
    c = test_api_roles.client_as(app, Role.VIEWER)
    for rel in ("escape", "../secret.txt", "..%2Fsecret.txt", "%2E%2E/secret.txt",
                "nope.html"):
        r = c.get(f"/manual/{rel}")
        assert r.status_code == 404, (rel, r.status_code)
        assert "not part of the manual" not in r.text


def test_a_token_of_the_metrics_role_cannot_read_it(app: FastAPI) -> None:
    r = test_api_roles.client_as(app, Role.METRICS).get("/manual/")
    assert r.status_code == 403


def test_a_manual_not_built_is_one_sentence(paths: Paths, tmp_path: Path,
                                            monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FUSUMA_MANUAL_DIR", str(tmp_path / "nothing"))
    c = test_api_roles.client_as(create_app(paths), Role.VIEWER)
    r = c.get("/manual/")
    assert r.status_code == 404
    assert r.text == (f"The manual is not built: run `make docs` in fusuma's source tree "
                      f"(it builds the site into {tmp_path / 'nothing'}), or point "
                      f"FUSUMA_MANUAL_DIR at a built site.\n")


# -- the reference, generated from the code ----------------------------------------------

def _generator() -> ModuleType:
    spec = importlib.util.spec_from_file_location("docs_reference",
                                                  REPO / "tools" / "docs_reference.py")
    assert spec and spec.loader
    mod = importlib.util.module_from_spec(spec)
    sys.modules["docs_reference"] = mod
    spec.loader.exec_module(mod)
    return mod


@pytest.fixture(scope="module")
def pages(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    out = tmp_path_factory.mktemp("reference")
    return {p.name: p.read_text() for p in _generator().generate(out)}


def test_every_command_is_in_the_reference_with_its_own_help(pages: dict[str, str]) -> None:
    from fusuma.cli.main import cli

    gen = _generator()
    seen = 0
    for path, cmd, ctx in gen.walk(cli, ["fusuma"]):
        assert f"{{#{gen.anchor(path)}}}" in pages["cli.md"], path
        assert cmd.get_help(ctx).rstrip() in pages["cli.md"], path
        seen += 1
    # Groups and their commands, the plugins' (bench) included.
    assert seen > 60 and "`fusuma bench cluster`" in pages["cli.md"]
    assert isinstance(cli, click.Group)


def test_every_route_spec_key_metric_and_error_is_in_the_reference(
        pages: dict[str, str]) -> None:
    from fusuma import errors, spec
    from fusuma.api.metrics import _Families

    gen = _generator()
    doc = gen.openapi()
    for p, ops in doc["paths"].items():
        for m in ops:
            assert f"### {m.upper()} `{p}`" in pages["api.md"], (m, p)
    for model in (spec.PartitionSpec, spec.VmSpec, spec.DiskSpec, spec.NetworkSpec):
        for name, field in model.model_fields.items():
            assert f"| `{field.alias or name}` |" in pages["spec.md"], (model, name)
    for fam in _Families.new().all():
        assert f"`{fam.name}" in pages["metrics.md"], fam.name
    for name in ("fusuma_vm_move_downtime_seconds", "fusuma_vm_moves_total",
                 "fusuma_events_total"):
        assert f"| `{name}` |" in pages["metrics.md"]
    for cls in vars(errors).values():
        if isinstance(cls, type) and issubclass(cls, errors.FusumaError):
            assert f"| {cls.exit_code} | `{cls.__name__}` |" in pages["errors.md"], cls


def test_every_spec_key_has_a_description(pages: dict[str, str]) -> None:
    """A key of the host spec without a description fails here: the reference shows
    each key's description beside its type and limits."""
    from fusuma import spec

    schema = spec.HostSpec.model_json_schema(by_alias=True)
    models = {"HostSpec": schema, **schema["$defs"]}
    bare = [f"{name}.{key}" for name, model in models.items()
            for key, prop in model.get("properties", {}).items()
            if len(prop.get("description", "").split()) < 3]
    assert not bare, f"spec keys without a description (a docstring under the key): {bare}"
    assert len(models) >= 7
    described = models["VmSpec"]["properties"]["qos"]["description"]
    assert " ".join(described.split()).replace("|", "\\|") in pages["spec.md"]


def test_no_issue_numbers_in_what_a_user_reads(pages: dict[str, str]) -> None:
    """The manual, the README and every --help name features, never issue numbers."""
    import re

    pattern = re.compile(r"\bissues? ?#?\d+", re.IGNORECASE)
    texts = {name: text for name, text in pages.items()}
    texts["README.md"] = (REPO / "README.md").read_text()
    for md in (REPO / "docs").rglob("*.md"):
        if "generated" not in md.parts:
            texts[str(md.relative_to(REPO))] = md.read_text()
    found = {name: pattern.findall(text) for name, text in texts.items()}
    assert not {k: v for k, v in found.items() if v}


# -- the tutorial checker ------------------------------------------------------------

PAGE = """\
Some prose.

```console
$ fusuma ps
PARTITION  CPUS  STATE
p0         1     running
...
$ fusuma vm exec vm0 -- uname -r
6.1.0-40-cloud-amd64
```

```sh
not a session
```
"""


def test_the_session_checker_compares_structure_not_numbers(tmp_path: Path) -> None:
    steps = docs_session.parse(PAGE)
    assert [s.argv for s in steps] == [["fusuma", "ps"],
                                       ["fusuma", "vm", "exec", "vm0", "--", "uname", "-r"]]
    ps = steps[0].expected
    assert docs_session.matches(ps, ["PARTITION CPUS STATE", "p0    12   running"])
    assert docs_session.matches(ps, ["PARTITION CPUS STATE", "p0 1 running", "vm0", "vm1"])
    assert not docs_session.matches(ps, ["PARTITION CPUS STATE", "p0 1 crashed"])
    assert not docs_session.matches(ps, ["PARTITION CPUS", "p0 1 running"])
    assert not docs_session.matches(ps, [])
    assert docs_session.matches(steps[1].expected, ["6.1.0-56-cloud-amd64"])
    assert not docs_session.matches(steps[1].expected, ["6.1.0-56-cloud-arm64"])
    assert not docs_session.matches(steps[1].expected, [])
    page = tmp_path / "t.md"
    page.write_text(PAGE)
    docs_session.record(page, ["A B\n1 2\n", "7.0.0\n"])
    again = docs_session.parse(page.read_text())
    assert [s.expected for s in again] == [["A B", "1 2"], ["7.0.0"]]
    assert "not a session" in page.read_text()


def test_the_first_host_tutorial_has_its_session() -> None:
    steps = docs_session.parse((REPO / "docs" / "tutorials" / "first-host.md").read_text())
    assert [s.argv[:3] for s in steps][:2] == [["fusuma", "partition", "create"],
                                               ["fusuma", "vm", "create"]]
    assert all(s.argv[0] == "fusuma" for s in steps)
    steps = docs_session.parse((REPO / "docs" / "tutorials" / "first-template.md").read_text())
    assert ["fusuma", "template", "create"] in [s.argv[:3] for s in steps]
    assert all(s.argv[0] == "fusuma" and s.expected for s in steps)


def test_the_cluster_tutorial_has_its_session_and_files() -> None:
    text = (REPO / "docs" / "tutorials" / "first-cluster.md").read_text()
    steps = docs_session.parse(text)
    assert all(s.argv[0] == "kubectl" and s.expected for s in steps)
    shown = docs_session.files(text)
    assert set(shown) == {"partitions.yaml", "web0.yaml"}
    used = {a for s in steps for a in s.argv if a.endswith(".yaml")}
    assert used == {"web0.yaml"}, "the session uses a file the page does not show"
    assert "kind: FusumaVM" in shown["web0.yaml"] and shown["web0.yaml"].endswith("}\n")


def test_an_age_as_kubectl_prints_it_matches_any_age() -> None:
    assert docs_session.matches(["h0  True  5m12s"], ["h0  True  7s"])
    assert docs_session.matches(["h0  True  2d"], ["h1  True  40h"])
    assert not docs_session.matches(["h0  True  5m"], ["h0  False  5m"])
