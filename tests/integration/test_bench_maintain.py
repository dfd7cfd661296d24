"""`fusuma bench maintain`: a 7.2 -> 10.0 upgrade by --via, then cpr-transfer in place,
with the result file, the data checks and the report."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.conftest import Host
from tests.integration.test_cpr import need_qemu_10

pytestmark = [pytest.mark.integration, pytest.mark.timeout(400)]


def test_bench_maintain_one_vm_both_methods(host: Host, tmp_path: Path) -> None:
    need_qemu_10(host)
    out, rep = tmp_path / "maintain.json", tmp_path / "report"
    host.run("bench", "maintain", "--vms", "1", "--from", "7.2", "--to", "10.0",
             "--in-place", "--json", str(out), "--report", str(rep), timeout=380)
    data = json.loads(out.read_text())
    meta = data["meta"]
    assert meta["benchmark"] == "maintain" and meta["vms"] == [1] and meta["in_place"]
    assert meta["from_version"].startswith("7.2") and meta["to_version"].startswith("10.0")
    for key in ("git_revision", "date", "host", "accel", "qemu"):
        assert meta[key], key
    rows = {r["method"]: r for r in data["results"]}
    assert sorted(rows) == ["cpr-transfer", "zero-copy"]
    assert rows["zero-copy"]["moves"] == 2 and rows["cpr-transfer"]["moves"] == 1
    for r in rows.values():
        assert r["data_intact"] is True and r["error"] is None, r
        assert r["maintain_s"] > 0 and r["downtime_ms_max"] > 0
        assert 0 < r["bytes_sent_median"] < 2**20       # device state only
    cpr = [m for m in data["moves"] if m["method"] == "cpr-transfer"]
    assert [(m["from"], m["to"], m["qemu_mode"]) for m in cpr] == [
        ("bench-maintain-p", "bench-maintain-p", "cpr-transfer")]
    # The scratch partitions are gone.
    assert host.ps() == {"partitions": [], "vms": [], "networks": []}
    text = (rep / "report.md").read_text()
    assert "## Which method wins" in text and "## Targets" in text
    assert (rep / "maintain.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
