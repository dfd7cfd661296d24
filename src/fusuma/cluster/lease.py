"""Leases (coordination.k8s.io/v1): each host's heartbeat, and the election of the one
active placement controller.

Expiry is judged the way client-go's leader election does: by when *this* process saw a
Lease's renewTime last change, on its own monotonic clock, never by comparing another
machine's timestamp with ours (clocks between hosts may differ).
"""

from __future__ import annotations

import contextlib
import logging
import time
from dataclasses import dataclass
from datetime import UTC, datetime

from fusuma.cluster import SYSTEM_NAMESPACE, ConflictApiError, NotFoundApiError
from fusuma.cluster.kube import LEASE, Kube, Obj

LOG = logging.getLogger(__name__)
PLACEMENT_LEASE = "fusuma-placement"
# The room ledger (fusuma.cluster.room): a Lease used as a versioned record.
ROOM_LEASE = "fusuma-room"


def host_lease_name(host: str) -> str:
    return f"fusuma-host-{host}"


def micro_now() -> str:
    """A Lease's MicroTime (RFC 3339 with microseconds)."""
    return datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


def _lease(name: str, holder: str, duration: int) -> Obj:
    now = micro_now()
    return {"metadata": {"name": name, "namespace": SYSTEM_NAMESPACE},
            "spec": {"holderIdentity": holder, "leaseDurationSeconds": duration,
                     "acquireTime": now, "renewTime": now, "leaseTransitions": 0}}


def renew_heartbeat(kube: Kube, host: str, duration: int) -> None:
    """Create or renew host ``host``'s heartbeat Lease."""
    name = host_lease_name(host)
    try:
        kube.patch(LEASE, name, {"spec": {"holderIdentity": host, "renewTime": micro_now(),
                                          "leaseDurationSeconds": duration}},
                   SYSTEM_NAMESPACE)
    except NotFoundApiError:
        with contextlib.suppress(ConflictApiError):
            kube.create(LEASE, _lease(name, host, duration), SYSTEM_NAMESPACE)


@dataclass
class _Seen:
    renew: str
    at: float          # time.monotonic() when renew was first seen


class Observer:
    """Tracks Leases' renewals on this process's clock."""

    def __init__(self) -> None:
        self.seen: dict[str, _Seen] = {}

    def observe(self, lease: Obj) -> float:
        """Seconds since ``lease`` was last seen renewed (0 when it just was)."""
        name = str(lease["metadata"]["name"])
        renew = str((lease.get("spec") or {}).get("renewTime") or "")
        now = time.monotonic()
        cur = self.seen.get(name)
        if cur is None or cur.renew != renew:
            self.seen[name] = _Seen(renew, now)
            return 0.0
        return now - cur.at

    def expired(self, lease: Obj) -> bool:
        duration = float((lease.get("spec") or {}).get("leaseDurationSeconds") or 40)
        return self.observe(lease) > duration


class Election:
    """Leader election on one Lease: ``try_lead()`` acquires or renews it."""

    def __init__(self, kube: Kube, identity: str, duration: int,
                 name: str = PLACEMENT_LEASE) -> None:
        self.kube = kube
        self.identity = identity
        self.duration = duration
        self.name = name
        self.observer = Observer()
        self.leading = False
        self.renewed = 0.0

    def try_lead(self) -> bool:
        now = time.monotonic()
        if self.leading and now - self.renewed < self.duration / 3:
            return True
        try:
            self.leading = self._try()
            if self.leading:
                self.renewed = now
        except Exception as exc:   # an unreachable API server: not leading
            LOG.warning("placement election: %s", exc)
            self.leading = False
        return self.leading

    def _try(self) -> bool:
        cur = self.kube.find(LEASE, self.name, SYSTEM_NAMESPACE)
        if cur is None:
            try:
                self.kube.create(LEASE, _lease(self.name, self.identity, self.duration),
                                 SYSTEM_NAMESPACE)
                LOG.info("placement controller: %s leads", self.identity)
                return True
            except ConflictApiError:
                return False
        spec = cur.setdefault("spec", {})
        holder = spec.get("holderIdentity")
        if holder != self.identity and holder and not self.observer.expired(cur):
            return False
        if holder != self.identity:
            spec["leaseTransitions"] = int(spec.get("leaseTransitions") or 0) + 1
            spec["acquireTime"] = micro_now()
            spec["holderIdentity"] = self.identity
        spec["renewTime"] = micro_now()
        spec["leaseDurationSeconds"] = self.duration
        try:
            self.kube.replace(LEASE, cur)     # resourceVersion precondition: one winner
        except ConflictApiError:
            return False
        if holder != self.identity:
            LOG.info("placement controller: %s leads (was %s)", self.identity, holder)
        return True
