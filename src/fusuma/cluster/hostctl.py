"""What `fusuma host` asks of the API server: cordon, drain and uncordon a FusumaHost
or some of its partitions (the host's spec), follow a drain, list the hosts. The agents do the work
(``fusuma.cluster.drain``); this module only asks and reads."""

from __future__ import annotations

import time
from collections.abc import Callable

from fusuma.cluster import ClusterError
from fusuma.cluster.drain import BLOCKED, DONE, describe, progress
from fusuma.cluster.kube import HOST, VM, Kube, Obj
from fusuma.errors import NotFoundError

FOLLOW_EVERY_S = 1.0


def get_host(kube: Kube, name: str) -> Obj:
    """FusumaHost ``name``, or NotFoundError naming the hosts there are."""
    got = kube.find(HOST, name)
    if got is not None:
        return got
    names = sorted(h["metadata"]["name"] for h in kube.list(HOST)[0])
    raise NotFoundError(f"no host named {name!r} in the cluster (it has: "
                        f"{', '.join(names) or 'none'}); `fusuma host list` shows them.")


def set_spec(kube: Kube, name: str, spec: Obj) -> Obj:
    """Merge ``spec`` into host ``name``'s spec (None removes a field); the host after."""
    get_host(kube, name)
    new = kube.patch(HOST, name, {"spec": spec})
    kept = new.get("spec") or {}
    for k, val in spec.items():
        if val is not None and kept.get(k) != val:
            # The API server prunes a field its CRD does not have.
            raise ClusterError(f"the cluster's FusumaHost has no spec.{k} (its CRD is "
                               "from an older fusuma): run `fusuma cluster install "
                               "--apply` first.")
    return new


def cordon(kube: Kube, name: str) -> Obj:
    return set_spec(kube, name, {"unschedulable": True})


def drain(kube: Kube, name: str, partitions: tuple[str, ...] = ()) -> Obj:
    """Drain host ``name``: every VM off it; or with ``partitions``, only those
    partitions' VMs, into the host's other partitions (the host keeps taking VMs)."""
    if not partitions:
        return set_spec(kube, name, {"unschedulable": True, "drain": True})
    h = get_host(kube, name)
    has = [str(p.get("name")) for p in (h.get("status") or {}).get("partitions") or []]
    unknown = [p for p in partitions if p not in has]
    if unknown:
        raise NotFoundError(f"host {name} has no partition {', '.join(unknown)} (it has: "
                            f"{', '.join(has) or 'none'}); `kubectl get fusumapartitions` "
                            "shows them.")
    if not set(has) - set(partitions):
        raise ClusterError(f"draining {', '.join(partitions)} would leave host {name} no "
                           "partition to move their VMs to: create a FusumaPartition "
                           "there first (on the new QEMU, for an upgrade), or drain the "
                           f"whole host (`fusuma host drain {name}`).")
    old = list((h.get("spec") or {}).get("drainPartitions") or [])
    return set_spec(kube, name, {"drainPartitions": sorted({*old, *partitions})})


def uncordon(kube: Kube, name: str, partitions: tuple[str, ...] = ()) -> Obj:
    """End host ``name``'s cordon and drains; with ``partitions``, only those
    partitions' drain."""
    if not partitions:
        return set_spec(kube, name, {"unschedulable": False, "drain": None,
                                     "drainPartitions": None})
    old = (get_host(kube, name).get("spec") or {}).get("drainPartitions") or []
    left = [p for p in old if p not in partitions]
    return set_spec(kube, name, {"drainPartitions": left or None})


def follow(kube: Kube, name: str, timeout: float, on_line: Callable[[str], None],
           sleep: Callable[[float], None] = time.sleep,
           clock: Callable[[], float] = time.monotonic) -> Obj:
    """Wait until host ``name``'s drain is done (Drained or Blocked), calling
    ``on_line`` with each new line of its progress; its last progress."""
    deadline = clock() + timeout
    said: set[str] = set()
    while True:
        st = progress(kube.get(HOST, name), kube.list(VM)[0])
        if st is not None:
            for line in describe(st):
                if line not in said:
                    said.add(line)
                    on_line(line)
            if st["state"] in DONE:
                return st
        if clock() >= deadline:
            if st is None:
                raise ClusterError(
                    f"host {name}'s agent did not take up the drain in {timeout:g} s: is "
                    "`fusuma agent` running there, and of a fusuma that knows spec.drain? "
                    "(`fusuma host list`)")
            raise ClusterError(f"host {name} is still draining after {timeout:g} s: "
                               f"{st['message']} `fusuma host drain {name} --wait` "
                               "follows it again.")
        sleep(FOLLOW_EVERY_S)


def blocked(name: str, st: Obj) -> ClusterError | None:
    """The error for a drain that ended with VMs that cannot leave (None: drained)."""
    if st["state"] != BLOCKED:
        return None
    n = len(st.get("refused") or [])
    parts = st.get("partitions") or []
    what = f"host {name}" if not parts else \
        f"partition(s) {', '.join(parts)} of host {name}"
    again = "".join(f" --partition {p}" for p in parts)
    return ClusterError(f"{what} is not drained: {n} VM(s) cannot leave it (each said "
                        f"why above); fix them and drain again, or `fusuma host uncordon "
                        f"{name}{again}`.")
