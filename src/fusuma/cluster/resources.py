"""Typed views of the custom resources, and the conditions every status carries."""

from __future__ import annotations

import time
from datetime import UTC, datetime
from typing import Any

from fusuma.cluster import FINALIZER
from fusuma.frozen import frozen

Obj = dict[str, Any]

# FusumaVM status.state values.
PENDING, PLACED, CREATING, RUNNING, STOPPED, MOVING, LOST, FAILED = (
    "Pending", "Placed", "Creating", "Running", "Stopped", "Moving", "Lost", "Failed")


def now_iso(ts: float | None = None) -> str:
    return datetime.fromtimestamp(time.time() if ts is None else ts, UTC).strftime(
        "%Y-%m-%dT%H:%M:%SZ")


def parse_time(value: str | None) -> float | None:
    """Kubernetes' RFC 3339 times (with or without fractions) as epoch seconds."""
    if not value:
        return None
    try:
        return datetime.fromisoformat(value.replace("Z", "+00:00")).timestamp()
    except ValueError:
        return None


def key(obj: Obj) -> tuple[str, str]:
    md = obj.get("metadata") or {}
    return str(md.get("namespace") or ""), str(md.get("name") or "")


def label(obj: Obj) -> str:
    ns, name = key(obj)
    return f"{ns}/{name}" if ns else name


def deleting(obj: Obj) -> bool:
    return bool((obj.get("metadata") or {}).get("deletionTimestamp"))


def has_finalizer(obj: Obj) -> bool:
    return FINALIZER in ((obj.get("metadata") or {}).get("finalizers") or [])


def condition(obj: Obj, ctype: str) -> Obj | None:
    for c in (obj.get("status") or {}).get("conditions") or []:
        if c.get("type") == ctype:
            return dict(c)
    return None


def set_condition(conditions: list[Obj], ctype: str, status: bool | None, reason: str,
                  message: str, generation: int | None = None) -> list[Obj]:
    """``conditions`` with ``ctype`` set; lastTransitionTime changes only with status."""
    st = "Unknown" if status is None else "True" if status else "False"
    out = [dict(c) for c in conditions if c.get("type") != ctype]
    old = next((c for c in conditions if c.get("type") == ctype), None)
    since = old.get("lastTransitionTime") if old and old.get("status") == st else None
    new: Obj = {"type": ctype, "status": st, "reason": reason, "message": message,
                "lastTransitionTime": since or now_iso()}
    if generation is not None:
        new["observedGeneration"] = generation
    out.append(new)
    return sorted(out, key=lambda c: str(c["type"]))


def same_conditions(a: list[Obj], b: list[Obj]) -> bool:
    """Equal but for transition times (what decides whether a status write is due)."""
    def strip(cs: list[Obj]) -> list[tuple[Any, ...]]:
        return sorted((c.get("type"), c.get("status"), c.get("reason"), c.get("message"),
                       c.get("observedGeneration")) for c in cs)
    return strip(a) == strip(b)


@frozen
class VmView:
    """A FusumaVM as the agents read it."""

    obj: Obj

    @property
    def namespace(self) -> str:
        return key(self.obj)[0]

    @property
    def name(self) -> str:
        return key(self.obj)[1]

    @property
    def uid(self) -> str:
        return str(self.obj["metadata"].get("uid") or "")

    @property
    def generation(self) -> int:
        return int(self.obj["metadata"].get("generation") or 0)

    @property
    def spec(self) -> Obj:
        return dict(self.obj.get("spec") or {})

    @property
    def status(self) -> Obj:
        return dict(self.obj.get("status") or {})

    @property
    def placement(self) -> Obj:
        return dict(self.status.get("placement") or {})

    @property
    def want_host(self) -> str | None:
        """Where the VM should be: spec.host, else the placement controller's choice."""
        return self.spec.get("host") or self.placement.get("host") or None

    @property
    def want_partition(self) -> str | None:
        return self.spec.get("partition") or self.placement.get("partition") or None

    @property
    def host(self) -> str | None:
        """Where it is defined now (status)."""
        return self.status.get("host") or None

    @property
    def state(self) -> str:
        return str(self.status.get("state") or PENDING)

    @property
    def move(self) -> Obj | None:
        m = self.status.get("move")
        return dict(m) if m else None

    @property
    def running(self) -> bool:
        return bool(self.spec.get("running", True))

    @property
    def restartable(self) -> bool:
        return bool(self.spec.get("restartable", False))

    @property
    def memory_mib(self) -> int:
        return int(self.spec.get("memoryMiB") or 256)

    @property
    def vcpus(self) -> int:
        return int(self.spec.get("vcpus") or 1)

    @property
    def shared_ram(self) -> bool:
        return bool(self.spec.get("sharedRam", not self.spec.get("mergeable", False)))

    @property
    def accel(self) -> str:
        return str(self.spec.get("accel") or "auto")

    @property
    def nic_ips(self) -> dict[int, str]:
        """The address each NIC holds, as its host wrote it (status.nics)."""
        return {int(n["index"]): str(n["ip"]) for n in self.status.get("nics") or []
                if n.get("ip") and n.get("index") is not None}

    def vm_spec_fields(self, partition: str,
                       ips: dict[int, str] | None = None) -> dict[str, Any]:
        """fusuma's VmSpec fields (fusuma.spec.VmSpec) for this VM in ``partition``;
        each NIC's address from ``ips`` (index -> address; default: what status.nics
        says it holds), else the spec's."""
        s = self.spec
        fields: dict[str, Any] = {
            "name": self.name, "partition": partition, "vcpus": self.vcpus,
            "memory_mib": self.memory_mib, "image": s.get("image") or "minimal",
            "accel": self.accel, "autostart": False, "shared_ram": self.shared_ram,
            "mergeable": bool(s.get("mergeable", False)),
            "qos": s.get("qos") or "burstable", "segments": list(s.get("segments") or []),
        }
        if s.get("boot"):
            fields["boot"] = s["boot"]
        if s.get("storage"):
            fields["storage"] = s["storage"]
        if s.get("nics"):
            # NICs on the cluster's networks (FusumaNetwork), as `vm create --nic`.
            held = self.nic_ips if ips is None else ips
            fields["nics"] = [{k: n[k] for k in ("network", "mac", "ip") if n.get(k)}
                              | ({"ip": held[i]} if i in held else {})
                              for i, n in enumerate(s["nics"])]
        return fields
