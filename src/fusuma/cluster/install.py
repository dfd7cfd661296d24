"""`fusuma cluster install --apply`: create or update the CRDs, roles and admission
policy (what ``kubectl apply -f -`` would do with the printed YAML), then wait until the
API server serves the new kinds. `fusuma cluster join` applies a host's identity the
same way."""

from __future__ import annotations

import time
from collections.abc import Callable

from fusuma.cluster import SYSTEM_NAMESPACE, ClusterError, ConflictApiError, NotFoundApiError
from fusuma.cluster.crds import crds, rbac
from fusuma.cluster.kube import MANIFEST_KINDS, Kube, Obj
from fusuma.cluster.policy import admission_policy

KINDS = MANIFEST_KINDS
# What fusuma installed before each host had an identity of its own: one that every
# agent shared, allowed to write every host's objects. `install --apply` removes it.
LEGACY = [("ClusterRoleBinding", "fusuma-agent", None), ("ClusterRole", "fusuma-agent", None),
          ("ServiceAccount", "fusuma-agent", SYSTEM_NAMESPACE)]


def manifests() -> list[Obj]:
    """Everything `fusuma cluster install` makes: the CRDs, the namespace, the view and
    edit roles, and the admission policies that keep each host to its own objects and
    the addresses it holds."""
    return [*crds(), *rbac(), *admission_policy()]


def apply(kube: Kube, objs: list[Obj], progress: Callable[[str], None] = lambda s: None,
          timeout: float = 60) -> None:
    for obj in objs:
        kind = KINDS[obj["kind"]]
        md = obj["metadata"]
        ns = md.get("namespace")
        try:
            kube.create(kind, dict(obj), ns)
            progress(f"{obj['kind']} {md['name']} created")
        except NotFoundApiError as exc:
            raise ClusterError(
                f"the API server does not serve {kind.plural} ({kind.api_version}): "
                f"{obj['kind']} {md['name']} cannot be made; fusuma needs Kubernetes >= "
                "1.30 (ValidatingAdmissionPolicy keeps each host to its own objects)."
            ) from exc
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


def remove_legacy(kube: Kube, progress: Callable[[str], None] = lambda s: None) -> None:
    """Remove the identity all agents shared before each host had its own."""
    for kind, name, ns in LEGACY:
        if kube.find(KINDS[kind], name, ns) is not None:
            kube.delete(KINDS[kind], name, ns)
            progress(f"{kind} {name} (shared by every agent) removed: each host needs "
                     "its own identity now (fusuma cluster join NAME)")
