"""What the OpenAPI document says is what the API does (what tests/integration/
test_api_fuzz.py holds a real daemon to): every error is an ErrorInfo under 4XX/5XX
(never FastAPI's 422, which the API does not send), every 202 is an operation, names
state their pattern, non-JSON answers their media type; a 405 lists every method of
its resource; and the answers the fuzzer first caught are right: a name with a final
newline is no name, an empty ``?partition=`` is refused, ``?recursion=0`` matches."""

from __future__ import annotations

import re
from typing import Any

import pytest
from fastapi import FastAPI

from fusuma.api.app import create_app
from fusuma.errors import SpecError
from fusuma.names import NAME_PATTERN, check_name
from fusuma.paths import Paths
from fusuma.qemu.versions import SERIES_RE
from fusuma.state import Database, PartitionRecord
from fusuma.state.roles import Role
from tests.unit import test_api, test_api_roles

paths = test_api.paths


@pytest.fixture
def app(paths: Paths) -> FastAPI:
    return create_app(paths)


@pytest.fixture
def spec(app: FastAPI) -> dict[str, Any]:
    with test_api_roles.client_as(app, Role.ADMIN) as c:
        doc: dict[str, Any] = c.get("/openapi.json").json()
    return doc


def operations(spec: dict[str, Any]) -> list[tuple[str, str, dict[str, Any]]]:
    return [(m.upper(), p, op) for p, ops in spec["paths"].items() for m, op in ops.items()]


ERROR_REF = {"$ref": "#/components/schemas/ErrorInfo"}


def test_every_error_is_an_error_info_and_every_202_an_operation(
        spec: dict[str, Any], app: FastAPI) -> None:
    assert "HTTPValidationError" not in spec["components"]["schemas"]
    for method, path, op in operations(spec):
        codes = op["responses"]
        assert "422" not in codes, (method, path)
        for rng in ("4XX", "5XX"):
            assert codes[rng]["content"] == {"application/json": {"schema": ERROR_REF}}, \
                (method, path, codes[rng])
        if "202" in codes:
            assert codes["202"]["content"]["application/json"]["schema"] == {
                "$ref": "#/components/schemas/OperationInfo"}, (method, path)
    # Every route that answers 202 says so.
    from fastapi.routing import iter_route_contexts

    accepted = {(method, ctx.path) for ctx in iter_route_contexts(app.routes)
                if getattr(ctx.original_route, "status_code", None) == 202
                for method in ctx.methods or ()}
    assert accepted == {(m, p) for m, p, op in operations(spec) if "202" in op["responses"]}
    assert len(accepted) == 20
    # Answers that are not JSON name their media type.
    assert list(spec["paths"]["/metrics"]["get"]["responses"]["200"]["content"]) == [
        "text/plain"]
    assert list(spec["paths"]["/1.0/events"]["get"]["responses"]["200"]["content"]) == [
        "text/event-stream"]


def test_names_state_their_pattern(spec: dict[str, Any]) -> None:
    named = 0
    for method, path, op in operations(spec):
        for param in op.get("parameters", []):
            if param["name"] in ("name", "partition", "vm", "snapshot"):
                assert param["schema"]["pattern"] == NAME_PATTERN, (method, path, param)
                named += 1
    assert named == 38
    schemas = spec["components"]["schemas"]
    for model, field in (("VmCreate", "name"), ("PartitionCreate", "name"),
                         ("DiskCreate", "name"), ("VmMove", "partition"),
                         ("TemplateCreate", "from_vm"), ("SegmentCreate", "name"),
                         ("SnapshotCreate", "name")):
        assert schemas[model]["properties"][field]["pattern"] == NAME_PATTERN, model
    # The document's pattern (ECMA) and fusuma's check agree, on the edges too.
    for name in ("0", "a-b_c", "x" * 32, "", "-a", "A", "x" * 33, "a b", "a\n", "é"):
        ok = re.fullmatch(NAME_PATTERN.strip("^$"), name) is not None
        try:
            check_name("vm", name)
            checked = True
        except SpecError:
            checked = False
        assert ok == checked, name


def test_a_405_names_every_method_of_the_resource(app: FastAPI) -> None:
    c = test_api_roles.client_as(app, Role.ADMIN)
    for path, allowed in (("/1.0/disks", "GET, POST"),
                          ("/1.0/vms/x", "DELETE, GET, PATCH"),
                          ("/1.0/vms/x/state", "GET, PUT"), ("/metrics", "GET")):
        r = c.request("TRACE", path)
        assert r.status_code == 405 and r.headers["allow"] == allowed, (path, r.headers)
        assert r.json()["error"] == f"TRACE is not allowed on {path} (see /docs)."


def test_a_final_newline_makes_no_name(app: FastAPI) -> None:
    with pytest.raises(SpecError, match="name 'vm0\\\\n' is not allowed"):
        check_name("vm", "vm0\n")
    assert SERIES_RE.match("10.0") and not SERIES_RE.match("10.0\n")
    assert not SERIES_RE.match("\u0661\u0660.\u0660")         # Arabic-Indic digits
    c = test_api_roles.client_as(app, Role.ADMIN)
    r = c.post("/1.0/partitions", json={"name": "p0\n", "cpus": "0", "memory_mib": 64})
    assert r.status_code == 400 and "'p0\\n' is not allowed" in r.json()["error"], r.text
    assert c.get("/1.0/vms/vm0%0A").status_code == 400


def test_query_names_and_url_lists(app: FastAPI, paths: Paths) -> None:
    c = test_api_roles.client_as(app, Role.VIEWER)
    r = c.get("/1.0/governor", params={"partition": ""})
    assert r.status_code == 400 and "name '' is not allowed" in r.json()["error"], r.text
    assert c.get("/1.0/share/analyze", params={"vm": ""}).status_code == 400
    Database(paths.db).add_partition(PartitionRecord("p0", [0], 256))
    assert c.get("/1.0/vms", params={"recursion": 0}).json() == []


def test_a_request_is_taken_as_typed(app: FastAPI, paths: Paths) -> None:
    """What the fuzzer sent and the API took: a false among the cores, a 0 for
    in_place (pydantic's lax mode read them as 0 and False)."""
    Database(paths.db).add_partition(PartitionRecord("p0", [0], 256))
    c = test_api_roles.client_as(app, Role.ADMIN)
    for method, path, body, field in (
            ("PATCH", "/1.0/partitions/p0", {"cpus": [False], "memory_mib": 1}, "cpus"),
            ("POST", "/1.0/partitions/p0/maintain", {"in_place": 0, "via": "p0"},
             "in_place"),
            ("POST", "/1.0/vms", {"name": "v", "partition": "p0", "vcpus": "1"}, "vcpus"),
            ("PUT", "/1.0/vms/v/state", {"action": "stop", "timeout": True}, "timeout")):
        r = c.request(method, path, json=body)
        assert r.status_code == 400 and r.json()["error"].startswith(f"field '{field}"), \
            (path, r.text)
    assert c.get("/1.0/operations").json() == []          # nothing was started


def test_what_a_request_gets_wrong_is_a_4xx_at_once(app: FastAPI, paths: Paths) -> None:
    """What the fuzzer's operations ended in with an internal error (500): an unknown
    or unbuilt image, a template from a stopped VM. Each is now refused at once, with
    the CLI's sentence and a client error, and no operation is made."""
    from fusuma.state import VmRecord

    db = Database(paths.db)
    db.add_partition(PartitionRecord("p0", [0], 256))
    db.add_vm(VmRecord("v0", "p0", vcpus=1, memory_mib=64))
    c = test_api_roles.client_as(app, Role.ADMIN)
    for method, path, body, code, says in (
            ("POST", "/1.0/segments", {"name": "s0", "from_image": ""}, 400,
             "there is no guest image kind ''"),
            ("POST", "/1.0/segments", {"name": "s0", "from_image": "minimal"}, 404,
             "the minimal guest image is not built"),
            ("POST", "/1.0/vms", {"name": "v1", "partition": "p0", "image": "nope"}, 404,
             "there is no image named 'nope'"),
            ("POST", "/1.0/vms", {"name": "v1", "partition": "p0"}, 404,
             "the minimal guest image is not built"),
            ("POST", "/1.0/templates", {"name": "t0", "from_vm": "v0"}, 409,
             "VM 'v0' is stopped; a template is made from a running VM")):
        r = c.request(method, path, json=body)
        assert r.status_code == code and r.json()["error"].startswith(says), (body, r.text)
    assert c.get("/1.0/operations").json() == []


def test_no_pattern_ends_with_a_dollar() -> None:
    """Python's ``$`` matches before a final newline, so ``re.compile(r"^...$")`` takes
    "vm0\\n", "pc-q35-7.2\\n" or a MAC with a newline after it (into QEMU's argv). Every
    such pattern of fusuma ends at the string's end (``\\Z``)."""
    from pathlib import Path

    from fusuma.network.addr import MAC_RE
    from fusuma.qemu.versions import Q35_RE

    src = Path(__file__).resolve().parents[2] / "src"
    found = [f"{p.relative_to(src)}:{n}" for p in src.rglob("*.py")
             for n, line in enumerate(p.read_text().splitlines(), 1)
             if re.search(r're\.compile\(r?"\^[^"]*\$"\)', line)]
    assert not found, found
    assert Q35_RE.match("pc-q35-7.2") and not Q35_RE.match("pc-q35-7.2\n")
    assert MAC_RE.match("52:54:00:12:34:56") and not MAC_RE.match("52:54:00:12:34:56\n")
