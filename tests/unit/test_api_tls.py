"""The certificate `fusuma serve --listen` makes: a server's leaf, never a CA. A client
that trusts it (``curl --cacert server.crt``, Prometheus' ``ca_file``) reaches this
server under its names, and trusts nothing else the server's key could sign: a
certificate for another name, signed with that key, is refused by the client's TLS."""

from __future__ import annotations

import datetime as dt
import ipaddress
import socket
import ssl
import threading
from pathlib import Path

import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from fusuma.api import auth


def made(tmp: Path) -> tuple[Path, Path]:
    cert, key = tmp / "api" / "server.crt", tmp / "api" / "server.key"
    assert auth.ensure_certificate(cert, key, hostname="h1")
    return cert, key


def handshake(cert: Path, key: Path, trusted: Path, name: str,
              chain: Path | None = None) -> None:
    """A TLS handshake on loopback: a server with ``cert`` (and ``chain`` after it),
    a client that trusts ``trusted`` only and checks ``name``. Raises the client's
    ssl error."""
    srv_ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    pem = cert.read_bytes() + (chain.read_bytes() if chain else b"")
    bundle = cert.with_suffix(".bundle")
    bundle.write_bytes(pem)
    srv_ctx.load_cert_chain(bundle, key)
    listener = socket.create_server(("127.0.0.1", 0))
    port = listener.getsockname()[1]

    def serve() -> None:
        conn, _ = listener.accept()
        try:
            with srv_ctx.wrap_socket(conn, server_side=True) as s:
                s.recv(1)
        except (ssl.SSLError, OSError):
            pass
    t = threading.Thread(target=serve, daemon=True)
    t.start()
    cli = ssl.create_default_context(cafile=str(trusted))
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=10) as raw, \
                cli.wrap_socket(raw, server_hostname=name) as s:
            s.sendall(b"x")
    finally:
        t.join(10)
        listener.close()


def test_the_certificate_is_a_servers_leaf(tmp_path: Path) -> None:
    cert, key = made(tmp_path)
    assert key.stat().st_mode & 0o777 == 0o600 and cert.stat().st_mode & 0o777 == 0o644
    crt = x509.load_pem_x509_certificate(cert.read_bytes())
    ext = crt.extensions
    bc = ext.get_extension_for_class(x509.BasicConstraints)
    assert bc.critical and bc.value.ca is False
    ku = ext.get_extension_for_class(x509.KeyUsage)
    assert ku.critical and ku.value.digital_signature
    assert not ku.value.key_cert_sign and not ku.value.crl_sign
    eku = ext.get_extension_for_class(x509.ExtendedKeyUsage).value
    assert list(eku) == [ExtendedKeyUsageOID.SERVER_AUTH]
    san = ext.get_extension_for_class(x509.SubjectAlternativeName).value
    assert san.get_values_for_type(x509.DNSName) == ["localhost", "h1"]
    assert [str(a) for a in san.get_values_for_type(x509.IPAddress)] == ["127.0.0.1", "::1"]
    assert not auth.is_ca(cert)
    assert not auth.ensure_certificate(cert, key)     # kept, not remade
    # A client that trusts it reaches the server under each of its names.
    for name in ("localhost", "127.0.0.1"):
        handshake(cert, key, trusted=cert, name=name)


def forge(cert: Path, key: Path, tmp: Path) -> tuple[Path, Path]:
    """A certificate for another name, issued in the server certificate's name and
    signed with its key: what a CA could do."""
    issuer = x509.load_pem_x509_certificate(cert.read_bytes())
    ikey = serialization.load_pem_private_key(key.read_bytes(), None)
    assert isinstance(ikey, ec.EllipticCurvePrivateKey)
    lkey = ec.generate_private_key(ec.SECP256R1())
    now = dt.datetime.now(dt.UTC)
    leaf = (x509.CertificateBuilder()
            .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "bank")]))
            .issuer_name(issuer.subject).public_key(lkey.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - dt.timedelta(minutes=5))
            .not_valid_after(now + dt.timedelta(days=1))
            .add_extension(x509.SubjectAlternativeName(
                [x509.DNSName("bank.example"),
                 x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]), critical=False)
            .sign(ikey, hashes.SHA256()))
    lcert, lkey_path = tmp / "forged.crt", tmp / "forged.key"
    lcert.write_bytes(leaf.public_bytes(serialization.Encoding.PEM))
    lkey_path.write_bytes(lkey.private_bytes(serialization.Encoding.PEM,
                                             serialization.PrivateFormat.PKCS8,
                                             serialization.NoEncryption()))
    return lcert, lkey_path


def test_what_its_key_signs_is_not_trusted(tmp_path: Path) -> None:
    cert, key = made(tmp_path)
    lcert, lkey = forge(cert, key, tmp_path)
    with pytest.raises(ssl.SSLCertVerificationError):
        handshake(lcert, lkey, trusted=cert, name="bank.example", chain=cert)


def test_a_ca_certificate_from_an_older_fusuma_is_replaced(tmp_path: Path) -> None:
    """The same forgery against the CA an older fusuma made is trusted (the flaw); the
    daemon's next start replaces that certificate with a leaf."""
    cert, key = tmp_path / "server.crt", tmp_path / "server.key"
    pkey = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "fusuma@h1")])
    now = dt.datetime.now(dt.UTC)
    old = (x509.CertificateBuilder().subject_name(name).issuer_name(name)
           .public_key(pkey.public_key()).serial_number(1)
           .not_valid_before(now - dt.timedelta(minutes=5))
           .not_valid_after(now + dt.timedelta(days=1))
           .add_extension(x509.SubjectAlternativeName([x509.DNSName("localhost")]),
                          critical=False)
           .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
           .sign(pkey, hashes.SHA256()))
    cert.write_bytes(old.public_bytes(serialization.Encoding.PEM))
    key.write_bytes(pkey.private_bytes(serialization.Encoding.PEM,
                                       serialization.PrivateFormat.PKCS8,
                                       serialization.NoEncryption()))
    assert auth.is_ca(cert)
    lcert, lkey = forge(cert, key, tmp_path)
    handshake(lcert, lkey, trusted=cert, name="bank.example", chain=cert)   # trusted!

    assert auth.ensure_certificate(cert, key, hostname="h1")
    assert not auth.is_ca(cert)
    assert key.read_bytes() != pkey.private_bytes(serialization.Encoding.PEM,
                                                  serialization.PrivateFormat.PKCS8,
                                                  serialization.NoEncryption())
    lcert, lkey = forge(cert, key, tmp_path)
    with pytest.raises(ssl.SSLCertVerificationError):
        handshake(lcert, lkey, trusted=cert, name="bank.example", chain=cert)
    handshake(cert, key, trusted=cert, name="localhost")
