"""The move stream between hosts under TLS, in the lab (issue 24): someone else on the
hosts' network who connects to the incoming port first, a capture of the stream against
a marker the guest holds in RAM, certificate rotation with a move in flight, and who may
read which Secret. See conftest.py for the lab."""

from __future__ import annotations

import base64
import json
import secrets
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from fusuma.cluster import pki
from fusuma.cluster.context import PLAIN_MOVES_ENV
from fusuma.cluster.hostmove import FAULT_STREAM_DELAY, TLS_CHANNELS
from fusuma.cluster.resources import now_iso
from tests.capture import Capture, tcp_flows
from tests.cluster.conftest import Cluster, wait_for
from tests.cluster.test_cluster import WRITE, guest_md5, vm_yaml
from tests.stranger import connect_first, refused

pytestmark = [pytest.mark.cluster, pytest.mark.timeout(600)]


def patch_host(c: Cluster, vm: str, host: str) -> None:
    c.lab.kubectl("patch", "fusumavm", vm, "--type=merge",
                  "-p", json.dumps({"spec": {"host": host}}))


def moved(c: Cluster, vm: str, host: str, timeout: float = 240) -> dict[str, Any]:
    """The VM once it runs on ``host`` and no move is recorded; its lastMove."""
    o = wait_for(lambda: (v := c.vm(vm))["status"].get("host") == host
                 and not v["status"].get("move") and c.running(vm) and v,
                 timeout, f"{vm} moved to {host}")
    return dict(o["status"]["lastMove"])


def restart_agents(c: Cluster, env: dict[str, str], *hosts: str) -> None:
    """Restart ``hosts``' agents with ``env`` added; wait until each registered again."""
    since = now_iso(time.time() + 1)     # after any write of the agent before
    for h in hosts:
        lh = c.lab_host(h)
        c.lab.stop_agent(lh)
        c.lab.start_agent(lh, env=env)
    wait_for(lambda: all((c.lab.get("fusumahost", h, None).get("status") or {})
                         .get("heartbeat", "") >= since for h in hosts), 60,
             "the agents registered again")


@pytest.fixture
def agents_restored(clean: Cluster) -> Iterator[Cluster]:
    """The cluster; its agents restarted as usual after the test (which changes their
    environment)."""
    yield clean
    for lh in clean.lab.hosts:
        clean.lab.stop_agent(lh)
        clean.lab.start_agent(lh)


def host_pem(c: Cluster, host: str) -> bytes:
    """A host's genuine certificate and key, read as the admin reads them."""
    data = c.lab.get("secret", f"fusuma-host-{host}", "fusuma-system")["data"]
    return base64.b64decode(data["tls.crt"]) + base64.b64decode(data["tls.key"])


def qemu_log(c: Cluster, host: str, vm: str) -> str:
    return (c.host(host).home / "vms" / vm / "qemu.log").read_text(errors="replace")


def test_someone_connecting_to_the_incoming_port_first_is_refused(
        agents_restored: Cluster) -> None:
    c = agents_restored
    # The source waits between the destination's prepare and the stream, so that the
    # stranger is first.
    restart_agents(c, {FAULT_STREAM_DELAY: "12"}, "h0")
    c.apply(vm_yaml("guarded", host="h0", partition="p0", memoryMiB=256))
    wait_for(lambda: c.running("guarded"), 180, "guarded running on h0")
    before = guest_md5(c, "h0", "guarded", WRITE)
    pid0 = c.vm("guarded")["status"]["pid"]
    stranger, _ = c.lab.outsider("x")
    patch_host(c, "guarded", "h1")
    move = wait_for(lambda: (m := c.vm("guarded")["status"].get("move") or {})
                    .get("phase") == "Prepared" and m, 120, "the destination prepared")
    assert move["tls"] is True
    port = int(move["uri"].rsplit(":", 1)[1])
    addr = c.lab_host("h1").address
    ca = pki.new_ca()
    claims_h0 = pki.issue(ca, "h0", [c.lab_host("h0").address])
    tries = {
        "raw migration stream": connect_first(stranger, addr, port),
        "another CA's certificate for h0": connect_first(
            stranger, addr, port, claims_h0.cert + claims_h0.key),
        "host h2's own certificate": connect_first(stranger, addr, port, host_pem(c, "h2")),
    }
    assert all(refused(t) for t in tries.values()), tries
    # The destination still waits for the real source; the guest runs on at h0.
    now = c.vm("guarded")["status"]
    assert (now["move"]["phase"], now["move"].get("decision"), now["pid"]) == \
        ("Prepared", None, pid0)
    assert c.local_vms("guarded")["h0"]["state"] in ("running", "migrating")
    last = moved(c, "guarded", "h1")
    assert (last["result"], last["decision"], last["tls"]) == ("ok", "forward", True)
    assert guest_md5(c, "h1", "guarded") == before
    assert list(c.local_vms("guarded")) == ["h1"]
    log = qemu_log(c, "h1", "guarded")
    assert "TLS handshake failed" in log
    assert "The certificate hasn't got a known issuer" in log
    assert "TLS x509 authz check for CN=h2 is denied" in log
    assert not list((c.host("h1").runtime / "vms" / "guarded").glob("**/tls-*")), \
        "a move's credentials were left on disk"
    print(f"strangers first on {addr}:{port}: {tries}")


MARK = """m={marker}; d=/dev/shm; [ -d $d ] || d=/tmp
i=0; while [ $i -lt 8192 ]; do echo $m; i=$((i+1)); done > $d/marker; sync
grep -c $m $d/marker"""


def captured_stream(pcap: Path, uri: str) -> tuple[list[bytes], list[bytes]]:
    """The source's bytes of each of the move's connections (each checked whole), and
    every direction's bytes of every connection to that port."""
    port = int(uri.rsplit(":", 1)[1])
    flows = tcp_flows(pcap, port)
    outgoing = []
    for (_, d), f in flows.items():
        data, missing = f.data()
        assert missing == 0, f"{missing} bytes of a connection are not in the capture"
        if d[1] == port:
            outgoing.append(data)
    assert outgoing, f"no connection to port {port} in the capture"
    return outgoing, [f.data()[0] for f in flows.values()]


def test_the_stream_between_hosts_shows_none_of_the_guests_memory(
        agents_restored: Cluster, tmp_path: Path) -> None:
    c = agents_restored
    marker = f"FZMARK-{secrets.token_hex(12)}"
    c.apply(vm_yaml("secretive", host="h0", partition="p1", memoryMiB=256))
    wait_for(lambda: c.running("secretive"), 180, "secretive running on h0")
    script = MARK.format(marker=marker)
    assert c.host("h0").run("vm", "exec", "secretive", "--", "/bin/sh", "-c",
                            script).out.split()[-1] == "8192"
    # Under TLS (as the agents run): every frame on the destination's side.
    pcap = tmp_path / "tls.pcap"
    with Capture(c.lab_host("h1").netns, pcap) as cap:
        patch_host(c, "secretive", "h1")
        last = moved(c, "secretive", "h1")
    assert cap.stop() == 0, "frames were dropped: the capture is not whole"
    assert last["tls"] is True and last["result"] == "ok"
    streams, every = captured_stream(pcap, last["uri"])
    assert len(streams) == 1 + last["channels"] == 1 + TLS_CHANNELS   # main + multifd
    assert all(d[:2] == b"\x16\x03" for d in streams), "a connection without TLS"
    assert sum(map(len, streams)) >= last["bytesSent"] > 16 * 2**20
    assert not any(marker.encode() in d for d in every)
    assert not any(marker[:16].encode() in d for d in every)
    # It arrived: the guest still holds it, at h1.
    assert c.host("h1").run("vm", "exec", "secretive", "--", "/bin/sh", "-c",
                            f"cat /dev/shm/marker /tmp/marker 2>/dev/null | grep -c {marker}"
                            ).out.strip() == "8192"
    # The control: in the clear the same capture finds it (so the check above can fail).
    restart_agents(c, {PLAIN_MOVES_ENV: "1"}, "h0", "h1")
    pcap = tmp_path / "plain.pcap"
    with Capture(c.lab_host("h0").netns, pcap) as cap:
        patch_host(c, "secretive", "h0")
        last = moved(c, "secretive", "h0")
    assert cap.stop() == 0
    assert last["tls"] is False and last["result"] == "ok"
    [data], _ = captured_stream(pcap, last["uri"])
    assert last["channels"] == 1 and data[:4] == b"QEVM" and marker.encode() in data
    print(f"in the clear: {data.count(marker.encode())} copies of the marker on the wire")


def rotate(c: Cluster, *args: str) -> subprocess.Popen[str]:
    return subprocess.Popen(
        ["nsenter", f"--net=/run/netns/{c.lab.ctl}", "--", sys.executable, "-m",
         "fusuma.cli.main", "cluster", "rotate-certs", "--kubeconfig",
         str(c.lab.admin_kubeconfig), "--timeout", "240", *args],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def tls_of(c: Cluster, host: str) -> dict[str, Any]:
    return dict((c.lab.get("fusumahost", host, None).get("status") or {}).get("moveTLS")
                or {})


def test_each_agent_reads_its_own_certificate_only(cluster: Cluster) -> None:
    def can(verb: str, what: str, host: str = "h0") -> str:
        user = f"system:serviceaccount:fusuma-system:fusuma-host-{host}"
        return cluster.lab.kubectl("auth", "can-i", verb, what, "-n", "fusuma-system",
                                   "--as", user, check=False).stdout.strip()

    assert can("get", "secret/fusuma-host-h0") == "yes"
    assert can("get", "secret/fusuma-host-h1") == "no"
    assert can("get", "secret/fusuma-move-ca") == "no"
    assert can("list", "secrets") == "no"
    assert can("get", "secret/fusuma-host-h1", "h1") == "yes"
    ca = cluster.lab.get("secret", "fusuma-move-ca", "fusuma-system")["data"]
    fp = pki.fingerprint(base64.b64decode(ca["ca.crt"]))
    for h in ("h0", "h1", "h2"):
        st = wait_for(lambda h=h: tls_of(cluster, h), 30, f"{h}'s moveTLS")
        assert st["issuer"] == fp and st["trust"] == [fp]


def test_rotation_with_a_new_ca_leaves_a_move_in_flight_alone(
        agents_restored: Cluster) -> None:
    c = agents_restored
    old = {h: tls_of(c, h) for h in ("h1", "h2")}
    # New host certificates, same CA: the hosts take them up.
    p = rotate(c)
    assert p.wait(120) == 0, p.stdout.read() if p.stdout else ""
    for h in ("h1", "h2"):
        st = wait_for(lambda h=h: (s := tls_of(c, h))["cert"] != old[h]["cert"] and s,
                      30, f"{h}'s new certificate")
        assert st["issuer"] == old[h]["issuer"]
    # A move held between the destination's prepare and its stream ...
    restart_agents(c, {FAULT_STREAM_DELAY: "10"}, "h1")
    c.apply(vm_yaml("rotor", host="h1", partition="p0", memoryMiB=256))
    wait_for(lambda: c.running("rotor"), 180, "rotor running on h1")
    before = guest_md5(c, "h1", "rotor", WRITE)
    patch_host(c, "rotor", "h2")
    wait_for(lambda: (c.vm("rotor")["status"].get("move") or {}).get("phase") == "Prepared",
             120, "the destination prepared")
    # ... while the CA itself is replaced (and the old one dropped).
    p = rotate(c, "--ca", "--drop-previous-ca")
    last = moved(c, "rotor", "h2")
    assert (last["result"], last["tls"]) == ("ok", True), last
    out, _ = p.communicate(timeout=240)
    assert p.returncode == 0, out
    assert "move(s) under way" in out
    ca = c.lab.get("secret", "fusuma-move-ca", "fusuma-system")["data"]
    new_fp = pki.fingerprint(base64.b64decode(ca["ca.crt"]))
    assert new_fp != old["h1"]["issuer"] and "previous.crt" not in ca
    for h in ("h0", "h1", "h2"):
        wait_for(lambda h=h: (s := tls_of(c, h))["issuer"] == new_fp
                 and s["trust"] == [new_fp], 30, f"{h} on the new CA alone")
    assert guest_md5(c, "h2", "rotor") == before
    # Moves go on with the new CA's certificates.
    patch_host(c, "rotor", "h0")
    last = moved(c, "rotor", "h0")
    assert (last["result"], last["tls"]) == ("ok", True)
    assert guest_md5(c, "h0", "rotor") == before


def test_an_agent_killed_during_a_rotation_takes_up_the_new_ca_when_it_is_back(
        agents_restored: Cluster) -> None:
    """kill -9 of a host's agent while `rotate-certs --ca` waits for every host to trust
    the new CA: the rotation goes on once that host's Lease has expired (a host that is
    not live cannot lag), and the agent, started again, reads its Secret and reports the
    new CA's certificate alone; its Secret was never left half written."""
    c = agents_restored
    lh = c.lab_host("h2")
    p = rotate(c, "--ca", "--drop-previous-ca")
    assert p.stdout is not None
    seen: list[str] = []
    for line in p.stdout:       # the CA is replaced: kill h2's agent right then
        seen.append(line)
        if "new CA" in line:
            c.lab.stop_agent(lh, signal.SIGKILL)
            break
    else:
        pytest.fail(f"rotate-certs never said it made a new CA: {''.join(seen)}")
    out, _ = p.communicate(timeout=240)
    assert p.returncode == 0, "".join(seen) + out
    ca = c.lab.get("secret", "fusuma-move-ca", "fusuma-system")["data"]
    new_fp = pki.fingerprint(base64.b64decode(ca["ca.crt"]))
    assert "previous.crt" not in ca
    pem = host_pem(c, "h2")        # whole: a certificate of the new CA and its key
    assert b"BEGIN CERTIFICATE" in pem and b"PRIVATE KEY" in pem
    c.lab.start_agent(lh)
    for h in ("h0", "h1", "h2"):
        wait_for(lambda h=h: (s := tls_of(c, h))["issuer"] == new_fp
                 and s["trust"] == [new_fp], 60, f"{h} on the new CA alone")
