"""Process-level helpers for QEMU: liveness, identity, pinning, log tails."""

from __future__ import annotations

import contextlib
import os
import signal
import time
from collections.abc import Callable
from pathlib import Path

from fusuma.paths import Paths

PROC = Path("/proc")


def pid_alive(pid: int) -> bool:
    """True while ``pid`` exists and is not a zombie."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    # The state letter follows the ")" that closes the command name.
    return stat.rsplit(")", 1)[1].split()[0] not in ("Z", "X")


def cmdline(pid: int) -> list[str]:
    try:
        raw = Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return []
    return [a.decode(errors="replace") for a in raw.split(b"\0") if a]


def daemon_pid(candidates: list[int | None], module: str, name: str) -> int | None:
    """The first of ``candidates`` that is alive and runs ``python -m MODULE NAME`` (a
    partition supervisor, a network's keeper): a recorded pid is never trusted alone."""
    for pid in candidates:
        if pid and pid_alive(pid):
            argv = cmdline(pid)
            if module in argv and argv[-1] == name:
                return pid
    return None


# Below this, uids of a host's own users and services (Debian gives logins 1000-59999):
# a QEMU whose run dir is gone must run above it.
FIRST_SANDBOX_UID = 65536


def is_vm_process(pid: int, vm: str, run_dir: Path) -> bool:
    """True if ``pid`` is a QEMU of ``vm`` whose sockets live under ``run_dir`` (guards
    against pid reuse on adoption, and against a process that only looks like one).

    Any user can write such a command line, so the process must also run as the uid
    that owns ``run_dir`` (the VM's own: root makes that directory for it), or, once
    that directory is gone, as a uid no login or service of the host has."""
    argv = cmdline(pid)
    if not (f"guest={vm},debug-threads=on" in argv
            and any(f"path={run_dir}/" in a for a in argv)):
        return False
    try:
        uids = set(_uids(Path(f"/proc/{pid}/status").read_text()))
    except (OSError, ValueError):
        return False
    if len(uids) != 1:
        return False
    [uid] = uids
    try:
        return uid == run_dir.stat().st_uid
    except OSError:
        return uid >= FIRST_SANDBOX_UID


def threads(pid: int, proc: Path = PROC) -> list[int]:
    """Process ``pid``'s thread ids, in order (empty when it cannot be read)."""
    try:
        return sorted(int(t) for t in os.listdir(proc / str(pid) / "task"))
    except (OSError, ValueError):
        return []


def sched_seconds(pid: int, proc: Path = PROC) -> tuple[float, float] | None:
    """Seconds process ``pid``'s threads ran on a CPU and waited runnable for one, from
    their ``schedstat`` (threads gone meanwhile are not counted); None when the
    process cannot be read."""
    ran = waited = 0
    try:
        tids = os.listdir(proc / str(pid) / "task")
    except OSError:
        return None
    for t in tids:
        with contextlib.suppress(OSError, ValueError):
            run_ns, wait_ns, _ = (proc / str(pid) / "task" / t / "schedstat").read_text().split()
            ran, waited = ran + int(run_ns), waited + int(wait_ns)
    return ran / 1e9, waited / 1e9


def main_thread_waited(pid: int, proc: Path = PROC) -> float | None:
    """Seconds process ``pid``'s main thread has waited runnable for a CPU (its
    ``schedstat``); None when it cannot be read."""
    try:
        return int((proc / str(pid) / "task" / str(pid) / "schedstat").read_text()
                   .split()[1]) / 1e9
    except (OSError, ValueError, IndexError):
        return None


class Patience:
    """How long to wait for a new process's first sign of life (a QEMU's monitor
    socket): ``limit_s`` seconds of the time it could have run. The seconds its main
    thread (the one that sets the machine up) waited runnable for a CPU do not count,
    up to ``cap_s`` of the clock in all. A process that hangs (asleep, or blocked on
    I/O) waits for no CPU and is given up on after ``limit_s``; one starved by busier
    processes on its cores (a best-effort VM beside a busy one, a nested guest on a
    loaded host) is not called hung."""

    def __init__(self, pid: int, limit_s: float, cap_s: float | None = None,
                 proc: Path = PROC, clock: Callable[[], float] = time.monotonic) -> None:
        self.pid, self.limit_s, self.proc, self.clock = pid, limit_s, proc, clock
        self.cap_s = cap_s if cap_s is not None else 10 * limit_s
        self.t0 = clock()
        self.q0 = main_thread_waited(pid, proc) or 0.0
        self.starved_s = 0.0

    def elapsed(self) -> float:
        return self.clock() - self.t0

    def expired(self) -> bool:
        wall = self.elapsed()
        if wall < self.limit_s:
            return False
        if wall >= self.cap_s:
            return True
        waited = main_thread_waited(self.pid, self.proc)
        self.starved_s = max(0.0, (waited or 0.0) - self.q0) if waited is not None else 0.0
        return wall - self.starved_s >= self.limit_s

    def said(self) -> str:
        """``within N s`` for an error message, with the clock's whole time when the
        process was starved meanwhile."""
        wall = self.elapsed()
        if wall - self.limit_s < 1:
            return f"within {self.limit_s:.0f} s"
        return (f"within {self.limit_s:.0f} s of the time it could run ({wall:.0f} s in "
                f"all, {self.starved_s:.0f} s of them waiting for a CPU)")


def thread_states(pid: int, proc: Path = PROC, limit: int = 12) -> str:
    """Process ``pid``'s threads other than vCPUs, each with its state and where the
    kernel has it wait (``wchan``), for a message about a QEMU that does not finish
    something: e.g. "live_migration S unix_stream_read_generic"; empty if unknown."""
    out = []
    for t in threads(pid, proc):
        d = proc / str(pid) / "task" / str(t)
        try:
            comm = (d / "comm").read_text().strip()
            stat = (d / "stat").read_text()
            state = stat.rsplit(")", 1)[1].split()[0]
        except (OSError, IndexError):
            continue
        if comm.startswith("CPU "):
            continue
        try:
            wchan = (d / "wchan").read_text().strip() or "-"
        except OSError:
            wchan = "?"
        out.append(f"{comm} {state} {wchan}")
    more = f", and {len(out) - limit} more" if len(out) > limit else ""
    return "; ".join(out[:limit]) + more


def cpu_note(pid: int, waited_s: float, proc: Path = PROC) -> str:
    """What a process that kept someone waiting ``waited_s`` seconds did meanwhile,
    for an error message: a starved process is not a hung one (empty if unknown)."""
    got = sched_seconds(pid, proc)
    if got is None:
        return ""
    ran, queued = got
    note = f" (it ran {ran:.2f} s and waited {queued:.1f} s for a CPU"
    if queued > waited_s / 2:
        note += ": starved of CPU by busier processes on its cores, not hung"
    return note + ")"


def is_thread_of(pid: int, tid: int) -> bool:
    """True if ``tid`` is a thread of process ``pid`` now. The kernel shows
    ``/proc/PID/task/TID`` only for a thread of PID's own thread group, so the id of
    another process (or of one of its threads) is never taken for one."""
    return tid > 0 and os.path.isdir(f"/proc/{pid}/task/{tid}")


def foreign_tids(pid: int, tids: list[int]) -> list[int]:
    """The ids in ``tids`` (what a QEMU says its vCPU threads are) that are not
    threads of ``pid``: a QEMU is not trusted to name only its own."""
    return [t for t in tids if not is_thread_of(pid, t)]


def _set_affinity(pid: int, tid: int, cpus: list[int]) -> bool:
    """Pin thread ``tid`` of ``pid`` to ``cpus``; False if it is not (or is no longer)
    a thread of ``pid``. A thread that ends between the check and the call can leave
    its id to another task: checked again afterwards, that task gets its old
    affinity back."""
    if not is_thread_of(pid, tid):
        return False
    try:
        before = os.sched_getaffinity(tid)
        os.sched_setaffinity(tid, cpus)
    except ProcessLookupError:
        return False
    if not is_thread_of(pid, tid):
        with contextlib.suppress(OSError):
            os.sched_setaffinity(tid, before)
        return False
    return True


def pin(pid: int, vcpu_tids: list[int], cpus: list[int],
        offset: int = 0, others: list[int] | None = None) -> dict[int, list[int]]:
    """Pin vCPU i to cpus[(offset + i) % n] and every other thread (the emulator
    threads) to ``others`` (default: all of ``cpus``).

    ``offset`` spreads the vCPUs of several VMs in one partition over its cores.
    ``vcpu_tids`` come from the QEMU (``query-cpus-fast``): only those that are threads
    of ``pid`` are touched (:func:`foreign_tids` names the others, for a warning).

    Returns the affinity given to each thread id. Threads that exit meanwhile are
    skipped: QEMU starts and ends helper threads on its own.
    """
    given: dict[int, list[int]] = {}
    vset = set(vcpu_tids)
    for tid in threads(pid):
        if tid in vset:
            continue
        if _set_affinity(pid, tid, others or cpus):
            given[tid] = list(others or cpus)
    for i, tid in enumerate(vcpu_tids):
        target = [cpus[(offset + i) % len(cpus)]]
        if _set_affinity(pid, tid, target):
            given[tid] = target
    return given


def kill(pid: int, sig: int = signal.SIGKILL) -> bool:
    """Send ``sig``; False if the process was already gone."""
    try:
        os.kill(pid, sig)
    except ProcessLookupError:
        return False
    return True


def tail(path: Path, lines: int = 10) -> str:
    """The last ``lines`` lines of a log file, or "" if it cannot be read.

    fusuma's own "--- date argv" header lines in QEMU logs are skipped: they are
    never the message a user needs."""
    try:
        data = path.read_bytes()[-16384:]
    except OSError:
        return ""
    text = [ln for ln in data.decode(errors="replace").splitlines()
            if not ln.startswith("--- ")]
    return "\n".join(text[-lines:])


def _uids(status: str) -> list[int]:
    for line in status.splitlines():
        if line.startswith("Uid:"):
            return [int(u) for u in line.split()[1:]]
    return []


def qemu_vm(pid: int, paths: Paths, proc: Path = PROC) -> str | None:
    """The VM whose QEMU of this fusuma namespace ``pid`` is, or None.

    Its argv must name the VM (``-name guest=NAME,debug-threads=on``) and put its
    sockets in that VM's run dir, and it must run as root or as a uid of this
    namespace's VM range: any user can write such an argv, only root can start a
    process under those uids."""
    try:
        raw = (proc / str(pid) / "cmdline").read_bytes()
        uids = _uids((proc / str(pid) / "status").read_text())
    except (OSError, ValueError):
        return None
    argv = [a.decode(errors="replace") for a in raw.split(b"\0") if a]
    names = [argv[i + 1] for i, a in enumerate(argv[:-1]) if a == "-name"]
    if len(names) != 1 or not names[0].startswith("guest=") \
            or not names[0].endswith(",debug-threads=on"):
        return None
    vm = names[0][len("guest="):-len(",debug-threads=on")]
    if not any(f"path={paths.vm_run_dir(vm)}/" in a for a in argv):
        return None
    if len(uids) != 4 or not all(u == 0 or any(u in r for r in paths.qemu_uids)
                                 for u in uids):
        return None
    return vm


def _maps_file(line: str, target: str, inode: int | None) -> bool:
    """True if a /proc/PID/maps line maps exactly ``target`` (the path, or the path
    the kernel marks deleted) and, while a file is there, that very file (by inode:
    the device column is the superblock's, which stat does not always report)."""
    fields = line.split(maxsplit=5)
    if len(fields) != 6 or fields[5] not in (target, f"{target} (deleted)"):
        return False
    return inode is None or fields[4] == str(inode)


def mapped_by(path: Path, paths: Paths, proc: Path = PROC) -> list[int]:
    """The QEMUs of this fusuma namespace (:func:`qemu_vm`) that map ``path`` now,
    compared by exact path and inode: no other process, whatever its command line,
    can keep a RAM file from being removed."""
    target = str(path)
    try:
        inode: int | None = os.stat(path).st_ino
    except OSError:
        inode = None
    out = []
    for d in proc.iterdir():
        if not d.name.isdigit() or qemu_vm(int(d.name), paths, proc) is None:
            continue
        try:
            maps = (d / "maps").read_text()
        except OSError:
            continue
        if any(_maps_file(line, target, inode) for line in maps.splitlines()):
            out.append(int(d.name))
    return sorted(out)


def remove_unmapped(path: Path | str, paths: Paths, proc: Path = PROC) -> bool:
    """Unlink a guest RAM file unless a QEMU of this namespace still maps it; True if
    it was removed."""
    p = Path(path)
    if mapped_by(p, paths, proc):
        return False
    try:
        p.unlink()
    except FileNotFoundError:
        return False
    return True


def vm_pids(vm: str, run_dir: Path) -> list[int]:
    """Every live QEMU process of VM ``vm`` whose sockets live under ``run_dir`` (this
    fusuma namespace's: another FUSUMA_RUNTIME_DIR may run a VM of the same name)."""
    out = []
    for d in Path("/proc").iterdir():
        if d.name.isdigit() and is_vm_process(int(d.name), vm, run_dir) \
                and pid_alive(int(d.name)):
            out.append(int(d.name))
    return out


def end_unmanaged(pid: int, vm: str, run_root: Path, timeout: float = 10.0) -> bool:
    """End a QEMU of ``vm`` that no instance holds (one that never opened QMP), by its
    pid checked against its command line; True if it was one and is gone."""
    if not (pid_alive(pid) and is_vm_process(pid, vm, run_root)):
        return False
    kill(pid)
    deadline = time.monotonic() + timeout
    while pid_alive(pid) and time.monotonic() < deadline:
        time.sleep(0.02)
    return not pid_alive(pid)
