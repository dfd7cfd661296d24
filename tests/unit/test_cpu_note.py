"""A QEMU that did not answer in time says whether it was starved or hung: the seconds
its threads ran and waited runnable for a CPU (/proc schedstat, a fake tree here), and,
when it waited most of the time, that it was starved (fusuma.qemu.process.cpu_note)."""

from __future__ import annotations

from pathlib import Path

from fusuma.qemu.process import cpu_note, sched_seconds


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
