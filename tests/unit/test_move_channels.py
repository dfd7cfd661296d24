"""A stream's channels: how many (both sides set the same) and their compression."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from fusuma.errors import QemuError, StateError
from fusuma.supervisor.moves.source import (
    MAX_CHANNELS,
    MULTIFD_COMPRESSION,
    capabilities,
    set_channels,
)


class Qmp:
    def __init__(self, zstd: bool = True) -> None:
        self.params: dict[str, Any] = {}
        self.zstd = zstd

    async def migrate_set_parameters(self, params: dict[str, Any]) -> None:
        if "multifd-compression" in params and not self.zstd:
            raise QemuError("QMP migrate-set-parameters failed: Parameter "
                            "'multifd-compression' does not accept value 'zstd'")
        self.params.update(params)


def test_one_channel_sets_nothing_and_no_multifd() -> None:
    q = Qmp()
    asyncio.run(set_channels(q, 1))  # type: ignore[arg-type]
    assert q.params == {}
    assert capabilities("copy", 1)["multifd"] is False


def test_several_channels_are_compressed_with_zstd_level_1() -> None:
    q = Qmp()
    asyncio.run(set_channels(q, 4))  # type: ignore[arg-type]
    assert q.params == {"multifd-channels": 4, **MULTIFD_COMPRESSION}
    assert q.params["multifd-compression"] == "zstd"
    assert capabilities("copy", 4)["multifd"] is True


def test_a_qemu_without_zstd_is_one_sentence() -> None:
    with pytest.raises(StateError, match="cannot compress a move's stream with zstd"):
        asyncio.run(set_channels(Qmp(zstd=False), 4))  # type: ignore[arg-type]


@pytest.mark.parametrize("n", [0, MAX_CHANNELS + 1])
def test_channels_out_of_range(n: int) -> None:
    q = Qmp()
    with pytest.raises(StateError, match=f"1 to {MAX_CHANNELS} channels"):
        asyncio.run(set_channels(q, n))  # type: ignore[arg-type]
    assert q.params == {}
