"""A template's RAM file while its clones run, with and without trimming, side by side
in one run: the template's allocated size when made and after N clones of it each wrote
and freed W MiB in their guests, each clone's own memory, and that the template's
content never changed.

    flock /tmp/fusuma-itest.lock python tools/template_holes.py N W OUT.json  (as root)

Each leg makes a namespace of its own (the integration tests' ``Host``: a temporary
home, shm dir and cgroup prefix, removed at the end), a partition on QEMU 10.0, one
minimal (busybox) guest of 256 MiB, a template of it and N clones. Leg ``off`` runs
with trimming turned off (FUSUMA_TEMPLATE_TRIM_S=0: what fusuma did before), leg ``on``
with the default interval; its figure after the clones ran is read once a trim had its
turn (polled, at most three intervals).
"""

import json
import os
import re
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "src"), str(ROOT)]
from tests.conftest import Host, _tear_down  # noqa: E402
from tests.integration.test_templates import sha256  # noqa: E402

from fusuma.memshare import holes  # noqa: E402

MIB = 2**20


def allocated_mib(path: str) -> float:
    return round(os.stat(path).st_blocks * 512 / MIB, 1)


def own_mib(pid: int) -> dict[str, float]:
    d = {}
    for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines()[1:]:
        k, v = line.split(":", 1)
        d[k] = int(v.split()[0])
    return {"private_mib": round((d["Private_Clean"] + d["Private_Dirty"]) / 1024, 1),
            "shared_mib": round((d["Shared_Clean"] + d["Shared_Dirty"]) / 1024, 1)}


def leg(trim: bool, n: int, write_mib: int) -> dict[str, Any]:
    tmp = Path(os.popen("mktemp -d").read().strip())
    h = Host(tmp)
    h.env[holes.TRIM_ENV] = str(holes.TRIM_EVERY_S) if trim else "0"

    def sh(vm: str, script: str) -> str:
        r = h.run("vm", "exec", vm, "--json", "--", "/bin/sh", "-c", script).json()
        assert r["exit_code"] == 0, r
        return str(r["stdout"])

    try:
        h.run("partition", "create", "p10", "--cpus", "0-1", "--memory",
              str(400 * (n + 1)), "--qemu", "10.0")
        h.run("vm", "create", "src", "-p", "p10", "--start")
        vm_file = allocated_mib(str(next(h.shm.glob("*.ram"))))
        t = h.run("template", "create", "t", "--from", "src", "--json").json()
        ram = t["ram_path"]
        made = allocated_mib(ram)
        digest = sha256(ram)
        clones = [f"c{i}" for i in range(n)]
        for c in clones:
            h.run("vm", "create", c, "-p", "p10", "--template", "t", "--start")
        started = allocated_mib(ram)
        sums = {}
        for c in clones:
            sums[c] = sh(c, f"dd if=/dev/urandom of=/tmp/blob bs=1M count={write_mib} "
                            "2>/dev/null; md5sum /tmp/blob").split()[0]
        for c in clones:
            # Each clone's data is its own: read back after every clone wrote.
            assert sh(c, "md5sum /tmp/blob; rm /tmp/blob; sync; "
                         "echo 3 > /proc/sys/vm/drop_caches").split()[0] == sums[c]
        wrote = allocated_mib(ram)
        after = wrote
        if trim:
            deadline = time.monotonic() + 3 * holes.TRIM_EVERY_S
            while time.monotonic() < deadline and after > made:
                time.sleep(0.5)
                after = allocated_mib(ram)
        mem = {c: own_mib(h.vm(c)["pid"]) for c in clones}
        same = sha256(ram) == digest
        for c in clones:
            sh(c, "true")           # every clone still runs and answers
        log = (h.home / "partitions" / "p10" / "supervisor.log").read_text()
        at_create = [int(x) for x in re.findall(r"(\d+) KiB of zero pages punched", log)]
        again = [int(x) for x in re.findall(r"(\d+) KiB its clones filled punched", log)]
        return {"trim": trim, "clones": n, "write_mib_each": write_mib,
                "vm_ram_file_allocated_mib": vm_file, "template_ram_mib": t["ram_size_mib"],
                "allocated_mib": {"made": made, "clones_started": started,
                                  "clones_wrote": wrote, "after_trim": after},
                "punched_at_create_mib": round(sum(at_create) / 1024, 1),
                "punched_while_clones_ran_mib": round(sum(again) / 1024, 1),
                "trims_that_freed_pages": len(again),
                "clone_memory": mem, "template_content_unchanged": same}
    finally:
        _tear_down(h)


def main() -> None:
    if len(sys.argv) != 4:
        sys.exit(__doc__)
    n, write_mib, out = int(sys.argv[1]), int(sys.argv[2]), Path(sys.argv[3])
    legs = [leg(False, n, write_mib), leg(True, n, write_mib)]
    out.write_text(json.dumps({"uname": os.uname().release, "legs": legs}, indent=1) + "\n")
    for r in legs:
        print("trim" if r["trim"] else "no trim", r["allocated_mib"],
              "content unchanged" if r["template_content_unchanged"] else "CONTENT CHANGED")


if __name__ == "__main__":
    main()
