"""Who is at the other end of the UNIX socket, and which role that gives them.

The kernel says who connected: ``SO_PEERCRED`` (pid, uid, primary gid) and
``SO_PEERGROUPS`` (the supplementary groups the connecting process held at
``connect()``), read once per connection by the server's protocol
(``fusuma.api.server``) and handed to each of its requests. Nothing the client sends
counts.

Roles, as Incus has ``incus-admin`` and ``incus``: root and members of the socket's
group (``fusuma``, ``serve --group``) are admin; ``serve --group-role GROUP=ROLE`` gives
the members of another local group that role (``viewer`` for a monitoring team,
``operator`` for those who run guests). A peer in several such groups holds the highest
of their roles; a peer in none is refused (403) with one sentence naming the groups.
"""

from __future__ import annotations

import grp
import os
import pwd
import socket
import struct
from dataclasses import field
from typing import Any

from fusuma.api.roles import Identity, local
from fusuma.errors import SpecError
from fusuma.frozen import frozen
from fusuma.state.roles import ROLES, Role

PEER = "fusuma_peer"                    # the request state's key for the Peer
SO_PEERGROUPS = getattr(socket, "SO_PEERGROUPS", 59)    # Linux 4.13; 59 on x86 and arm
_UCRED = struct.Struct("iII")           # struct ucred: pid_t, uid_t, gid_t
NO_ID = 2**32 - 1                        # (uid_t) -1: the kernel knows no peer
_MAX_GROUPS_BUF = 1024                   # Python's getsockopt takes at most this


@frozen
class Peer:
    """The credentials of a socket's peer when it connected."""

    pid: int
    uid: int
    gid: int
    groups: frozenset[int]

    @property
    def user(self) -> str:
        try:
            return pwd.getpwuid(self.uid).pw_name
        except KeyError:
            return str(self.uid)


def credentials(sock: Any) -> Peer | None:
    """The peer of the connected UNIX socket ``sock`` (None if the kernel says
    nothing: not a UNIX socket)."""
    try:
        pid, uid, gid = _UCRED.unpack(sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED,
                                                      _UCRED.size))
    except (OSError, struct.error):
        return None
    if pid <= 0 or NO_ID in (uid, gid):        # not connected, or no credentials
        return None
    try:
        raw = sock.getsockopt(socket.SOL_SOCKET, SO_PEERGROUPS, _MAX_GROUPS_BUF)
        groups = set(struct.unpack(f"{len(raw) // 4}I", raw[: len(raw) // 4 * 4]))
    except OSError:
        # More groups than fit (or a kernel before 4.13): the user database's.
        try:
            groups = set(os.getgrouplist(pwd.getpwuid(uid).pw_name, gid))
        except KeyError:
            groups = set()
    return Peer(pid, uid, gid, frozenset(groups | {gid}))


def parse_group_role(value: str) -> tuple[str, Role]:
    """``GROUP=ROLE`` of ``serve --group-role``; a SpecError naming the roles else."""
    name, sep, role = value.partition("=")
    if not sep or not name or role not in ROLES:
        raise SpecError(f"--group-role {value!r}: give GROUP=ROLE, ROLE one of "
                        f"{', '.join(ROLES)} (e.g. fusuma-view=viewer).")
    return name, Role(role)


@frozen
class LocalAccess:
    """The socket's groups and their roles: ``admin_group`` (admin) and ``mapped``
    (gid -> group name and role)."""

    admin_group: str
    admin_gid: int | None = None
    mapped: dict[int, tuple[str, Role]] = field(default_factory=dict)

    @classmethod
    def build(cls, admin_group: str, admin_gid: int,
              group_roles: tuple[tuple[str, Role], ...] = ()) -> LocalAccess:
        """Look up each mapped group; a SpecError for one that does not exist, for the
        admin group itself, or for one named twice."""
        mapped: dict[int, tuple[str, Role]] = {}
        for name, role in group_roles:
            if name == admin_group:
                raise SpecError(f"--group-role {name}={role}: group {name!r} is the "
                                f"socket's admin group (--group); map another group.")
            try:
                gid = grp.getgrnam(name).gr_gid
            except KeyError:
                raise SpecError(f"--group-role {name}={role}: there is no group {name!r}; "
                                f"create it (groupadd {name}) and add its users.") from None
            if gid in mapped or gid == admin_gid:
                raise SpecError(f"--group-role {name}={role}: group {name!r} (gid {gid}) "
                                "is named twice.")
            mapped[gid] = (name, role)
        return cls(admin_group, admin_gid, mapped)

    @property
    def open_to_all(self) -> bool:
        """Whether other groups than the admin group may use the socket: then its mode
        lets every local user connect, and the peer's credentials decide."""
        return bool(self.mapped)

    def describe(self) -> dict[str, str]:
        return {self.admin_group: Role.ADMIN.value,
                **{name: role.value for name, role in self.mapped.values()}}

    def identity(self, peer: Peer | None) -> Identity | str:
        """The Identity of ``peer``, or the sentence that refuses it."""
        if peer is None:
            if not self.open_to_all:       # only root and the admin group can connect
                return local(self.admin_group)
            return ("this connection came without its peer's credentials "
                    "(SO_PEERCRED); it is refused.")
        if peer.uid == 0:
            return local(self.admin_group)
        if self.admin_gid is not None and self.admin_gid in peer.groups:
            return Identity(f"user {peer.user!r} (group {self.admin_group!r})", Role.ADMIN)
        held = [(role, name) for gid, (name, role) in self.mapped.items()
                if gid in peer.groups]
        if held:
            role, name = max(held, key=lambda h: ROLES.index(h[0]))
            return Identity(f"user {peer.user!r} (group {name!r})", role)
        groups = ", ".join(f"{g} ({r})" for g, r in self.describe().items())
        return (f"user {peer.user!r} (uid {peer.uid}) is in none of the groups that may "
                f"use this socket: {groups}; ask root to add them to one.")
