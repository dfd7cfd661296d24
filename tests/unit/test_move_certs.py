"""The move stream's certificates: what fusuma.cluster.pki issues, and how
fusuma.cluster.certs keeps and rotates them, against a fake API server whose "agents"
report what they hold, as the real ones do."""

from __future__ import annotations

import base64
import copy
from typing import Any

import pytest
from cryptography import x509
from cryptography.x509.oid import ExtendedKeyUsageOID

from fusuma.cluster import ClusterError, ConflictApiError, NotFoundApiError, certs, pki
from fusuma.cluster.identity import host_objects
from fusuma.cluster.kube import HOST, VM, Kind
from fusuma.qemu import tlscreds
from fusuma.qemu.tlscreds import HostCreds

Obj = dict[str, Any]


def test_a_host_certificate_names_the_host_and_serves_both_ends() -> None:
    ca = pki.new_ca()
    kp = pki.issue(ca, "h0", ["10.251.0.10"])
    leaf = x509.load_pem_x509_certificate(kp.cert)
    ca_cert = x509.load_pem_x509_certificate(ca.cert)
    leaf.verify_directly_issued_by(ca_cert)
    # What the destination's authz-simple compares, exactly.
    assert leaf.subject.rfc4514_string() == tlscreds.identity("h0") == "CN=h0"
    san = leaf.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert san.get_values_for_type(x509.DNSName) == ["h0"]
    assert [str(a) for a in san.get_values_for_type(x509.IPAddress)] == ["10.251.0.10"]
    eku = leaf.extensions.get_extension_for_class(x509.ExtendedKeyUsage).value
    assert set(eku) == {ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH}
    ku = leaf.extensions.get_extension_for_class(x509.KeyUsage).value
    assert ku.digital_signature and ku.key_encipherment and not ku.key_cert_sign
    assert not leaf.extensions.get_extension_for_class(x509.BasicConstraints).value.ca
    assert ca_cert.extensions.get_extension_for_class(x509.BasicConstraints).value.ca
    assert leaf.not_valid_after_utc <= ca_cert.not_valid_after_utc
    pki.check_pair(kp.cert, kp.key)
    certs.check(HostCreds(ca.cert, kp.cert, kp.key), "h0")


def test_a_set_that_does_not_belong_together_is_refused() -> None:
    ca, other = pki.new_ca(), pki.new_ca()
    a, b = pki.issue(ca, "h0"), pki.issue(ca, "h1")
    with pytest.raises(ClusterError, match="do not belong together"):
        certs.check(HostCreds(ca.cert, a.cert, b.key), "h0")
    with pytest.raises(ClusterError, match="names host 'h1', not 'h0'"):
        certs.check(HostCreds(ca.cert, b.cert, b.key), "h0")
    with pytest.raises(ClusterError, match="not signed by a CA it trusts"):
        certs.check(HostCreds(other.cert, a.cert, a.key), "h0")
    both = pki.bundle(other.cert, ca.cert, ca.cert)
    assert len(pki.certs(both)) == 2
    assert pki.issuer_of(a.cert, both) is not None
    assert pki.fingerprint(pki.issuer_of(a.cert, both)) == pki.fingerprint(ca.cert)


class FakeKube:
    """Objects by kind, namespace and name; the hosts' agents act on every list of
    FusumaHosts (each reads its Secret and reports it, unless told to lag), and each
    move recorded ends after ``move_lists`` lists of FusumaVMs."""

    def __init__(self, hosts: list[str]) -> None:
        self.objs: dict[tuple[str, str, str], Obj] = {}
        self.log: list[tuple[str, str, Obj]] = []          # (kind, name, data) written
        self.lagging: set[str] = set()
        self.move_lists = 0
        for h in hosts:
            self.objs[(HOST.plural, "", h)] = {
                "metadata": {"name": h}, "status": {
                    "address": f"10.0.0.{hosts.index(h) + 1}",
                    "conditions": [{"type": "Ready", "status": "True"}]}}

    def _k(self, kind: Kind, name: str, ns: str | None) -> tuple[str, str, str]:
        return kind.plural, ns or "", name

    def create(self, kind: Kind, obj: Obj, ns: str | None = None) -> Obj:
        k = self._k(kind, obj["metadata"]["name"], ns)
        if k in self.objs:
            raise ConflictApiError(409, "AlreadyExists", "exists")
        self.objs[k] = self._versioned(obj)
        self.log.append((kind.kind, obj["metadata"]["name"], copy.deepcopy(obj)))
        return obj

    def _versioned(self, obj: Obj) -> Obj:
        self.version = getattr(self, "version", 0) + 1
        out = copy.deepcopy(obj)
        out["metadata"]["resourceVersion"] = str(self.version)
        return out

    def get(self, kind: Kind, name: str, ns: str | None = None) -> Obj:
        try:
            return copy.deepcopy(self.objs[self._k(kind, name, ns)])
        except KeyError:
            raise NotFoundApiError(404, "NotFound", name) from None

    def find(self, kind: Kind, name: str, ns: str | None = None) -> Obj | None:
        return copy.deepcopy(self.objs.get(self._k(kind, name, ns)))

    def replace(self, kind: Kind, obj: Obj, sub: str | None = None) -> Obj:
        md = obj["metadata"]
        k = self._k(kind, md["name"], md.get("namespace"))
        if md.get("resourceVersion") != self.objs[k]["metadata"].get("resourceVersion"):
            raise ConflictApiError(409, "Conflict", "changed")
        self.objs[k] = self._versioned(obj)
        self.log.append((kind.kind, md["name"], copy.deepcopy(obj)))
        return obj

    def list(self, kind: Kind, ns: str | None = None,
             label_selector: str | None = None) -> tuple[list[Obj], str]:
        if kind is HOST:
            self.agents_report()
        if kind is VM:
            self.move_lists -= 1
            if self.move_lists < 0:
                self.objs.pop((VM.plural, "default", "vm0"), None)
        out = [copy.deepcopy(o) for (plural, _, _), o in self.objs.items()
               if plural == kind.plural and (not label_selector or label_selector in
                                             (o["metadata"].get("labels") or {}))]
        return out, "1"

    def agents_report(self) -> None:
        for (plural, _, h), obj in self.objs.items():
            if plural != HOST.plural or h in self.lagging:
                continue
            creds = certs.read_host(self, h)  # type: ignore[arg-type]
            if creds is not None:
                obj["status"]["moveTLS"] = certs.tls_status(creds)

    def secret(self, host: str) -> HostCreds:
        creds = certs.read_host(self, host)  # type: ignore[arg-type]
        assert creds is not None
        return creds

    def start_move(self, lists: int) -> None:
        self.objs[(VM.plural, "default", "vm0")] = {
            "metadata": {"name": "vm0", "namespace": "default"},
            "status": {"move": {"id": "m1"}}}
        self.move_lists = lists


def rotation(kube: FakeKube, timeout: float = 5.0) -> certs.Rotation:
    return certs.Rotation(kube, lambda s: None, timeout=timeout, every=0.001)  # type: ignore[arg-type]


def issuer(creds: HostCreds) -> str:
    found = pki.issuer_of(creds.cert, creds.ca)
    assert found is not None
    return pki.fingerprint(found)


def test_the_first_certificates_and_who_may_read_them() -> None:
    kube = FakeKube(["h0"])
    auth = rotation(kube).run(["h1"])
    ca = kube.get(certs.SECRET, certs.CA_SECRET, "fusuma-system")
    assert base64.b64decode(ca["data"]["ca.key"]) == auth.current.key
    for h in ("h0", "h1"):              # the registered host and the one named
        s = kube.get(certs.SECRET, certs.host_secret(h), "fusuma-system")
        assert s["type"] == "kubernetes.io/tls"
        creds = kube.secret(h)
        certs.check(creds, h)
        assert creds.ca == auth.current.cert
        # The one Secret the host's identity may read (its Role names it).
        rules = [r for o in host_objects(h) if o["kind"] == "Role" for r in o["rules"]
                 if r["resources"] == ["secrets"]]
        assert rules == [{"apiGroups": [""], "resources": ["secrets"],
                          "resourceNames": [s["metadata"]["name"]],
                          "verbs": ["get", "watch"]}]
    san = x509.load_pem_x509_certificate(kube.secret("h0").cert).extensions \
        .get_extension_for_class(x509.SubjectAlternativeName).value
    assert [str(a) for a in san.get_values_for_type(x509.IPAddress)] == ["10.0.0.1"]


def test_rotating_host_certificates_keeps_the_ca() -> None:
    kube = FakeKube(["h0", "h1"])
    auth = rotation(kube).run([])
    before = kube.secret("h0")
    kube.start_move(lists=10 ** 6)          # a move under way: not waited for
    again = rotation(kube).run([])
    after = kube.secret("h0")
    assert again.current == auth.current and after.ca == before.ca
    assert after.cert != before.cert and after.key != before.key
    assert issuer(after) == pki.fingerprint(auth.current.cert)


def test_a_new_ca_is_trusted_everywhere_before_any_host_uses_it() -> None:
    kube = FakeKube(["h0", "h1"])
    old = rotation(kube).run([])
    old_fp = pki.fingerprint(old.current.cert)
    kube.agents_report()
    kube.start_move(lists=3)
    kube.log.clear()
    new = rotation(kube).run([], new_ca=True)
    new_fp = pki.fingerprint(new.current.cert)
    assert new.previous == old.current.cert
    writes = [(name, HostCreds(*(base64.b64decode(o["data"][f])
                                 for f in ("ca.crt", "tls.crt", "tls.key"))))
              for kind, name, o in kube.log if kind == "Secret" and name != certs.CA_SECRET]
    # First every host trusts both, with its certificate of the old CA ...
    first = writes[:2]
    assert [n for n, _ in first] == ["fusuma-host-h0", "fusuma-host-h1"]
    for _, creds in first:
        assert [pki.fingerprint(c) for c in pki.certs(creds.ca)] == [new_fp, old_fp]
        assert issuer(creds) == old_fp
    # ... and only then (the move under way ended) certificates of the new CA.
    assert kube.move_lists < 0
    for _, creds in writes[2:]:
        assert issuer(creds) == new_fp
    assert len(writes) == 4
    # The old CA stays trusted (the overlap) until it is dropped.
    assert len(pki.certs(kube.secret("h0").ca)) == 2
    kube.agents_report()
    final = rotation(kube).run([], drop_previous=True)
    assert final.previous is None
    assert [pki.fingerprint(c) for c in pki.certs(kube.secret("h1").ca)] == [new_fp]
    assert "previous.crt" not in kube.get(certs.SECRET, certs.CA_SECRET,
                                          "fusuma-system")["data"]


def test_a_host_that_does_not_take_up_the_new_ca_stops_the_rotation_safely() -> None:
    kube = FakeKube(["h0", "h1"])
    old = rotation(kube).run([])
    kube.agents_report()
    kube.lagging.add("h1")
    with pytest.raises(ClusterError, match="hosts h1 have not reported it; nothing is "
                                           "broken, run the same command again"):
        rotation(kube, timeout=0.05).run([], new_ca=True)
    # No host holds a certificate the other cannot check.
    for h in ("h0", "h1"):
        assert issuer(kube.secret(h)) == pki.fingerprint(old.current.cert)
    kube.lagging.clear()
    new = rotation(kube).run([])
    assert issuer(kube.secret("h1")) == pki.fingerprint(new.current.cert)


def test_a_damaged_secret_gets_one_sentence() -> None:
    kube = FakeKube([])
    kube.create(certs.SECRET, {"metadata": {"name": "fusuma-host-h0",
                                            "namespace": "fusuma-system"},
                               "data": {"tls.crt": "eA=="}}, "fusuma-system")
    with pytest.raises(ClusterError, match="rotate-certs --host h0"):
        certs.read_host(kube, "h0")  # type: ignore[arg-type]
