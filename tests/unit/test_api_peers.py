"""The UNIX socket's peers and their roles, without a daemon: the kernel's credentials
of a real socket pair, the groups ``serve --group-role`` maps (refused when they do not
exist or repeat the admin group), the role each peer gets (the highest of its groups,
none: a sentence), and the app behind ``LocalAuth`` answering a viewer's read and
refusing its write. tests/integration/test_api_groups.py does it with real users."""

from __future__ import annotations

import grp
import os
import socket
from typing import Any

import pytest
from fastapi.testclient import TestClient

from fusuma.api.app import Limits, create_app
from fusuma.api.peers import PEER, LocalAccess, Peer, credentials, parse_group_role
from fusuma.api.server import LocalAuth
from fusuma.errors import SpecError
from fusuma.paths import Paths
from fusuma.state.roles import Role
from tests.unit import test_api

paths = test_api.paths

ROOT_GROUP = grp.getgrgid(0).gr_name


def test_the_kernel_names_the_peer() -> None:
    a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    with a, b:
        peer = credentials(a)
    assert peer is not None
    assert (peer.pid, peer.uid, peer.gid) == (os.getpid(), os.getuid(), os.getgid())
    assert set(os.getgroups()) | {os.getgid()} == set(peer.groups)
    tcp = socket.socket()
    with tcp:
        assert credentials(tcp) is None


def test_group_roles_are_parsed_and_checked() -> None:
    assert parse_group_role("fusuma-view=viewer") == ("fusuma-view", Role.VIEWER)
    for bad in ("fusuma-view", "=viewer", "x=root", "x=Viewer"):
        with pytest.raises(SpecError, match="give GROUP=ROLE, ROLE one of metrics, "
                                            "viewer, operator, admin"):
            parse_group_role(bad)
    with pytest.raises(SpecError, match="there is no group 'no-such-group-fz'; create "
                                        "it \\(groupadd no-such-group-fz\\)"):
        LocalAccess.build("fusuma", 4242, (("no-such-group-fz", Role.VIEWER),))
    with pytest.raises(SpecError, match="is the socket's admin group"):
        LocalAccess.build(ROOT_GROUP, 0, ((ROOT_GROUP, Role.VIEWER),))
    with pytest.raises(SpecError, match="is named twice"):
        LocalAccess.build("fusuma", 4242, ((ROOT_GROUP, Role.VIEWER),
                                           (ROOT_GROUP, Role.OPERATOR)))
    access = LocalAccess.build("fusuma", 4242, ((ROOT_GROUP, Role.VIEWER),))
    assert access.open_to_all and access.describe() == {"fusuma": "admin",
                                                        ROOT_GROUP: "viewer"}
    assert not LocalAccess.build("fusuma", 4242).open_to_all


def peer(uid: int, *groups: int) -> Peer:
    return Peer(pid=1, uid=uid, gid=groups[0] if groups else uid, groups=frozenset(groups))


def test_each_peer_holds_the_highest_role_of_its_groups() -> None:
    access = LocalAccess("fusuma", 900, {901: ("view", Role.VIEWER),
                                         902: ("ops", Role.OPERATOR),
                                         903: ("prom", Role.METRICS)})
    def role(p: Peer | None) -> Any:
        who = access.identity(p)
        return who if isinstance(who, str) else (who.role, who.name)
    assert role(peer(0))[0] is Role.ADMIN
    assert role(peer(70001, 70001, 900))[0] is Role.ADMIN
    assert role(peer(70001, 70001, 901))[0] is Role.VIEWER
    assert role(peer(70001, 901, 903, 902)) == (Role.OPERATOR,
                                                "user '70001' (group 'ops')")
    assert role(peer(70001, 903)) == (Role.METRICS, "user '70001' (group 'prom')")
    assert role(peer(70001, 70001)) == (
        "user '70001' (uid 70001) is in none of the groups that may use this socket: "
        "fusuma (admin), view (viewer), ops (operator), prom (metrics); ask root to add "
        "them to one.")
    # No credentials: refused where other groups may connect; where only root and the
    # admin group can (the socket's mode decides), admin as before.
    assert "without its peer's credentials" in role(None)
    assert role_of(LocalAccess("fusuma", 900), None) is Role.ADMIN


def role_of(access: LocalAccess, p: Peer | None) -> Role | None:
    who = access.identity(p)
    return None if isinstance(who, str) else who.role


class AsPeer:
    """What the UNIX server's protocol does: the connection's peer in the request
    state."""

    def __init__(self, app: Any, p: Peer) -> None:
        self.app, self.peer = app, p

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        scope = {**scope, "state": {**scope.get("state", {}), PEER: self.peer}}
        await self.app(scope, receive, send)


def test_a_viewer_groups_member_reads_and_may_not_write(paths: Paths) -> None:
    access = LocalAccess("fusuma", 900, {901: ("view", Role.VIEWER)})
    app = LocalAuth(Limits(create_app(paths)), "fusuma", access)
    with TestClient(AsPeer(app, peer(70001, 70001, 901)),
                    raise_server_exceptions=False) as c:
        me = c.get("/1.0")
        assert me.status_code == 200, me.text
        assert (me.json()["auth_user_name"], me.json()["auth_role"]) == (
            "user '70001' (group 'view')", "viewer")
        assert c.get("/1.0/vms").status_code == 200
        r = c.post("/1.0/vms", json={"name": "v", "partition": "p0", "memory_mib": 64})
        assert r.status_code == 403 and r.json()["error"] == (
            "POST /1.0/vms needs the operator role; user '70001' (group 'view') has the "
            "viewer role."), r.text
    with TestClient(AsPeer(app, peer(70002, 70002)), raise_server_exceptions=False) as c:
        r = c.get("/1.0")
        assert r.status_code == 403 and "in none of the groups" in r.json()["error"]
