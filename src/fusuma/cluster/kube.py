"""A small Kubernetes client over httpx: a kubeconfig, the REST verbs, watches.

Why not the ``kubernetes`` package or kopf: the agent needs a dozen verbs on five
kinds, with exact control over optimistic concurrency (a between-host move records its
outcome with a resourceVersion precondition) and over when it acts; httpx is already
fusuma's HTTP client, typed, and small. Objects are plain JSON dicts here; the typed
views live in ``fusuma.cluster.resources``.
"""

from __future__ import annotations

import base64
import contextlib
import json
import logging
import os
import ssl
import tempfile
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any
from urllib.parse import quote

import httpx
import yaml

from fusuma.cluster import (
    API_VERSION,
    GROUP,
    VERSION,
    ApiError,
    ClusterError,
    ConflictApiError,
    NotFoundApiError,
)
from fusuma.frozen import frozen

LOG = logging.getLogger(__name__)
Obj = dict[str, Any]


@frozen
class Kind:
    """Where a kind lives in the API: group/version, plural, namespaced or not."""

    group: str
    version: str
    plural: str
    namespaced: bool
    kind: str

    @property
    def api_version(self) -> str:
        return f"{self.group}/{self.version}" if self.group else self.version

    def path(self, namespace: str | None = None, name: str | None = None,
             sub: str | None = None) -> str:
        base = f"/apis/{self.group}/{self.version}" if self.group else f"/api/{self.version}"
        if self.namespaced and namespace:
            base += f"/namespaces/{quote(namespace)}"
        base += f"/{self.plural}"
        if name:
            base += f"/{quote(name)}"
        if sub:
            base += f"/{sub}"
        return base


HOST = Kind(GROUP, VERSION, "fusumahosts", False, "FusumaHost")
PARTITION = Kind(GROUP, VERSION, "fusumapartitions", False, "FusumaPartition")
VM = Kind(GROUP, VERSION, "fusumavms", True, "FusumaVM")
SEGMENT = Kind(GROUP, VERSION, "fusumasegments", False, "FusumaSegment")
NETWORK = Kind(GROUP, VERSION, "fusumanetworks", False, "FusumaNetwork")
ADDRESS = Kind(GROUP, VERSION, "fusumaaddresses", False, "FusumaAddress")
LEASE = Kind("coordination.k8s.io", "v1", "leases", True, "Lease")
EVENT = Kind("", "v1", "events", True, "Event")
NAMESPACE = Kind("", "v1", "namespaces", False, "Namespace")
assert HOST.api_version == API_VERSION
_RBAC = "rbac.authorization.k8s.io"
_ADMISSION = "admissionregistration.k8s.io"
# The kinds `fusuma cluster install` and `join` create, by their ``kind``.
MANIFEST_KINDS = {k.kind: k for k in (
    Kind("apiextensions.k8s.io", "v1", "customresourcedefinitions", False,
         "CustomResourceDefinition"),
    NAMESPACE,
    Kind("", "v1", "serviceaccounts", True, "ServiceAccount"),
    Kind(_RBAC, "v1", "clusterroles", False, "ClusterRole"),
    Kind(_RBAC, "v1", "clusterrolebindings", False, "ClusterRoleBinding"),
    Kind(_RBAC, "v1", "roles", True, "Role"),
    Kind(_RBAC, "v1", "rolebindings", True, "RoleBinding"),
    Kind(_ADMISSION, "v1", "validatingadmissionpolicies", False,
         "ValidatingAdmissionPolicy"),
    Kind(_ADMISSION, "v1", "validatingadmissionpolicybindings", False,
         "ValidatingAdmissionPolicyBinding"),
)}


@frozen
class KubeConfig:
    """The parts of a kubeconfig's current context the agent uses."""

    server: str
    verify: ssl.SSLContext
    token: str | None = None
    # Client certificate and key files the kubeconfig names (inline ones are loaded
    # into ``verify`` and kept nowhere else).
    cert: tuple[str, str] | None = None
    namespace: str | None = None
    # The cluster's CA certificate (PEM) when the kubeconfig names one: `fusuma cluster
    # join` hands it to the host's kubeconfig.
    ca_pem: str | None = None

    @classmethod
    def load(cls, path: Path, context: str | None = None) -> KubeConfig:
        try:
            doc = yaml.safe_load(path.read_text())
        except (OSError, yaml.YAMLError) as exc:
            raise ClusterError(f"cannot read kubeconfig {path}: {exc}.") from exc
        if not isinstance(doc, dict):
            raise ClusterError(f"kubeconfig {path} is not a kubeconfig (no mapping).")
        base = path.parent

        def named(section: str, name: str) -> dict[str, Any]:
            for item in doc.get(section) or []:
                if item.get("name") == name:
                    return dict(item.get(section[:-1]) or {})
            raise ClusterError(f"kubeconfig {path} has no {section[:-1]} named {name!r}.")

        ctx_name = context or doc.get("current-context")
        if not ctx_name:
            raise ClusterError(f"kubeconfig {path} has no current-context; pass one.")
        ctx = named("contexts", ctx_name)
        cluster = named("clusters", ctx["cluster"])
        user = named("users", ctx["user"]) if ctx.get("user") else {}
        server = str(cluster.get("server") or "")
        if not server:
            raise ClusterError(f"kubeconfig {path}: cluster {ctx['cluster']!r} has no server.")
        verify = ssl.create_default_context()
        ca: str | None = None
        if cluster.get("insecure-skip-tls-verify"):
            verify.check_hostname = False
            verify.verify_mode = ssl.CERT_NONE
        elif cluster.get("certificate-authority-data"):
            ca = base64.b64decode(cluster["certificate-authority-data"]).decode()
            verify = ssl.create_default_context(cadata=ca)
        elif cluster.get("certificate-authority"):
            ca = (base / cluster["certificate-authority"]).read_text()
            verify = ssl.create_default_context(cadata=ca)
        token = user.get("token")
        if not token and user.get("tokenFile"):
            token = (base / user["tokenFile"]).read_text().strip()
        cert = None
        if user.get("client-certificate-data") and user.get("client-key-data"):
            load_inline_cert(verify, base64.b64decode(user["client-certificate-data"]),
                             base64.b64decode(user["client-key-data"]))
        elif user.get("client-certificate") and user.get("client-key"):
            cert = (str(base / user["client-certificate"]), str(base / user["client-key"]))
            verify.load_cert_chain(*cert)
        return cls(server.rstrip("/"), verify, token, cert, ctx.get("namespace"), ca)


def find_kubeconfig(given: Path | None, env: Mapping[str, str] | None = None) -> Path:
    """The kubeconfig a user's command talks to the cluster with: ``given``, else the
    first existing file of ``$KUBECONFIG`` (a list, as kubectl reads it), else
    ``~/.kube/config``; ClusterError when there is none."""
    if given is not None:
        return given
    vars_ = os.environ if env is None else env
    for part in (vars_.get("KUBECONFIG") or "").split(os.pathsep):
        if part and Path(part).is_file():
            return Path(part)
    home = Path(vars_.get("HOME") or "~").expanduser() / ".kube" / "config"
    if home.is_file():
        return home
    raise ClusterError("no cluster configured: pass --kubeconfig FILE (credentials that "
                       "may change FusumaHosts, e.g. an admin's), or set KUBECONFIG.")


# Where inline client keys pass on their way into an SSLContext: a tmpfs, so that the
# key never reaches a disk (the temp dir when there is none).
INLINE_KEY_DIR = Path("/dev/shm")


def load_inline_cert(ctx: ssl.SSLContext, cert: bytes, key: bytes) -> None:
    """Load inline client credentials into ``ctx``. The ssl module loads only files:
    they pass through a private directory (0700, the caller's: root's for the agent)
    that is removed as soon as they are loaded; the key then lives only in ``ctx``."""
    base = INLINE_KEY_DIR if INLINE_KEY_DIR.is_dir() else None
    with tempfile.TemporaryDirectory(prefix="fusuma-kube-", dir=base) as tmp:
        d = Path(tmp)
        os.chmod(d, 0o700)
        for name, data in (("cert.pem", cert), ("key.pem", key)):
            fd = os.open(d / name, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW,
                         0o600)
            with os.fdopen(fd, "wb") as f:
                f.write(data)
        try:
            ctx.load_cert_chain(str(d / "cert.pem"), str(d / "key.pem"))
        except (ssl.SSLError, OSError) as exc:
            raise ClusterError(f"the kubeconfig's client certificate or key cannot be "
                               f"loaded ({exc}).") from exc


class Kube:
    """REST verbs on JSON objects. Thread-safe (httpx's pool); a watch has its own."""

    def __init__(self, cfg: KubeConfig, timeout: float = 15.0,
                 user_agent: str = "fusuma") -> None:
        self.cfg = cfg
        self.timeout = timeout
        self.headers = {"User-Agent": user_agent, "Accept": "application/json"}
        if cfg.token:
            self.headers["Authorization"] = f"Bearer {cfg.token}"
        self.http = self._client(timeout)

    def _client(self, timeout: float | None) -> httpx.Client:
        return httpx.Client(base_url=self.cfg.server, verify=self.cfg.verify,
                            headers=self.headers, timeout=timeout)

    def close(self) -> None:
        self.http.close()

    # -- verbs --------------------------------------------------------------------------
    def request(self, method: str, path: str, body: Any = None,
                content_type: str = "application/json", **params: Any) -> Obj:
        try:
            r = self.http.request(method, path, params={k: v for k, v in params.items()
                                                        if v is not None},
                                  content=None if body is None else json.dumps(body),
                                  headers={"Content-Type": content_type})
        except httpx.HTTPError as exc:
            raise ClusterError(f"cannot reach the API server at {self.cfg.server} "
                               f"({method} {path}): {exc}.") from exc
        if r.status_code >= 400:
            raise _error(r, method, path)
        out: Obj = r.json() if r.content else {}
        return out

    def get(self, kind: Kind, name: str, namespace: str | None = None) -> Obj:
        return self.request("GET", kind.path(namespace, name))

    def find(self, kind: Kind, name: str, namespace: str | None = None) -> Obj | None:
        try:
            return self.get(kind, name, namespace)
        except NotFoundApiError:
            return None

    def list(self, kind: Kind, namespace: str | None = None,
             label_selector: str | None = None) -> tuple[list[Obj], str]:
        """Every object (of ``namespace``, or all) and the list's resourceVersion."""
        out = self.request("GET", kind.path(namespace), labelSelector=label_selector)
        items: list[Obj] = []
        for item in out.get("items") or []:
            item.setdefault("apiVersion", kind.api_version)
            item.setdefault("kind", kind.kind)
            items.append(item)
        return items, str(out.get("metadata", {}).get("resourceVersion", ""))

    def create(self, kind: Kind, obj: Obj, namespace: str | None = None) -> Obj:
        obj.setdefault("apiVersion", kind.api_version)
        obj.setdefault("kind", kind.kind)
        return self.request("POST", kind.path(namespace), obj)

    def replace(self, kind: Kind, obj: Obj, sub: str | None = None) -> Obj:
        """PUT: fails with ConflictApiError unless ``obj``'s resourceVersion is current."""
        md = obj["metadata"]
        return self.request("PUT", kind.path(md.get("namespace"), md["name"], sub), obj)

    def patch(self, kind: Kind, name: str, patch: Obj, namespace: str | None = None,
              sub: str | None = None) -> Obj:
        """A JSON merge patch (null removes a field)."""
        return self.request("PATCH", kind.path(namespace, name, sub), patch,
                            content_type="application/merge-patch+json")

    def patch_status(self, kind: Kind, name: str, status: Obj,
                     namespace: str | None = None) -> Obj:
        return self.patch(kind, name, {"status": status}, namespace, sub="status")

    def delete(self, kind: Kind, name: str, namespace: str | None = None) -> None:
        with contextlib.suppress(NotFoundApiError):
            self.request("DELETE", kind.path(namespace, name))

    # -- watch --------------------------------------------------------------------------
    def watch(self, kind: Kind, resource_version: str, namespace: str | None = None,
              timeout_s: int = 60) -> Iterator[tuple[str, Obj]]:
        """(type, object) pairs from ``resource_version`` on; ends after ``timeout_s``
        or when the server ends the stream. Raises ApiError(410) when the version is
        too old (the caller lists again)."""
        params = {"watch": "1", "resourceVersion": resource_version,
                  "timeoutSeconds": str(timeout_s), "allowWatchBookmarks": "true"}
        with self._client(None) as http:
            try:
                with http.stream("GET", kind.path(namespace), params=params) as r:
                    if r.status_code >= 400:
                        r.read()
                        raise _error(r, "WATCH", kind.path(namespace))
                    for line in r.iter_lines():
                        if not line.strip():
                            continue
                        ev = json.loads(line)
                        if ev.get("type") == "ERROR":
                            st = ev.get("object") or {}
                            raise ApiError(int(st.get("code") or 500),
                                           str(st.get("reason") or ""),
                                           str(st.get("message") or ""), "WATCH",
                                           kind.path(namespace))
                        yield str(ev.get("type")), dict(ev.get("object") or {})
            except httpx.HTTPError as exc:
                raise ClusterError(f"watch of {kind.plural} ended: {exc}.") from exc


def _error(r: httpx.Response, method: str, path: str) -> ApiError:
    try:
        st = r.json()
        reason, message = str(st.get("reason") or ""), str(st.get("message") or r.text)
    except ValueError:
        reason, message = "", r.text
    cls = (ConflictApiError if r.status_code == 409 else
           NotFoundApiError if r.status_code == 404 else ApiError)
    return cls(r.status_code, reason, message.strip(), method, path)
