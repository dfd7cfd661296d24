"""Root of fusuma's exception tree.

Every error a user can trigger carries one sentence that says what is wrong and how to
fix it; the CLI prints ``str(exc)`` and exits non-zero.

    FusumaError
     ├── SpecError          a malformed or impossible host spec / CLI argument
     ├── NotFoundError      an unknown partition, VM or disk
     ├── ConflictError      a duplicate name, an overlapping core, a disk in use
     ├── ResourceError      more cores or memory than the host or partition can give
     ├── StateError         an operation called in the wrong lifecycle state
     ├── HostError          the host lacks something (a binary, cgroups, /dev/kvm, ...)
     ├── ImageError         the guest image is missing or cannot be built
     │    └── ImageMissing  (also a NotFoundError) the image asked for is not built
     ├── CgroupError        a cgroup operation failed (fusuma.host.cgroups)
     ├── QemuError          QEMU failed to start or answer (fusuma.qemu)
     │    └── GuestAgentError  the guest agent did not answer or a command failed
     ├── SupervisorError    a partition supervisor is down or answered with an error
     ├── MigrationError     a migration failed (the VM stays where it was)
     ├── SegmentError       a shared segment cannot be built, found or removed
     ├── TemplateError      a template cannot be made, or its files are missing or damaged
     └── NetworkError       a bridge, tap, nftables table or dnsmasq could not be made
"""

from __future__ import annotations

from typing import Any


class FusumaError(Exception):
    """Base of all fusuma errors; ``str()`` is the sentence shown to the user."""

    exit_code = 1


class SpecError(FusumaError):
    """A malformed or impossible spec or argument."""

    exit_code = 2


class NotFoundError(FusumaError):
    """An object named by the user does not exist."""

    exit_code = 3


class ConflictError(FusumaError):
    """The request collides with an existing object."""

    exit_code = 4


class ResourceError(FusumaError):
    """Not enough cores or memory."""

    exit_code = 5


class StateError(FusumaError):
    """An operation was called in a lifecycle state that does not allow it."""

    exit_code = 6


class HostError(FusumaError):
    """The host lacks a binary, a kernel feature or a permission fusuma needs."""

    exit_code = 7


class ImageError(FusumaError):
    """The guest image is missing or could not be built."""

    exit_code = 8


class ImageMissing(ImageError, NotFoundError):
    """The guest image asked for is not built: an ImageError to the CLI (its exit
    code), and an unknown object (404) to the API, like any name not found."""


class CgroupError(FusumaError):
    """A cgroup could not be created, changed or removed."""

    exit_code = 9


class QemuError(FusumaError):
    """QEMU failed to start, crashed, or did not answer on QMP."""

    exit_code = 10

    def __init__(self, message: str, *, argv: list[str] | None = None,
                 exit_status: int | None = None, log_tail: str = "") -> None:
        super().__init__(message)
        self.argv = argv or []
        self.exit_status = exit_status
        self.log_tail = log_tail


class GuestAgentError(QemuError):
    """The guest agent did not answer, or a guest command could not run.

    ``agent_said``: the agent's own error text, which the guest controls (None when
    the sentence is all fusuma's); ``summary``: the sentence without it, for what is
    published (a VM's recorded error, the event log)."""

    def __init__(self, message: str, *, agent_said: str | None = None,
                 summary: str | None = None, **kw: Any) -> None:
        super().__init__(message, **kw)
        self.agent_said = agent_said
        self.summary = summary or message


class SupervisorError(FusumaError):
    """A partition supervisor is not running or reported an error."""

    exit_code = 11


class MigrationError(FusumaError):
    """A migration failed; the message says where the VM runs now."""

    exit_code = 12


class SegmentError(FusumaError):
    """A shared segment cannot be built, attached or removed."""

    exit_code = 13


class TemplateError(FusumaError):
    """A template cannot be made or used: refused, or its files are missing or damaged."""

    exit_code = 14


class NetworkError(FusumaError):
    """A network's kernel side (bridge, tap, nftables) or its dnsmasq failed."""

    exit_code = 15

    def __init__(self, message: str, *, argv: list[str] | None = None,
                 detail: str = "") -> None:
        super().__init__(message)
        self.argv = argv or []
        self.detail = detail
