"""One identity per host: `fusuma cluster join NAME` makes host NAME's ServiceAccount,
its roles and a kubeconfig with a token for it; `fusuma cluster leave NAME` removes
them (and so revokes every token of it).

As Kubernetes has ``system:node:NAME`` in ``system:nodes`` for its kubelets, a fusuma
host is the ServiceAccount ``fusuma-system/fusuma-host-NAME`` (tokens from the
TokenRequest API, bound to the account: deleting it revokes them), or a user
``fusuma:host:NAME`` (a client certificate from your own CA, CN ``fusuma:host:NAME``),
bound to the same roles. RBAC grants the verbs (its roles below: its own heartbeat
Lease and certificate Secret by name); which objects and fields it may write is the
admission policy's (``fusuma.cluster.policy``).
"""

from __future__ import annotations

import base64
import contextlib
import logging
import os
import re
import tempfile
from pathlib import Path
from typing import Any

import yaml

from fusuma.cluster import GROUP, SYSTEM_NAMESPACE, ClusterError, NotFoundApiError
from fusuma.cluster.kube import MANIFEST_KINDS, Kind, Kube, KubeConfig, Obj
from fusuma.cluster.lease import PLACEMENT_LEASE, ROOM_LEASE, host_lease_name

LOG = logging.getLogger(__name__)
HOST_USER_PREFIX = "fusuma:host:"
SA_PREFIX = "fusuma-host-"
SA_USER_PREFIX = f"system:serviceaccount:{SYSTEM_NAMESPACE}:{SA_PREFIX}"
# A FusumaHost name: a DNS label short enough for the ServiceAccount's name.
HOST_NAME_RE = re.compile(r"^[a-z0-9]([-a-z0-9]{0,49}[a-z0-9])?\Z")
RBAC = "rbac.authorization.k8s.io"
SERVICE_ACCOUNT = MANIFEST_KINDS["ServiceAccount"]
SELF_REVIEW = Kind("authentication.k8s.io", "v1", "selfsubjectreviews", False,
                   "SelfSubjectReview")
DEFAULT_TOKEN_HOURS = 24 * 365


def check_host_name(host: str) -> str:
    if not HOST_NAME_RE.match(host):
        raise ClusterError(f"host name {host!r} is not allowed: use 1-51 characters of "
                           "a-z, 0-9 and '-', starting and ending with a letter or digit.")
    return host


def account(host: str) -> str:
    """The ServiceAccount (in fusuma-system) and the roles of host ``host``."""
    return f"{SA_PREFIX}{host}"


def certificate_secret(host: str) -> str:
    """The Secret (in fusuma-system) that holds host ``host``'s own certificate; only it
    may read it."""
    return f"{SA_PREFIX}{host}"


def host_of(username: str) -> str | None:
    """The host a user name is the identity of (None: not a host's)."""
    for prefix in (HOST_USER_PREFIX, SA_USER_PREFIX):
        if username.startswith(prefix):
            return username[len(prefix):]
    return None


def cluster_rules() -> list[Obj]:
    """What every host may do cluster-wide (the policy narrows the writes to its own)."""
    ours = ["fusumahosts", "fusumapartitions", "fusumavms", "fusumasegments",
            "fusumanetworks"]
    return [
        {"apiGroups": [GROUP], "resources": ours, "verbs": ["get", "list", "watch"]},
        # Registering itself (create cannot be limited by name in RBAC: the policy does).
        {"apiGroups": [GROUP], "resources": ["fusumahosts"], "verbs": ["create"]},
        # Finalizers of what is placed on it.
        {"apiGroups": [GROUP], "resources": ["fusumapartitions", "fusumavms",
                                             "fusumasegments", "fusumanetworks"],
         "verbs": ["update", "patch"]},
        {"apiGroups": [GROUP], "resources": [f"{r}/status" for r in ours],
         "verbs": ["get", "update", "patch"]},
        # Addresses on the cluster's networks (the policy: only those it holds).
        {"apiGroups": [GROUP], "resources": ["fusumaaddresses"],
         "verbs": ["get", "list", "watch", "create", "update", "delete"]},
        {"apiGroups": [""], "resources": ["events"], "verbs": ["create", "patch"]},
        {"apiGroups": ["events.k8s.io"], "resources": ["events"],
         "verbs": ["create", "patch"]},
    ]


def namespace_rules(host: str) -> list[Obj]:
    """What host ``host`` may do in fusuma-system: its own heartbeat Lease, the
    placement Lease and the room ledger, its own certificate Secret (read)."""
    return [
        {"apiGroups": ["coordination.k8s.io"], "resources": ["leases"],
         "verbs": ["get", "list", "watch", "create"]},
        {"apiGroups": ["coordination.k8s.io"], "resources": ["leases"],
         "resourceNames": [host_lease_name(host), PLACEMENT_LEASE, ROOM_LEASE],
         "verbs": ["update", "patch"]},
        {"apiGroups": [""], "resources": ["secrets"],
         "resourceNames": [certificate_secret(host)], "verbs": ["get", "watch"]},
    ]


def host_objects(host: str) -> list[Obj]:
    """Host ``host``'s ServiceAccount, roles and bindings (all named fusuma-host-NAME)."""
    name = account(check_host_name(host))
    labels = {"fusuma.io/host": host}
    subjects = [{"kind": "ServiceAccount", "name": name, "namespace": SYSTEM_NAMESPACE},
                {"kind": "User", "apiGroup": RBAC, "name": f"{HOST_USER_PREFIX}{host}"}]
    ns_md = {"name": name, "namespace": SYSTEM_NAMESPACE, "labels": labels}
    return [
        {"apiVersion": "v1", "kind": "ServiceAccount", "metadata": ns_md},
        {"apiVersion": f"{RBAC}/v1", "kind": "ClusterRole",
         "metadata": {"name": name, "labels": labels}, "rules": cluster_rules()},
        {"apiVersion": f"{RBAC}/v1", "kind": "ClusterRoleBinding",
         "metadata": {"name": name, "labels": labels},
         "roleRef": {"apiGroup": RBAC, "kind": "ClusterRole", "name": name},
         "subjects": subjects},
        {"apiVersion": f"{RBAC}/v1", "kind": "Role", "metadata": ns_md,
         "rules": namespace_rules(host)},
        {"apiVersion": f"{RBAC}/v1", "kind": "RoleBinding", "metadata": ns_md,
         "roleRef": {"apiGroup": RBAC, "kind": "Role", "name": name},
         "subjects": subjects},
    ]


def request_token(kube: Kube, host: str, hours: int) -> tuple[str, str]:
    """A token of host ``host``'s ServiceAccount (TokenRequest) and when it expires."""
    path = SERVICE_ACCOUNT.path(SYSTEM_NAMESPACE, account(host), "token")
    out = kube.request("POST", path, {
        "apiVersion": "authentication.k8s.io/v1", "kind": "TokenRequest",
        "spec": {"expirationSeconds": hours * 3600}})
    st = out.get("status") or {}
    if not st.get("token"):
        raise ClusterError(f"the API server gave no token for {account(host)}.")
    return str(st["token"]), str(st.get("expirationTimestamp") or "")


def kubeconfig(cfg: KubeConfig, host: str, token: str, server: str | None = None) -> str:
    """A kubeconfig for host ``host``'s agent: the admin's cluster (its server, or
    ``server``, and its CA), the host's token."""
    cluster: dict[str, Any] = {"server": server or cfg.server}
    if cfg.ca_pem:
        cluster["certificate-authority-data"] = base64.b64encode(
            cfg.ca_pem.encode()).decode()
    user = account(host)
    doc = {"apiVersion": "v1", "kind": "Config", "current-context": f"fusuma-{host}",
           "clusters": [{"name": "fusuma", "cluster": cluster}],
           "users": [{"name": user, "user": {"token": token}}],
           "contexts": [{"name": f"fusuma-{host}",
                         "context": {"cluster": "fusuma", "user": user}}]}
    return yaml.safe_dump(doc, sort_keys=False)


def write_private(path: Path, text: str) -> None:
    """Write ``text`` to ``path`` readable by its owner only (0600), replacing it
    atomically; never through a symlink."""
    path = path.absolute()
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


def remove(kube: Kube, host: str) -> list[str]:
    """Delete host ``host``'s identity (its tokens stop working); what was deleted."""
    gone = []
    for obj in reversed(host_objects(host)):
        md = obj["metadata"]
        kind = MANIFEST_KINDS[obj["kind"]]
        if kube.find(kind, md["name"], md.get("namespace")) is not None:
            with contextlib.suppress(NotFoundApiError):
                kube.delete(kind, md["name"], md.get("namespace"))
            gone.append(f"{obj['kind']} {md['name']}")
    return gone


def whoami(kube: Kube) -> str:
    """The user name the API server knows this client as (SelfSubjectReview)."""
    out = kube.request("POST", SELF_REVIEW.path(), {
        "apiVersion": SELF_REVIEW.api_version, "kind": SELF_REVIEW.kind})
    return str(((out.get("status") or {}).get("userInfo") or {}).get("username") or "")


def check_agent(kube: Kube, host: str) -> None:
    """Refuse to run host ``host``'s agent with another host's identity (every write
    would be refused); warn when it is no host's identity at all (an admin's: nothing
    keeps it to this host's objects)."""
    try:
        user = whoami(kube)
    except ClusterError as exc:
        LOG.warning("cannot ask the API server who this agent is: %s", exc)
        return
    owner = host_of(user)
    if owner is None:
        LOG.warning("the agent of host %s runs as %r, which is no host's identity: "
                    "nothing keeps it to its own objects; give it one with `fusuma "
                    "cluster join %s`", host, user, host)
    elif owner != host:
        raise ClusterError(f"the kubeconfig is host {owner}'s identity ({user}), not host "
                           f"{host}'s: run this agent with --host-name {owner}, or make "
                           f"host {host}'s identity with `fusuma cluster join {host}`.")
