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
The default (minimal) image must be built (`fusuma image build`). With RAW_TRACE=1
each QEMU also writes its migration sections' trace (QEMU's log backend, timestamped)
into the run directory, which is removed at the end: set RAW_KEEP=DIR to copy the
traces there first."""

import asyncio
import contextlib
import fcntl
import json
import os
import shutil
import statistics
import struct
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
from qemu.qmp import QMPClient

from fusuma.network import queues

CACHE = Path("/var/cache/fusuma/images")
RUN = Path(os.environ.get("RAW_RUN") or "/nonexistent")
IMG = RUN / "img"
TAP = "fzraw0"
NS = "fusuma-raw-nic"
TRACE = os.environ.get("RAW_TRACE") == "1"
PROCS = []


def tap_fd(detach=False):
    fd = os.open("/dev/net/tun", os.O_RDWR)
    # IFF_TAP|IFF_NO_PI|IFF_VNET_HDR|IFF_MULTI_QUEUE
    fcntl.ioctl(
        fd, 0x400454CA, struct.pack("16sH22x", TAP.encode(), 0x0002 | 0x1000 | 0x4000 | 0x0100)
    )
    if detach:
        queues.set_queue(fd, attach=False)
    return fd


def append() -> str:
    return str(json.loads((IMG / "image.json").read_text())["append"])


def argv(name, variant, ram, qmp, core, incoming, tapfd):
    a = [
        "taskset",
        "-c",
        str(core),
        "setpriv",
        "--reuid",
        "65534",
        "--regid",
        "65534",
        "--clear-groups",
        "qemu-system-x86_64",
        "-name",
        f"guest={name},debug-threads=on",
        "-nodefaults",
        "-no-user-config",
        "-display",
        "none",
        "-accel",
        "tcg,tb-size=32",
        "-cpu",
        "max",
        "-machine",
        "q35,sata=off,smbus=off,vmport=off,i8042=off,memory-backend=ram0",
        "-smp",
        "1",
        "-m",
        "256M",
        "-object",
        f"memory-backend-file,id=ram0,size=256M,mem-path={ram},share=on,merge=off",
        "-kernel",
        str(IMG / "vmlinuz"),
        "-initrd",
        str(IMG / "initrd.img"),
        "-append",
        append() + " fusuma.net=none",
        "-chardev",
        f"socket,id=qmp0,path={qmp},server=on,wait=off",
        "-mon",
        "chardev=qmp0,mode=control",
        "-serial",
        "none",
        "-device",
        "virtio-serial-pci,id=vser0",
    ]
    if variant == "tap":
        a += [
            "-netdev",
            f"tap,id=nic0,fd={tapfd},vhost=off",
            "-device",
            "virtio-net-pci,netdev=nic0,mac=52:54:00:00:00:01,romfile=",
        ]
    elif variant == "user":
        a += [
            "-netdev",
            "user,id=nic0",
            "-device",
            "virtio-net-pci,netdev=nic0,mac=52:54:00:00:00:02,romfile=",
        ]
    if incoming:
        a += ["-S", "-incoming", "defer"]
    if TRACE:
        a += [
            "-msg",
            "timestamp=on",
            "-D",
            str(RUN / f"{name}.trace"),
            "-trace",
            "savevm_section_*",
            "-trace",
            "qemu_loadvm_state_section*",
            "-trace",
            "vmstate_load_state_end",
            "-trace",
            "migration_completion*",
            "-trace",
            "loadvm_state*",
            "-trace",
            "vmstate_save",
            "-trace",
            "vmstate_load",
        ]
    return a


class Vm:
    def __init__(self, variant):
        self.variant = variant
        self.ram = RUN / f"{variant}.ram"
        self.n = 0
        self.core = 0
        self.proc = None
        self.qmp = None
        self.fd = None

    async def start(self, incoming=False):
        self.n += 1
        sock = RUN / f"{self.variant}-{self.n}.qmp"
        fd = tap_fd(detach=incoming) if self.variant == "tap" else None
        p = subprocess.Popen(
            argv(
                f"{self.variant}{self.n}",
                self.variant,
                self.ram,
                sock,
                self.core if not incoming else 1 - self.core,
                incoming,
                fd,
            ),
            pass_fds=(fd,) if fd is not None else (),
        )
        PROCS.append(p)
        for _ in range(500):
            if sock.exists():
                break
            await asyncio.sleep(0.01)
        q = QMPClient(f"{self.variant}{self.n}")
        await q.connect(str(sock))
        return p, q, fd


def ts(ev):
    return ev["timestamp"]["seconds"] + ev["timestamp"]["microseconds"] / 1e6


async def move(vm):
    dp, dq, dfd = await vm.start(incoming=True)
    await dq.execute(
        "migrate-set-capabilities",
        {
            "capabilities": [
                {"capability": "x-ignore-shared", "state": True},
                {"capability": "events", "state": True},
            ]
        },
    )
    uri = f"unix:{RUN}/{vm.variant}-{vm.n}.mig"
    await dq.execute("migrate-incoming", {"uri": uri})
    sq = vm.qmp
    await sq.execute(
        "migrate-set-capabilities",
        {
            "capabilities": [
                {"capability": "x-ignore-shared", "state": True},
                {"capability": "events", "state": True},
            ]
        },
    )
    out = {}

    async def dest_side():
        with dq.listener() as lst:  # all events
            async for ev in lst:
                if ev["event"] == "MIGRATION" and ev["data"]["status"] == "completed":
                    out["loaded"] = ts(ev)
                    out["seen"] = time.time()
                    if vm.variant == "tap":
                        # the handover fusuma does: source queue off, dest queue on
                        queues.set_queue(vm.fd, attach=False)
                        queues.set_queue(dfd, attach=True)
                    out["taps"] = time.time()
                    await dq.execute("cont")
                if ev["event"] == "RESUME":
                    out["resumed"] = ts(ev)
                    return

    async def src_side():
        with sq.listener() as lst:
            async for ev in lst:
                if ev["event"] == "STOP":
                    out["stop"] = ts(ev)
                if ev["event"] == "MIGRATION" and ev["data"]["status"] == "completed":
                    out["completed"] = ts(ev)
                    return

    d = asyncio.ensure_future(dest_side())
    s = asyncio.ensure_future(src_side())
    await asyncio.sleep(0)
    await sq.execute("migrate", {"uri": uri})
    await asyncio.wait_for(asyncio.gather(d, s), 30)
    info = await sq.execute("query-migrate")
    await sq.execute("quit")
    with contextlib.suppress(EOFError):
        await sq.disconnect()
    vm.proc.wait()
    if vm.fd is not None:
        os.close(vm.fd)
    vm.proc, vm.qmp, vm.fd = dp, dq, dfd
    vm.core = 1 - vm.core
    down = (out["resumed"] - out["stop"]) * 1000
    steps = {
        "source_saved": out["completed"] - out["stop"],
        "dest_loaded": out["loaded"] - out["completed"],
        "event": out["seen"] - out["loaded"],
        "taps": out["taps"] - out["seen"],
        "cont": out["resumed"] - out["taps"],
    }
    return {
        "variant": vm.variant,
        "downtime_ms": round(down, 2),
        "qemu_downtime_ms": info.get("downtime"),
        "steps_ms": {k: round(v * 1000, 2) for k, v in steps.items()},
    }


async def main(runs, variants):
    RUN.mkdir(parents=True, exist_ok=True)
    os.chown(RUN, 65534, 65534)
    vms = [Vm(v) for v in variants]
    for vm in vms:
        vm.ram.touch()
        os.truncate(vm.ram, 256 << 20)
        os.chown(vm.ram, 65534, 65534)
        vm.proc, vm.qmp, vm.fd = await vm.start()
    await asyncio.sleep(float(os.environ.get("RAW_BOOT", "12")))
    res = []
    for r in range(runs):
        order = vms if r % 2 == 0 else vms[::-1]
        for vm in order:
            got = await move(vm)
            got["run"] = r
            res.append(got)
            print(json.dumps(got), flush=True)
    for vm in vms:
        await vm.qmp.execute("quit")
        vm.proc.wait()
        vm.ram.unlink()
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
    image = CACHE / json.loads((CACHE / "minimal.json").read_text())["dir"]
    run = Path(tempfile.mkdtemp(prefix="fusuma-raw-nic-"))
    try:
        os.chmod(run, 0o755)
        (run / "img").mkdir()
        for f in ("vmlinuz", "initrd.img", "image.json"):
            shutil.copy(image / f, run / "img" / f)
        os.chown(run, 65534, 65534)
        subprocess.run(["ip", "netns", "add", NS], check=True)
        try:
            for cmd in (
                ["link", "add", "fzrawbr", "type", "bridge"],
                ["tuntap", "add", "dev", TAP, "mode", "tap", "multi_queue", "vnet_hdr"],
                ["link", "set", TAP, "master", "fzrawbr"],
                ["link", "set", TAP, "up"],
                ["link", "set", "fzrawbr", "up"],
            ):
                subprocess.run(["ip", "-n", NS, *cmd], check=True)
            subprocess.run(
                [
                    "nsenter",
                    f"--net=/run/netns/{NS}",
                    sys.executable,
                    __file__,
                    "--inside",
                    str(runs),
                    out,
                ],
                check=True,
                env={**os.environ, "RAW_RUN": str(run)},
            )
        finally:
            subprocess.run(["ip", "netns", "del", NS], check=True)
    finally:
        keep = os.environ.get("RAW_KEEP")
        if keep:
            for trace in run.glob("*.trace"):
                shutil.copy(trace, keep)
        shutil.rmtree(run, ignore_errors=True)


if __name__ == "__main__":
    if sys.argv[1] != "--inside":
        outer(int(sys.argv[1]), sys.argv[2])
        sys.exit(0)
    runs = int(sys.argv[2])
    variants = ["none", "tap"]
    try:
        res, summary = asyncio.run(main(runs, variants))
    finally:
        for p in PROCS:
            if p.poll() is None:
                p.kill()
                p.wait()
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
