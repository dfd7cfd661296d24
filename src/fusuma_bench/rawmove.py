"""Raw QEMU doing fusuma's zero-copy move, with no fusuma: the mechanism's own cost.

Two bare QEMUs, no partition, supervisor, state file or job: the source maps the
guest's RAM from a named file on /dev/shm (``memory-backend-file``, ``share=on``), the
destination starts with ``-S -incoming defer`` on the same file, both get the
``x-ignore-shared`` and ``events`` capabilities, and the source migrates over a UNIX
socket. When the destination says MIGRATION "completed" it is told ``cont``: the same
steps fusuma's destination takes, without recording a decision. Each QEMU runs as
nobody, pinned to one core (``taskset``), the destination on the other core, so a
move goes back and forth between two cores the way the benchmark's partitions do.

A move is measured as fusuma's are (``fusuma.migration.MigrationResult``): the
downtime from the source's STOP event to the destination's RESUME event (QEMU's own
timestamps), the total from just before ``migrate`` to that RESUME, QEMU's own
``query-migrate`` downtime and total beside them, and the same ``steps_ms``
(``fusuma.migration.DOWNTIME_STEPS``, without the decision).

Used by ``fusuma bench vmbeam`` (the raw row beside fusuma's) and by
``tools/raw_nic_downtime.py`` (a tap NIC handed over as fusuma does).
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import json
import os
import shutil
import struct
import subprocess
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from qemu.qmp import QMPClient, QMPError

from fusuma.migration import MigrationResult, cpu_seconds
from fusuma.network import queues
from fusuma.qemu.cmdline import MACHINE_OPTS, QGA_PORT_NAME, SANDBOX
from fusuma.qemu.qga import GuestAgent
from fusuma.qemu.qmp import event_time

NOBODY = 65534
IMAGES = Path("/var/cache/fusuma/images")
SHM = Path("/dev/shm")
# The tap variant's tap (made by the caller, in a namespace of its own).
TAP = "fzraw0"
VARIANTS = ("none", "tap", "user")
# migrate-set-capabilities of a zero-copy move (as fusuma.supervisor.moves.source).
CAPS = {"capabilities": [{"capability": "x-ignore-shared", "state": True},
                         {"capability": "events", "state": True}]}
TRACE_EVENTS = ("savevm_section_*", "qemu_loadvm_state_section*", "vmstate_load_state_end",
                "migration_completion*", "loadvm_state*", "vmstate_save", "vmstate_load")
MOVE_TIMEOUT_S = 30.0


def tap_fd(tap: str = TAP, detach: bool = False) -> int:
    """A new queue of multiqueue tap ``tap`` (detached at once if ``detach``)."""
    fd = os.open("/dev/net/tun", os.O_RDWR)
    # IFF_TAP|IFF_NO_PI|IFF_VNET_HDR|IFF_MULTI_QUEUE
    fcntl.ioctl(fd, 0x400454CA,
                struct.pack("16sH22x", tap.encode(), 0x0002 | 0x1000 | 0x4000 | 0x0100))
    if detach:
        queues.set_queue(fd, attach=False)
    return fd


def image_copy(run: Path) -> Path:
    """The default (minimal) image's kernel and initrd, copied where nobody reads them."""
    image = IMAGES / json.loads((IMAGES / "minimal.json").read_text())["dir"]
    img = run / "img"
    img.mkdir()
    os.chmod(img, 0o755)         # whatever the umask (fusuma's CLI runs under 077)
    for f in ("vmlinuz", "initrd.img", "image.json"):
        shutil.copy(image / f, img / f)
        os.chmod(img / f, 0o644)
    return img


@dataclass
class RawConfig:
    """What both QEMUs of a raw pair are started with."""

    run: Path                   # nobody's directory: sockets, traces
    img: Path                   # kernel, initrd, image.json
    ram: Path                   # the guest's RAM file (on /dev/shm)
    memory_mib: int = 256
    cores: tuple[int, int] = (0, 1)
    variant: str = "none"       # no NIC, a tap NIC (tap_fd), a user-mode NIC
    trace: bool = False         # each QEMU writes its migration sections' trace
    # The serial console appended to run/console.log (both QEMUs), else on a socket
    # nobody reads (as a fusuma VM's, whose supervisor reads it).
    console_file: bool = False


def argv(cfg: RawConfig, name: str, qmp: Path, qga: Path, core: int, incoming: bool,
         tapfd: int | None) -> list[str]:
    """One QEMU of the pair: fusuma's machine options, sandbox, guest-agent port,
    serial console and vmgenid (as fusuma's VMs have)."""
    append = str(json.loads((cfg.img / "image.json").read_text())["append"])
    console = (f"file,id=con0,path={cfg.run / 'console.log'},append=on" if cfg.console_file
               else f"socket,id=con0,path={cfg.run / (name + '.con')},server=on,wait=off")
    a = ["taskset", "-c", str(core),
         "setpriv", "--reuid", str(NOBODY), "--regid", str(NOBODY), "--clear-groups",
         "qemu-system-x86_64", "-name", f"guest={name},debug-threads=on",
         "-nodefaults", "-no-user-config", "-display", "none", "-sandbox", SANDBOX,
         "-accel", "tcg,tb-size=32", "-cpu", "max",
         "-machine", f"q35,{MACHINE_OPTS},memory-backend=ram0",
         "-smp", "1", "-m", f"{cfg.memory_mib}M",
         "-object", f"memory-backend-file,id=ram0,size={cfg.memory_mib}M,"
                    f"mem-path={cfg.ram},share=on,merge=off",
         "-kernel", str(cfg.img / "vmlinuz"), "-initrd", str(cfg.img / "initrd.img"),
         "-append", f"{append} fusuma.net=none fusuma.name={name}",
         "-chardev", f"socket,id=qmp0,path={qmp},server=on,wait=off",
         "-mon", "chardev=qmp0,mode=control",
         "-chardev", console,
         "-serial", "chardev:con0",
         "-chardev", f"socket,id=qga0,path={qga},server=on,wait=off",
         "-device", "virtio-serial-pci,id=vser0",
         "-device", f"virtserialport,bus=vser0.0,chardev=qga0,name={QGA_PORT_NAME}",
         "-device", "vmgenid,id=vmgenid0"]
    if cfg.variant == "tap":
        a += ["-netdev", f"tap,id=nic0,fd={tapfd},vhost=off",
              "-device", "virtio-net-pci,netdev=nic0,mac=52:54:00:00:00:01,romfile="]
    elif cfg.variant == "user":
        a += ["-netdev", "user,id=nic0",
              "-device", "virtio-net-pci,netdev=nic0,mac=52:54:00:00:00:02,romfile="]
    if incoming:
        a += ["-S", "-incoming", "defer"]
    if cfg.trace:
        a += ["-msg", "timestamp=on", "-D", str(cfg.run / f"{name}.trace")]
        for ev in TRACE_EVENTS:
            a += ["-trace", ev]
    return a


@dataclass
class RawQemu:
    """One running QEMU of the pair."""

    name: str
    proc: subprocess.Popen[bytes]
    qmp: QMPClient
    qga: Path
    core: int
    tapfd: int | None = None


@dataclass
class RawPair:
    """A guest moved back and forth between two bare QEMUs (``RawConfig``)."""

    cfg: RawConfig
    current: RawQemu | None = None
    procs: list[subprocess.Popen[bytes]] = field(default_factory=list)
    n: int = 0

    async def _start(self, core: int, incoming: bool) -> RawQemu:
        self.n += 1
        name = f"raw{self.cfg.variant}{self.n}"
        sock, qga = self.cfg.run / f"{name}.qmp", self.cfg.run / f"{name}.qga"
        fd = tap_fd(detach=incoming) if self.cfg.variant == "tap" else None
        proc = subprocess.Popen(argv(self.cfg, name, sock, qga, core, incoming, fd),
                                pass_fds=(fd,) if fd is not None else (),
                                stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        self.procs.append(proc)
        q = QMPClient(name)
        deadline = time.monotonic() + 10.0
        while True:
            try:
                await q.connect(str(sock))
                break
            except (OSError, QMPError) as exc:
                if proc.poll() is not None or time.monotonic() > deadline:
                    err = proc.stderr.read().decode(errors="replace") if proc.stderr else ""
                    raise RuntimeError(f"raw QEMU {name} did not start: "
                                       f"{err.strip()}") from exc
                q = QMPClient(name)
                await asyncio.sleep(0.01)
        return RawQemu(name, proc, q, qga, core, fd)

    async def boot(self, agent_timeout: float = 120.0) -> None:
        """Start the source on the first core and wait for the guest's agent."""
        self.cfg.ram.touch()
        os.truncate(self.cfg.ram, self.cfg.memory_mib << 20)
        os.chown(self.cfg.ram, NOBODY, NOBODY)
        os.chmod(self.cfg.ram, 0o600)
        self.current = await self._start(self.cfg.cores[0], incoming=False)
        async with self.agent() as ga:
            await ga.connect(agent_timeout)

    def agent(self) -> GuestAgent:
        assert self.current is not None
        return GuestAgent(self.current.name, self.current.qga)

    async def move(self, handover: Callable[[RawQemu, RawQemu], None] | None = None
                   ) -> tuple[MigrationResult, dict[str, float]]:
        """Move the guest to a new QEMU on the other core; the result as fusuma's, and
        the raw marks (host realtime seconds) of each step."""
        src = self.current
        assert src is not None
        core = self.cfg.cores[1] if src.core == self.cfg.cores[0] else self.cfg.cores[0]
        p0 = time.monotonic()
        dst = await self._start(core, incoming=True)
        await dst.qmp.execute("migrate-set-capabilities", CAPS)
        uri = f"unix:{self.cfg.run / dst.name}.mig"
        await dst.qmp.execute("migrate-incoming", {"uri": uri})
        prepare_ms = (time.monotonic() - p0) * 1000
        await src.qmp.execute("migrate-set-capabilities", CAPS)
        marks: dict[str, float] = {}

        async def dest_side() -> None:
            with dst.qmp.listener(("MIGRATION", "RESUME")) as lst:
                async for msg in lst:
                    ev: Any = msg
                    if ev["event"] == "MIGRATION" and ev["data"]["status"] == "completed":
                        marks["loaded"] = event_time(ev)
                        marks["seen"] = time.time()
                        if handover is not None:
                            handover(src, dst)
                        marks["taps"] = time.time()
                        await dst.qmp.execute("cont")
                    elif ev["event"] == "RESUME":
                        marks["resumed"] = event_time(ev)
                        return

        async def src_side() -> None:
            with src.qmp.listener(("STOP", "MIGRATION")) as lst:
                async for msg in lst:
                    ev: Any = msg
                    if ev["event"] == "STOP":
                        marks["stop"] = event_time(ev)
                    elif ev["data"]["status"] == "completed":
                        marks["completed"] = event_time(ev)
                        return
                    elif ev["data"]["status"] in ("failed", "cancelled"):
                        raise RuntimeError(f"raw migration {ev['data']['status']}")

        d, s = asyncio.ensure_future(dest_side()), asyncio.ensure_future(src_side())
        await asyncio.sleep(0)
        cpu0 = cpu_seconds(src.proc.pid) + cpu_seconds(dst.proc.pid)
        marks["t0"] = time.time()
        await src.qmp.execute("migrate", {"uri": uri})
        await asyncio.wait_for(asyncio.gather(d, s), MOVE_TIMEOUT_S)
        cpu1 = cpu_seconds(src.proc.pid) + cpu_seconds(dst.proc.pid)
        info: Any = await src.qmp.execute("query-migrate")
        await self._end(src)
        self.current = dst
        steps = {"source_saved": marks["completed"] - marks["stop"],
                 "dest_loaded": marks["loaded"] - marks["completed"],
                 "event": marks["seen"] - marks["loaded"],
                 "taps": marks["taps"] - marks["seen"],
                 "cont": marks["resumed"] - marks["taps"]}
        res = MigrationResult(
            vm=f"raw-{self.cfg.variant}", source=f"core{src.core}", to=f"core{dst.core}",
            mode="raw", total_ms=round((marks["resumed"] - marks["t0"]) * 1000, 2),
            downtime_ms=round((marks["resumed"] - marks["stop"]) * 1000, 2),
            bytes_sent=int((info.get("ram") or {}).get("transferred", 0)),
            prepare_ms=round(prepare_ms, 2), cpu_s=round(cpu1 - cpu0, 3),
            qemu_total_ms=info.get("total-time"), qemu_downtime_ms=info.get("downtime"),
            source_pid=src.proc.pid, dest_pid=dst.proc.pid,
            steps_ms={k: round(v * 1000, 2) for k, v in steps.items()})
        return res, marks

    async def _end(self, q: RawQemu) -> None:
        with contextlib.suppress(Exception):
            await q.qmp.execute("quit")
        with contextlib.suppress(Exception):
            await q.qmp.disconnect()
        try:
            q.proc.wait(10)
        except subprocess.TimeoutExpired:
            q.proc.kill()
            q.proc.wait()
        if q.tapfd is not None:
            os.close(q.tapfd)

    async def close(self) -> None:
        """End every QEMU of the pair and remove the RAM file."""
        if self.current is not None:
            await self._end(self.current)
            self.current = None
        for p in self.procs:
            if p.poll() is None:
                p.kill()
                p.wait()
        with contextlib.suppress(FileNotFoundError):
            self.cfg.ram.unlink()


@contextlib.contextmanager
def run_dir(prefix: str = "fusuma-raw-") -> Any:
    """A temporary directory nobody's QEMUs can use, with the image copied in;
    removed afterwards."""
    run = Path(tempfile.mkdtemp(prefix=prefix))
    try:
        os.chmod(run, 0o755)
        img = image_copy(run)
        os.chown(run, NOBODY, NOBODY)
        yield run, img
    finally:
        shutil.rmtree(run, ignore_errors=True)


def shm_ram(tag: str) -> Path:
    """A RAM file's name on /dev/shm for a raw pair (made by ``RawPair.boot``)."""
    return SHM / f"fusuma-raw-{tag}-{os.getpid()}.ram"
