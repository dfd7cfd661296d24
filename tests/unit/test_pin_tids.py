"""Thread ids a QEMU reports are pinned only if they are its own threads.

Real processes, no VM: a stand-in "QEMU" with one extra thread, and a victim process
whose pid the "QEMU" claims as a vCPU thread. The victim's affinity must not change,
the stand-in's real thread is pinned, and the supervisor says so in a warning."""

from __future__ import annotations

import asyncio
import logging
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any, cast

import pytest

from fusuma.qemu import process
from fusuma.qemu.qmp import VcpuInfo
from fusuma.supervisor.host import PartitionHost

CPUS = sorted(os.sched_getaffinity(0))
pytestmark = pytest.mark.skipif(len(CPUS) < 2, reason="needs two CPUs to tell pinned apart")

STAND_IN = """
import threading, time
def vcpu():
    print(threading.get_native_id(), flush=True)
    time.sleep(60)
threading.Thread(target=vcpu, daemon=True).start()
time.sleep(60)
"""


@pytest.fixture
def procs() -> Iterator[tuple[int, int, int]]:
    """(stand-in QEMU pid, its extra thread's id, a victim's pid), ended afterwards."""
    qemu = subprocess.Popen([sys.executable, "-c", STAND_IN], stdout=subprocess.PIPE,
                            text=True)
    victim = subprocess.Popen(["sleep", "60"])
    try:
        assert qemu.stdout is not None
        tid = int(qemu.stdout.readline())
        yield qemu.pid, tid, victim.pid
    finally:
        for p in (qemu, victim):
            p.kill()
            p.wait()


def test_a_foreign_tid_is_never_pinned(procs: tuple[int, int, int]) -> None:
    qemu, tid, victim = procs
    assert os.sched_getaffinity(victim) == set(CPUS)
    assert process.is_thread_of(qemu, tid) and process.is_thread_of(qemu, qemu)
    # The pid of another process, and ids that are nobody's, are not its threads.
    assert process.foreign_tids(qemu, [tid, victim, 0, -5, 2**22 + 12345]) == \
        [victim, 0, -5, 2**22 + 12345]

    given = process.pin(qemu, [tid, victim], [CPUS[0], CPUS[1]], others=[CPUS[1]])
    assert given[tid] == [CPUS[0]]
    assert victim not in given
    assert os.sched_getaffinity(victim) == set(CPUS)          # untouched
    assert os.sched_getaffinity(tid) == {CPUS[0]}
    assert os.sched_getaffinity(qemu) == {CPUS[1]}            # its other threads


def test_the_supervisor_warns_and_pins_only_its_own(procs: tuple[int, int, int],
                                                     caplog: pytest.LogCaptureFixture
                                                     ) -> None:
    qemu, tid, victim = procs

    class Qmp:
        async def query_cpus_fast(self) -> list[VcpuInfo]:
            # vCPU 1 "is" the victim: a QEMU that lies, or that someone else controls.
            return [VcpuInfo(index=0, thread_id=tid), VcpuInfo(index=1, thread_id=victim)]

    h = PartitionHost.__new__(PartitionHost)
    h.partition = "p0"
    h.log = logging.getLogger("fusuma.test.pin")
    h.db = cast(Any, SimpleNamespace(partition=lambda name: SimpleNamespace(cpus=CPUS)))
    inst = cast(Any, SimpleNamespace(vm="vm0", pid=qemu, qmp=Qmp(), vcpu_tids=None))
    with caplog.at_level(logging.WARNING, logger="fusuma.test.pin"):
        got = asyncio.run(h._repin(inst))
    assert got == [CPUS[0]]
    assert os.sched_getaffinity(victim) == set(CPUS)
    assert [r.getMessage() for r in caplog.records] == [
        f"vm0: QEMU pid {qemu} reports vCPU thread id(s) {victim} that are not threads "
        "of its own; nothing is pinned there"]


def test_a_qemu_is_asked_for_its_vcpu_threads_once(procs: tuple[int, int, int]) -> None:
    """Each move's commit re-pins every VM of its partition: the vCPU threads, fixed
    for a QEMU's life, are asked once per QEMU, not once per move; a report that named
    a foreign thread is not kept, so the next re-pin asks again."""
    qemu, tid, victim = procs
    asked: list[str] = []

    class Qmp:
        def __init__(self, tids: list[int]) -> None:
            self.tids = tids

        async def query_cpus_fast(self) -> list[VcpuInfo]:
            asked.append("q")
            return [VcpuInfo(index=i, thread_id=t) for i, t in enumerate(self.tids)]

    h = PartitionHost.__new__(PartitionHost)
    h.partition = "p0"
    h.log = logging.getLogger("fusuma.test.pin")
    h.db = cast(Any, SimpleNamespace(partition=lambda name: SimpleNamespace(cpus=CPUS)))
    inst = cast(Any, SimpleNamespace(vm="vm0", pid=qemu, qmp=Qmp([tid]), vcpu_tids=None))
    for offset in (0, 1, 0):
        assert asyncio.run(h._repin(inst, offset)) == [CPUS[offset]]
        assert os.sched_getaffinity(tid) == {CPUS[offset]}
    assert asked == ["q"] and inst.vcpu_tids == [tid]
    liar = cast(Any, SimpleNamespace(vm="vm1", pid=qemu, qmp=Qmp([tid, victim]),
                                     vcpu_tids=None))
    asyncio.run(h._repin(liar))
    asyncio.run(h._repin(liar))
    assert asked == ["q", "q", "q"] and liar.vcpu_tids is None


def test_a_reused_id_gets_its_affinity_back(procs: tuple[int, int, int],
                                            monkeypatch: pytest.MonkeyPatch) -> None:
    """The race: the thread ends right after the check and its id goes to another
    task. Seen afterwards, that task's old affinity is put back."""
    qemu, _tid, victim = procs
    checks = iter([True, False])
    monkeypatch.setattr(process, "is_thread_of", lambda pid, t: next(checks))
    assert process._set_affinity(qemu, victim, [CPUS[0]]) is False
    assert os.sched_getaffinity(victim) == set(CPUS)
    assert Path(f"/proc/{victim}").exists()
