"""The keeper of one managed network's dnsmasq: ``python -m fusuma.network.keeper NET``.

Why a process of its own: a network serves VMs of every partition, so no partition
supervisor can own its dnsmasq (each partition's supervisor may be restarted alone,
and a network outlives any partition); and the CLI is gone once a command returns. The
keeper is small (no asyncio, no QEMU, no state file): it starts dnsmasq in the
foreground, watches it through a pidfd and starts it again when it dies (a short,
growing pause between restarts, reset once it has run for a while). dnsmasq reads its
lease file back at each start, so a restarted one keeps the leases; its addresses come
from the hosts file anyway (fusuma.network.dnsmasq).

The keeper runs in a session of its own; dnsmasq too, so a keeper that is killed
leaves dnsmasq serving, and the next keeper (`fusuma up`, `fusuma network restart`)
adopts it by its pidfile, checked against its command line. SIGTERM ends dnsmasq and
the keeper; SIGHUP is passed on to dnsmasq (read the hosts file again).
"""

from __future__ import annotations

import contextlib
import logging
import os
import select
import signal
import subprocess
import sys
import time
from types import FrameType

from fusuma.network import dnsmasq
from fusuma.paths import Paths
from fusuma.qemu import process

LOG = logging.getLogger("fusuma.network.keeper")
KEEPER_MODULE = "fusuma.network.keeper"
# Fault injection (tests): seconds a keeper waits before it starts a dnsmasq, so that a
# test can kill it between the bridge and dnsmasq at a point it knows.
FAULT_DNSMASQ_DELAY = "FUSUMA_FAULT_KEEPER_DNSMASQ_DELAY"
PIDFILE = "keeper.pid"
RESTART_MIN, RESTART_MAX, STABLE_S = 0.2, 5.0, 30.0


def files(paths: Paths, network: str) -> dnsmasq.Files:
    run = paths.network_run_dir(network)
    return dnsmasq.Files(conf=run / "dnsmasq.conf", hosts=run / "hosts",
                         leases=paths.network_dir(network) / "leases",
                         pid=run / "dnsmasq.pid")


def dnsmasq_pid(f: dnsmasq.Files) -> int | None:
    """The live dnsmasq of these files (its pidfile, checked against its command line)."""
    try:
        pid = int(f.pid.read_text().strip())
    except (OSError, ValueError):
        return None
    if pid > 0 and process.pid_alive(pid) and f"--conf-file={f.conf}" in \
            process.cmdline(pid):
        return pid
    return None


def keeper_pid(paths: Paths, network: str, recorded: int | None) -> int | None:
    """The live keeper of ``network`` (the recorded pid, else its pidfile's), checked
    against its command line."""
    candidates = [recorded]
    with contextlib.suppress(OSError, ValueError):
        candidates.append(int((paths.network_run_dir(network) / PIDFILE).read_text()))
    return process.daemon_pid(candidates, KEEPER_MODULE, network)


class Keeper:
    def __init__(self, paths: Paths, network: str) -> None:
        self.paths = paths
        self.network = network
        self.files = files(paths, network)
        self.stopping = False
        self.pid: int | None = None
        self.child: subprocess.Popen[bytes] | None = None

    def _term(self, signum: int, frame: FrameType | None) -> None:
        self.stopping = True

    def _hup(self, signum: int, frame: FrameType | None) -> None:
        if self.pid is not None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, signal.SIGHUP)

    def start(self) -> int:
        """Adopt a live dnsmasq of this network, else start one."""
        pid = dnsmasq_pid(self.files)
        if pid is not None:
            LOG.info("adopted dnsmasq pid %d", pid)
            self.child = None
            return pid
        with contextlib.suppress(FileNotFoundError):
            self.files.pid.unlink()
        delay = float(os.environ.get(FAULT_DNSMASQ_DELAY) or 0)
        if delay > 0:
            time.sleep(delay)
        self.child = subprocess.Popen(dnsmasq.argv(self.files), stdin=subprocess.DEVNULL,
                                      start_new_session=True, close_fds=True)
        LOG.info("started dnsmasq pid %d", self.child.pid)
        return self.child.pid

    def wait(self, pid: int) -> str:
        """Until dnsmasq ``pid`` ends (its status) or the keeper is told to stop ("")."""
        try:
            pidfd = os.pidfd_open(pid)
        except ProcessLookupError:
            return "gone"
        try:
            poller = select.poll()
            poller.register(pidfd, select.POLLIN)
            while not self.stopping:
                if poller.poll(500):
                    break
            else:
                return ""
        finally:
            os.close(pidfd)
        if self.child is not None and self.child.pid == pid:
            code = self.child.wait()
            return f"killed by signal {-code}" if code < 0 else f"exit status {code}"
        return "ended (adopted: status unknown)"

    def stop_dnsmasq(self, pid: int) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGTERM)
        deadline = time.monotonic() + 5
        while process.pid_alive(pid) and time.monotonic() < deadline:
            if self.child is not None and self.child.poll() is not None:
                break
            time.sleep(0.05)
        if process.pid_alive(pid):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        if self.child is not None:
            self.child.wait()
        with contextlib.suppress(FileNotFoundError):
            self.files.pid.unlink()

    def run(self) -> None:
        signal.signal(signal.SIGTERM, self._term)
        signal.signal(signal.SIGINT, self._term)
        signal.signal(signal.SIGHUP, self._hup)
        pidfile = self.paths.network_run_dir(self.network) / PIDFILE
        pidfile.write_text(f"{os.getpid()}\n")
        delay = RESTART_MIN
        try:
            while not self.stopping:
                started = time.monotonic()
                self.pid = self.start()
                how = self.wait(self.pid)
                if self.stopping:
                    self.stop_dnsmasq(self.pid)
                    break
                ran = time.monotonic() - started
                delay = RESTART_MIN if ran > STABLE_S else min(delay * 2, RESTART_MAX)
                LOG.warning("dnsmasq (pid %d) %s after %.1f s; starting it again in "
                            "%.1f s", self.pid, how, ran, delay)
                self.pid = None
                end = time.monotonic() + delay
                while not self.stopping and time.monotonic() < end:
                    time.sleep(0.05)
        finally:
            with contextlib.suppress(FileNotFoundError):
                pidfile.unlink()
        LOG.info("keeper of network %s ends", self.network)


def main(argv: list[str]) -> int:
    if len(argv) != 2:
        print("usage: python -m fusuma.network.keeper NETWORK", file=sys.stderr)
        return 2
    os.umask(0o077)
    logging.basicConfig(level=logging.INFO,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    paths = Paths.from_env()
    Keeper(paths, argv[1]).run()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
