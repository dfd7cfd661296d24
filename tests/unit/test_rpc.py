"""The supervisor protocol: one typed request and reply per operation, a version."""

from __future__ import annotations

import dataclasses
import json
from typing import Any

import pytest

from fusuma.errors import FusumaError, StateError, SupervisorError
from fusuma.supervisor import rpc
from fusuma.supervisor.daemon import LAZY, Supervisor
from fusuma.supervisor.host import PartitionHost


def test_every_request_has_a_reply_class_and_one_handler() -> None:
    # The table from name to request and the supervisor's table from request to
    # handler, with the groups loaded on first use, hold the same operations (mypy
    # checks each handler's reply type through ``route``).
    for name, cls in rpc.REQUESTS.items():
        assert name == cls.OP
        assert dataclasses.is_dataclass(rpc.reply_type(cls)), name
    sup = object.__new__(Supervisor)
    sup.host = h = object.__new__(PartitionHost)
    eager = set(Supervisor.handlers(sup))
    assert not eager & set(LAZY)
    assert eager | set(LAZY) == set(rpc.REQUESTS.values())
    # Each group answers exactly the requests the lazy table sends it.
    for group in set(LAZY.values()):
        assert [cls for cls, _ in group(h)] == [c for c, g in LAZY.items() if g is group]


def test_requests_round_trip() -> None:
    for req in (rpc.Start("vm0", wait_agent=2.5), rpc.Exec("v", ["/bin/true"], "aGk=", 3.0),
                rpc.MigrateOut("v", "unix:/x", "copy", max_bandwidth=5), rpc.Ping(),
                rpc.RemoteIncomingWait("v", timeout=1.0)):
        assert rpc.decode_request(rpc.encode_request(req)) == req


def test_replies_round_trip_with_nested_types() -> None:
    reply = rpc.Instances([rpc.Instance("vm", 12, "running", "none", "/run/x")])
    line = rpc.encode_reply(reply)
    assert rpc.decode_reply(rpc.ListInstances("v"), line, "p0") == reply
    streamed = rpc.Streamed(t0=1.0, stop_ts=None, qemu_total_ms=3.0, qemu_downtime_ms=None,
                            bytes_sent=210100, source_pid=7, paused=False)
    got = rpc.decode_reply(rpc.MigrateOut("v", "u", "zero-copy"), rpc.encode_reply(streamed),
                           "p0")
    assert got == streamed and isinstance(got, rpc.Streamed)


def test_errors_keep_their_class() -> None:
    line = rpc.encode_error(StateError("VM 'v' is stopped."))
    with pytest.raises(StateError, match="is stopped"):
        rpc.decode_reply(rpc.Stop("v"), line, "p0")
    with pytest.raises(SupervisorError):
        rpc.decode_reply(rpc.Ping(), rpc.encode_error(SupervisorError("down")), "p0")
    # A kind that is not one of fusuma's errors never names another class.
    bad = json.dumps({"v": rpc.PROTOCOL_VERSION, "ok": False, "kind": "os.system",
                      "error": "x"}).encode()
    with pytest.raises(FusumaError) as info:
        rpc.decode_reply(rpc.Ping(), bad, "p0")
    assert type(info.value) is FusumaError
    assert json.loads(rpc.encode_error(ValueError("v")))["kind"] == "FusumaError"


def _line(msg: dict[str, Any]) -> bytes:
    return json.dumps(msg).encode() + b"\n"


def test_another_version_is_one_sentence_on_either_side() -> None:
    # A version 1 supervisor answers without "v": the caller says what to do.
    with pytest.raises(SupervisorError, match=r"speaks protocol version 1 and this fusuma "
                       r"speaks 2.*fusuma partition restart p0"):
        rpc.decode_reply(rpc.Ping(), _line({"ok": True, "result": {"pid": 1}}), "p0")
    # A version 1 request ({"op": ...}) is refused, never acted on.
    with pytest.raises(SupervisorError, match="protocol version 2 and the request is of "
                       "version 1"):
        rpc.decode_request(_line({"op": "stop", "args": {"vm": "v"}}))


@pytest.mark.parametrize(("msg", "says"), [
    ({"v": 2, "request": "format-disk", "args": {}}, "unknown supervisor request"),
    ({"v": 2, "request": "stop", "args": {"vm": "v", "force": True}},
     r"fields this supervisor does not know \(force\): it was started by an older "
     r"fusuma; restart it with `fusuma partition restart`"),
    ({"v": 2, "request": "stop", "args": {}}, "field vm: Field required"),
    ({"v": 2, "request": "exec", "args": {"vm": "v", "argv": "rm -rf /"}},
     "field argv"),
    ({"v": 2, "request": "start", "args": ["vm0"]}, "is not an object"),
])
def test_bad_requests_are_one_sentence(msg: dict[str, Any], says: str) -> None:
    with pytest.raises(SupervisorError, match=says):
        rpc.decode_request(_line(msg))
    with pytest.raises(SupervisorError, match="not JSON"):
        rpc.decode_request(b"{nope\n")


def test_a_malformed_reply_is_one_sentence() -> None:
    with pytest.raises(SupervisorError, match="garbled"):
        rpc.decode_reply(rpc.Ping(), b"<html>\n", "p0")
    with pytest.raises(SupervisorError, match="field pid"):
        rpc.decode_reply(rpc.Ping(), _line({"v": 2, "ok": True, "result": {
            "pid": "many", "partition": "p0", "vms": []}}), "p0")


def test_decoding_needs_no_validation_library() -> None:
    """Replies are decoded in a move's downtime on the cores its QEMUs share: by
    hand, with no library to import or warm up there."""
    import subprocess
    import sys

    code = ("import sys; from fusuma.supervisor import rpc; "
            "r = rpc.Streamed(t0=1.0, stop_ts=2.0, qemu_total_ms=None, "
            "qemu_downtime_ms=1.5, bytes_sent=3, source_pid=4, paused=False); "
            "rpc.decode_reply(rpc.MigrateOut('v', 'u', 'copy'), rpc.encode_reply(r), 'p'); "
            "print('pydantic' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True).stdout.strip()
    assert out == "False"


def test_a_field_at_its_default_is_not_sent() -> None:
    """A field added to a request reaches an older supervisor only when it is used: the
    sender leaves out what equals its default, and the reader fills it in."""

    @dataclasses.dataclass(frozen=True)
    class Old:
        vm: str

    @dataclasses.dataclass(frozen=True)
    class New:
        vm: str
        force: bool = False
        tags: list[str] = dataclasses.field(default_factory=list)

    sent = json.loads(rpc.encode_request(rpc.Stop(vm="v")))
    assert sent["args"] == {"vm": "v"}
    assert rpc._wire(New(vm="v")) == {"vm": "v"}
    assert rpc._wire(New(vm="v", force=True, tags=["a"])) == {"vm": "v", "force": True,
                                                              "tags": ["a"]}
    # What an older reader makes of each: the unused new fields never reach it, a used
    # one is refused (a request) or left out (a reply).
    assert rpc._fields(Old, rpc._wire(New(vm="v")), "", True) == Old(vm="v")
    with pytest.raises(rpc.ProtocolError, match=r"does not know \(force\)"):
        rpc._fields(Old, rpc._wire(New(vm="v", force=True)), "", True)
    assert rpc._fields(Old, rpc._wire(New(vm="v", force=True)), "", False) == Old(vm="v")


def test_a_newer_supervisors_reply_is_read_without_its_new_fields() -> None:
    reply = {"v": 2, "ok": True, "result": {"pid": 7, "partition": "p0", "vms": [],
                                            "added_later": {"x": 1}}}
    got = rpc.decode_reply(rpc.Ping(), _line(reply), "p0")
    assert got.pid == 7
