"""The move stream's certificates in the cluster: the CA's Secret, one Secret per host,
the RBAC that lets each host's agent read its own, and their rotation
(`fusuma cluster rotate-certs`). The certificates themselves are ``pki``'s.

In namespace fusuma-system::

    Secret fusuma-move-ca          ca.crt, ca.key: the CA that issues now;
                                   previous.crt: the CA it replaced, still trusted
    Secret fusuma-host-<host>      kubernetes.io/tls: tls.crt, tls.key (the host's),
                                   ca.crt (what it trusts: the CA, and the previous one
                                   while both are trusted)

The CA's key is in a Secret that no role fusuma makes can read: only the cluster's
admins (who may read every Secret, and so are trusted with the cluster anyway) issue
and rotate certificates. A host's identity (``fusuma.cluster.identity``, `fusuma
cluster join`) may read its own certificate Secret by name and no other: a host can
prove only that it is itself.

Rotation never breaks a move in flight: QEMU reads its credentials once, when a move's
side begins, and a new certificate of the same CA is trusted by every host. A new CA
(``--ca``) is brought in with an overlap: first every host's bundle trusts both CAs
(its certificate unchanged); once every live host's agent reports that it trusts the
new one (``status.moveTLS.trust`` of its FusumaHost) and the moves under way then have
ended, hosts get certificates of the new CA; the old one leaves the bundles only with
``--drop-previous-ca``, once every live host holds a certificate of the new CA and the
moves under way then have ended.
"""

from __future__ import annotations

import base64
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC

from fusuma.cluster import SYSTEM_NAMESPACE, ClusterError, ConflictApiError, NotFoundApiError, pki
from fusuma.cluster.identity import certificate_secret
from fusuma.cluster.kube import HOST, VM, Kind, Kube, Obj
from fusuma.cluster.resources import condition
from fusuma.frozen import frozen
from fusuma.qemu.tlscreds import HostCreds

SECRET = Kind("", "v1", "secrets", True, "Secret")
CA_SECRET = "fusuma-move-ca"
HOST_LABEL = "fusuma.io/move-cert"
Progress = Callable[[str], None]


def host_secret(host: str) -> str:
    """Host ``host``'s certificate Secret, the one its identity may read."""
    return certificate_secret(host)


def _enc(data: bytes) -> str:
    return base64.b64encode(data).decode()


def _dec(obj: Obj, field: str) -> bytes | None:
    raw = (obj.get("data") or {}).get(field)
    return base64.b64decode(raw) if raw else None


def _put(kube: Kube, kind: Kind, obj: Obj) -> None:
    """Create ``obj`` or replace what is there."""
    md = obj["metadata"]
    for _ in range(5):
        try:
            kube.create(kind, dict(obj), md.get("namespace"))
            return
        except ConflictApiError:
            pass
        try:
            cur = kube.get(kind, md["name"], md.get("namespace"))
            kube.replace(kind, {**obj, "metadata": {
                **md, "resourceVersion": cur["metadata"]["resourceVersion"]}})
            return
        except (ConflictApiError, NotFoundApiError):
            continue
    raise ClusterError(f"could not write {kind.kind} {md['name']}: it kept changing.")


# -- the CA -----------------------------------------------------------------------------
@frozen
class Authority:
    """The CA that issues now, and the one it replaced (trusted still, if any)."""

    current: pki.KeyPair
    previous: bytes | None = None

    @property
    def trust(self) -> bytes:
        return pki.bundle(self.current.cert, self.previous)


def read_ca(kube: Kube) -> Authority | None:
    obj = kube.find(SECRET, CA_SECRET, SYSTEM_NAMESPACE)
    if obj is None:
        return None
    cert, key = _dec(obj, "ca.crt"), _dec(obj, "ca.key")
    if not cert or not key:
        raise ClusterError(f"Secret {SYSTEM_NAMESPACE}/{CA_SECRET} lacks ca.crt or ca.key; "
                           "delete it and run `fusuma cluster rotate-certs --ca`.")
    return Authority(pki.KeyPair(cert, key), _dec(obj, "previous.crt"))


def write_ca(kube: Kube, auth: Authority) -> None:
    data = {"ca.crt": _enc(auth.current.cert), "ca.key": _enc(auth.current.key)}
    if auth.previous:
        data["previous.crt"] = _enc(auth.previous)
    _put(kube, SECRET, {"apiVersion": "v1", "kind": "Secret", "type": "Opaque",
                        "metadata": {"name": CA_SECRET, "namespace": SYSTEM_NAMESPACE,
                                     "labels": {"app.kubernetes.io/part-of": "fusuma"}},
                        "data": data})


def ensure_ca(kube: Kube, progress: Progress = lambda s: None) -> Authority:
    """The cluster's move CA, made first if there is none."""
    auth = read_ca(kube)
    if auth is None:
        auth = Authority(pki.new_ca())
        write_ca(kube, auth)
        progress(f"Secret {SYSTEM_NAMESPACE}/{CA_SECRET} created (the CA of the move "
                 "stream between hosts)")
    return auth


# -- one host ----------------------------------------------------------------------------
def read_host(kube: Kube, host: str) -> HostCreds | None:
    """Host ``host``'s credentials from its Secret (what its agent fetches)."""
    obj = kube.find(SECRET, host_secret(host), SYSTEM_NAMESPACE)
    if obj is None:
        return None
    ca, cert, key = (_dec(obj, f) for f in ("ca.crt", "tls.crt", "tls.key"))
    if not (ca and cert and key):
        raise ClusterError(f"Secret {SYSTEM_NAMESPACE}/{host_secret(host)} lacks ca.crt, "
                           "tls.crt or tls.key; an admin runs `fusuma cluster "
                           f"rotate-certs --host {host}`.")
    return HostCreds(ca, cert, key)


def write_host(kube: Kube, host: str, creds: HostCreds) -> None:
    """Host ``host``'s certificate Secret (its identity's Role lets it, and no other
    host, read it: ``identity.namespace_rules``)."""
    md = {"name": host_secret(host), "namespace": SYSTEM_NAMESPACE,
          "labels": {HOST_LABEL: host, "app.kubernetes.io/part-of": "fusuma"}}
    _put(kube, SECRET, {"apiVersion": "v1", "kind": "Secret", "type": "kubernetes.io/tls",
                        "metadata": md, "data": {"ca.crt": _enc(creds.ca),
                                                 "tls.crt": _enc(creds.cert),
                                                 "tls.key": _enc(creds.key)}})


def tls_status(creds: HostCreds) -> Obj:
    """What a host's agent reports of its credentials (FusumaHost ``status.moveTLS``):
    its certificate's and its issuer's fingerprints, its expiry, the CAs it trusts."""
    leaf = pki.certs(creds.cert)[0]
    issuer = pki.issuer_of(creds.cert, creds.ca)
    return {"cert": pki.fingerprint(leaf),
            "issuer": pki.fingerprint(issuer) if issuer is not None else None,
            "notAfter": leaf.not_valid_after_utc.astimezone(UTC).strftime(
                "%Y-%m-%dT%H:%M:%SZ"),
            "trust": [pki.fingerprint(c) for c in pki.certs(creds.ca)]}


def check(creds: HostCreds, host: str) -> None:
    """ClusterError unless ``creds`` are a usable set for ``host``."""
    pki.check_pair(creds.cert, creds.key)
    if pki.host_of(creds.cert) != host:
        raise ClusterError(f"the move certificate in Secret {SYSTEM_NAMESPACE}/"
                           f"{host_secret(host)} names host {pki.host_of(creds.cert)!r}, "
                           f"not {host!r}; an admin runs `fusuma cluster rotate-certs "
                           f"--host {host}`.")
    if pki.issuer_of(creds.cert, creds.ca) is None:
        raise ClusterError(f"the move certificate of host {host} is not signed by a CA it "
                           "trusts; an admin runs `fusuma cluster rotate-certs`.")


# -- rotation ---------------------------------------------------------------------------
@dataclass
class Rotation:
    """`fusuma cluster rotate-certs`, as an admin runs it."""

    kube: Kube
    progress: Progress
    timeout: float = 300.0
    every: float = 1.0           # seconds between looks while waiting

    def hosts(self, extra: list[str]) -> list[str]:
        """Hosts that hold a certificate, are registered, or are named."""
        secrets, _ = self.kube.list(SECRET, SYSTEM_NAMESPACE, label_selector=HOST_LABEL)
        names = {str(s["metadata"]["labels"][HOST_LABEL]) for s in secrets}
        registered, _ = self.kube.list(HOST)
        names |= {str(h["metadata"]["name"]) for h in registered}
        return sorted(names | set(extra))

    def _address(self, host: str) -> list[str]:
        obj = self.kube.find(HOST, host)
        addr = ((obj or {}).get("status") or {}).get("address")
        return [str(addr)] if addr else []

    def _live(self) -> list[Obj]:
        items, _ = self.kube.list(HOST)
        return [h for h in items if (condition(h, "Ready") or {}).get("status") == "True"]

    def _moves(self) -> set[tuple[str, str, str]]:
        items, _ = self.kube.list(VM)
        out = set()
        for o in items:
            move = (o.get("status") or {}).get("move") or {}
            if move.get("id"):
                md = o["metadata"]
                out.add((str(md.get("namespace")), str(md["name"]), str(move["id"])))
        return out

    def settle(self, what: str, ok: Callable[[Obj], bool], moves: bool = True) -> None:
        """Wait until every live host's reported credentials satisfy ``ok`` and (with
        ``moves``) the moves under way now have ended."""
        before = self._moves() if moves else set()
        deadline = time.monotonic() + self.timeout
        self.progress(f"waiting until every live host {what}"
                      + (f" and {len(before)} move(s) under way end" if before else ""))
        while True:
            # A host that reports no credentials takes part in no move: it cannot lag.
            behind = [str(h["metadata"]["name"]) for h in self._live()
                      if (st := (h.get("status") or {}).get("moveTLS")) and not ok(st)]
            running = before & self._moves()
            if not behind and not running:
                return
            if time.monotonic() > deadline:
                why = (f"hosts {', '.join(behind)} have not reported it" if behind else
                       f"{len(running)} move(s) are still under way")
                raise ClusterError(f"rotation stopped after {self.timeout:.0f} s: {why}; "
                                   "nothing is broken, run the same command again to go "
                                   "on.")
            time.sleep(self.every)

    def run(self, extra: list[str], new_ca: bool = False,
            drop_previous: bool = False) -> Authority:
        kube = self.kube
        auth = ensure_ca(kube, self.progress)
        hosts = self.hosts(extra)
        if new_ca:
            old = auth.current
            auth = Authority(pki.new_ca(), old.cert)
            write_ca(kube, auth)
            self.progress(f"new CA {pki.fingerprint(auth.current.cert)[:16]}; every host "
                          "trusts both CAs first")
            for h in hosts:
                cur = read_host(kube, h)
                kept = (pki.KeyPair(cur.cert, cur.key) if cur is not None
                        else pki.issue(old, h, self._address(h)))
                write_host(kube, h, HostCreds(auth.trust, kept.cert, kept.key))
        new_fp = pki.fingerprint(auth.current.cert)
        self.settle("trusts the current CA", lambda st: new_fp in (st.get("trust") or []),
                    moves=new_ca)
        for h in hosts:
            kp = pki.issue(auth.current, h, self._address(h))
            write_host(kube, h, HostCreds(auth.trust, kp.cert, kp.key))
            self.progress(f"host {h}: new certificate {pki.fingerprint(kp.cert)[:16]} "
                          f"(Secret {SYSTEM_NAMESPACE}/{host_secret(h)})")
        if drop_previous and auth.previous:
            self.settle("holds a certificate of the current CA",
                        lambda st: st.get("issuer") == new_fp)
            auth = Authority(auth.current)
            write_ca(kube, auth)
            for h in hosts:
                cur = read_host(kube, h)
                if cur is not None:
                    write_host(kube, h, HostCreds(auth.trust, cur.cert, cur.key))
            self.progress("the previous CA is no longer trusted")
        return auth
