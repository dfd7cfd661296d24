"""`fusuma cluster install --apply`: create or update the CRDs and RBAC (what
``kubectl apply -f -`` would do with the printed YAML), then wait until the API server
serves the new kinds."""

from __future__ import annotations

import time
from collections.abc import Callable

from fusuma.cluster import ClusterError, ConflictApiError
from fusuma.cluster.kube import Kind, Kube, Obj

KINDS = {
    "CustomResourceDefinition": Kind("apiextensions.k8s.io", "v1",
                                     "customresourcedefinitions", False,
                                     "CustomResourceDefinition"),
    "Namespace": Kind("", "v1", "namespaces", False, "Namespace"),
    "ServiceAccount": Kind("", "v1", "serviceaccounts", True, "ServiceAccount"),
    "ClusterRole": Kind("rbac.authorization.k8s.io", "v1", "clusterroles", False,
                        "ClusterRole"),
    "ClusterRoleBinding": Kind("rbac.authorization.k8s.io", "v1", "clusterrolebindings",
                               False, "ClusterRoleBinding"),
}


def apply(kube: Kube, objs: list[Obj], progress: Callable[[str], None] = lambda s: None,
          timeout: float = 60) -> None:
    for obj in objs:
        kind = KINDS[obj["kind"]]
        md = obj["metadata"]
        ns = md.get("namespace")
        try:
            kube.create(kind, dict(obj), ns)
            progress(f"{obj['kind']} {md['name']} created")
        except ConflictApiError:
            cur = kube.get(kind, md["name"], ns)
            new = {**obj, "metadata": {**md, "resourceVersion":
                                       cur["metadata"]["resourceVersion"]}}
            kube.replace(kind, new)
            progress(f"{obj['kind']} {md['name']} configured")
    crds = [o["metadata"]["name"] for o in objs if o["kind"] == "CustomResourceDefinition"]
    deadline = time.monotonic() + timeout
    for name in crds:
        while True:
            cur = kube.get(KINDS["CustomResourceDefinition"], name)
            conds = {c.get("type"): c.get("status")
                     for c in (cur.get("status") or {}).get("conditions") or []}
            if conds.get("Established") == "True":
                break
            if time.monotonic() > deadline:
                raise ClusterError(f"CRD {name} was not established within {timeout:.0f} s.")
            time.sleep(0.2)
