"""A QEMU that did not answer in time says whether it was starved or hung: the seconds
its threads ran and waited runnable for a CPU (/proc schedstat, a fake tree here), and,
when it waited most of the time, that it was starved (fusuma.qemu.process.cpu_note);
and the wait for a new QEMU counts only the time it could run (Patience)."""

from __future__ import annotations

from pathlib import Path

from fusuma.qemu.process import Patience, cpu_note, sched_seconds, thread_states


def fake_proc(root: Path, pid: int, threads: dict[int, str]) -> Path:
    for tid, text in threads.items():
        d = root / str(pid) / "task" / str(tid)
        d.mkdir(parents=True)
        (d / "schedstat").write_text(text)
    return root


def test_a_starved_qemu_is_said_to_be_starved_not_hung(tmp_path: Path) -> None:
    # Two threads: 0.2 s and 0.05 s on a CPU, 20 s and 8.5 s runnable waiting.
    proc = fake_proc(tmp_path, 42, {42: "200000000 20000000000 900\n",
                                    43: "50000000 8500000000 100\n"})
    assert sched_seconds(42, proc) == (0.25, 28.5)
    assert cpu_note(42, 30.0, proc) == (
        " (it ran 0.25 s and waited 28.5 s for a CPU: starved of CPU by busier processes "
        "on its cores, not hung)")


def test_a_qemu_that_had_its_cpu_is_not_called_starved(tmp_path: Path) -> None:
    proc = fake_proc(tmp_path, 42, {42: "3000000000 100000000 50\n",
                                    43: "garbled\n"})
    assert cpu_note(42, 30.0, proc) == " (it ran 3.00 s and waited 0.1 s for a CPU)"


def test_a_process_gone_says_nothing(tmp_path: Path) -> None:
    assert sched_seconds(7, tmp_path) is None and cpu_note(7, 30.0, tmp_path) == ""


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def set_waited(proc: Path, pid: int, waited_s: float) -> None:
    d = proc / str(pid) / "task" / str(pid)
    d.mkdir(parents=True, exist_ok=True)
    (d / "schedstat").write_text(f"1000 {int(waited_s * 1e9)} 5\n")


def test_a_hung_process_is_given_up_on_at_the_limit(tmp_path: Path) -> None:
    # Asleep or blocked: it waits for no CPU, so the clock's time is all its own.
    clock = Clock()
    set_waited(tmp_path, 42, 0.5)
    p = Patience(42, 30.0, proc=tmp_path, clock=clock)
    clock.now += 29.9
    assert not p.expired()
    clock.now += 0.2
    assert p.expired()
    assert p.said() == "within 30 s"


def test_a_starved_process_is_waited_for_until_it_had_its_time(tmp_path: Path) -> None:
    clock = Clock()
    set_waited(tmp_path, 42, 0.5)
    p = Patience(42, 30.0, proc=tmp_path, clock=clock)
    clock.now += 45.0
    set_waited(tmp_path, 42, 0.5 + 40.0)      # 40 of the 45 s waiting for a CPU
    assert not p.expired()
    clock.now += 24.0                         # 69 s in all, 29 of them its own
    assert not p.expired()
    clock.now += 2.0                          # 31 s its own
    assert p.expired()
    assert p.said() == "within 30 s of the time it could run (71 s in all, 40 s of them " \
                       "waiting for a CPU)"


def test_patience_has_a_cap_on_the_clock(tmp_path: Path) -> None:
    clock = Clock()
    set_waited(tmp_path, 42, 0.0)
    p = Patience(42, 30.0, proc=tmp_path, clock=clock)
    clock.now += 299.0
    set_waited(tmp_path, 42, 299.0)           # starved the whole time
    assert not p.expired()
    clock.now += 1.0
    assert p.expired()


def test_a_process_that_cannot_be_read_is_held_to_the_clock(tmp_path: Path) -> None:
    clock = Clock()
    p = Patience(7, 30.0, proc=tmp_path, clock=clock)
    clock.now += 30.0
    assert p.expired()


def test_thread_states_name_what_each_non_vcpu_thread_waits_on(tmp_path: Path) -> None:
    for tid, comm, state, wchan in ((50, "qemu-system-x86", "S", "do_sys_poll"),
                                    (51, "CPU 0/TCG", "R", "0"),
                                    (52, "live_migration", "D", "unix_stream_sendmsg")):
        d = tmp_path / "50" / "task" / str(tid)
        d.mkdir(parents=True)
        (d / "comm").write_text(comm + "\n")
        (d / "stat").write_text(f"{tid} ({comm}) {state} 1 2 3\n")
        (d / "wchan").write_text(wchan)
    assert thread_states(50, tmp_path) == (
        "qemu-system-x86 S do_sys_poll; live_migration D unix_stream_sendmsg")
    assert thread_states(51, tmp_path) == ""
