"""The per-VM log records guest-agent commands and sizes, never guest payloads."""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path

import pytest

from fusuma.qemu.qga import GuestAgent, redact
from tests.unit.test_qga import FakeAgent


def test_exec_log_has_commands_and_sizes_but_no_payload(tmp_path: Path,
                                                        caplog: pytest.LogCaptureFixture
                                                        ) -> None:
    sock = tmp_path / "qga.sock"
    fake = FakeAgent(0.0)
    log = logging.getLogger("fusuma.vm.test-redact")

    async def main() -> None:
        server = await asyncio.start_unix_server(fake.handle, path=str(sock))
        async with server, GuestAgent("vm0", sock, log) as ga:
            await ga.connect(timeout=10)
            await ga.ping()
            res = await ga.run(["/bin/sh", "-c", "echo topsecret-arg"],
                               stdin=b"topsecret-input")
            assert res.stdout == b"hello\n"

    with caplog.at_level(logging.DEBUG, logger="fusuma.vm.test-redact"):
        asyncio.run(main())
    text = "\n".join(r.getMessage() for r in caplog.records)
    assert "guest-exec" in text and "guest-exec-status" in text and "guest-ping" in text
    assert "topsecret" not in text and "/bin/sh" not in text
    # base64 of the input and of the output ("hello\n") are not there either
    assert "dG9wc2VjcmV0" not in text and "aGVsbG8K" not in text
    assert "'arg': '<2 items, 20 bytes>'" in text
    assert "'input-data': '<20 bytes>'" in text and "'out-data': '<8 bytes>'" in text
    assert "'exitcode': 3" in text      # what is not guest data stays in the log


def test_redact_leaves_other_commands_alone() -> None:
    sync = {"execute": "guest-sync-delimited", "arguments": {"id": 5}}
    assert redact(sync) == sync
    assert redact({"return": {"pid": 7}}) == {"return": {"pid": 7}}
    assert redact({"return": [1, 2]}) == {"return": [1, 2]}
    assert redact({"execute": "guest-file-write",
                   "arguments": {"handle": 1, "buf-b64": "QUJD"}}) == {
        "execute": "guest-file-write", "arguments": {"handle": 1, "buf-b64": "<4 bytes>"}}
