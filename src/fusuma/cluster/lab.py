"""A throwaway cluster on this machine, for the cluster tests and `fusuma bench cluster`.

Real parts only: Debian's etcd and the kube-apiserver built by `make kube`, in a network
namespace of their own (etcd on its loopback), and one network namespace per fusuma
host. A bridge in the control namespace joins a veth pair from each host namespace, so
every host reaches the API server and the other hosts at addresses made here, and
nothing is put in (or sent to) the machine's own network namespace::

    fz<tag>-ctl: lo (etcd 127.0.0.1:2379)  br0 10.251.0.1 (kube-apiserver :6443)
    fz<tag>-h0:  eth0 10.251.0.10 ─veth─ br0
    fz<tag>-h1:  eth0 10.251.0.11 ─veth─ br0  ...

The admin authenticates with a static ``system:masters`` token; each host with its own
identity, made by `fusuma cluster join` as on a real cluster (its ServiceAccount's token;
the API server authorizes with RBAC and enforces `fusuma cluster install`'s admission
policy). Processes are started by ``nsenter --net`` (only the network namespace changes:
``ip netns exec`` would remount /sys and hide the cgroup hierarchy) and ended by pid;
``close`` removes the namespaces, and the keys and tokens (kept in a 0700 directory).
"""

from __future__ import annotations

import contextlib
import datetime
import ipaddress
import json
import os
import secrets
import shutil
import signal
import subprocess
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from fusuma import spawn
from fusuma.cluster import ClusterError

K8S_VERSION = "1.33.13"
SUBNET = "10.251.0"
API_ADDR = f"{SUBNET}.1"
API_PORT = 6443


def kube_binary(name: str) -> Path:
    cache = Path(os.environ.get("FUSUMA_CACHE", "/var/cache/fusuma"))
    return cache / "k8s" / f"{name}-v{K8S_VERSION}"


def missing_parts() -> str | None:
    """Why a lab cannot start here (None: it can)."""
    for name in ("kube-apiserver", "kubectl"):
        if not kube_binary(name).exists():
            return f"{kube_binary(name)} is missing; build it with `make kube`."
    for tool in ("etcd", "nsenter", "ip"):
        if shutil.which(tool) is None:
            return f"{tool} is not installed (`make deps` installs etcd-server)."
    return None


@dataclass
class LabHost:
    name: str
    netns: str
    address: str
    env: dict[str, str]
    kubeconfig: Path
    agent: subprocess.Popen[bytes] | None = None
    log: Path | None = None


@dataclass
class Lab:
    workdir: Path
    host_envs: list[dict[str, str]]
    lease_seconds: int = 6
    tag: str = field(default_factory=lambda: uuid.uuid4().hex[:6])
    hosts: list[LabHost] = field(default_factory=list)
    procs: list[subprocess.Popen[bytes]] = field(default_factory=list)
    namespaces: list[str] = field(default_factory=list)

    @property
    def ctl(self) -> str:
        return f"fz{self.tag}-ctl"

    @property
    def secrets(self) -> Path:
        """The lab's keys, tokens and kubeconfigs (0700, removed by ``close``)."""
        return self.workdir / "pki"

    # -- bring-up -------------------------------------------------------------------
    def start(self) -> None:
        why = missing_parts()
        if why:
            raise ClusterError(why)
        self.workdir.mkdir(parents=True, exist_ok=True)
        try:
            self._network()
            self._credentials()
            self._etcd()
            self._apiserver()
            self._install()
            for h in self.hosts:
                self.join(h.name, h.kubeconfig)
        except BaseException:
            self.close()
            raise

    def _ip(self, *args: str, netns: str | None = None) -> None:
        cmd = ["ip", *(["-n", netns] if netns else []), *args]
        p = subprocess.run(cmd, capture_output=True, text=True)
        if p.returncode:
            raise ClusterError(f"{' '.join(cmd)} failed: {p.stderr.strip()}")

    def _network(self) -> None:
        self._ip("netns", "add", self.ctl)
        self.namespaces.append(self.ctl)
        self._ip("link", "set", "lo", "up", netns=self.ctl)
        self._ip("link", "add", "br0", "type", "bridge", netns=self.ctl)
        self._ip("addr", "add", f"{API_ADDR}/24", "dev", "br0", netns=self.ctl)
        self._ip("link", "set", "br0", "up", netns=self.ctl)
        for i, env in enumerate(self.host_envs):
            ns, addr = self._on_bridge(f"h{i}", f"vh{i}", f"{SUBNET}.{10 + i}")
            self.hosts.append(LabHost(f"h{i}", ns, addr, dict(env),
                                      self.secrets / f"h{i}.kubeconfig"))

    def _on_bridge(self, name: str, port: str, addr: str) -> tuple[str, str]:
        """A network namespace fz<tag>-NAME whose eth0 (``addr``) is joined to the
        bridge by its ``port``."""
        ns = f"fz{self.tag}-{name}"
        self._ip("netns", "add", ns)
        self.namespaces.append(ns)
        # Both ends are made inside the namespaces: nothing appears in the host's.
        self._ip("link", "add", "eth0", "netns", ns, "type", "veth", "peer", "name",
                 port, "netns", self.ctl)
        self._ip("link", "set", port, "master", "br0", "up", netns=self.ctl)
        self._ip("addr", "add", f"{addr}/24", "dev", "eth0", netns=ns)
        self._ip("link", "set", "eth0", "up", netns=ns)
        self._ip("link", "set", "lo", "up", netns=ns)
        return ns, addr

    def _credentials(self) -> None:
        from cryptography import x509
        from cryptography.hazmat.primitives import hashes, serialization
        from cryptography.hazmat.primitives.asymmetric import ec, rsa
        from cryptography.x509.oid import NameOID

        d = self.secrets
        d.mkdir(mode=0o700, exist_ok=True)
        now = datetime.datetime.now(datetime.UTC)

        def pem_key(k: Any) -> bytes:
            out: bytes = k.private_bytes(serialization.Encoding.PEM,
                                         serialization.PrivateFormat.PKCS8,
                                         serialization.NoEncryption())
            return out

        ca_key = ec.generate_private_key(ec.SECP256R1())
        ca_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "fusuma-lab-ca")])
        ca = (x509.CertificateBuilder().subject_name(ca_name).issuer_name(ca_name)
              .public_key(ca_key.public_key()).serial_number(x509.random_serial_number())
              .not_valid_before(now - datetime.timedelta(minutes=5))
              .not_valid_after(now + datetime.timedelta(days=2))
              .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
              .sign(ca_key, hashes.SHA256()))
        key = ec.generate_private_key(ec.SECP256R1())
        san = x509.SubjectAlternativeName([
            x509.IPAddress(ipaddress.ip_address(API_ADDR)),
            x509.IPAddress(ipaddress.ip_address("127.0.0.1")),
            x509.DNSName("localhost"), x509.DNSName("kubernetes")])
        cert = (x509.CertificateBuilder()
                .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME,
                                                            "kube-apiserver")]))
                .issuer_name(ca_name).public_key(key.public_key())
                .serial_number(x509.random_serial_number())
                .not_valid_before(now - datetime.timedelta(minutes=5))
                .not_valid_after(now + datetime.timedelta(days=2))
                .add_extension(san, critical=False).sign(ca_key, hashes.SHA256()))
        (d / "ca.crt").write_bytes(ca.public_bytes(serialization.Encoding.PEM))
        (d / "apiserver.crt").write_bytes(cert.public_bytes(serialization.Encoding.PEM))
        (d / "apiserver.key").write_bytes(pem_key(key))
        sa = rsa.generate_private_key(public_exponent=65537, key_size=2048)
        (d / "sa.key").write_bytes(pem_key(sa))
        (d / "sa.pub").write_bytes(sa.public_key().public_bytes(
            serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo))
        self.admin_token = secrets.token_hex(16)
        (d / "tokens.csv").write_text(f'{self.admin_token},admin,admin,"system:masters"\n')
        self.admin_kubeconfig = d / "admin.kubeconfig"
        self._kubeconfig(self.admin_kubeconfig, "admin", self.admin_token)

    def _kubeconfig(self, path: Path, user: str, token: str) -> None:
        import base64

        ca = base64.b64encode((self.secrets / "ca.crt").read_bytes()).decode()
        doc = {"apiVersion": "v1", "kind": "Config", "current-context": "lab",
               "clusters": [{"name": "lab", "cluster": {
                   "server": f"https://{API_ADDR}:{API_PORT}",
                   "certificate-authority-data": ca}}],
               "users": [{"name": user, "user": {"token": token}}],
               "contexts": [{"name": "lab", "context": {"cluster": "lab", "user": user}}]}
        path.write_text(json.dumps(doc, indent=1))
        path.chmod(0o600)

    def _spawn(self, netns: str, argv: list[str], log: Path,
               env: dict[str, str] | None = None) -> subprocess.Popen[bytes]:
        # nsenter without --fork execs the command: the pid is the command's own.
        with open(log, "ab") as out:
            p = subprocess.Popen(["nsenter", f"--net=/run/netns/{netns}", "--", *argv],
                                 stdout=out, stderr=subprocess.STDOUT,
                                 stdin=subprocess.DEVNULL,
                                 env=spawn.child_env(env or os.environ), cwd=spawn.CWD)
        self.procs.append(p)
        return p

    def _etcd(self) -> None:
        data = self.workdir / "etcd"
        self.etcd = self._spawn(self.ctl, [
            "etcd", "--name", "lab", "--data-dir", str(data),
            "--listen-client-urls", "http://127.0.0.1:2379",
            "--advertise-client-urls", "http://127.0.0.1:2379",
            "--listen-peer-urls", "http://127.0.0.1:2380",
            "--initial-advertise-peer-urls", "http://127.0.0.1:2380",
            "--initial-cluster", "lab=http://127.0.0.1:2380",
            "--log-level", "warn"], self.workdir / "etcd.log")

    def _apiserver(self) -> None:
        pki = self.secrets
        self.apiserver = self._spawn(self.ctl, [
            str(kube_binary("kube-apiserver")),
            "--etcd-servers=http://127.0.0.1:2379",
            f"--bind-address={API_ADDR}", f"--advertise-address={API_ADDR}",
            f"--secure-port={API_PORT}",
            f"--tls-cert-file={pki / 'apiserver.crt'}",
            f"--tls-private-key-file={pki / 'apiserver.key'}",
            f"--client-ca-file={pki / 'ca.crt'}",
            f"--token-auth-file={pki / 'tokens.csv'}",
            "--authorization-mode=RBAC",
            # On by default since 1.30; named so that the lab never runs without the
            # policy that keeps each host to its own objects.
            "--enable-admission-plugins=ValidatingAdmissionPolicy",
            "--service-account-issuer=https://kubernetes.default.svc.cluster.local",
            f"--service-account-key-file={pki / 'sa.pub'}",
            f"--service-account-signing-key-file={pki / 'sa.key'}",
            "--service-cluster-ip-range=10.96.0.0/24",
            f"--cert-dir={self.workdir / 'certs'}",
            "--event-ttl=1h", "--v=1"], self.workdir / "apiserver.log")
        deadline = time.monotonic() + 90
        while True:
            p = self.kubectl("get", "--raw", "/readyz", check=False, timeout=10)
            if p.returncode == 0 and "ok" in p.stdout:
                return
            if self.apiserver.poll() is not None or self.etcd.poll() is not None:
                raise ClusterError("kube-apiserver or etcd exited; see "
                                   f"{self.workdir}/apiserver.log and etcd.log.")
            if time.monotonic() > deadline:
                raise ClusterError(f"kube-apiserver not ready in 90 s: {p.stderr.strip()}")
            time.sleep(0.5)

    def _install(self) -> None:
        p = self.fusuma(self.ctl, ["cluster", "install", "--apply",
                                   "--kubeconfig", str(self.admin_kubeconfig)], timeout=120)
        if p.returncode:
            raise ClusterError(f"fusuma cluster install --apply failed: {p.stderr}")
        # Each host's certificate for the move stream, before its agent starts.
        p = self.fusuma(self.ctl, ["cluster", "rotate-certs", "--kubeconfig",
                                   str(self.admin_kubeconfig),
                                   *(a for h in self.hosts for a in ("--host", h.name))],
                        timeout=120)
        if p.returncode:
            raise ClusterError(f"fusuma cluster rotate-certs failed: {p.stderr}")

    def outsider(self, name: str = "x") -> tuple[str, str]:
        """One more network namespace on the lab's bridge, running no fusuma: someone
        else on the hosts' network (its name, its address). Removed by ``close``."""
        i = 200 + len(self.namespaces)
        return self._on_bridge(name, f"vx{i}", f"{SUBNET}.{i}")

    def join(self, host: str, kubeconfig: Path) -> None:
        """Give host ``host`` its identity (`fusuma cluster join`): its kubeconfig."""
        p = self.fusuma(self.ctl, ["cluster", "join", host, "--kubeconfig",
                                   str(self.admin_kubeconfig), "--output", str(kubeconfig)],
                        timeout=60)
        if p.returncode:
            raise ClusterError(f"fusuma cluster join {host} failed: {p.stderr}")

    # -- use --------------------------------------------------------------------------
    def fusuma(self, netns: str, args: list[str], env: dict[str, str] | None = None,
               timeout: float = 120) -> subprocess.CompletedProcess[str]:
        return subprocess.run(["nsenter", f"--net=/run/netns/{netns}", "--",
                               *spawn.module_argv("fusuma.cli.main", *args)],
                              env=spawn.child_env(env or os.environ), cwd=spawn.CWD,
                              capture_output=True, text=True, timeout=timeout)

    def kubectl(self, *args: str, input: str | None = None, check: bool = True,
                timeout: float = 60, kubeconfig: Path | None = None
                ) -> subprocess.CompletedProcess[str]:
        """kubectl as the admin (or as ``kubeconfig``'s user), from the control
        namespace."""
        cmd = ["nsenter", f"--net=/run/netns/{self.ctl}", "--", str(kube_binary("kubectl")),
               f"--kubeconfig={kubeconfig or self.admin_kubeconfig}", *args]
        p = subprocess.run(cmd, capture_output=True, text=True, input=input, timeout=timeout)
        if check and p.returncode:
            raise ClusterError(f"kubectl {' '.join(args)} failed: {p.stderr.strip()}")
        return p

    def get(self, kind: str, name: str | None = None,
            namespace: str | None = "default") -> Any:
        args = ["get", kind, *([name] if name else []), "-o", "json"]
        if namespace:
            args += ["-n", namespace]
        return json.loads(self.kubectl(*args).stdout)

    def start_agent(self, h: LabHost, *extra: str,
                    env: dict[str, str] | None = None) -> subprocess.Popen[bytes]:
        """Start ``h``'s agent (``env``: added to the host's environment)."""
        h.log = self.workdir / f"agent-{h.name}.log"
        h.agent = self._spawn(h.netns, [
            *spawn.module_argv("fusuma.cli.main"), "-v", "agent",
            "--kubeconfig", str(h.kubeconfig), "--host-name", h.name,
            "--address", h.address, "--lease-seconds", str(self.lease_seconds), *extra],
            h.log, env={**h.env, **(env or {})})
        return h.agent

    def stop_agent(self, h: LabHost, sig: int = signal.SIGTERM, wait: float = 20) -> None:
        p = h.agent
        if p is None:
            return
        if p.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(p.pid, sig)
            try:
                p.wait(wait)
            except subprocess.TimeoutExpired:
                os.kill(p.pid, signal.SIGKILL)
                p.wait(10)
        h.agent = None

    def restart_apiserver(self, down_s: float = 1.0) -> float:
        """kill -9 the API server (every agent's connection to it is lost) and start it
        again on the same etcd after ``down_s`` seconds; return once it is ready, with
        the seconds it was gone."""
        t0 = time.monotonic()
        self.apiserver.kill()
        self.apiserver.wait(10)
        time.sleep(down_s)
        self._apiserver()
        return time.monotonic() - t0

    def close(self) -> None:
        """End every process this lab started (by pid) and remove its namespaces."""
        for h in self.hosts:
            with contextlib.suppress(Exception):
                self.stop_agent(h, signal.SIGKILL)
        for p in reversed(self.procs):
            if p.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    p.send_signal(signal.SIGTERM)
                try:
                    p.wait(15)
                except subprocess.TimeoutExpired:
                    p.kill()
                    p.wait(10)
        for ns in reversed(self.namespaces):
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)
        self.namespaces.clear()
        # Keys, tokens and kubeconfigs: not left behind.
        shutil.rmtree(self.secrets, ignore_errors=True)

    def leftovers(self) -> list[str]:
        out = [f"process {p.pid} ({p.args!r:.60})" for p in self.procs if p.poll() is None]
        have = subprocess.run(["ip", "netns", "list"], capture_output=True,
                              text=True).stdout
        out += [f"netns {line.split()[0]}" for line in have.splitlines()
                if line.startswith(f"fz{self.tag}-")]
        if self.secrets.exists():
            out.append(f"keys and tokens in {self.secrets}")
        return out
