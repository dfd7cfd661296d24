"""The move stream's TLS with real QEMUs and the cluster CA's certificates, no guest and
no cluster (issue 24): QEMUs as unprivileged uids in a network namespace this test
makes, their credentials given by ``fusuma.qemu.tlscreds.arm`` as the supervisors give
them, a marker in the source's RAM, every frame on the namespace's loopback captured.

- In the clear the marker crosses the wire (so the capture can find it: the check below
  can fail);
- under TLS, over several channels as fusuma's moves between hosts run (multifd), whoever
  connects to the listening QEMU first (raw bytes, a certificate of
  another CA that claims to be the source, another host's genuine certificate) is
  refused and the destination keeps waiting; a source that expects another destination
  refuses this one; the real source's stream then arrives whole (the secret is in the
  destination's RAM) and not one copy of the marker is on the wire, while the capture
  holds the whole stream, starting with a TLS handshake. The marked pages are random
  besides the marker, so the channels' compression cannot be what hides it.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import secrets
import shutil
import signal
import subprocess
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from fusuma.cluster import pki
from fusuma.paths import Paths
from fusuma.qemu import tlscreds, versions
from fusuma.qemu.cmdline import SANDBOX
from fusuma.qemu.qmp import Qmp
from fusuma.qemu.tlscreds import CLIENT, SERVER, HostCreds
from fusuma.supervisor.moves.source import capabilities, set_channels
from tests.capture import Capture, tcp_flows
from tests.conftest import REPO
from tests.netns import add as add_netns
from tests.netns import delete as delete_netns
from tests.stranger import connect_first, refused

pytestmark = [pytest.mark.integration, pytest.mark.timeout(180)]

RAM_MIB = 64
CHANNELS = 2
MARKED_MIB = 4
MARKED_AT = 32 * 2**20


def secret(marker: bytes) -> bytes:
    """The guest's secret: each page the marker, then random bytes, so that the
    channels' compression (zstd) cannot make the marker vanish by shrinking it."""
    page = 4096 - len(marker)
    return b"".join(marker + secrets.token_bytes(page) for _ in range(MARKED_MIB * 256))


@dataclass
class World:
    netns: str
    base: Path
    uid: int
    ca: pki.KeyPair
    creds: dict[str, HostCreds]
    rogue: HostCreds
    marker: bytes
    procs: list[subprocess.Popen[bytes]]
    secret: bytes = b""


@pytest.fixture
def world(request: pytest.FixtureRequest) -> Iterator[World]:
    tag = uuid.uuid4().hex[:8]
    netns = f"fz-tls-{tag}"
    base = Path(f"/tmp/fz-tls-{tag}")
    base.mkdir(mode=0o711)
    add_netns(netns)
    ca, other = pki.new_ca(), pki.new_ca()
    creds = {h: HostCreds(ca.cert, (kp := pki.issue(ca, h, ["127.0.0.1"])).cert, kp.key)
             for h in ("h0", "h1", "h2")}
    fake = pki.issue(other, "h0", ["127.0.0.1"])
    w = World(netns, base, 1_990_000_000 + secrets.randbelow(60000), ca, creds,
              HostCreds(other.cert, fake.cert, fake.key),
              (marker := f"FZMARK-{secrets.token_hex(12)}-".encode()), [], secret(marker))
    try:
        yield w
    finally:
        rep = getattr(request.node, "rep_call", None)
        if rep is None or rep.failed:       # keep the QEMUs' logs (conventions 12)
            out = REPO / "test-output" / request.node.name
            out.mkdir(parents=True, exist_ok=True)
            for log in base.glob("*.log"):
                shutil.copy(log, out / log.name)
        for p in w.procs:
            if p.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(p.pid, signal.SIGKILL)
                p.wait(10)
        delete_netns(netns)
        shutil.rmtree(base, ignore_errors=True)
    left = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    assert netns not in left and not base.exists()


def qemu() -> versions.Qemu:
    paths = Paths.from_env()
    q = versions.resolve_unpacked(paths, "10.0") or versions.system(paths)
    if q is None:
        pytest.fail("no QEMU: `make deps` or `fusuma qemu install 10.0`")
    return q


class Vm:
    """One QEMU with no guest: paused (a source) or waiting for a stream."""

    def __init__(self, w: World, name: str, incoming: bool, marked: bool) -> None:
        self.run = w.base / name
        self.run.mkdir(mode=0o700)
        os.chown(self.run, w.uid, w.uid)
        self.ram = self.run / "ram"
        with open(self.ram, "wb") as f:
            f.truncate(RAM_MIB * 2**20)
            if marked:     # the guest's secret, far from anything firmware touches
                f.seek(MARKED_AT)
                f.write(w.secret)
        os.chown(self.ram, w.uid, w.uid)
        self.log = self.run.parent / f"{name}.log"
        q = qemu()
        argv = [str(q.binary), "-machine", "pc,memory-backend=ram0", "-m", f"{RAM_MIB}M",
                "-object", f"memory-backend-file,id=ram0,size={RAM_MIB}M,"
                           f"mem-path={self.ram},share=on",
                "-nodefaults", "-no-user-config", "-display", "none", "-sandbox", SANDBOX,
                *(a for d in q.data_dirs for a in ("-L", str(d))),
                "-qmp", f"unix:{self.run}/qmp.sock,server=on,wait=off",
                *(["-incoming", "defer"] if incoming else ["-S"])]
        with open(self.log, "wb") as out:
            self.proc = subprocess.Popen(
                ["nsenter", f"--net=/run/netns/{w.netns}", f"--setuid={w.uid}",
                 f"--setgid={w.uid}", "--", *argv], stdout=out, stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL, env={**os.environ, **q.env})
        w.procs.append(self.proc)
        self.qmp = Qmp(name, self.run / "qmp.sock", logging.getLogger(f"test.{name}"))

    async def migration(self, timeout: float = 60) -> dict[str, object]:
        """query-migrate once it has ended (or ``timeout``)."""
        loop = asyncio.get_running_loop()
        end = loop.time() + timeout
        while True:
            info: dict[str, object] = await self.qmp.execute("query-migrate")
            if info.get("status") in ("completed", "failed", "cancelled") \
                    or loop.time() > end:
                return info
            await asyncio.sleep(0.05)


async def channels(*vms: Vm) -> None:
    """Two channels (multifd), as moves between hosts under TLS take."""
    for vm in vms:
        await vm.qmp.migrate_set_capabilities(capabilities("copy", CHANNELS))
        await set_channels(vm.qmp, CHANNELS)


async def listen(vm: Vm) -> int:
    await vm.qmp.migrate_incoming("tcp:127.0.0.1:0")
    info = await vm.qmp.execute("query-migrate")
    return int(info["socket-address"][0]["port"])


def test_the_stream_is_private_and_only_the_named_peers_take_part(
        world: World, tmp_path: Path) -> None:
    w = world
    pcap = tmp_path / "lo.pcap"

    async def scenario() -> dict[str, object]:
        # In the clear, for the control.
        src, dst = Vm(w, "src-plain", False, True), Vm(w, "dst-plain", True, False)
        await src.qmp.connect()
        await dst.qmp.connect()
        plain_port = await listen(dst)
        await src.qmp.migrate(f"tcp:127.0.0.1:{plain_port}")
        assert (await src.migration())["status"] == "completed"
        assert (await dst.migration())["status"] == "completed"
        # Under TLS, armed as the supervisors arm a move's QEMUs: h0 sends to h1.
        src, dst = Vm(w, "src-tls", False, True), Vm(w, "dst-tls", True, False)
        await src.qmp.connect()
        await dst.qmp.connect()
        await channels(src, dst)
        await tlscreds.arm(dst.qmp, dst.run, w.uid, w.creds["h1"], SERVER, "h0")
        assert sorted(p.name for p in dst.run.iterdir()) == ["qmp.sock", "ram"]
        tls_port = await listen(dst)
        pems = {"raw": None, "rogue": w.rogue.cert + w.rogue.key,
                "h2": w.creds["h2"].cert + w.creds["h2"].key}
        tries = {how: await asyncio.to_thread(connect_first, w.netns, "127.0.0.1",
                                              tls_port, pem) for how, pem in pems.items()}
        assert (await dst.qmp.execute("query-migrate"))["status"] == "setup", tries
        assert await dst.qmp.query_status() == "inmigrate"
        # A source refuses a destination that is not the host it sends to (h1 here,
        # where the source expects h2). That destination then fails: the one peer it
        # lets in went away.
        other = Vm(w, "dst-other", True, False)
        await other.qmp.connect()
        await channels(other)
        await tlscreds.arm(other.qmp, other.run, w.uid, w.creds["h1"], SERVER, "h0")
        tls = await tlscreds.arm(src.qmp, src.run, w.uid, w.creds["h0"], CLIENT, "h2")
        await src.qmp.migrate(f"tcp:127.0.0.1:{await listen(other)}")
        wrong = await src.migration()
        await tlscreds.drop(src.qmp, tls)
        assert wrong["status"] == "failed", wrong
        assert (await dst.qmp.execute("query-migrate"))["status"] == "setup"
        # The real source.
        tls = await tlscreds.arm(src.qmp, src.run, w.uid, w.creds["h0"], CLIENT, "h1")
        await src.qmp.migrate(f"tcp:127.0.0.1:{tls_port}")
        done = await src.migration()
        assert done["status"] == "completed", done
        assert (await dst.migration())["status"] == "completed"
        await tlscreds.drop(src.qmp, tls)
        for vm in (src, dst, other):
            await vm.qmp.disconnect()
        return {"plain": plain_port, "tls": tls_port, "tries": tries, "wrong": wrong,
                "sent": done["ram"]["transferred"]}   # type: ignore[index]

    with Capture(w.netns, pcap, iface="lo", seconds=120) as cap:
        got = asyncio.run(scenario())
    assert cap.stop() == 0, "the kernel dropped frames: the capture is not whole"

    tries = got["tries"]
    assert all(refused(t) for t in tries.values()), tries
    log = (w.base / "dst-tls.log").read_text()
    assert "TLS handshake failed" in log                    # the raw bytes
    assert "The certificate hasn't got a known issuer" in log   # another CA's "h0"
    assert "TLS x509 authz check for CN=h2 is denied" in log    # a genuine other host
    assert "Certificate does not match the hostname h2" in \
        (w.base / "src-tls.log").read_text()

    # The control: in the clear, the marker crosses the wire.
    [plain] = [f for (s, d), f in tcp_flows(pcap, got["plain"]).items()
               if d[1] == got["plain"]]
    data, missing = plain.data()
    assert missing == 0 and w.marker in data
    # Under TLS: the whole stream is in the capture (each connection whole, each
    # beginning with a TLS handshake) and holds no copy of the marker.
    flows = tcp_flows(pcap, got["tls"])
    sent = 0
    for (_, d), f in flows.items():
        data, missing = f.data()
        assert missing == 0, f"{missing} bytes of a connection are not in the capture"
        assert w.marker not in data and w.marker[:8] not in data
        if d[1] == got["tls"] and len(data) > 4096:
            assert data[:2] == b"\x16\x03", "no TLS handshake at a channel's start"
            sent += len(data)
    assert sent >= got["sent"] > MARKED_MIB * 2**20
    # ... and it arrived whole: the destination's RAM holds the secret.
    with open(w.base / "dst-tls" / "ram", "rb") as f:
        f.seek(MARKED_AT)
        assert f.read(len(w.secret)) == w.secret
    print(f"stream: {sent} bytes on the wire for {got['sent']} sent, no marker; in "
          f"the clear the marker was found; strangers: {tries}")
