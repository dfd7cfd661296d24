"""Supervisor wire format: errors cross the socket as their own class."""

from __future__ import annotations

import pytest

from fusuma.errors import FusumaError, StateError, SupervisorError
from fusuma.partition.protocol import error_reply, raise_reply


def test_error_crosses_as_its_class() -> None:
    reply = error_reply(StateError("VM 'v' is stopped."))
    assert reply == {"ok": False, "error": "VM 'v' is stopped.", "kind": "StateError"}
    with pytest.raises(StateError, match="is stopped"):
        raise_reply(reply)


def test_unknown_kind_is_generic_and_ok_returns_result() -> None:
    with pytest.raises(FusumaError, match="x") as info:
        raise_reply({"ok": False, "error": "x", "kind": "os.system"})
    assert type(info.value) is FusumaError
    assert raise_reply({"ok": True, "result": [1]}) == [1]
    assert error_reply(ValueError("v"))["kind"] == "FusumaError"
    with pytest.raises(SupervisorError):
        raise_reply(error_reply(SupervisorError("down")))
