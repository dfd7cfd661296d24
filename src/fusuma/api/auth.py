"""Who may use the API.

- The UNIX socket ``RUNTIME/api/fusuma.sock`` (directory 0750, socket 0660, group
  ``fusuma``): the file system decides; root and members of that group may connect,
  nobody else can even reach the socket.
- TCP (``fusuma serve --listen``): HTTPS only, and every request carries a bearer token
  (``Authorization: Bearer fsm_...``) made by ``fusuma token create``
  (``fusuma.ops.tokens``). Only the token's SHA-256 is stored; the token is printed
  once. Tokens are never accepted in the URL (URLs end up in logs), and the daemon never
  logs a request's headers.
"""

from __future__ import annotations

import datetime as dt
import grp
import ipaddress
import os
import socket
import subprocess
from pathlib import Path

from fusuma.errors import HostError

GROUP = "fusuma"


def bearer(header: str | None) -> str | None:
    """The token of an ``Authorization: Bearer ...`` header, else None."""
    if not header:
        return None
    scheme, _, value = header.partition(" ")
    if scheme.lower() != "bearer" or not value.strip():
        return None
    return value.strip()


def ensure_group(name: str = GROUP) -> int:
    """The gid of group ``name``, created (a system group) when missing."""
    try:
        return grp.getgrnam(name).gr_gid
    except KeyError:
        pass
    try:
        subprocess.run(["groupadd", "--system", name], check=True, capture_output=True,
                       text=True)
    except FileNotFoundError as exc:
        raise HostError(f"group {name!r} does not exist and groupadd is missing; create "
                        f"the group yourself (members may use the API socket).") from exc
    except subprocess.CalledProcessError as exc:
        try:        # made by a concurrent groupadd?
            return grp.getgrnam(name).gr_gid
        except KeyError:
            raise HostError(f"cannot create group {name!r}: {exc.stderr.strip()}") from exc
    return grp.getgrnam(name).gr_gid


def is_ca(cert: Path) -> bool:
    """Whether the certificate in ``cert`` says it is a CA (BasicConstraints ca=True)."""
    from cryptography import x509

    crt = x509.load_pem_x509_certificate(cert.read_bytes())
    try:
        return bool(crt.extensions.get_extension_for_class(x509.BasicConstraints).value.ca)
    except x509.ExtensionNotFound:
        return False


def ensure_certificate(cert: Path, key: Path, hostname: str | None = None) -> bool:
    """Make a self-signed server certificate (EC P-256, 10 years, for localhost, the host
    name and the loopback addresses) when ``cert`` does not exist, or when it is one an
    older fusuma made as a CA. The key is 0600. Returns True when one was made.

    The certificate is a leaf, not a CA (BasicConstraints ca=False, key usage
    digitalSignature, extended key usage serverAuth): a client that trusts it, as
    ``curl --cacert`` or Prometheus' ``ca_file`` do, trusts this server and nothing
    that its key could sign."""
    if cert.exists() and key.exists() and not is_ca(cert):
        return False
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

    host = hostname or socket.gethostname()
    pkey = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, f"fusuma@{host}"),
                      x509.NameAttribute(NameOID.ORGANIZATION_NAME, "fusuma")])
    now = dt.datetime.now(dt.UTC)
    sans: list[x509.GeneralName] = [x509.DNSName("localhost"), x509.DNSName(host),
                                    x509.IPAddress(ipaddress.ip_address("127.0.0.1")),
                                    x509.IPAddress(ipaddress.ip_address("::1"))]
    usage = x509.KeyUsage(digital_signature=True, content_commitment=False,
                          key_encipherment=False, data_encipherment=False,
                          key_agreement=False, key_cert_sign=False, crl_sign=False,
                          encipher_only=False, decipher_only=False)
    crt = (x509.CertificateBuilder().subject_name(name).issuer_name(name)
           .public_key(pkey.public_key()).serial_number(x509.random_serial_number())
           .not_valid_before(now - dt.timedelta(minutes=5))
           .not_valid_after(now + dt.timedelta(days=3650))
           .add_extension(x509.SubjectAlternativeName(sans), critical=False)
           .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
           .add_extension(usage, critical=True)
           .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH]),
                          critical=False)
           .add_extension(x509.SubjectKeyIdentifier.from_public_key(pkey.public_key()),
                          critical=False)
           .sign(pkey, hashes.SHA256()))
    cert.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    fd = os.open(key, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(pkey.private_bytes(serialization.Encoding.PEM,
                                   serialization.PrivateFormat.PKCS8,
                                   serialization.NoEncryption()))
    cert.write_bytes(crt.public_bytes(serialization.Encoding.PEM))
    os.chmod(cert, 0o644)
    return True
