"""Raw QEMU beside `fusuma bench network`: the same zero-copy move (a shared RAM file,
x-ignore-shared, a UNIX socket, the destination started with -S and `cont` after
its MIGRATION "completed") of the same minimal guest, with a virtio-net NIC on a tap
(handed over as fusuma does: the destination's queue detached until "completed", then
the source's detached and the destination's attached) and without any NIC, in turn,
STOP to RESUME, and the same steps as fusuma's ``steps_ms``. No fusuma in the pause:
what QEMU itself costs.

    python tools/raw_nic_downtime.py RUNS OUT.json      (as root, both cores free)

Makes its own network namespace (a bridge and a multiqueue tap in it) and removes
it; QEMU runs as nobody, on cores 0 and 1 in turn like the benchmark's partitions.
The default (minimal) image must be built (`fusuma image build`). The QEMUs and the
move are `fusuma_bench.rawmove`'s (as `fusuma bench vmbeam`'s raw row). With
RAW_TRACE=1 each QEMU also writes its migration sections' trace (QEMU's log backend,
timestamped) into the run directory, which is removed at the end: set RAW_KEEP=DIR to
copy the traces there first."""

import asyncio
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
from fusuma.network import queues
from fusuma_bench import rawmove

NS = "fusuma-raw-nic"
TRACE = os.environ.get("RAW_TRACE") == "1"


def handover(src: rawmove.RawQemu, dst: rawmove.RawQemu) -> None:
    """The handover fusuma does: the source's queue off, the destination's on."""
    assert src.tapfd is not None and dst.tapfd is not None
    queues.set_queue(src.tapfd, attach=False)
    queues.set_queue(dst.tapfd, attach=True)


async def main(runs, variants, run, img):
    pairs = [rawmove.RawPair(rawmove.RawConfig(run, img, rawmove.shm_ram(v), variant=v,
                                               trace=TRACE))
             for v in variants]
    res = []
    try:
        for pair in pairs:
            await pair.boot()
        for r in range(runs):
            order = pairs if r % 2 == 0 else pairs[::-1]
            for pair in order:
                v = pair.cfg.variant
                moved, _ = await pair.move(handover if v == "tap" else None)
                got = {"variant": v, "downtime_ms": moved.downtime_ms,
                       "qemu_downtime_ms": moved.qemu_downtime_ms,
                       "steps_ms": moved.steps_ms, "run": r}
                res.append(got)
                print(json.dumps(got), flush=True)
    finally:
        for pair in pairs:
            await pair.close()
    summary = {}
    for v in variants:
        mine = [x for x in res if x["variant"] == v]
        summary[v] = {
            "downtime_ms_median": statistics.median(x["downtime_ms"] for x in mine),
            "qemu_downtime_ms_median": statistics.median(x["qemu_downtime_ms"] for x in mine),
            "steps_ms_median": {
                k: round(statistics.median(x["steps_ms"][k] for x in mine), 2)
                for k in mine[0]["steps_ms"]
            },
        }
    print(json.dumps(summary, indent=1))
    return res, summary


def outer(runs: int, out: str) -> None:
    """Make the namespace, a copy of the image nobody can read, run inside, clean up."""
    with rawmove.run_dir("fusuma-raw-nic-") as (run, _img):
        try:
            inside(run, runs, out)
        finally:
            keep = os.environ.get("RAW_KEEP")
            if keep:
                for trace in run.glob("*.trace"):
                    shutil.copy(trace, keep)


def inside(run: Path, runs: int, out: str) -> None:
    """The namespace with a bridge and a multiqueue tap; this script again in it."""
    subprocess.run(["ip", "netns", "add", NS], check=True)
    try:
        for cmd in (
            ["link", "add", "fzrawbr", "type", "bridge"],
            ["tuntap", "add", "dev", rawmove.TAP, "mode", "tap", "multi_queue", "vnet_hdr"],
            ["link", "set", rawmove.TAP, "master", "fzrawbr"],
            ["link", "set", rawmove.TAP, "up"],
            ["link", "set", "fzrawbr", "up"],
        ):
            subprocess.run(["ip", "-n", NS, *cmd], check=True)
        subprocess.run(
            ["nsenter", f"--net=/run/netns/{NS}", sys.executable, __file__, "--inside",
             str(runs), out],
            check=True,
            env={**os.environ, "RAW_RUN": str(run)},
        )
    finally:
        subprocess.run(["ip", "netns", "del", NS], check=True)


if __name__ == "__main__":
    if sys.argv[1] != "--inside":
        outer(int(sys.argv[1]), sys.argv[2])
        sys.exit(0)
    runs = int(sys.argv[2])
    run = Path(os.environ["RAW_RUN"])
    res, summary = asyncio.run(main(runs, ["none", "tap"], run, run / "img"))
    meta = {
        "date": time.strftime("%Y-%m-%dT%H:%M:%S+00:00", time.gmtime()),
        "qemu": subprocess.run(
            ["qemu-system-x86_64", "--version"], capture_output=True, text=True
        ).stdout.splitlines()[0],
        "load_average": Path("/proc/loadavg").read_text().split()[:3],
        "runs": runs,
        "command": "tools/raw_nic_downtime.py",
    }
    Path(sys.argv[3]).write_text(
        json.dumps({"meta": meta, "samples": res, "summary": summary}, indent=1)
    )
