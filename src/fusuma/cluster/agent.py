"""`fusuma agent`: one host's agent process.

Threads: one watch per kind (``Informer``), the heartbeat (the host's Lease, renewed
every third of its duration, and the FusumaHost status every ``STATUS_EVERY_S``), the
placement controller (acting only while it holds the placement Lease), and a pool
that reconciles objects, one object at a time per object (``submit``). The main thread
wakes on every change, and at least every ``RESYNC_S``, and hands each object that
concerns this host to the pool.

A VM with a move between hosts under way or wanted is reconciled on threads of their
own, the moves out of this host apart from those into it (``moves_out``, ``moves_in``):
a move's source half waits for its destination's half on the other host, which must
never wait for a thread that source halves hold there. The moves out of this host run
at most ``AgentConfig.moves_per_pair`` at once per destination host
(``fusuma.cluster.moveslots``); the others wait their turn.
"""

from __future__ import annotations

import contextlib
import logging
import signal
import socket
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any
from urllib.parse import urlparse

from fusuma import __version__
from fusuma.cluster import (
    FINALIZER,
    SYSTEM_NAMESPACE,
    ApiError,
    ClusterError,
    ConflictApiError,
    NotFoundApiError,
    certs,
    drain,
)
from fusuma.cluster.context import PLAIN_MOVES_ENV, AgentConfig
from fusuma.cluster.controller import Placement
from fusuma.cluster.events import Recorder
from fusuma.cluster.identity import check_agent
from fusuma.cluster.informer import Informer
from fusuma.cluster.kube import (
    HOST,
    LEASE,
    NETWORK,
    PARTITION,
    SEGMENT,
    VM,
    Kind,
    Kube,
    KubeConfig,
    Obj,
)
from fusuma.cluster.lease import Election, Observer, host_lease_name, renew_heartbeat
from fusuma.cluster.moveslots import PairSlots
from fusuma.cluster.networks import NetworkReconciler
from fusuma.cluster.owners import Owners
from fusuma.cluster.reconcile import PartitionReconciler, SegmentReconciler, VmReconciler
from fusuma.cluster.resources import VmView, key, now_iso, set_condition
from fusuma.errors import FusumaError
from fusuma.ops.context import Ctx, ThreadContexts
from fusuma.paths import Paths
from fusuma.qemu import tlscreds

LOG = logging.getLogger(__name__)
RESYNC_S = 5.0
STATUS_EVERY_S = 10.0
PLACEMENT_EVERY_S = 1.0
# How often an agent looks over the addresses it holds (fusuma.cluster.addresses.sweep).
ADDRESS_SWEEP_S = 30.0
# Threads for moves between hosts, each way: a running move holds one on its source host
# and one on its destination (at most moves_per_pair per pair of hosts); a move waiting
# for its slot holds one for a moment.
MOVE_THREADS = 32


class Agent:
    """One host's agent (implements ``fusuma.cluster.context.AgentContext``)."""

    def __init__(self, paths: Paths, kubecfg: KubeConfig, cfg: AgentConfig) -> None:
        self.paths = paths
        self.cfg = cfg
        self.host = cfg.host
        self.kube = Kube(kubecfg, user_agent=f"fusuma-agent/{__version__} ({cfg.host})")
        self.address = cfg.address or _route_source(kubecfg.server)
        self.owners = Owners(paths.home)
        self.events = Recorder(self.kube, cfg.host)
        self.wake = threading.Event()
        self.stop = threading.Event()
        self._contexts = ThreadContexts(paths)
        wake: Callable[[], None] = self.wake.set
        self.hosts_informer = Informer(self.kube, HOST, on_change=wake)
        self.parts_informer = Informer(self.kube, PARTITION, on_change=wake)
        self.vms_informer = Informer(self.kube, VM, cfg.namespace, on_change=wake)
        self.leases_informer = Informer(self.kube, LEASE, SYSTEM_NAMESPACE)
        self.segs_informer = Informer(self.kube, SEGMENT, on_change=wake)
        self.nets_informer = Informer(self.kube, NETWORK, on_change=wake)
        self.informers = [self.hosts_informer, self.parts_informer, self.vms_informer,
                          self.leases_informer, self.segs_informer, self.nets_informer]
        self._inflight: set[tuple[str, ...]] = set()
        self._dirty: set[tuple[str, ...]] = set()
        self._lock = threading.Lock()
        self._swept_at = 0.0
        self._qemu_versions: dict[str, str | None] = {}
        self._tls_lock = threading.Lock()
        self._tls_reported: dict[str, Any] | None = None
        self.pool = ThreadPoolExecutor(cfg.workers, thread_name_prefix="reconcile")
        self.moves_out = ThreadPoolExecutor(MOVE_THREADS, thread_name_prefix="move-out")
        self.moves_in = ThreadPoolExecutor(MOVE_THREADS, thread_name_prefix="move-in")
        self.move_slots = PairSlots(cfg.moves_per_pair, on_free=self.wake.set)
        self.vm_rec = VmReconciler(self)
        self.part_rec = PartitionReconciler(self)
        self.seg_rec = SegmentReconciler(self)
        self.net_rec = NetworkReconciler(self)
        self.placement = Placement(self)
        self.election = Election(self.kube, cfg.host, cfg.lease_seconds)
        self.lease_observer = Observer()
        self._observer_lock = threading.Lock()

    def ctx(self) -> Ctx:
        """This thread's context (a state-file connection is per thread)."""
        return self._contexts.get()

    # -- run ----------------------------------------------------------------------------
    def run(self) -> None:
        def _stop(*_: object) -> None:
            self.stop.set()
            self.wake.set()

        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, _stop)
        LOG.info("fusuma agent for host %s (address %s) against %s", self.host,
                 self.address, self.kube.cfg.server)
        if self.cfg.plain_moves:
            LOG.warning("moves between hosts from and to %s are NOT encrypted (%s is set: "
                        "for the benchmark's before only)", self.host, PLAIN_MOVES_ENV)
        check_agent(self.kube, self.host)
        self.register()
        for inf in self.informers:
            inf.start()
        for inf in self.informers:
            if not inf.synced.wait(60):
                raise FusumaError(f"cannot list {inf.kind.plural} from the API server.")
        threads = [threading.Thread(target=self._heartbeat, name="heartbeat", daemon=True),
                   threading.Thread(target=self._placement, name="placement", daemon=True)]
        for t in threads:
            t.start()
        try:
            while not self.stop.is_set():
                self.wake.wait(RESYNC_S)
                self.wake.clear()
                if self.stop.is_set():
                    break
                try:
                    self.reconcile_all()
                except Exception:
                    LOG.exception("reconcile pass failed")
        finally:
            for inf in self.informers:
                inf.stop()
            for pool in (self.pool, self.moves_out, self.moves_in):
                pool.shutdown(wait=True, cancel_futures=True)
            LOG.info("fusuma agent for host %s stopped", self.host)

    def register(self) -> None:
        """Create this host's FusumaHost (if missing), its Lease, and its status."""
        renew_heartbeat(self.kube, self.host, self.cfg.lease_seconds)
        if self.kube.find(HOST, self.host) is None:
            with contextlib.suppress(ConflictApiError):
                self.kube.create(HOST, {"metadata": {"name": self.host,
                                                     "labels": {"fusuma.io/host": self.host}},
                                        "spec": {}})
        self.write_host_status()
        self._refresh_move_creds()

    def _heartbeat(self) -> None:
        last_status = time.monotonic()
        every = max(1.0, self.cfg.lease_seconds / 3)
        while not self.stop.wait(every):
            try:
                renew_heartbeat(self.kube, self.host, self.cfg.lease_seconds)
                self._refresh_move_creds()
                if time.monotonic() - last_status >= STATUS_EVERY_S:
                    self.write_host_status()
                    last_status = time.monotonic()
            except Exception as exc:
                LOG.warning("heartbeat: %s", exc)

    def _placement(self) -> None:
        while not self.stop.wait(PLACEMENT_EVERY_S):
            if not self.election.try_lead():
                continue
            try:
                self.placement.run_once()
            except Exception:
                LOG.exception("placement pass failed")

    # -- dispatch -------------------------------------------------------------------------
    def reconcile_all(self) -> None:
        for p in self.parts_informer.items():
            if (p.get("spec") or {}).get("host") == self.host:
                self.submit(("partition", p["metadata"]["name"]), self._partition)
        for sg in self.segs_informer.items():
            self.submit(("segment", sg["metadata"]["name"]), self._segment)
        for nw in self.nets_informer.items():
            self.submit(("network", nw["metadata"]["name"]), self._network)
        me = self.hosts_informer.get("", self.host)
        if me is not None and drain.wanted(me):
            self.submit(("drain",), self._drain)
        uids = set()
        for o in self.vms_informer.items():
            v = VmView(o)
            uids.add(v.uid)
            if self._concerns(v):
                self.submit(("vm", v.namespace, v.name), self._vm, self._pool_for(v))
        self._orphans(uids)
        if time.monotonic() - self._swept_at >= ADDRESS_SWEEP_S:
            self._swept_at = time.monotonic()
            self.submit(("addresses",), self._sweep_addresses)

    def _pool_for(self, v: VmView) -> ThreadPoolExecutor:
        """Where ``v``'s pass runs: with the moves into this host, those out of it, or
        (no move between hosts) with everything else."""
        m = v.move or {}
        if m.get("toHost") == self.host:
            return self.moves_in
        if m.get("fromHost") == self.host:
            return self.moves_out
        if v.host == self.host and v.want_host not in (None, self.host):
            return self.moves_out
        return self.pool

    def _sweep_addresses(self, k: tuple[str, ...]) -> None:
        from fusuma.cluster import addresses

        for line in addresses.sweep(self.kube, self.host, self.vms_informer.get,
                                    self.cfg.namespace):
            LOG.info("addresses: %s", line)

    def _concerns(self, v: VmView) -> bool:
        if self.host in (v.want_host, v.host):
            return True
        m = v.move
        if m and self.host in (m.get("fromHost"), m.get("toHost")):
            return True
        owner = self.owners.get("vms", v.name)
        return owner is not None and owner.uid == v.uid

    def _orphans(self, uids: set[str]) -> None:
        """VMs this host made for objects that no longer exist (deleted while this
        agent was away and their finalizer removed by the placement controller)."""
        if self.cfg.namespace is not None:
            return      # objects of other namespaces are not ours to judge
        for name, owner in self.owners.all("vms").items():
            if owner.uid not in uids:
                self.submit(("orphan", name), self._drop_orphan)

    def _drop_orphan(self, k: tuple[str, ...]) -> None:
        name = k[1]
        c = self.ctx()
        owner = self.owners.get("vms", name)
        if owner is None or any(VmView(o).uid == owner.uid
                                for o in self.vms_informer.items()):
            return
        if c.db.find_vm(name) is not None:
            with contextlib.suppress(FusumaError):
                c.vms.delete(name, force=True)
            LOG.warning("deleted VM %s: its FusumaVM %s is gone", name, owner.label)
        self.owners.remove("vms", name)

    def submit(self, k: tuple[str, ...], fn: Callable[[tuple[str, ...]], None],
               pool: ThreadPoolExecutor | None = None) -> None:
        """Reconcile ``k`` by ``fn`` on ``pool`` (the reconcile pool unless given), or
        again after the pass of ``k`` that runs now."""
        with self._lock:
            if k in self._inflight:
                self._dirty.add(k)
                return
            self._inflight.add(k)
        try:
            (pool or self.pool).submit(self._work, k, fn)
        except RuntimeError:         # shutting down
            with self._lock:
                self._inflight.discard(k)

    def _work(self, k: tuple[str, ...], fn: Callable[[tuple[str, ...]], None]) -> None:
        try:
            fn(k)
        except ApiError as exc:
            LOG.warning("%s: %s", "/".join(k), exc)
        except FusumaError as exc:
            LOG.warning("%s: %s", "/".join(k), exc)
        except Exception:
            LOG.exception("reconcile of %s failed", "/".join(k))
        finally:
            with self._lock:
                self._inflight.discard(k)
                again = k in self._dirty
                self._dirty.discard(k)
            if again:
                self.wake.set()

    def _vm(self, k: tuple[str, ...]) -> None:
        obj = self.vms_informer.get(k[1], k[2])
        if obj is not None:
            self.vm_rec.reconcile(obj)

    def _drain(self, k: tuple[str, ...]) -> None:
        drain.run(self)

    def _segment(self, k: tuple[str, ...]) -> None:
        obj = self.segs_informer.get("", k[1])
        if obj is not None:
            self.seg_rec.reconcile(obj)

    def _network(self, k: tuple[str, ...]) -> None:
        obj = self.nets_informer.get("", k[1])
        if obj is not None:
            self.net_rec.reconcile(obj)

    def _partition(self, k: tuple[str, ...]) -> None:
        obj = self.parts_informer.get("", k[1])
        if obj is not None:
            self.part_rec.reconcile(obj)

    # -- helpers for the reconcilers ------------------------------------------------------
    def _finalizers(self, kind: Kind, obj: Obj, change: Callable[[list[str]], list[str]]
                    ) -> None:
        for _ in range(5):
            md = obj["metadata"]
            cur = list(md.get("finalizers") or [])
            new = change(cur)
            if new == cur:
                return
            try:
                out = self.kube.patch(kind, md["name"], {"metadata": {
                    "finalizers": new, "resourceVersion": md["resourceVersion"]}},
                    md.get("namespace"))
            except ConflictApiError:
                got = self.kube.find(kind, md["name"], md.get("namespace"))
                if got is None:
                    return
                obj = got
                continue
            except NotFoundApiError:
                return
            inf = {VM.plural: self.vms_informer, PARTITION.plural: self.parts_informer,
                   SEGMENT.plural: self.segs_informer,
                   NETWORK.plural: self.nets_informer}.get(kind.plural)
            if inf is not None:
                inf.put(out)
            return

    def add_finalizer(self, kind: Kind, obj: Obj) -> None:
        self._finalizers(kind, obj, lambda f: f if FINALIZER in f else [*f, FINALIZER])

    def remove_finalizer(self, kind: Kind, obj: Obj) -> None:
        self._finalizers(kind, obj, lambda f: [x for x in f if x != FINALIZER])

    def host_lost(self, host: str) -> bool:
        """Whether ``host``'s heartbeat Lease is missing or expired (as seen here)."""
        lease = self.leases_informer.get(SYSTEM_NAMESPACE, host_lease_name(host))
        if lease is None:
            return True
        with self._observer_lock:
            return self.lease_observer.expired(lease)

    def move_creds(self) -> None:
        """Before a move's half: this host holds its move credentials. The heartbeat
        keeps them fresh (a rotation reaches them within a third of the Lease), so they
        are fetched here only if this agent has none yet; ClusterError if it has none."""
        if self._tls_reported is not None and tlscreds.load(self.paths) is not None:
            return
        self.refresh_move_creds()

    def refresh_move_creds(self) -> None:
        """Fetch this host's credentials for moves between hosts from its Secret into
        the host's store (``fusuma.qemu.tlscreds``: its supervisors read them there),
        and report them in the FusumaHost's status; ClusterError if it has none."""
        try:
            creds = certs.read_host(self.kube, self.host)
        except ApiError as exc:
            raise ClusterError(f"host {self.host} cannot read its move certificate "
                               f"(Secret {SYSTEM_NAMESPACE}/{certs.host_secret(self.host)}): "
                               f"{exc.message or exc.reason}.") from exc
        if creds is None:
            raise ClusterError(f"host {self.host} has no certificate for moves between "
                               f"hosts (Secret {SYSTEM_NAMESPACE}/"
                               f"{certs.host_secret(self.host)}); an admin runs `fusuma "
                               f"cluster rotate-certs --host {self.host}`.")
        certs.check(creds, self.host)
        with self._tls_lock:
            changed = tlscreds.store(self.paths, creds)
            if changed or self._tls_reported is None:
                status = certs.tls_status(creds)
                self.hosts_informer.put(self.kube.patch_status(HOST, self.host,
                                                               {"moveTLS": status}))
                self._tls_reported = status
                LOG.info("move certificate %s (issuer %s) in use", status["cert"][:16],
                         (status["issuer"] or "?")[:16])

    def _refresh_move_creds(self) -> None:
        try:
            self.refresh_move_creds()
        except FusumaError as exc:
            LOG.debug("move certificate: %s", exc)

    def qemu_version_of(self, binary: str | None) -> str | None:
        b = binary or "qemu-system-x86_64"
        if b not in self._qemu_versions:
            import subprocess

            try:
                out = subprocess.run([b, "--version"], capture_output=True, text=True,
                                     timeout=10).stdout
                self._qemu_versions[b] = out.split("version", 1)[1].split()[0] \
                    if "version" in out else None
            except (OSError, subprocess.SubprocessError, IndexError):
                self._qemu_versions[b] = None
        return self._qemu_versions[b]

    # -- the FusumaHost's status ----------------------------------------------------------
    def host_status(self) -> dict[str, Any]:
        from fusuma import capacity
        from fusuma.host.accel import probe_accel
        from fusuma.host.topology import host_info

        c = self.ctx()
        hi = host_info()
        accel = probe_accel("auto")
        parts = []
        for p in c.db.partitions():
            parts.append({"name": p.name, "cpus": list(p.cpus), "memoryMiB": p.memory_mib,
                          "usedMiB": capacity.partition_need(c.db, p.name).total,
                          "vms": len(c.db.vms(p.name)), "state": c.parts.status(p.name).state,
                          "qemu": p.qemu or ""})
        avail = hi.memory_available_for_partitions_mib
        free = avail - capacity.host_now(c.db).total
        versions: list[str] = []
        try:
            from fusuma.qemu.versions import installed

            versions = [q.version for q in installed(self.paths)]
        except (FusumaError, OSError) as exc:
            LOG.debug("qemu versions: %s", exc)
        uplink: dict[str, int] = {}
        try:
            from fusuma.network import span

            uplink["uplinkMtu"] = span.uplink(self.address)[1]
        except FusumaError as exc:       # no interface holds the address (yet)
            LOG.debug("uplink: %s", exc)
        return {"address": self.address, **uplink, "cores": len(hi.cpus),
                "accelerator": accel.name, "memoryMiB": hi.memory_total_mib,
                "availableMiB": avail, "freeMiB": free, "partitions": parts,
                "vms": len(c.db.vms()), "qemuVersions": versions,
                "agentVersion": __version__,
                "lease": f"{SYSTEM_NAMESPACE}/{host_lease_name(self.host)}",
                "heartbeat": now_iso()}

    def write_host_status(self) -> None:
        status = self.host_status()
        cur = self.kube.get(HOST, self.host)
        conds = set_condition(list((cur.get("status") or {}).get("conditions") or []),
                              "Ready", True, "AgentRunning",
                              f"agent on {self.host} renews its Lease every "
                              f"{max(1, self.cfg.lease_seconds // 3)} s")
        new = self.kube.patch_status(HOST, self.host, {**status, "conditions": conds})
        self.hosts_informer.put(new)

    def vm_key(self, obj: Obj) -> tuple[str, str]:
        return key(obj)


def _route_source(server: str) -> str:
    """The local address this host uses to reach the API server."""
    u = urlparse(server)
    s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    try:
        s.connect((u.hostname or "127.0.0.1", u.port or 443))
        return str(s.getsockname()[0])
    except OSError:
        return "127.0.0.1"
    finally:
        s.close()
