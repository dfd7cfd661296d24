"""The console log: the supervisor's side of QEMU's console FIFO, capped and rotated.

Real FIFOs and a real writer process stand in for QEMU (no VM here; the flooding guest
is tests/fault/test_untrusted.py)."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
from pathlib import Path

import pytest

from fusuma.errors import HostError
from fusuma.paths import Paths, console_log_max
from fusuma.qemu import consolelog, privilege
from fusuma.qemu.consolelog import CappedLog, ConsoleLog, ConsolePump, open_pipe, rotated
from tests.unit.test_privilege import cfg, open_fds

CAP = 64 * 1024


def stream(n: int) -> bytes:
    """``n`` bytes of numbered lines, so that any piece shows where it came from."""
    out = b"".join(b"%08d\n" % i for i in range(n // 9 + 1))
    return out[:n]


def kept(path: Path) -> bytes:
    return (rotated(path).read_bytes() if rotated(path).exists() else b"") + \
        path.read_bytes()


def test_capped_log_rotates_once_and_keeps_the_latest(tmp_path: Path) -> None:
    path = tmp_path / "console.log"
    log = CappedLog(ConsoleLog(path, CAP))
    data = stream(5 * CAP + 123)
    for i in range(0, len(data), 1000):
        log.write(data[i:i + 1000])
        assert path.stat().st_size <= CAP
    log.close()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["console.log", "console.log.1"]
    assert rotated(path).stat().st_size <= CAP
    both = kept(path)
    # What is kept is the end of the stream, without a gap: the rotated file, then the
    # current one.
    assert data.endswith(both) and len(both) > CAP


def test_a_write_larger_than_the_cap_keeps_its_end(tmp_path: Path) -> None:
    path = tmp_path / "console.log"
    log = CappedLog(ConsoleLog(path, CAP))
    log.write(b"old\n")
    big = stream(3 * CAP)
    log.write(big)
    log.close()
    assert path.read_bytes() == big[-CAP:]
    assert rotated(path).read_bytes() == b"old\n"


def test_two_writers_follow_each_others_rotation(tmp_path: Path) -> None:
    """A move's two QEMUs, each with its supervisor, write one VM's log."""
    path = tmp_path / "console.log"
    a, b = CappedLog(ConsoleLog(path, CAP)), CappedLog(ConsoleLog(path, CAP))
    for i in range(200):
        (a if i % 2 else b).write(b"%04d" % i + b"x" * 995 + b"\n")
        assert path.stat().st_size <= CAP
        assert not rotated(path).exists() or rotated(path).stat().st_size <= CAP
    a.close()
    b.close()
    tail = path.read_bytes().splitlines()
    assert tail[-1].startswith(b"0199") and tail[-2].startswith(b"0198")


async def _pump_until_closed(pump: ConsolePump, timeout: float = 20) -> None:
    pump.start()
    deadline = asyncio.get_running_loop().time() + timeout
    while pump.open and asyncio.get_running_loop().time() < deadline:
        await asyncio.sleep(0.01)
    assert not pump.open, "the pump did not see QEMU's end of the FIFO"


WRITER = """
import os, sys
fd, n = int(sys.argv[1]), int(sys.argv[2])
data = b"".join(b"%08d\\n" % i for i in range(n // 9 + 1))[:n]
view = memoryview(data)
while view:
    view = view[os.write(fd, view[:4096]):]
"""


def test_a_flooding_writer_gets_a_bounded_log_and_nothing_lost_at_its_end(
        tmp_path: Path) -> None:
    fifo, path = tmp_path / consolelog.FIFO_NAME, tmp_path / "console.log"
    reader, writer = open_pipe(fifo)
    total = 20 * CAP + 7
    # The "QEMU": inherits only the write end, floods, exits.
    child = subprocess.Popen([sys.executable, "-c", WRITER, str(writer), str(total)],
                             pass_fds=[writer])
    os.close(writer)
    pump = ConsolePump(reader, ConsoleLog(path, CAP))
    asyncio.run(_pump_until_closed(pump))
    assert child.wait(10) == 0
    assert path.stat().st_size <= CAP and rotated(path).stat().st_size <= CAP
    # The end of the stream, up to its last byte, with no gap, more than one file of it.
    assert stream(total).endswith(kept(path)) and len(kept(path)) > CAP


def test_while_no_supervisor_reads_output_is_dropped_then_resumes(tmp_path: Path) -> None:
    fifo, path = tmp_path / consolelog.FIFO_NAME, tmp_path / "console.log"
    spec = ConsoleLog(path, CAP)
    reader, writer = open_pipe(fifo)

    async def main() -> None:
        pump = ConsolePump(reader, spec)
        pump.start()
        os.write(writer, b"one\n")
        await asyncio.sleep(0.05)
        pump.close()                       # the supervisor stops (QEMU runs on)
        # No reader: QEMU's write fails at once (QEMU ignores SIGPIPE), nothing queues.
        with pytest.raises(BrokenPipeError):
            os.write(writer, b"lost\n")
        again = ConsolePump.reopen(fifo, spec)   # the next supervisor adopts it
        assert again is not None
        again.start()
        os.write(writer, b"two\n")
        os.close(writer)                   # QEMU exits
        deadline = asyncio.get_running_loop().time() + 5
        while again.open and asyncio.get_running_loop().time() < deadline:
            await asyncio.sleep(0.01)
        assert not again.open

    asyncio.run(main())
    assert path.read_bytes() == b"one\ntwo\n"


def test_reopen_takes_only_our_own_fifo(tmp_path: Path) -> None:
    spec = ConsoleLog(tmp_path / "console.log", CAP)
    (tmp_path / "file").write_bytes(b"secret")
    (tmp_path / "link").symlink_to(tmp_path / "file")
    os.mkfifo(tmp_path / "theirs", 0o600)
    if os.geteuid() == 0:
        os.chown(tmp_path / "theirs", 65534, 65534)
    for name in ("missing", "file", "link") + (("theirs",) if os.geteuid() == 0 else ()):
        assert ConsolePump.reopen(tmp_path / name, spec) is None, name
    assert not spec.path.exists()


def test_open_for_qemu_gives_qemu_the_write_end_and_keeps_the_read_end(
        tmp_path: Path) -> None:
    c = cfg(tmp_path, console_fifo=tmp_path / consolelog.FIFO_NAME)
    before = open_fds()
    opened, files = privilege.open_for_qemu(c, os.geteuid(), new_ram=True)
    with files:
        w = opened.console_log_fd
        assert w is not None and w in files.fds and files.console is not None
        assert files.console not in opened.passed_fds()
        os.write(w, b"hello")
        assert os.read(files.console, 16) == b"hello"
        assert not (tmp_path / "console.log").exists()    # QEMU no longer writes it
    assert open_fds() == before, "both ends closed with the files"
    opened, files = privilege.open_for_qemu(c, os.geteuid(), new_ram=False)
    with files:
        reader = files.take_console()
    assert reader is not None and reader in open_fds()
    os.close(reader)


@pytest.mark.parametrize(("raw", "size"), [(None, 16 * 2**20), ("16M", 16 * 2**20),
                                           ("512k", 512 * 1024), ("1G", 2**30),
                                           ("65536", 65536), ("2MiB", 2 * 2**20)])
def test_the_cap_is_configurable(raw: str | None, size: int) -> None:
    assert console_log_max(raw) == size


@pytest.mark.parametrize("raw", ["", "10", "63K", "lots", "-1M", "1T"])
def test_a_bad_cap_is_one_sentence(raw: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FUSUMA_CONSOLE_LOG_MAX", raw)
    with pytest.raises(HostError, match=r"^FUSUMA_CONSOLE_LOG_MAX=.* is not a size of at "
                                        r"least 64K; give bytes or a number with K, M or "
                                        r"G \(default 16M\)\.$"):
        Paths.from_env()
