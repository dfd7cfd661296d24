"""The X.509 side of the move stream between hosts: the cluster's CA and the hosts'
certificates, made with ``cryptography`` (pure functions; the Secrets they are kept in
are ``fusuma.cluster.certs``'s).

A host's certificate names the host: its subject is ``CN=<host>`` and nothing else (the
distinguished name the destination's QEMU compares with ``authz-simple``:
``fusuma.qemu.tlscreds.identity``), its subjectAltName holds the host's name as a DNS
name (what the source's QEMU checks with ``tls-hostname``) and, when known, the address
it registered. One certificate serves both ends of a stream (serverAuth and
clientAuth): a host is the destination of one move and the source of the next. Keys are
ECDSA P-256; a host's certificate lasts ``HOST_DAYS``, the CA ``CA_DAYS``.
"""

from __future__ import annotations

import datetime
import hashlib
import ipaddress
import uuid

from cryptography import x509
from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from fusuma.cluster import ClusterError
from fusuma.frozen import frozen

CA_DAYS = 3650
HOST_DAYS = 365
# Certificates are valid from a little before now: clocks between hosts may differ.
BACKDATE = datetime.timedelta(minutes=10)


@frozen
class KeyPair:
    """A certificate and its private key, PEM."""

    cert: bytes
    key: bytes


def _now() -> datetime.datetime:
    return datetime.datetime.now(datetime.UTC)


def _key_pem(key: ec.EllipticCurvePrivateKey) -> bytes:
    return key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                             serialization.NoEncryption())


def _usage(*, sign: bool, ca: bool) -> x509.KeyUsage:
    # QEMU's sanity check (crypto/tlscredsx509.c) wants certSign on a CA and both
    # digitalSignature and keyEncipherment on a peer's certificate.
    return x509.KeyUsage(digital_signature=sign, content_commitment=False,
                         key_encipherment=sign, data_encipherment=False,
                         key_agreement=False, key_cert_sign=ca, crl_sign=ca,
                         encipher_only=False, decipher_only=False)


def new_ca(days: int = CA_DAYS) -> KeyPair:
    """A new CA for the cluster's moves (its name is unique, so that the CA that
    issued a certificate can be told from the one that replaced it)."""
    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([
        x509.NameAttribute(NameOID.ORGANIZATION_NAME, "fusuma"),
        x509.NameAttribute(NameOID.COMMON_NAME, f"fusuma move CA {uuid.uuid4().hex[:8]}")])
    now = _now()
    cert = (x509.CertificateBuilder().subject_name(name).issuer_name(name)
            .public_key(key.public_key()).serial_number(x509.random_serial_number())
            .not_valid_before(now - BACKDATE)
            .not_valid_after(now + datetime.timedelta(days=days))
            .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
            .add_extension(_usage(sign=False, ca=True), critical=True)
            .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()),
                           critical=False)
            .sign(key, hashes.SHA256()))
    return KeyPair(cert.public_bytes(serialization.Encoding.PEM), _key_pem(key))


def issue(ca: KeyPair, host: str, addresses: list[str] | None = None,
          days: int = HOST_DAYS) -> KeyPair:
    """A certificate for ``host`` (and its ``addresses``), signed by ``ca``."""
    ca_cert = x509.load_pem_x509_certificate(ca.cert)
    ca_key = serialization.load_pem_private_key(ca.key, None)
    if not isinstance(ca_key, ec.EllipticCurvePrivateKey):
        raise ClusterError("the cluster's move CA key is not an ECDSA key; make a new CA "
                           "with `fusuma cluster rotate-certs --ca`.")
    key = ec.generate_private_key(ec.SECP256R1())
    names: list[x509.GeneralName] = [x509.DNSName(host)]
    for a in addresses or []:
        try:
            names.append(x509.IPAddress(ipaddress.ip_address(a)))
        except ValueError:
            names.append(x509.DNSName(a))
    now = _now()
    cert = (x509.CertificateBuilder()
            .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, host)]))
            .issuer_name(ca_cert.subject).public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - BACKDATE)
            .not_valid_after(min(now + datetime.timedelta(days=days),
                                 ca_cert.not_valid_after_utc))
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
            .add_extension(_usage(sign=True, ca=False), critical=True)
            .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH,
                                                  ExtendedKeyUsageOID.CLIENT_AUTH]),
                           critical=False)
            .add_extension(x509.SubjectAlternativeName(names), critical=False)
            .add_extension(x509.AuthorityKeyIdentifier.from_issuer_public_key(
                ca_key.public_key()), critical=False)
            .sign(ca_key, hashes.SHA256()))
    return KeyPair(cert.public_bytes(serialization.Encoding.PEM), _key_pem(key))


def certs(pem: bytes) -> list[x509.Certificate]:
    """Every certificate of a PEM bundle."""
    try:
        return x509.load_pem_x509_certificates(pem)
    except ValueError as exc:
        raise ClusterError(f"not a PEM certificate bundle: {exc}.") from exc


def bundle(*pems: bytes | None) -> bytes:
    """One PEM bundle of the given certificates (None skipped, duplicates once)."""
    out: list[bytes] = []
    for p in pems:
        if p and p not in out:
            out.append(p)
    return b"".join(out)


def fingerprint(cert: x509.Certificate | bytes) -> str:
    """SHA-256 of a certificate's DER (of the first one of a PEM), hex."""
    c = certs(cert)[0] if isinstance(cert, bytes) else cert
    return hashlib.sha256(c.public_bytes(serialization.Encoding.DER)).hexdigest()


def issuer_of(cert_pem: bytes, trusted: bytes) -> x509.Certificate | None:
    """The certificate of ``trusted`` (a bundle) that signed ``cert_pem``, if any."""
    leaf = certs(cert_pem)[0]
    for ca in certs(trusted):
        try:
            leaf.verify_directly_issued_by(ca)
        except (ValueError, TypeError, InvalidSignature):
            continue
        return ca
    return None


def check_pair(cert_pem: bytes, key_pem: bytes) -> None:
    """ClusterError unless the key is the certificate's."""
    leaf = certs(cert_pem)[0]
    try:
        key = serialization.load_pem_private_key(key_pem, None)
    except (ValueError, TypeError) as exc:
        raise ClusterError(f"the host's move key is not a PEM private key: {exc}.") from exc
    pub = serialization.PublicFormat.SubjectPublicKeyInfo
    if key.public_key().public_bytes(serialization.Encoding.DER, pub) != \
            leaf.public_key().public_bytes(serialization.Encoding.DER, pub):
        raise ClusterError("the host's move certificate and key do not belong together.")


def host_of(cert_pem: bytes) -> str:
    """The host a certificate names (its subject's CN)."""
    cn = certs(cert_pem)[0].subject.get_attributes_for_oid(NameOID.COMMON_NAME)
    return str(cn[0].value) if cn else ""
