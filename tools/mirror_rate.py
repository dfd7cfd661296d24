"""How fast this host's QEMU mirrors a thin disk's top layer over NBD under TLS, as a
move between hosts does (``fusuma.qemu.block``: the destination serves a fresh overlay
on the same base, writable, the source runs ``blockdev-mirror``, ``sync: top``, until
the job is ready), over loopback, with no guest running: the mirror's own rate.

    python tools/mirror_rate.py MIB [RUNS]      (QEMU, qemu-img, qemu-io, openssl)

Writes MIB MiB of random data into the source's overlay (on a 1 GiB base), then times
each run's mirror from ``blockdev-mirror`` to the job's "ready"; prints each run's
seconds and the median as seconds per GiB. Everything is made in a temporary
directory, removed at the end, and both QEMUs are ended.
"""

import asyncio
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from qemu.qmp import QMPClient

QEMU = os.environ.get("QEMU", "qemu-system-x86_64")


def run(*argv: str) -> None:
    subprocess.run(argv, check=True, capture_output=True)


def certs(d: Path) -> tuple[Path, Path]:
    """A CA, a server certificate for 127.0.0.1 and a client's: QEMU's x509 dirs."""
    srv, cli = d / "server", d / "client"
    srv.mkdir()
    cli.mkdir()
    run("openssl", "req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:P-256",
        "-nodes", "-keyout", str(d / "ca.key"), "-out", str(d / "ca.pem"), "-days", "1",
        "-subj", "/CN=mirror-rate-ca")
    for name, where in (("server", srv), ("client", cli)):
        run("openssl", "req", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:P-256",
            "-nodes", "-keyout", str(where / f"{name}-key.pem"), "-out",
            str(d / f"{name}.csr"), "-subj", f"/CN={name}")
        ext = d / f"{name}.ext"
        ext.write_text("subjectAltName=IP:127.0.0.1\n" if name == "server" else
                       "extendedKeyUsage=clientAuth\n")
        run("openssl", "x509", "-req", "-in", str(d / f"{name}.csr"), "-CA",
            str(d / "ca.pem"), "-CAkey", str(d / "ca.key"), "-CAcreateserial", "-out",
            str(where / f"{name}-cert.pem"), "-days", "1", "-extfile", str(ext))
        shutil.copy(d / "ca.pem", where / "ca-cert.pem")
    return srv, cli


async def qemu(d: Path, name: str, disk: Path) -> tuple[subprocess.Popen[bytes], QMPClient]:
    sock = d / f"{name}.sock"
    proc = subprocess.Popen([QEMU, "-machine", "none", "-nodefaults", "-display", "none",
                             "-qmp", f"unix:{sock},server=on,wait=off",
                             "-blockdev", f"driver=qcow2,node-name=disk,file.driver=file,"
                             f"file.filename={disk}"])
    qmp = QMPClient(name)
    for _ in range(200):
        try:
            await qmp.connect(str(sock))
            return proc, qmp
        except Exception:
            await asyncio.sleep(0.05)
    raise SystemExit(f"{name}'s QEMU did not open its QMP socket")


async def once(d: Path, mib: int, srv: Path, cli: Path) -> float:
    for f in ("src.qcow2", "dst.qcow2"):
        (d / f).unlink(missing_ok=True)
        run("qemu-img", "create", "-q", "-f", "qcow2", "-b", str(d / "base.qcow2"),
            "-F", "qcow2", str(d / f))
    run("qemu-io", "-f", "qcow2", "-c", f"write -s {d / 'data'} 0 {mib}M",
        str(d / "src.qcow2"))
    dp, dst = await qemu(d, "dst", d / "dst.qcow2")
    sp, src = await qemu(d, "src", d / "src.qcow2")
    try:
        await dst.execute("object-add", {"qom-type": "tls-creds-x509", "id": "tls",
                                         "endpoint": "server", "dir": str(srv),
                                         "verify-peer": True})
        await dst.execute("nbd-server-start", {"addr": {"type": "inet", "data": {
            "host": "127.0.0.1", "port": "0"}}, "tls-creds": "tls"})
        port = None
        # The port QEMU bound: it says it nowhere over QMP, /proc does.
        for line in Path("/proc/net/tcp").read_text().splitlines()[1:]:
            f = line.split()
            if f[1].startswith("0100007F:") and f[3] == "0A":
                inode = f[9]
                fds = Path(f"/proc/{dp.pid}/fd")
                if any(os.readlink(fds / x) == f"socket:[{inode}]" for x in os.listdir(fds)):
                    port = int(f[1].split(":")[1], 16)
        assert port, "no listening port"
        await dst.execute("block-export-add", {"type": "nbd", "id": "e", "node-name": "disk",
                                               "name": "e", "writable": True})
        await src.execute("object-add", {"qom-type": "tls-creds-x509", "id": "tls",
                                         "endpoint": "client", "dir": str(cli),
                                         "verify-peer": True})
        await src.execute("blockdev-add", {"driver": "nbd", "node-name": "nbd", "export": "e",
                                           "server": {"type": "inet", "host": "127.0.0.1",
                                                      "port": str(port)},
                                           "tls-creds": "tls", "tls-hostname": "127.0.0.1"})
        t0 = time.monotonic()
        await src.execute("blockdev-mirror", {"job-id": "m", "device": "disk",
                                              "target": "nbd", "sync": "top"})
        while True:
            jobs = await src.execute("query-jobs")
            if jobs[0]["status"] == "ready":
                return time.monotonic() - t0
            assert jobs[0]["status"] == "running", jobs
            await asyncio.sleep(0.02)
    finally:
        for proc, q in ((sp, src), (dp, dst)):
            await q.disconnect()
            proc.kill()
            proc.wait()


async def main(mib: int, runs: int) -> None:
    with tempfile.TemporaryDirectory(prefix="mirror-rate-") as tmp:
        d = Path(tmp)
        srv, cli = certs(d)
        run("qemu-img", "create", "-q", "-f", "qcow2", str(d / "base.qcow2"), "1G")
        (d / "data").write_bytes(os.urandom(mib * 2**20))
        times = [await once(d, mib, srv, cli) for _ in range(runs)]
    for t in times:
        print(f"{mib} MiB in {t:.2f} s")
    print(f"median {statistics.median(times) * 1024 / mib:.1f} s/GiB "
          f"({mib / statistics.median(times):.0f} MiB/s)")


if __name__ == "__main__":
    asyncio.run(main(int(sys.argv[1]), int(sys.argv[2]) if len(sys.argv) > 2 else 3))
