"""fusuma.qemu.tlscreds: the host's store, the directory one move's QEMU reads its
credentials from (and when it exists), the QMP objects and parameters."""

from __future__ import annotations

import asyncio
import base64
import os
import stat
from pathlib import Path
from typing import Any

import pytest

from fusuma.errors import HostError, QemuError
from fusuma.paths import Paths
from fusuma.qemu import tlscreds
from fusuma.qemu.tlscreds import CLIENT, SERVER, HostCreds

CREDS = HostCreds(b"CA PEM\n", b"CERT PEM\n", b"KEY PEM\n")
UID = 1_999_000_123


def paths(tmp: Path) -> Paths:
    return Paths(home=tmp / "home", runtime=tmp / "run", shm=tmp / "shm", cache=tmp / "c",
                 cgroup_prefix="t")


def test_ffdhe2048_is_rfc7919s_group() -> None:
    # p = 2^2048 - 2^1984 + (floor(2^1918 * e) + 560316) * 2^64 - 1, g = 2 (RFC 7919 A.1)
    bits = 1918 + 128
    e = 0
    fact = 1
    for k in range(400):
        fact *= max(k, 1)
        e += (1 << bits) // fact
    p = (1 << 2048) - (1 << 1984) + ((e >> (bits - 1918)) + 560316) * (1 << 64) - 1
    assert _pkcs3(tlscreds.FFDHE2048) == (p, 2)


def _pkcs3(pem: bytes) -> tuple[int, int]:
    """(p, g) of PKCS#3 DHParameter PEM: SEQUENCE { INTEGER p, INTEGER g }."""
    body = b"".join(line for line in pem.splitlines() if not line.startswith(b"-----"))
    der = base64.b64decode(body)

    def tlv(at: int) -> tuple[int, int, int]:       # tag, start of value, its length
        tag, n = der[at], der[at + 1]
        if n < 0x80:
            return tag, at + 2, n
        k = n & 0x7F
        return tag, at + 2 + k, int.from_bytes(der[at + 2:at + 2 + k], "big")

    tag, at, size = tlv(0)
    assert tag == 0x30 and at + size == len(der)
    out = []
    for _ in range(2):
        tag, start, size = tlv(at)
        assert tag == 0x02
        out.append(int.from_bytes(der[start:start + size], "big"))
        at = start + size
    assert at == len(der)
    return out[0], out[1]


def test_the_store_is_roots_alone_and_replaced_whole(tmp_path: Path) -> None:
    p = paths(tmp_path)
    assert tlscreds.load(p) is None
    with pytest.raises(HostError, match="rotate-certs --host"):
        tlscreds.require(p)
    assert tlscreds.store(p, CREDS) is True
    assert tlscreds.store(p, CREDS) is False          # unchanged: not rewritten
    assert tlscreds.load(p) == CREDS
    d = tlscreds.store_dir(p)
    assert stat.S_IMODE(d.stat().st_mode) == 0o700
    assert [f.name for f in d.iterdir()] == [tlscreds.STORE_FILE]
    assert stat.S_IMODE((d / tlscreds.STORE_FILE).stat().st_mode) == 0o600
    new = HostCreds(b"CA2\n", b"CERT2\n", b"KEY2\n")
    assert tlscreds.store(p, new) is True and tlscreds.require(p) == new
    (d / tlscreds.STORE_FILE).write_text("{not json")
    with pytest.raises(HostError, match="damaged"):
        tlscreds.load(p)


@pytest.mark.parametrize(("endpoint", "names"), [
    (SERVER, {"ca-cert.pem", "server-cert.pem", "server-key.pem", "dh-params.pem"}),
    (CLIENT, {"ca-cert.pem", "client-cert.pem", "client-key.pem"}),
])
def test_a_qemus_directory_is_its_uids_alone_and_gone_afterwards(
        tmp_path: Path, endpoint: str, names: set[str]) -> None:
    run = tmp_path / "run"
    run.mkdir(mode=0o700)
    with tlscreds.for_qemu(run, UID, CREDS, endpoint) as d:
        assert d.parent == run
        st = d.stat()
        assert (st.st_uid, st.st_gid, stat.S_IMODE(st.st_mode)) == (UID, UID, 0o700)
        assert {f.name for f in d.iterdir()} == names
        for f in d.iterdir():
            fst = f.stat()
            assert (fst.st_uid, stat.S_IMODE(fst.st_mode)) == (UID, 0o600)
        assert (d / f"{endpoint}-key.pem").read_bytes() == CREDS.key
        assert (d / "ca-cert.pem").read_bytes() == CREDS.ca
    assert list(run.iterdir()) == []
    with pytest.raises(RuntimeError), tlscreds.for_qemu(run, UID, CREDS, endpoint):
        raise RuntimeError("object-add failed")
    assert list(run.iterdir()) == []


def test_a_run_dir_swapped_for_a_symlink_is_not_followed(tmp_path: Path) -> None:
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (tmp_path / "run").symlink_to(elsewhere)
    with pytest.raises(OSError), tlscreds.for_qemu(tmp_path / "run", UID, CREDS, SERVER):
        pass
    assert list(elsewhere.iterdir()) == []


class FakeQmp:
    """Records commands; checks what QEMU would read at object-add."""

    def __init__(self, fail: str | None = None) -> None:
        self.calls: list[tuple[str, Any]] = []
        self.seen: dict[str, bytes] = {}
        self.fail = fail

    async def object_add(self, props: dict[str, Any]) -> None:
        self.calls.append(("object-add", props))
        if props["qom-type"] == "tls-creds-x509":
            d = Path(props["dir"])
            self.seen = {f.name: f.read_bytes() for f in d.iterdir()}
        if self.fail == props["qom-type"]:
            raise QemuError("refused")

    async def object_del(self, obj_id: str) -> None:
        self.calls.append(("object-del", obj_id))

    async def migrate_set_parameters(self, params: dict[str, Any]) -> None:
        self.calls.append(("migrate-set-parameters", params))
        if self.fail == "parameters" and params.get("tls-creds"):
            raise QemuError("refused")


def _arm(run: Path, qmp: FakeQmp, endpoint: str) -> tlscreds.MoveTls:
    return asyncio.run(tlscreds.arm(qmp, run, UID, CREDS, endpoint, "h0"))  # type: ignore[arg-type]


def test_the_destination_lets_in_the_source_hosts_certificate_only(tmp_path: Path) -> None:
    run = tmp_path / "run"
    run.mkdir()
    qmp = FakeQmp()
    tls = _arm(run, qmp, SERVER)
    (_, creds), (_, authz), (_, params) = [c for c in qmp.calls]
    assert creds == {"qom-type": "tls-creds-x509", "id": tls.creds_id, "endpoint": "server",
                     "dir": creds["dir"], "verify-peer": True}
    assert qmp.seen["server-key.pem"] == CREDS.key
    assert authz == {"qom-type": "authz-simple", "id": tls.authz_id, "identity": "CN=h0"}
    assert params == {"tls-creds": tls.creds_id, "tls-authz": tls.authz_id}
    assert list(run.iterdir()) == [], "the key outlived object-add"
    qmp.calls.clear()
    asyncio.run(tlscreds.drop(qmp, tls))  # type: ignore[arg-type]
    assert qmp.calls == [("migrate-set-parameters", tlscreds.TLS_OFF),
                         ("object-del", tls.authz_id), ("object-del", tls.creds_id)]


def test_the_source_checks_the_destinations_name(tmp_path: Path) -> None:
    run = tmp_path / "run"
    run.mkdir()
    qmp = FakeQmp()
    tls = _arm(run, qmp, CLIENT)
    assert tls.authz_id is None
    assert qmp.calls[-1] == ("migrate-set-parameters",
                             {"tls-creds": tls.creds_id, "tls-hostname": "h0"})
    assert qmp.seen["client-cert.pem"] == CREDS.cert
    assert list(run.iterdir()) == []


@pytest.mark.parametrize("fail", ["tls-creds-x509", "authz-simple", "parameters"])
def test_a_refused_step_leaves_no_file_and_no_object(tmp_path: Path, fail: str) -> None:
    run = tmp_path / "run"
    run.mkdir()
    qmp = FakeQmp(fail)
    with pytest.raises(QemuError):
        _arm(run, qmp, SERVER)
    assert list(run.iterdir()) == []
    if fail != "tls-creds-x509":
        assert ("object-del", qmp.calls[0][1]["id"]) in qmp.calls
        assert ("migrate-set-parameters", tlscreds.TLS_OFF) in qmp.calls


def test_uid_is_who_owns_what_root_writes(tmp_path: Path) -> None:
    # Root writes the files and hands them over; nothing is left owned by root.
    run = tmp_path / "run"
    run.mkdir()
    with tlscreds.for_qemu(run, UID, CREDS, CLIENT) as d:
        owners = {os.stat(f).st_uid for f in [d, *d.iterdir()]}
    assert owners == {UID}
