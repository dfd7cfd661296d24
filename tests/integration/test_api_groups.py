"""Local groups with roles on a real `fusuma serve`: root makes two groups and three
users for the test (removed after it), starts the daemon with ``--group-role
GROUP=viewer`` and ``GROUP=operator``, and each user, as a real non-root process on the
UNIX socket, gets its group's role from the kernel's word (SO_PEERCRED) alone: the
viewer reads (200) and is refused a write (403, one sentence, nothing made), the
operator defines a VM but may not make a partition, a user in no such group is refused
everything, and root stays admin."""

from __future__ import annotations

import json
import stat
import subprocess
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import pytest

from tests.apikit import Api
from tests.conftest import Host
from tests.integration import test_api

pytestmark = [pytest.mark.integration, pytest.mark.timeout(180)]

daemons = test_api.daemons

# Run as another user: the system's python and the standard library only.
CLIENT = r"""
import json, socket, sys
path, method, target, body = sys.argv[1:5]
s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
s.connect(path)
data = body.encode()
s.sendall(f"{method} {target} HTTP/1.1\r\nHost: fusuma\r\nConnection: close\r\n"
          f"Content-Type: application/json\r\nContent-Length: {len(data)}\r\n\r\n"
          .encode() + data)
buf = b""
while chunk := s.recv(65536):
    buf += chunk
head, _, payload = buf.partition(b"\r\n\r\n")
print(json.dumps({"status": int(head.split(b" ", 2)[1]), "body": payload.decode()}))
"""


@dataclass
class User:
    name: str
    groups: list[str]


@pytest.fixture
def people() -> Iterator[dict[str, User]]:
    """Two groups and three users of this test only (userdel/groupdel at the end)."""
    tag = uuid.uuid4().hex[:6]
    view, ops = f"fzview{tag}", f"fzops{tag}"
    users = {"viewer": User(f"fzv{tag}", [view]), "operator": User(f"fzo{tag}", [ops]),
             "both": User(f"fzb{tag}", [view, ops]), "nobody": User(f"fzn{tag}", [])}
    made_groups: list[str] = []
    made_users: list[str] = []
    try:
        for g in (view, ops):
            subprocess.run(["groupadd", g], check=True, capture_output=True)
            made_groups.append(g)
        for u in users.values():
            extra = ["-G", ",".join(u.groups)] if u.groups else []
            subprocess.run(["useradd", "--no-create-home", "--shell", "/usr/sbin/nologin",
                            "--user-group", *extra, u.name], check=True,
                           capture_output=True)
            made_users.append(u.name)
        yield {"view": User(view, []), "ops": User(ops, []), **users}
    finally:
        for name in made_users:
            subprocess.run(["userdel", name], capture_output=True)
        for g in made_groups:
            subprocess.run(["groupdel", g], capture_output=True)


def as_user(api: Api, user: str) -> Callable[..., tuple[int, Any]]:
    def call(method: str, target: str, body: Any = None) -> tuple[int, Any]:
        p = subprocess.run(["setpriv", f"--reuid={user}", f"--regid={user}",
                            "--init-groups", "/usr/bin/python3", "-I", "-c", CLIENT,
                            str(api.socket), method, target,
                            "" if body is None else json.dumps(body)],
                           capture_output=True, text=True, timeout=30, cwd="/")
        assert p.returncode == 0, p.stderr
        got = json.loads(p.stdout)
        return got["status"], json.loads(got["body"]) if got["body"] else None
    return call


def test_local_groups_hold_their_roles(host: Host, daemons: Callable[..., Api],
                                       people: dict[str, User]) -> None:
    host.run("partition", "create", "p0", "--cpus", host.core(0), "--memory", "512")
    view, ops = people["view"].name, people["ops"].name
    api = daemons(args=("--group-role", f"{view}=viewer", "--group-role", f"{ops}=operator"))
    assert api.info["group_roles"] == {"fusuma": "admin", view: "viewer", ops: "operator"}
    # Every local user may reach the socket now; the kernel's credentials decide.
    assert stat.S_IMODE(api.socket.stat().st_mode) == 0o666
    assert stat.S_IMODE(api.socket.parent.stat().st_mode) == 0o711

    viewer = as_user(api, people["viewer"].name)
    code, me = viewer("GET", "/1.0")
    assert code == 200 and (me["auth_user_name"], me["auth_role"]) == (
        f"user {people['viewer'].name!r} (group {view!r})", "viewer"), me
    code, listed = viewer("GET", "/1.0/partitions")
    assert code == 200 and [p["name"] for p in listed] == ["p0"]
    vm = {"name": "v1", "partition": "p0", "memory_mib": 64}
    code, err = viewer("POST", "/1.0/vms", vm)
    assert (code, err["error"]) == (403, (
        f"POST /1.0/vms needs the operator role; user {people['viewer'].name!r} "
        f"(group {view!r}) has the viewer role.")), err
    code, _ = viewer("PUT", "/1.0/vms/v1/state", {"action": "start"})
    assert code == 403
    assert host.run("vm", "list", "--json").json() == []

    operator = as_user(api, people["operator"].name)
    code, err = operator("POST", "/1.0/partitions",
                         {"name": "p1", "cpus": "1", "memory_mib": 256})
    assert (code, err["error"]) == (403, (
        f"POST /1.0/partitions needs the admin role; user {people['operator'].name!r} "
        f"(group {ops!r}) has the operator role.")), err
    code, op = operator("POST", "/1.0/vms", vm)
    assert code == 202, op
    with api.unix() as root:
        done = root.get(f"/1.0/operations/{op['id']}/wait", params={"timeout": 60}).json()
        assert done["status"] == "Success", done
        me = root.get("/1.0").json()
        assert (me["auth_user_name"], me["auth_role"]) == (
            "the UNIX socket (group fusuma)", "admin")
    assert [v["name"] for v in host.run("vm", "list", "--json").json()] == ["v1"]
    assert [p["name"] for p in host.run("partition", "list", "--json").json()] == ["p0"]

    # In both groups: the higher role.
    code, me = as_user(api, people["both"].name)("GET", "/1.0")
    assert (code, me["auth_role"]) == (200, "operator"), me
    # In neither: nothing, not even a read, and the sentence says why.
    code, err = as_user(api, people["nobody"].name)("GET", "/1.0/vms")
    assert code == 403 and err["error"].startswith(
        f"user {people['nobody'].name!r} (uid "), err
    assert "is in none of the groups that may use this socket" in err["error"]


def test_without_group_roles_only_root_and_the_admin_group_reach_it(
        host: Host, daemons: Callable[..., Api], people: dict[str, User]) -> None:
    api = daemons()
    assert stat.S_IMODE(api.socket.stat().st_mode) == 0o660
    assert stat.S_IMODE(api.socket.parent.stat().st_mode) == 0o750
    p = subprocess.run(["setpriv", f"--reuid={people['viewer'].name}",
                        f"--regid={people['viewer'].name}", "--init-groups",
                        "/usr/bin/python3", "-I", "-c", CLIENT, str(api.socket), "GET",
                        "/1.0", ""], capture_output=True, text=True, timeout=30, cwd="/")
    assert p.returncode != 0 and "PermissionError" in p.stderr, p.stdout
