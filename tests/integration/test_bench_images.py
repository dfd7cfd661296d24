"""`fusuma bench images --quick`: a small generated image imported, thin disks on it,
and readers sharing its page cache, measured from the kernel; no guest boots."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from tests.conftest import Host

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120)]

MIB = 2**20


def test_bench_images_quick(host: Host, tmp_path: Path) -> None:
    out = tmp_path / "images.json"
    res = host.run("bench", "images", "--quick", "--runs", "3", "--readers", "3",
                   "--json", str(out), timeout=100)
    assert f"written to {out}" in res.out
    data = json.loads(out.read_text())
    meta = data["meta"]
    assert meta["benchmark"] == "images" and meta["quick"] is True
    assert (meta["runs"], meta["readers"], meta["boot_vms"]) == (3, 3, 0)
    for key in ("git_revision", "date", "host", "accel", "qemu"):
        assert meta[key], key
    img = meta["image"]
    assert img["generated"] and img["format"] == "qcow2"
    assert img["virtual_size_bytes"] == 64 * MIB
    # 48 MiB of random data: the qcow2 holds it all (it cannot compress).
    assert 48 * MIB < img["file_bytes"] < 50 * MIB

    imp = data["import"]
    assert len(imp["import_ms"]) == len(imp["sha256_ms"]) == len(imp["probe_ms"]) == 3
    for key in ("import_ms", "sha256_ms", "probe_ms"):
        values = imp[key]
        assert all(math.isfinite(v) and v > 0 for v in values), (key, values)
        assert imp[f"{key}_median"] == sorted(values)[1]
    # The import copies and hashes the file, then asks qemu-img: more than either part.
    assert imp["import_ms_median"] > imp["sha256_ms_median"]
    gib = img["file_bytes"] / 2**30
    assert imp["import_s_per_gib"] == pytest.approx(imp["import_ms_median"] / 1000 / gib,
                                                    abs=0.001)
    ov = data["overlay"]
    assert len(ov["overlay_create_ms"]) == 5
    assert 0 < ov["overlay_create_ms_median"] < 2000

    sh = data["sharing"]
    assert sh["readers"] == 3
    # Dropped before the first reader; each reader's reads land in the one base's
    # pages: it does not grow with more readers.
    assert sh["base_resident_bytes_before"] <= MIB
    first, *rest = sh["shared_resident_bytes"]
    assert first >= 47 * MIB and first <= img["file_bytes"] + MIB
    assert all(abs(r - first) <= MIB for r in rest)
    # A full copy per reader: the copies' pages add up, one copy's worth per reader.
    copies = sh["copies_resident_bytes"]
    assert len(copies) == 3
    for i, c in enumerate(copies, 1):
        assert c == pytest.approx(i * first, rel=0.05), (i, c, first)
    assert sh["base_resident_bytes"] == sh["shared_resident_bytes"][-1]
    assert sh["saved_bytes"] == 2 * sh["base_resident_bytes"]
    assert sh["copies_minus_shared_bytes"] == copies[-1] - sh["base_resident_bytes"]
    assert sh["copies_minus_shared_bytes"] == pytest.approx(sh["saved_bytes"], rel=0.05)
    assert data["boot"] is None and data["summary"]["boot_to_agent_ms_median"] is None

    # Nothing left: the image deleted, no scratch files, no partition.
    assert [i["name"] for i in host.run("image", "list", "--json").json()
            if i["kind"] == "imported"] == []
    assert not list(host.home.glob(".bench-images-*"))
    assert host.ps()["partitions"] == []
