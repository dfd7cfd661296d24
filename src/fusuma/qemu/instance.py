"""One QEMU process, owned by one object from launch to cleanup.

A :class:`QemuInstance` is the only thing that starts, signals, waits for or cleans up
a QEMU (QEMU's own ``python/qemu/machine/machine.py`` is the model): it has an
instance id and a run directory of its own; :meth:`QemuInstance.launch` is a
transaction (a QEMU that fails to come up is killed, reaped and its files removed
before the error is raised); :meth:`stop` asks QEMU to quit and kills it if it does
not; the process's end is learnt through a pidfd, after which its sockets are removed
whatever happened (:meth:`_exited`, in ``finally``). An instance taken back by a new
supervisor is :meth:`adopt`-ed, and a QEMU nothing can talk to is ended by
:func:`fusuma.qemu.process.end_unmanaged`, by its checked pid.

Its :class:`Role` says what it is to its VM: the VM's running QEMU, a move's incoming
destination, or a move's leaving source. Roles change only along :data:`TRANSITIONS`,
through :class:`Instances`, the registry a partition keeps of its QEMUs.

Errors: ``QemuError`` (fusuma.errors) for a QEMU that cannot be started, reached or
ended; ``StateError`` for an illegal role change.
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import logging
import os
import subprocess
import time
from collections.abc import Awaitable, Callable, Collection, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from fusuma.errors import MigrationError, QemuError, StateError
from fusuma.frozen import frozen
from fusuma.qemu import process
from fusuma.qemu.consolelog import FIFO_NAME, ConsoleLog, ConsolePump
from fusuma.qemu.qmp import EVENT_RESUME, EVENT_STOP, MigrationInfo, Qmp

LOG = logging.getLogger(__name__)

# The files a QEMU makes in its run dir (never the guest's RAM file), and those a
# move's destination adds in its own ``in-…`` dir.
RUN_FILES = ("qmp.sock", "qga.sock", "console.sock", "qemu.pid", FIFO_NAME)
MOVE_FILES = ("migrate.sock", "cpr.sock")
# Prefix of the sub-directory of a VM's run dir that holds a move destination's
# sockets: unique per move, since QEMU unlinks its socket paths on exit.
INCOMING_PREFIX = "in-"
CONNECT_TIMEOUT_S = 30.0
LISTEN_TIMEOUT_S = 30.0


class Role(enum.Enum):
    """What a QEMU is to its VM."""

    RUNNING = "vm"           # the VM's own QEMU: the record names it
    INCOMING = "incoming"    # a move's destination, not (yet) the VM's
    LEAVING = "leaving"      # a move's source whose guest has moved on (or may)


#: The legal role changes: a destination takes the guest (commit), a source streams
#: it away (or an in-place move's old QEMU gives way), and a source runs it again
#: when the move goes back.
TRANSITIONS = frozenset({(Role.INCOMING, Role.RUNNING), (Role.RUNNING, Role.LEAVING),
                         (Role.LEAVING, Role.RUNNING)})


def remove_run_files(run: Path) -> None:
    """Remove a QEMU instance's sockets and pidfile from ``run`` (never a RAM file),
    and a move destination's own dir.

    The run dir belongs to the VM's uid, so its entries are removed through the
    directory's fd, opened without following a symlink: nothing that uid put there
    makes root remove a file elsewhere."""
    names = list(RUN_FILES)
    incoming = run.name.startswith(INCOMING_PREFIX)
    if incoming:
        names += MOVE_FILES
    try:
        fd = os.open(run, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError:
        return   # gone, or not a directory of ours
    try:
        for name in names:
            with contextlib.suppress(OSError):
                os.unlink(name, dir_fd=fd)
    finally:
        os.close(fd)
    if incoming:
        with contextlib.suppress(OSError):
            run.rmdir()


@frozen
class LaunchPlan:
    """How to start one QEMU: all of it decided by the caller (argv, fds, cgroup and
    privileges in ``preexec``), so the instance only runs it."""

    argv: list[str]
    env: dict[str, str]
    pass_fds: Sequence[int]
    preexec: Callable[[], None]
    log: Path                          # QEMU's stdout and stderr
    qmp_socket: Path
    # An in-place move's new QEMU: it opens QMP only once the old one has sent the
    # guest's descriptors on this socket, so the launch waits until it listens.
    cpr_socket: Path | None = None
    uid: int | None = None             # for messages: who QEMU runs as,
    cgroup: str = ""                   # and where ``preexec`` places it
    # Where the supervisor writes the console that QEMU sends to its FIFO
    # (fusuma.qemu.consolelog), given the FIFO's read end at launch.
    console: ConsoleLog | None = None



def exit_status(pid: int) -> int | None:
    """The exit status of ended child ``pid`` as ``Popen.returncode`` gives it (minus
    the signal that killed it), read without reaping it: the kernel's reap of an ended
    QEMU (``wait4``) took up to 400 ms on a loaded host, which the event loop, and a
    move's release, must not wait for; the reap runs on a worker thread instead."""
    try:
        info = os.waitid(os.P_PID, pid, os.WEXITED | os.WNOHANG | os.WNOWAIT)
    except ChildProcessError:
        return None
    if info is None:
        return None
    if info.si_code == os.CLD_EXITED:
        return info.si_status
    return -info.si_status

@dataclass(eq=False)
class QemuInstance:
    """One QEMU process of one VM (see the module docstring)."""

    vm: str
    pid: int
    qmp: Qmp
    run_dir: Path
    ram_file: Path | None
    role: Role = Role.RUNNING
    child: subprocess.Popen[bytes] | None = None
    version: str | None = None       # of the QEMU binary, when this process started it
    # False while another QEMU maps the same RAM file (a zero-copy move), or once the
    # file is a template's: then it must outlive this process.
    owns_ram: bool = True
    stopping: bool = False           # its end was asked for: not a crash
    # A move's outcome "back" reached it (``resume``) while its stream may still run:
    # the stream's end must not leave the guest paused.
    resumed_back: bool = False
    # A move's ``perform`` owns this QEMU's outgoing stream (and runs the guest again at
    # its end when "back" was decided meanwhile).
    streaming: bool = False
    stop_note: str | None = None     # how that end went, if not cleanly (the record's)
    started_log: str | None = None   # QEMU's last log line at start: exits say newer ones
    # 12 random hex digits (uuid4's first 48 bits, without importing uuid and platform)
    id: str = field(default_factory=lambda: os.urandom(6).hex())
    exited: asyncio.Event = field(default_factory=asyncio.Event)
    status: int | None = None        # exit status (a child's only)
    # A move's destination side keeps its own state here (fusuma.supervisor.moves.dest).
    move: Any = None
    # Copies its console into the VM's capped log while it is watched.
    console: ConsolePump | None = None
    # Monotonic times of its end: ``quit`` asked (``stop``), the process gone (pidfd).
    quit_at: float | None = None
    gone_at: float | None = None
    # Its vCPUs' thread ids in index order (``query-cpus-fast``), asked once: they are
    # fixed for the process's life (fusuma hot-plugs no vCPU).
    vcpu_tids: list[int] | None = None
    _pidfd: int | None = None
    _reap: asyncio.Future[int] | None = None
    _runstate: asyncio.Task[None] | None = None
    _exit_task: asyncio.Future[None] | None = None

    def __post_init__(self) -> None:
        self.qmp.pid = self.pid

    # -- start ----------------------------------------------------------------------------
    @classmethod
    async def launch(cls, vm: str, plan: LaunchPlan, *, run_dir: Path,
                     ram_file: Path | None, logger: logging.Logger, role: Role,
                     version: str | None = None,
                     on_spawn: Callable[[int], None] = lambda pid: None,
                     console_fd: int | None = None) -> QemuInstance:
        """Start QEMU and connect QMP (or, in place, wait for its cpr channel): a
        transaction. On any failure the process is killed and reaped and its run files
        removed before the error is raised. ``on_spawn(pid)`` runs as soon as the
        process exists (so that a supervisor killed meanwhile leaves a QEMU the next
        one can find by its recorded pid). ``console_fd``: the read end of its console
        FIFO, the instance's from now on (closed on failure)."""
        pump = None
        if console_fd is not None:
            if plan.console is None:
                os.close(console_fd)
            else:
                pump = ConsolePump(console_fd, plan.console, logger)
        try:
            child = cls._spawn(vm, plan)
        except BaseException:
            if pump is not None:
                pump.close()
            raise
        inst = cls(vm, child.pid, Qmp(vm, plan.qmp_socket, logger), run_dir=run_dir,
                   ram_file=ram_file, role=role, child=child, version=version,
                   console=pump)
        try:
            on_spawn(child.pid)
            if plan.cpr_socket is not None:
                await inst._wait_listening(plan.cpr_socket, plan.log)
            else:
                await inst._connect_or_fail(plan.log)
        except BaseException:
            await inst.qmp.disconnect()
            inst.reap()
            if inst.console is not None:
                inst.console.close()
            remove_run_files(run_dir)
            raise
        inst.started_log = process.tail(plan.log, 1)
        return inst

    @staticmethod
    def _spawn(vm: str, plan: LaunchPlan) -> subprocess.Popen[bytes]:
        with open(plan.log, "ab") as log:
            log.write(f"--- {time.ctime()} {plan.argv}\n".encode())
            log.flush()
            try:
                child = subprocess.Popen(plan.argv, stdin=subprocess.DEVNULL, stdout=log,
                                         stderr=log, env=plan.env, start_new_session=True,
                                         close_fds=True, pass_fds=plan.pass_fds,
                                         preexec_fn=plan.preexec)
            except OSError as exc:
                raise QemuError(f"VM {vm}: cannot run {plan.argv[0]} as uid {plan.uid}: "
                                f"{exc.strerror}; QEMU, its firmware and libraries must be "
                                "readable and executable by other users.",
                                argv=plan.argv) from exc
            except subprocess.SubprocessError as exc:
                # preexec (cgroup, KSM, dropping privileges) failed.
                raise QemuError(f"VM {vm}: cannot place QEMU in cgroup {plan.cgroup} as "
                                f"uid {plan.uid}: {exc}.", argv=plan.argv) from exc
        return child

    async def _connect_or_fail(self, log: Path) -> None:
        assert self.child is not None
        patience = process.Patience(self.child.pid, CONNECT_TIMEOUT_S)
        while not patience.expired():
            if self.child.poll() is not None:
                said = process.tail(log, 1)
                raise QemuError(f"VM {self.vm}: QEMU exited at start with status "
                                f"{self.child.returncode}: {said or 'no message'}",
                                exit_status=self.child.returncode, log_tail=process.tail(log))
            try:
                await self.qmp.connect(timeout=0.5)
                return
            except QemuError:
                continue
        raise QemuError(f"VM {self.vm}: QEMU did not open its QMP socket "
                        f"{patience.said()}"
                        f"{process.cpu_note(self.pid, patience.elapsed())}; see {log}.",
                        log_tail=process.tail(log))

    async def _wait_listening(self, sock: Path, log: Path) -> None:
        """Wait until a new QEMU listens on its cpr channel (its monitor opens only
        after the descriptors arrived, so there is no QMP to wait for)."""
        assert self.child is not None
        patience = process.Patience(self.child.pid, LISTEN_TIMEOUT_S)
        while not sock.exists():
            if self.child.poll() is not None:
                raise QemuError(f"VM {self.vm}: the new QEMU exited at start with status "
                                f"{self.child.returncode}: "
                                f"{process.tail(log, 1) or 'no message'}",
                                exit_status=self.child.returncode, log_tail=process.tail(log))
            if patience.expired():
                raise QemuError(f"VM {self.vm}: the new QEMU did not listen on {sock} "
                                f"{patience.said()}"
                                f"{process.cpu_note(self.pid, patience.elapsed())}; see {log}.",
                                log_tail=process.tail(log))
            await asyncio.sleep(0.002)

    def reap(self) -> None:
        """Kill and wait for a child that never became an instance (launch undo)."""
        if self.child is None:
            return
        if self.child.poll() is None:
            self.child.kill()
        self.child.wait(timeout=10)

    @classmethod
    async def adopt(cls, vm: str, pid: int, run_dir: Path, ram_file: Path | None,
                    logger: logging.Logger, console: ConsoleLog | None = None
                    ) -> tuple[QemuInstance, str]:
        """Take back a QEMU an earlier supervisor started: connect QMP and ask its
        status, and reopen its console FIFO (into ``console``). QemuError if it does
        not answer (the caller decides its fate)."""
        inst = cls(vm, pid, Qmp(vm, run_dir / "qmp.sock", logger), run_dir=run_dir,
                   ram_file=ram_file)
        try:
            await inst.qmp.connect(timeout=5.0)
            status = await inst.qmp.query_status()
        except QemuError:
            await inst.qmp.disconnect()
            raise
        if console is not None:
            inst.console = ConsolePump.reopen(run_dir / FIFO_NAME, console, logger)
        return inst, status

    # -- watching ----------------------------------------------------------------------
    def watch(self, on_exit: Callable[[QemuInstance], Awaitable[None]],
              on_gone: Callable[[QemuInstance], None] = lambda inst: None) -> None:
        """Learn of the process's end through a pidfd (works for adopted, non-child
        pids): ``on_gone`` runs first, before anything waits (the caller forgets the
        instance at once), then its own cleanup, then ``on_exit`` (the caller's
        records), and only then is ``exited`` set."""
        loop = asyncio.get_running_loop()

        def fire() -> None:
            self.gone_at = time.monotonic()
            self._exit_task = asyncio.ensure_future(self._exited(on_exit, on_gone))
        if self.console is not None:
            self.console.start()
        try:
            fd = os.pidfd_open(self.pid)
        except ProcessLookupError:
            loop.call_soon(fire)
            return
        self._pidfd = fd
        loop.add_reader(fd, fire)

    def follow_runstate(self, on_change: Callable[[QemuInstance, bool], None]) -> None:
        """Call ``on_change(self, paused)`` on each QMP STOP and RESUME (once)."""
        if self._runstate is not None:
            return

        async def follow() -> None:
            listener = self.qmp.listener(EVENT_STOP, EVENT_RESUME)
            try:
                while not self.exited.is_set():
                    ev = await listener.get()
                    on_change(self, ev["event"] == EVENT_STOP)
            except asyncio.CancelledError:
                pass
            finally:
                self.qmp.drop_listener(listener)
        self._runstate = asyncio.ensure_future(follow())

    async def _exited(self, on_exit: Callable[[QemuInstance], Awaitable[None]],
                      on_gone: Callable[[QemuInstance], None]) -> None:
        if self.exited.is_set():
            return
        try:
            on_gone(self)
            if self._pidfd is not None:
                asyncio.get_running_loop().remove_reader(self._pidfd)
                os.close(self._pidfd)
                self._pidfd = None
            if self._runstate is not None:
                self._runstate.cancel()
            if self.console is not None:
                self.console.close()       # what QEMU wrote last, then the FIFO
            if self.child is not None:
                self.status = exit_status(self.pid)
                self._reap = asyncio.get_running_loop().run_in_executor(
                    None, self.child.wait)
                if self.status is None or self.role != Role.LEAVING:
                    # Only a move's released source is not waited for. After any other
                    # end (a stop before qemu-img works on the disk, a restart) the reap,
                    # off the loop, comes first: a disk snapshot's qemu-img run while the
                    # QEMU it followed was not yet reaped failed to allocate its stack
                    # (ENOMEM; test_disk_snapshot_restored_running_and_stopped).
                    self.status = await self._reap
            await self.qmp.disconnect()
            remove_run_files(self.run_dir)
            await on_exit(self)
        except Exception:
            LOG.exception("handling the exit of %s (pid %d) failed", self.vm, self.pid)
        finally:
            self.exited.set()

    def detach(self) -> None:
        """Stop watching (the supervisor ends; the QEMU runs on for the next one, which
        reopens its console FIFO)."""
        if self.console is not None:
            self.console.close()
        if self._pidfd is not None:
            asyncio.get_running_loop().remove_reader(self._pidfd)
            os.close(self._pidfd)
            self._pidfd = None

    # -- ending ------------------------------------------------------------------------
    async def wait_exit(self, timeout: float = 10.0) -> None:
        try:
            await asyncio.wait_for(self.exited.wait(), timeout)
        except TimeoutError as exc:
            raise QemuError(f"VM {self.vm}: QEMU (pid {self.pid}) did not exit within "
                            f"{timeout:.0f} s.") from exc

    async def kill(self, timeout: float = 10.0) -> None:
        """SIGKILL, and wait until the exit has been handled."""
        self.stopping = True
        if not self.exited.is_set() and self.gone_at is None:
            # Not once its pidfd said it ended: a worker may have reaped it already, and
            # its pid may be another process's by now.
            process.kill(self.pid)
        await self.wait_exit(timeout)

    async def stop(self, timeout: float = 10.0) -> bool:
        """QMP ``quit``, then SIGKILL if it has not exited within ``timeout``; waits
        until the exit has been handled. True if it quit by itself."""
        self.stopping = True
        if self.exited.is_set():
            return True
        self.quit_at = time.monotonic()
        with contextlib.suppress(QemuError):
            await self.qmp.quit()
        try:
            await asyncio.wait_for(self.exited.wait(), timeout)
            return True
        except TimeoutError:
            LOG.warning("%s did not quit in %.0f s; killing pid %d", self.vm, timeout,
                        self.pid)
        killed = f"QEMU did not quit within {timeout:.0f} s and was killed"
        self.stop_note = f"{self.stop_note}; {killed}" if self.stop_note else killed
        await self.kill()
        return False

    async def wait_migration(self, timeout: float,
                             until: Collection[str] = ()) -> MigrationInfo:
        """Poll ``query-migrate`` until this QEMU's migration ends, or reaches a status
        of ``until`` (cancelled after ``timeout``, refused once the process has
        exited)."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        delay = 0.001
        while True:
            if self.exited.is_set():
                raise MigrationError(f"the source QEMU of {self.vm!r} exited during "
                                     "migration.")
            info = await self.qmp.query_migrate()
            if info.status in ("completed", "failed", "cancelled") or info.status in until:
                return info
            if loop.time() > deadline:
                with contextlib.suppress(QemuError):
                    await self.qmp.migrate_cancel()
                raise MigrationError(f"migration of {self.vm!r} did not finish in "
                                     f"{timeout:.0f} s and was cancelled.")
            await asyncio.sleep(delay)
            delay = min(delay * 2, 0.05)

    def settle_into(self, target: Path) -> None:
        """Move this QEMU's sockets from a move destination's ``in-…`` dir into
        ``target`` (the VM's usual run dir). Only once the move's source QEMU has
        exited: QEMU unlinks its listening sockets' paths on exit, which would remove
        these if they already had the same names."""
        for name in RUN_FILES:
            with contextlib.suppress(FileNotFoundError):
                (self.run_dir / name).rename(target / name)
        for name in MOVE_FILES:
            with contextlib.suppress(FileNotFoundError):
                (self.run_dir / name).unlink()
        with contextlib.suppress(OSError):
            self.run_dir.rmdir()
        self.run_dir = target
        self.qmp.socket = target / "qmp.sock"

    @property
    def how_ended(self) -> str:
        """How the process ended, in words (once ``exited`` is set)."""
        status = self.status
        return (f"killed by signal {-status}" if status is not None and status < 0
                else f"exited with status {status}" if status is not None
                else "exited (status unknown: adopted process)")

    @property
    def alive(self) -> bool:
        return not self.exited.is_set() and process.pid_alive(self.pid)


class Instances:
    """The QEMUs one partition holds, at most one per VM and role; roles change only
    along :data:`TRANSITIONS`."""

    def __init__(self) -> None:
        self._held: dict[tuple[str, Role], QemuInstance] = {}

    def add(self, inst: QemuInstance) -> None:
        key = (inst.vm, inst.role)
        if key in self._held and self._held[key] is not inst:
            raise StateError(f"VM {inst.vm!r} already has a {inst.role.value} QEMU "
                             f"(pid {self._held[key].pid}) here.")
        self._held[key] = inst

    def change(self, inst: QemuInstance, to: Role) -> None:
        """Give ``inst`` role ``to`` (refused off the table, or if another QEMU of the
        VM holds that role)."""
        if inst.role == to and self._held.get((inst.vm, to)) is inst:
            return
        if (inst.role, to) not in TRANSITIONS:
            raise StateError(f"the {inst.role.value} QEMU of {inst.vm!r} (pid {inst.pid}) "
                             f"cannot become {to.value}.")
        other = self._held.get((inst.vm, to))
        if other is not None and other is not inst:
            raise StateError(f"VM {inst.vm!r} already has a {to.value} QEMU (pid "
                             f"{other.pid}) here.")
        self.remove(inst)
        inst.role = to
        self._held[(inst.vm, to)] = inst

    def remove(self, inst: QemuInstance) -> None:
        if self._held.get((inst.vm, inst.role)) is inst:
            del self._held[(inst.vm, inst.role)]

    def get(self, vm: str, role: Role = Role.RUNNING) -> QemuInstance | None:
        return self._held.get((vm, role))

    def of(self, vm: str) -> list[QemuInstance]:
        """Every QEMU of ``vm`` here: the running one, the leaving, the incoming."""
        return [self._held[(vm, r)] for r in (Role.RUNNING, Role.LEAVING, Role.INCOMING)
                if (vm, r) in self._held]

    def running(self) -> dict[str, QemuInstance]:
        return {vm: i for (vm, r), i in self._held.items() if r == Role.RUNNING}

    def __iter__(self) -> Iterator[QemuInstance]:
        return iter(list(self._held.values()))

    def __contains__(self, vm: object) -> bool:
        return any(v == vm for v, _ in self._held)


# How long a source QEMU whose stream ended may stay in "finish-migrate" before
# ``run_again`` gives up on it.
FINALIZE_WAIT_S = 10.0


async def run_again(inst: QemuInstance, wait: float = FINALIZE_WAIT_S) -> None:
    """Run the guest of a source QEMU whose stream ended (unless it already runs), once
    QEMU has finished with the stream. QEMU sends its MIGRATION "completed" event
    before its migration thread moves the guest from "finish-migrate" to
    "postmigrate", and refuses `cont` in between ("Migration is not finalized yet"):
    a `cont` sent at once on that event can fail, and the guest would stay paused for
    good. After a failed stream QEMU runs the guest again itself, from the same
    state."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + wait
    while (status := await inst.qmp.query_status()) == "finish-migrate":
        if loop.time() > deadline:
            raise MigrationError(f"the source QEMU of {inst.vm!r} is still finishing its "
                                 f"stream after {wait:.0f} s; it cannot run the guest.")
        await asyncio.sleep(0.002)
    if status != "running":
        await inst.qmp.cont()
