"""Kubernetes Events (core/v1) about fusuma's objects, for `kubectl describe`."""

from __future__ import annotations

import logging
import uuid

from fusuma.cluster.kube import EVENT, Kube, Obj
from fusuma.cluster.resources import now_iso

LOG = logging.getLogger(__name__)
NORMAL, WARNING = "Normal", "Warning"


class Recorder:
    def __init__(self, kube: Kube, host: str) -> None:
        self.kube = kube
        self.host = host

    def emit(self, obj: Obj, reason: str, message: str, type_: str = NORMAL) -> None:
        """One Event on ``obj``; a failure to write it is logged, never raised."""
        md = obj.get("metadata") or {}
        ns = md.get("namespace") or "default"
        now = now_iso()
        ev: Obj = {
            "metadata": {"name": f"{md.get('name')}.{uuid.uuid4().hex[:12]}",
                         "namespace": ns},
            "involvedObject": {"apiVersion": obj.get("apiVersion"), "kind": obj.get("kind"),
                               "name": md.get("name"), "namespace": md.get("namespace"),
                               "uid": md.get("uid"),
                               "resourceVersion": md.get("resourceVersion")},
            "reason": reason, "message": message[:1000], "type": type_,
            "source": {"component": "fusuma-agent", "host": self.host},
            "reportingComponent": "fusuma.io/agent", "reportingInstance": self.host,
            "firstTimestamp": now, "lastTimestamp": now, "count": 1,
        }
        LOG.info("event %s %s/%s: %s", reason, ns, md.get("name"), message)
        try:
            self.kube.create(EVENT, ev, ns)
        except Exception as exc:
            LOG.warning("cannot record event %s on %s: %s", reason, md.get("name"), exc)
