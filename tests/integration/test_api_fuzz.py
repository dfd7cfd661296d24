"""Every route of the OpenAPI document, fuzzed: schemathesis, seeded and bounded, against
a real `fusuma serve --listen` with an admin token, on a host whose partitions, disk and
VM are defined and no guest runs. No answer may be a server error (5xx), every answer
must be one the document declares (status, content type, headers, body schema), a
request the document says is invalid must be refused (4xx), and an undeclared method
must get 405 with the resource's ``Allow``. After the run, no operation the fuzzer
started may have ended in an internal error, and nothing outside the test's namespace
may have changed.

Admin is root-equivalent, so the fuzzer may do anything the API can: delete the
partitions, register and delete disks, resize, maintain, make networks. All of it stays
in the test's own namespace (``tests/conftest.py``: its FUSUMA_HOME, runtime and shm
dirs and cgroup prefix; disks only inside its storage directory, FUSUMA_HOME/disks,
since the API cannot declare another; a file is deleted only if fusuma made it), and
the daemon, its CLI and the fuzzer run in a network namespace of the test's own, so
the bridges, nftables tables and dnsmasq a network is made of are made there and go
with it. The guest image
cache is an empty directory of the test's: no VM can start and no image is read, while
the definitions made before the run (in the shared cache) stay for the fuzzer to change
or delete.

The objects are named "0" and "1": the first names the generator makes for the
document's name pattern, so the fuzzer reaches existing objects as well as missing
ones.

Left out, each for its reason (EXCLUDED): ``POST /1.0/images`` builds a guest image
(minutes; the Debian kind downloads) and ``GET /1.0/events`` is an endless stream; both
have tests of their own in test_api.py.
"""

from __future__ import annotations

import json
import os
import sqlite3
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from tests.apikit import Api
from tests.conftest import Host
from tests.integration import test_api
from tests.netns import netns as netns_of
from tests.netns import wrap

pytestmark = [pytest.mark.integration, pytest.mark.timeout(420)]

daemons = test_api.daemons

# The run of `make test` is the same every time; FUSUMA_FUZZ_SEED explores another.
SEED = int(os.environ.get("FUSUMA_FUZZ_SEED", "20240924"))
MAX_EXAMPLES = 30               # per operation and phase
BUDGET_S = 240                  # the whole run ends by then, whatever it found
CHECKS = ("not_a_server_error", "status_code_conformance", "content_type_conformance",
          "response_headers_conformance", "response_schema_conformance",
          "negative_data_rejection", "unsupported_method")
# Not checked: positive_data_acceptance, which wants every schema-valid request
# accepted; the API refuses with 400 what is well formed but wrong for this host (a core
# it does not have, a disk path outside its storage directories, a machine type no QEMU
# here has) and no schema can say that. The stateful checks (use_after_free,
# ensure_resource_availability) need links the document does not declare.
EXCLUDED = {
    ("POST", "/1.0/images"): "builds a guest image: minutes of work, and the Debian kind "
                             "downloads; tested in test_api.py",
    ("GET", "/1.0/events"): "an endless server-sent stream (no request ends); tested in "
                            "test_api.py and test_api_load.py",
}
# Where a fusuma outside the test's namespace would keep its files.
OUTSIDE = (Path("/var/lib/fusuma"), Path("/run/fusuma"), Path("/dev/shm/fusuma"))


def schemathesis() -> list[str]:
    st = Path(sys.executable).parent / "schemathesis"
    return [str(st)] if st.exists() else [sys.executable, "-m", "schemathesis.cli"]


def snapshot_outside() -> dict[str, int | None]:
    """Every entry below OUTSIDE with, for a file, its mtime. Not a directory's mtime,
    nor SQLite's -wal/-shm/-journal files: any process that reads a state file (another
    fusuma on the machine, with the default paths) makes and removes those."""
    out: dict[str, int | None] = {}
    for root in OUTSIDE:
        for p in [root, *root.rglob("*")] if root.exists() else []:
            if p.name.endswith(("-wal", "-shm", "-journal")):
                continue
            out[str(p)] = None if p.is_dir() else p.lstat().st_mtime_ns
    return out


def failures(report: Path) -> list[str]:
    """One line per failed operation of schemathesis' JUnit report."""
    import xml.etree.ElementTree as ET

    if not report.exists():
        return ["no JUnit report was written"]
    out = []
    for case in ET.parse(report).getroot().iter("testcase"):
        for bad in [*case.iter("failure"), *case.iter("error")]:
            text = (bad.get("message") or bad.text or "").strip().splitlines()
            out.append(f"{case.get('name')}: {' | '.join(text[:12])}")
    return out


@pytest.fixture
def netns() -> Iterator[str]:
    """A network namespace with only its loopback up; set up before the host fixture
    and so removed after its teardown (`fusuma down` inside it)."""
    with netns_of("fzfz") as ns:
        yield ns


def test_every_route_fuzzed(netns: str, host: Host, daemons: Callable[..., Api],
                            tmp_path: Path) -> None:
    host.wrap = wrap(netns)
    # Defined with the shared image cache: two partitions, a disk, a stopped VM.
    host.run("partition", "create", "0", "--cpus", host.core(0), "--memory", "512")
    host.run("partition", "create", "1", "--cpus", host.core(1), "--memory", "512")
    host.run("disk", "add", "0", "-p", "0", "--size-mib", "4")
    host.run("vm", "create", "0", "-p", "0", "--memory", "64")
    token = host.run("token", "create", "fuzz", "--role", "admin", "--json").json()["token"]
    # From here on, an empty cache of the test's own: nothing can boot or be read.
    host.env["FUSUMA_CACHE"] = str(tmp_path / "empty-cache")
    outside = snapshot_outside()
    api = daemons(listen=True)
    assert api.url is not None and api.cert is not None

    report = tmp_path / "junit.xml"
    cmd = [*host.wrap, *schemathesis(), "run", f"{api.url}/openapi.json",
           "--checks", ",".join(CHECKS), "--seed", str(SEED),
           "--generation-database", "none",     # the same run every time: no replays
           "--max-examples", str(MAX_EXAMPLES), "--phases", "examples,coverage,fuzzing",
           "--workers", "1", "--request-timeout", "30", "--no-color",
           "--header", f"Authorization: Bearer {token}", "--tls-verify", api.cert,
           "--report", "junit", "--report-junit-path", str(report)]
    for method, path in EXCLUDED:
        cmd += ["--exclude-name", f"{method} {path}"]
    t0 = time.monotonic()
    run = subprocess.run(cmd, capture_output=True, text=True, timeout=BUDGET_S,
                         env={**os.environ, "NO_COLOR": "1"}, cwd=tmp_path)
    took = time.monotonic() - t0
    print(f"schemathesis ran {took:.0f} s:\n{run.stdout[-6000:]}{run.stderr[-2000:]}")
    assert run.returncode == 0, "\n".join(failures(report)) + \
        f"\n{run.stdout[-4000:]}{run.stderr[-2000:]}"

    # What the fuzzer's operations did in the background ended in no internal error.
    with api.unix() as c:           # (its TCP port is the namespace's loopback's)
        ops = c.get("/1.0/operations").json()
    broken = [o for o in ops if o["error_code"] is not None and o["error_code"] >= 500]
    assert not broken, json.dumps(broken, indent=1)
    assert "internal error" not in api.log_text(), api.log_text()[-4000:]
    # No guest ran: the state file's event log has no VM started.
    with sqlite3.connect(host.home / "state.db") as db:
        started = db.execute("SELECT count(*) FROM events WHERE action = 'vm-started'"
                             ).fetchone()[0]
        made = db.execute("SELECT count(*) FROM events").fetchone()[0]
    assert started == 0 and made > 100, (started, made)
    # Nothing outside the namespace: no fusuma file elsewhere changed, and every disk
    # file made is in the test's own storage directory.
    assert snapshot_outside() == outside
    disks = host.run("disk", "list", "--json").json()
    assert all(d["path"].startswith(f"{host.home}/disks/") for d in disks), disks
