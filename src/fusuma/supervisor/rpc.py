"""Typed requests and replies between a partition supervisor and its callers.

Every supervisor operation is one request class (a frozen dataclass naming its reply
class as its type argument) in :data:`REQUESTS`, the one table from wire name to
request; the supervisor maps each request class to one handler
(``Supervisor.handlers``), and callers use ``SupervisorClient.send(request)``, whose
return type is the request's reply class. A reader and a type checker follow a call
from the CLI into the supervisor by class, never by string.

Wire format, one JSON object per line::

    request  {"v": 2, "request": "start", "args": {"vm": "vm0", "wait_agent": 0.0}}
    reply    {"v": 2, "ok": true, "result": {"vm": "vm0", "pid": 4242}}
             {"v": 2, "ok": false, "error": "one sentence", "kind": "StateError"}

``v`` is :data:`PROTOCOL_VERSION`. A request of another version is refused with one
sentence and never acted on; version 1 named the operation ``op``, so a supervisor of
version 1 answers a version 2 request with an error, never by doing something.
"""

from __future__ import annotations

import dataclasses
import json
import types
import typing
from dataclasses import field
from typing import Any, ClassVar, Generic, TypeVar

from fusuma import errors
from fusuma.frozen import frozen

PROTOCOL_VERSION = 2

R = TypeVar("R")


class Request(Generic[R]):
    """One supervisor operation; ``R`` is its reply class."""

    OP: ClassVar[str]


def reply_type(req: type[Request[Any]]) -> type[Any]:
    """The reply class a request class names as its type argument."""
    for base in getattr(req, "__orig_bases__", ()):
        if typing.get_origin(base) is Request:
            arg = typing.get_args(base)[0]
            if isinstance(arg, str):
                arg = globals()[arg]
            return typing.cast(type[Any], arg)
    raise TypeError(f"{req.__name__} names no reply class")


# -- replies ------------------------------------------------------------------------------
@frozen
class Pong:
    pid: int
    partition: str
    vms: list[str]


@frozen
class VmPid:
    vm: str
    pid: int | None = None


@frozen
class Running:
    vms: list[VmPid]


@frozen
class Seconds:
    seconds: float


@frozen
class Ended:
    """A QEMU ended, or was already gone: ``was`` says which."""

    vm: str
    was: str
    pid: int | None = None
    # A released move source: from QMP ``quit`` to the process's end, and from that to
    # its exit handled (records, sockets), in ms.
    quit_ms: float | None = None
    handled_ms: float | None = None


@frozen
class ExecResult:
    exit_code: int
    signal: int | None
    stdout: str          # base64
    stderr: str          # base64


@frozen
class Trimmed:
    vm: str
    resident_before_mib: float | None
    resident_after_mib: float | None
    returned_mib: float | None
    seconds: float


@frozen
class Resized:
    vm: str
    drive: str
    old_size: int
    size: int


@frozen
class BackedUp:
    """A backup point written whole (its manifest last)."""

    vm: str
    dest: str                  # the chain's directory
    point: int
    kind: str                  # full | incremental
    chain: str
    bytes: int                 # the point's files on disk
    disk_bytes: int            # the disks' virtual sizes
    seconds: float
    frozen: bool               # the guest agent froze the filesystems at the point
    files: list[str]
    # The raw disks an incremental point copied whole (no dirty bitmap on a raw file).
    whole: list[str] = field(default_factory=list)


@frozen
class Snapshot:
    """A snapshot taken (fusuma.supervisor.snapshots), as recorded."""

    vm: str
    name: str
    memory: bool
    disks: list[str]
    created_at: float
    running: bool
    frozen: bool
    vmstate_bytes: int | None = None
    seconds: float = 0.0


@frozen
class SnapshotDone:
    """A snapshot restored or deleted; ``state``: the VM's state after it."""

    vm: str
    name: str
    state: str
    seconds: float


@frozen
class TemplateSaved:
    template: str
    vm: str
    ms: float
    state_bytes: int
    unbound: list[str]


@frozen
class GovernorReport:
    """The governor's controls and decisions, a document for display (``governor
    status``, ``top``, the API): its shape is ``Governor.status``'s."""

    status: dict[str, Any]


@frozen
class Pins:
    """Each VM's vCPU cores after a repin."""

    cores: dict[str, list[int]]


@frozen
class Prepared:
    """A move's destination QEMU, waiting for the stream (or, in place, for the old
    QEMU's descriptors)."""

    pid: int
    prepare_ms: float
    run_dir: str
    uri: str | None = None
    dest_ram: str | None = None
    binary: str | None = None
    version: str | None = None
    # A move from another host of a VM with a thin disk: where its disk is served
    # (tcp:ADDRESS:PORT, NBD) for the source's mirror.
    nbd: str | None = None


@frozen
class Streamed:
    """A move's source after its stream completed (it is then the leaving side)."""

    t0: float
    stop_ts: float | None
    qemu_total_ms: float | None
    qemu_downtime_ms: float | None
    bytes_sent: int
    source_pid: int
    paused: bool
    # An in-place move's: the new QEMU's pid, when it connected, the mode the old QEMU
    # reported, and when the guest ran again on the new one.
    dest_pid: int | None = None
    connected_ts: float | None = None
    source_mode: str | None = None
    resume_ts: float | None = None
    # When the source QEMU said its stream completed (its MIGRATION event's time).
    completed_ts: float | None = None


@frozen
class Resumed:
    """The guest runs on this QEMU (a destination that took it, or a source again)."""

    pid: int
    resume_ts: float
    already: bool = False
    # A destination's steps between the stream's end and the guest's run, each the
    # host's realtime (seconds) when it ended (``fusuma.supervisor.moves.dest.STEPS``).
    steps: dict[str, float] = field(default_factory=dict)


@frozen
class Settled:
    vm: str
    moved: bool
    unbound_ports: list[str] = field(default_factory=list)


@frozen
class Instance:
    """One QEMU a supervisor holds of a VM, as QEMU itself reports it."""

    role: str            # "vm" | "leaving" | "incoming"
    pid: int
    status: str
    migration: str
    run_dir: str


@frozen
class Instances:
    instances: list[Instance]


@frozen
class StreamState:
    """An incoming stream from another host: ``completed``, ``failed``, ``cancelled``,
    ``gone`` (its QEMU exited), ``running`` (committed) or still in progress."""

    status: str
    pid: int | None = None


# -- requests -----------------------------------------------------------------------------
@frozen
class Ping(Request[Pong]):
    OP: ClassVar[str] = "ping"


@frozen
class Status(Request[Running]):
    OP: ClassVar[str] = "status"


@frozen
class Start(Request[VmPid]):
    OP: ClassVar[str] = "start"
    vm: str
    wait_agent: float = 0.0


@frozen
class WaitAgent(Request[Seconds]):
    """Wait until the guest agent answers; the reply is seconds since QEMU started."""

    OP: ClassVar[str] = "wait-agent"
    vm: str
    timeout: float = 60.0


@frozen
class Stop(Request[Ended]):
    OP: ClassVar[str] = "stop"
    vm: str
    timeout: float = 10.0


@frozen
class Kill(Request[Ended]):
    OP: ClassVar[str] = "kill"
    vm: str


@frozen
class Exec(Request[ExecResult]):
    OP: ClassVar[str] = "exec"
    vm: str
    argv: list[str]
    stdin: str | None = None     # base64
    timeout: float = 60.0


@frozen
class Trim(Request[Trimmed]):
    OP: ClassVar[str] = "trim"
    vm: str
    timeout: float = 60.0


@frozen
class ResizeDisk(Request[Resized]):
    """Grow a VM's disk, online while it runs (QMP ``block_resize``), else offline: its
    thin disk (``disk`` "") or a registered disk attached to it."""

    OP: ClassVar[str] = "resize-disk"
    vm: str
    disk: str
    size: int


@frozen
class Backup(Request[BackedUp]):
    """Back up a running VM's disks into backup ``dest`` (a name, or from root's CLI
    a path in a storage directory: ``anywhere``), fully or on its last point."""

    OP: ClassVar[str] = "backup"
    vm: str
    dest: str
    incremental: bool = False
    anywhere: bool = False
    max_bandwidth: int = 0     # bytes/s for the copy; 0: no limit


@frozen
class SnapshotCreate(Request[Snapshot]):
    """Snapshot a VM's qcow2 disks (``memory``: its RAM and device state too)."""

    OP: ClassVar[str] = "snapshot-create"
    vm: str
    name: str
    memory: bool = False


@frozen
class SnapshotRestore(Request[SnapshotDone]):
    OP: ClassVar[str] = "snapshot-restore"
    vm: str
    name: str


@frozen
class SnapshotDelete(Request[SnapshotDone]):
    OP: ClassVar[str] = "snapshot-delete"
    vm: str
    name: str


@frozen
class TemplateSave(Request[TemplateSaved]):
    OP: ClassVar[str] = "template-save"
    vm: str
    template: str
    fault: str = ""


@frozen
class GovernorStatus(Request[GovernorReport]):
    OP: ClassVar[str] = "governor-status"
    limit: int = 50


@frozen
class Repin(Request[Pins]):
    OP: ClassVar[str] = "repin"


@frozen
class IncomingPrepare(Request[Prepared]):
    """Destination, same host: a QEMU waiting for the stream of ``vm``."""

    OP: ClassVar[str] = "incoming-prepare"
    vm: str
    mode: str
    fault_decide_delay: float = 0.0


@frozen
class MigrateOut(Request[Streamed]):
    """Source: stream ``vm`` to ``uri``; it is then the leaving side."""

    OP: ClassVar[str] = "migrate-out"
    vm: str
    uri: str
    mode: str
    max_bandwidth: int = 0
    # To another host: the destination host, whose certificate the stream's TLS
    # requires; ``plain_tcp`` sends it in the clear (the benchmark's before only).
    tls_peer: str = ""
    plain_tcp: bool = False
    channels: int = 1          # multifd connections (as the destination prepared)
    # A VM with a thin disk, to another host: the destination's NBD export
    # (tcp:ADDRESS:PORT) its top layer is mirrored to before the stream; the mirror's
    # bytes/s at most (0: no limit; fault injection in tests).
    nbd: str = ""
    mirror_speed: int = 0


@frozen
class CprPrepare(Request[Prepared]):
    """In place: a new QEMU waiting for the old one's descriptors."""

    OP: ClassVar[str] = "cpr-prepare"
    vm: str
    fault_decide_delay: float = 0.0


@frozen
class CprTransfer(Request[Streamed]):
    OP: ClassVar[str] = "cpr-transfer"
    vm: str
    fault_incoming_delay: float = 0.0


@frozen
class IncomingFinish(Request[Resumed]):
    """Destination: wait until the guest runs here."""

    OP: ClassVar[str] = "incoming-finish"
    vm: str
    timeout: float = 30.0


@frozen
class IncomingCommit(Request[Resumed]):
    """Destination: record "forward" and run the guest here."""

    OP: ClassVar[str] = "incoming-commit"
    vm: str


@frozen
class IncomingAbort(Request[Ended]):
    OP: ClassVar[str] = "incoming-abort"
    vm: str


@frozen
class Release(Request[Ended]):
    """Source: end the leaving QEMU once the outcome is "forward"."""

    OP: ClassVar[str] = "release"
    vm: str


@frozen
class ResumeSource(Request[Resumed]):
    """Source: run the guest again once the outcome is "back"."""

    OP: ClassVar[str] = "resume-source"
    vm: str


@frozen
class Settle(Request[Settled]):
    OP: ClassVar[str] = "settle"
    vm: str


@frozen
class ListInstances(Request[Instances]):
    OP: ClassVar[str] = "instances"
    vm: str


@frozen
class RemoteIncoming(Request[Prepared]):
    """Destination, another host's move: a QEMU listening on ``tcp:LISTEN:<port>``
    for host ``peer``'s stream, under TLS (``tls`` False: the benchmark's before)."""

    OP: ClassVar[str] = "remote-incoming"
    vm: str
    listen: str
    peer: str
    tls: bool = True
    channels: int = 1
    nbd: bool = False          # serve the VM's thin disk for the source's mirror
    # Its thin disk is on shared storage, the source's very files: kept inactive until
    # the commit (late-block-activate), never mirrored.
    shared_disk: bool = False


@frozen
class RemoteIncomingWait(Request[StreamState]):
    OP: ClassVar[str] = "remote-incoming-wait"
    vm: str
    timeout: float = 2.0


#: The one table from wire name to request class.
REQUESTS: dict[str, type[Request[Any]]] = {cls.OP: cls for cls in (
    Ping, Status, Start, WaitAgent, Stop, Kill, Exec, Trim, ResizeDisk, Backup, TemplateSave,
    GovernorStatus, Repin, IncomingPrepare, MigrateOut, CprPrepare, CprTransfer, IncomingFinish,
    IncomingCommit, IncomingAbort, Release, ResumeSource, Settle, ListInstances,
    RemoteIncoming, RemoteIncomingWait, SnapshotCreate, SnapshotRestore, SnapshotDelete)}


# -- the wire -----------------------------------------------------------------------------
class ProtocolError(errors.SupervisorError):
    """A message that is not of this protocol (version, name, fields, JSON)."""


class _Invalid(Exception):
    def __init__(self, where: str, why: str) -> None:
        super().__init__(f"field {where}: {why}")


_HINTS: dict[type[Any], dict[str, Any]] = {}


def _hints(cls: type[Any]) -> dict[str, Any]:
    if cls not in _HINTS:
        hints = typing.get_type_hints(cls)
        _HINTS[cls] = {f.name: hints[f.name] for f in dataclasses.fields(cls)}
    return _HINTS[cls]


def _value(value: Any, kind: Any, where: str, strict: bool) -> Any:
    """``value`` as ``kind`` (a field's annotation: str, int, float, bool, None, unions
    of them, list[X], dict[str, X], Any, or a dataclass of this module), or _Invalid.
    ``strict``: a field the dataclass does not have is refused (requests), else left
    out (replies).
    Checked by hand, not by a validation library: a move's replies are decoded in its
    downtime, on the cores its QEMUs share."""
    origin = typing.get_origin(kind)
    if kind is Any:
        return value
    if origin in (typing.Union, types.UnionType):
        for option in typing.get_args(kind):
            try:
                return _value(value, option, where, strict)
            except _Invalid:
                continue
        raise _Invalid(where, f"{value!r} is none of {kind}")
    if kind is type(None):
        if value is None:
            return None
        raise _Invalid(where, "expected null")
    if origin is list:
        if not isinstance(value, list):
            raise _Invalid(where, "expected a list")
        (item,) = typing.get_args(kind)
        return [_value(v, item, f"{where}.{i}", strict) for i, v in enumerate(value)]
    if origin is dict:
        if not isinstance(value, dict) or not all(isinstance(k, str) for k in value):
            raise _Invalid(where, "expected an object")
        _, item = typing.get_args(kind)
        return {k: _value(v, item, f"{where}.{k}", strict) for k, v in value.items()}
    if dataclasses.is_dataclass(kind):
        return _fields(typing.cast(type[Any], kind), value, where, strict)
    if kind is float and isinstance(value, int | float) and not isinstance(value, bool):
        return float(value)
    if kind in (str, int, bool) and type(value) is kind:
        return value
    raise _Invalid(where, f"expected {getattr(kind, '__name__', kind)}, got "
                          f"{type(value).__name__}")


def _fields(cls: type[Any], data: Any, where: str, strict: bool) -> Any:
    """A dataclass from ``data``. Fields compatible across versions of fusuma: a sender
    leaves out what equals its default (``_wire``), so a field added later reaches an
    older reader only when it is used. A request's field that this side does not know
    is then refused (an older supervisor must not half-do what was asked); a reply's
    is left out (a newer supervisor telling more)."""
    if not isinstance(data, dict):
        raise _Invalid(where or "(top)", "not an object")
    hints = _hints(cls)
    unknown = sorted(set(data) - set(hints))
    if unknown and strict:
        raise ProtocolError(f"fields this supervisor does not know ({', '.join(unknown)})")
    args = {}
    for f in dataclasses.fields(cls):
        at = f"{where}.{f.name}" if where else f.name
        if f.name in data:
            args[f.name] = _value(data[f.name], hints[f.name], at, strict)
        elif f.default is dataclasses.MISSING and \
                f.default_factory is dataclasses.MISSING:
            raise _Invalid(at, "Field required")
    return cls(**args)


def _load(cls: type[R], data: Any, what: str, strict: bool) -> R:
    if not isinstance(data, dict):
        raise ProtocolError(f"{what} is not an object.")
    try:
        return typing.cast(R, _fields(typing.cast(type[Any], cls), data, "", strict))
    except ProtocolError as exc:
        raise ProtocolError(f"{what} has {exc}.") from exc
    except _Invalid as exc:
        raise ProtocolError(f"{what}: {exc}.") from exc


def _wire(obj: Any) -> dict[str, Any]:
    """``obj``'s fields as sent: the ones equal to their default left out (see
    ``_fields``)."""
    out = {}
    for f in dataclasses.fields(obj):
        value = getattr(obj, f.name)
        if f.default is not dataclasses.MISSING and value == f.default:
            continue
        if f.default_factory is not dataclasses.MISSING and value == f.default_factory():
            continue
        out[f.name] = _plain(value)
    return out


def _plain(value: Any) -> Any:
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return _wire(value)
    if isinstance(value, list | tuple):
        return [_plain(v) for v in value]
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    return value


def encode_request(req: Request[Any]) -> bytes:
    return json.dumps({"v": PROTOCOL_VERSION, "request": req.OP,
                       "args": _wire(req)}).encode() + b"\n"


def decode_request(line: bytes) -> Request[Any]:
    """The request in one line, or ProtocolError with one sentence."""
    try:
        msg = json.loads(line)
    except ValueError as exc:
        raise ProtocolError("the request is not JSON.") from exc
    if not isinstance(msg, dict):
        raise ProtocolError("the request is not a JSON object.")
    version = msg.get("v", 1)
    if version != PROTOCOL_VERSION:
        raise ProtocolError(f"this supervisor speaks protocol version {PROTOCOL_VERSION} "
                            f"and the request is of version {version}: use the fusuma "
                            "that started it, or restart it with `fusuma partition "
                            "restart` (its VMs keep running).")
    name = msg.get("request")
    cls = REQUESTS.get(str(name))
    if cls is None:
        raise ProtocolError(f"unknown supervisor request {name!r}.")
    try:
        return _load(cls, msg.get("args") or {}, f"request {name!r}", True)
    except ProtocolError as exc:
        if "does not know" not in str(exc):
            raise
        raise ProtocolError(f"{str(exc).rstrip('.')}: it was started by an "
                            "older fusuma; restart it with `fusuma partition restart` "
                            "(its VMs keep running).") from exc


def encode_reply(result: Any) -> bytes:
    return json.dumps({"v": PROTOCOL_VERSION, "ok": True,
                       "result": dataclasses.asdict(result)}).encode() + b"\n"


def encode_error(exc: BaseException) -> bytes:
    kind = type(exc).__name__ if isinstance(exc, errors.FusumaError) else "FusumaError"
    if not hasattr(errors, kind):
        kind = "SupervisorError" if isinstance(exc, errors.SupervisorError) else "FusumaError"
    return json.dumps({"v": PROTOCOL_VERSION, "ok": False, "kind": kind,
                       "error": str(exc) or type(exc).__name__}).encode() + b"\n"


def decode_reply(req: Request[R], line: bytes, partition: str) -> R:
    """The reply to ``req``, or the error it carries raised as its own class."""
    try:
        msg = json.loads(line)
    except ValueError as exc:
        raise ProtocolError(f"the supervisor of partition {partition!r} sent a garbled "
                            f"answer to {req.OP!r}; see its log.") from exc
    if not isinstance(msg, dict) or msg.get("v", 1) != PROTOCOL_VERSION:
        version = msg.get("v", 1) if isinstance(msg, dict) else "unknown"
        raise ProtocolError(
            f"the supervisor of partition {partition!r} speaks protocol version {version} "
            f"and this fusuma speaks {PROTOCOL_VERSION}: it was started by another "
            f"version of fusuma; restart it with `fusuma partition restart {partition}` "
            "(its VMs keep running).")
    if not msg.get("ok"):
        cls = getattr(errors, str(msg.get("kind", "FusumaError")), errors.FusumaError)
        if not (isinstance(cls, type) and issubclass(cls, errors.FusumaError)):
            cls = errors.FusumaError
        raise cls(str(msg.get("error") or "the supervisor reported an unknown error"))
    return _load(typing.cast(type[R], reply_type(type(req))), msg.get("result"),
                 f"the reply of partition {partition!r} to {req.OP!r}", False)
