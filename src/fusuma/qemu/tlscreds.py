"""The move stream between hosts under QEMU's own TLS: the host's credentials, and how
one move's QEMU gets them.

QEMU encrypts and authenticates a migration stream itself (docs/system/tls.rst): a
``tls-creds-x509`` object reads a directory of PEM files, an ``authz-simple`` object
names the one peer identity (the certificate's distinguished name) the listening side
lets in, and the migration parameters ``tls-creds``, ``tls-authz`` (destination) and
``tls-hostname`` (source: the name the destination's certificate must carry) switch it
on for the next stream. Both sides verify the other's certificate against the cluster's
CA bundle; a peer without a certificate of that CA, or with another host's, fails the
handshake, and the listening QEMU keeps waiting for the real source.

Where the keys are:

- a host's credentials (its certificate and key, issued by the cluster CA, and the CA
  bundle it trusts) come from its Kubernetes Secret; the agent keeps a copy in
  ``FUSUMA_HOME/cluster/tls`` (:func:`store`, root's, 0700, files 0600), which the
  supervisors (root) read for each move (:func:`load`);
- for one move, the supervisor writes them into a directory of that move's QEMU
  (:func:`for_qemu`: a fresh directory in the QEMU's run dir, 0700, its files 0600, all
  owned by the VM's uid, which QEMU runs as and must read them with), adds the objects
  over QMP (QEMU reads every file during ``object-add``) and removes the directory at
  once: the key is on disk for the few milliseconds of that call, never in /tmp, never
  readable by another uid. Every file is made through the directory's descriptor with
  ``O_NOFOLLOW | O_EXCL``, since the run dir belongs to the VM's uid.

The objects are dropped again once the stream ends (:func:`drop`), so a QEMU that runs
the guest on does not keep the host's key.
"""

from __future__ import annotations

import contextlib
import json
import os
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from fusuma.errors import FusumaError, HostError
from fusuma.frozen import frozen
from fusuma.paths import PRIVATE_DIR, Paths
from fusuma.qemu import block
from fusuma.qemu.qmp import Qmp

# The host's store: one file (replaced atomically, so a reader never gets a new
# certificate with an old key), JSON of the three PEM texts.
STORE_FILE = "move-creds.json"
FILE_MODE = 0o600
# RFC 7919's ffdhe2048 group, PKCS#3. Without a dh-params.pem QEMU generates 2048-bit
# DH parameters in every server-side object-add (~0.3 s here, in the move's prepare);
# the key exchange is ECDHE anyway. tests/unit/test_tlscreds.py derives it again.
FFDHE2048 = b"""-----BEGIN DH PARAMETERS-----
MIIBCAKCAQEA//////////+t+FRYortKmq/cViAnPTzx2LnFg84tNpWp4TZBFGQz
+8yTnc4kmz75fS/jY2MMddj2gbICrsRhetPfHtXV/WVhJDP1H18GbtCFY2VVPe0a
87VXE15/V8k1mE8McODmi3fipona8+/och3xWKE2rec1MKzKT0g6eXq8CrGCsyT7
YdEIqUuyyOP7uWrat2DX9GgdT0Kj3jlN9K5W7edjcrsZCwenyO4KbXCeAvzhzffi
7MA0BM0oNC9hkXL+nOmFg/+OTxIy7vKBg8P+OxtMb61zO7X8vC7CIAXFjvGDfRaD
ssbzSibBsu/6iGtCOGEoXJf//////////wIBAg==
-----END DH PARAMETERS-----
"""
SERVER, CLIENT = "server", "client"


def identity(host: str) -> str:
    """The distinguished name of ``host``'s certificate, as QEMU's authz compares it:
    the subject is the host's name alone (``fusuma.cluster.pki`` issues it so)."""
    return f"CN={host}"


@frozen
class HostCreds:
    """One host's move credentials: the CA bundle it trusts, its certificate, its key
    (PEM)."""

    ca: bytes
    cert: bytes
    key: bytes


def store_dir(paths: Paths) -> Path:
    return paths.home / "cluster" / "tls"


def store(paths: Paths, creds: HostCreds) -> bool:
    """Keep ``creds`` as this host's (root only, replaced atomically); whether they
    changed."""
    if load(paths) == creds:
        return False
    d = store_dir(paths)
    d.parent.mkdir(mode=PRIVATE_DIR, parents=True, exist_ok=True)
    d.mkdir(mode=PRIVATE_DIR, exist_ok=True)
    os.chmod(d, PRIVATE_DIR)
    tmp = d / f".{STORE_FILE}.{uuid.uuid4().hex[:8]}"
    data = json.dumps({"ca": creds.ca.decode(), "cert": creds.cert.decode(),
                       "key": creds.key.decode()}).encode()
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, FILE_MODE)
    try:
        os.write(fd, data)
    finally:
        os.close(fd)
    os.replace(tmp, d / STORE_FILE)
    return True


def load(paths: Paths) -> HostCreds | None:
    """This host's move credentials, or None if its agent has none (yet)."""
    f = store_dir(paths) / STORE_FILE
    try:
        doc = json.loads(f.read_bytes())
        return HostCreds(doc["ca"].encode(), doc["cert"].encode(), doc["key"].encode())
    except FileNotFoundError:
        return None
    except OSError as exc:
        raise HostError(f"cannot read this host's move credentials {f}: "
                        f"{exc.strerror}.") from exc
    except (ValueError, KeyError, TypeError, AttributeError) as exc:
        raise HostError(f"this host's move credentials {f} are damaged; remove the file "
                        "and restart the agent (it fetches them again).") from exc


def require(paths: Paths) -> HostCreds:
    """This host's move credentials, or HostError with the fix."""
    creds = load(paths)
    if creds is None:
        raise HostError(f"this host has no certificate for moves between hosts (its agent "
                        f"keeps it in {store_dir(paths)} from its Secret); an admin issues "
                        "one with `fusuma cluster rotate-certs --host NAME`.")
    return creds


def _files(creds: HostCreds, endpoint: str) -> dict[str, bytes]:
    files = {"ca-cert.pem": creds.ca, f"{endpoint}-cert.pem": creds.cert,
             f"{endpoint}-key.pem": creds.key}
    if endpoint == SERVER:
        files["dh-params.pem"] = FFDHE2048
    return files


@contextlib.contextmanager
def for_qemu(run: Path, uid: int, creds: HostCreds, endpoint: str) -> Iterator[Path]:
    """A fresh directory in ``run`` (a QEMU's run dir) holding ``creds`` as QEMU's
    ``tls-creds-x509`` reads them for ``endpoint``, owned by ``uid`` (0700, files 0600);
    removed, with its files, when the block ends."""
    name = f"tls-{uuid.uuid4().hex[:12]}"
    parent = os.open(run, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    fd = -1
    written: list[str] = []
    try:
        os.mkdir(name, PRIVATE_DIR, dir_fd=parent)
        fd = os.open(name, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC,
                     dir_fd=parent)
        os.fchown(fd, uid, uid)
        os.fchmod(fd, PRIVATE_DIR)
        for fname, data in _files(creds, endpoint).items():
            f = os.open(fname, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW
                        | os.O_CLOEXEC, FILE_MODE, dir_fd=fd)
            written.append(fname)
            try:
                os.fchown(f, uid, uid)
                os.write(f, data)
            finally:
                os.close(f)
        yield run / name
    finally:
        if fd >= 0:
            for fname in written:
                with contextlib.suppress(OSError):
                    os.unlink(fname, dir_fd=fd)
            os.close(fd)
        with contextlib.suppress(OSError):
            os.rmdir(name, dir_fd=parent)
        os.close(parent)


# The names of a move's TLS objects in a QEMU: these, then the move's own tag.
CREDS_PREFIX, AUTHZ_PREFIX = "fz-tls-", "fz-authz-"


@frozen
class MoveTls:
    """The QOM objects and migration parameters of one move's TLS on one side."""

    creds_id: str
    authz_id: str | None = None

    @classmethod
    def new(cls, endpoint: str) -> MoveTls:
        tag = uuid.uuid4().hex[:8]
        return cls(f"{CREDS_PREFIX}{tag}",
                   f"{AUTHZ_PREFIX}{tag}" if endpoint == SERVER else None)

    def creds_object(self, directory: Path, endpoint: str) -> dict[str, Any]:
        """``object-add`` arguments of the credentials (the peer must present a
        certificate of the CA bundle: ``verify-peer``)."""
        return {"qom-type": "tls-creds-x509", "id": self.creds_id, "endpoint": endpoint,
                "dir": str(directory), "verify-peer": True}

    def authz_object(self, peer: str) -> dict[str, Any]:
        """``object-add`` arguments of the one identity the destination lets in."""
        assert self.authz_id is not None
        return {"qom-type": "authz-simple", "id": self.authz_id,
                "identity": identity(peer)}

    def incoming_parameters(self) -> dict[str, Any]:
        assert self.authz_id is not None
        return {"tls-creds": self.creds_id, "tls-authz": self.authz_id}

    def outgoing_parameters(self, peer: str) -> dict[str, Any]:
        """The source's: ``peer``'s certificate must name it (its DNS SAN)."""
        return {"tls-creds": self.creds_id, "tls-hostname": peer}


def parse_armed(reply: object) -> list[MoveTls]:
    """``qom-list /objects``'s answer: the TLS objects of moves (``MoveTls.new``'s
    names) that a QEMU holds, each credentials object with the authorization of the
    same move, if any; other objects are left out. QemuError if malformed."""
    names = block.names(reply, "qom-list", "name", "a property")
    out = []
    for name in sorted(n for n in names if n.startswith(CREDS_PREFIX)):
        authz = AUTHZ_PREFIX + name.removeprefix(CREDS_PREFIX)
        out.append(MoveTls(name, authz if authz in names else None))
    # An authorization whose credentials are gone already (a drop cut short).
    paired = {t.authz_id for t in out}
    out += [MoveTls("", n) for n in sorted(names)
            if n.startswith(AUTHZ_PREFIX) and n not in paired]
    return out


async def armed(qmp: Qmp) -> list[MoveTls]:
    """The moves' TLS objects this QEMU holds (``parse_armed``): a supervisor that
    adopts a QEMU asks it what an earlier one armed."""
    return parse_armed(await qmp.execute("qom-list", {"path": "/objects"}))


# Migration parameters that turn TLS off again (an empty string disables it in QEMU).
TLS_OFF = {"tls-creds": "", "tls-authz": "", "tls-hostname": ""}


async def arm(qmp: Qmp, run: Path, uid: int, creds: HostCreds, endpoint: str,
              peer: str) -> MoveTls:
    """Give a QEMU (its QMP, run dir and uid) this host's ``creds`` and turn TLS on for
    its next stream with ``peer``: the destination (``SERVER``) lets in only ``peer``'s
    certificate, the source (``CLIENT``) accepts only a destination whose certificate
    names ``peer``. The credentials' files exist only during ``object-add``."""
    tls = MoveTls.new(endpoint)
    with for_qemu(run, uid, creds, endpoint) as directory:
        await qmp.object_add(tls.creds_object(directory, endpoint))
    try:
        if endpoint == SERVER:
            await qmp.object_add(tls.authz_object(peer))
            await qmp.migrate_set_parameters(tls.incoming_parameters())
        else:
            await qmp.migrate_set_parameters(tls.outgoing_parameters(peer))
    except BaseException:
        await drop(qmp, tls)
        raise
    return tls


async def drop(qmp: Qmp, tls: MoveTls) -> None:
    """Turn TLS off again and delete the objects (and with them the key in QEMU's
    memory). Best effort: a QEMU that is gone holds nothing."""
    with contextlib.suppress(FusumaError):
        await qmp.migrate_set_parameters(TLS_OFF)
    for obj in (tls.authz_id, tls.creds_id):
        if obj:
            with contextlib.suppress(FusumaError):
                await qmp.object_del(obj)
