"""fusuma on Kubernetes: a node agent per host, custom resources, placement, moves.

Each host runs ``fusuma agent --kubeconfig K``: it registers a ``FusumaHost``, keeps a
heartbeat Lease, and reconciles the ``FusumaPartition``, ``FusumaVM`` and
``FusumaSegment`` objects assigned to it through the same operations the CLI and the
API use. Every agent also runs the placement controller; one at a time is active,
chosen through a Lease. Kubernetes' storage, watches, RBAC and leader election do the
cluster's work; fusuma adds the partitions, moves, segments and the governor.

Modules: ``kube`` (a small typed client over httpx), ``crds`` (the CRDs that
``fusuma cluster install`` prints), ``policy`` (the admission policy that keeps each host
to its own objects), ``identity`` (a host's own ServiceAccount, roles and kubeconfig:
``fusuma cluster join``), ``resources`` (typed views of the objects and their
conditions), ``placement`` (the capacity arithmetic across hosts), ``agent`` (the
process), ``context`` (what the rest needs from the agent, as protocols: the agent
builds them, none of them imports it), ``reconcile`` (one host's half), ``hostmove``
(live moves between hosts), ``pki`` and ``certs`` (the move stream's CA and the hosts'
certificates, their Secrets and rotation), ``lease`` (heartbeats and leader election).

Errors::

    FusumaError
     └── ClusterError        the agent cannot do what the cluster asks
          └── ApiError        the API server refused a request (code, reason)
               └── ConflictApiError  409: another writer changed the object first
"""

from __future__ import annotations

from fusuma.errors import FusumaError

GROUP = "fusuma.io"
VERSION = "v1alpha1"
API_VERSION = f"{GROUP}/{VERSION}"
# Where the agents keep their Leases (heartbeats, the placement controller's).
SYSTEM_NAMESPACE = "fusuma-system"
# Set on a FusumaVM / FusumaPartition while a host holds something for it.
FINALIZER = f"{GROUP}/host-cleanup"


class ClusterError(FusumaError):
    """The agent cannot do what the cluster asks (not an API refusal)."""


class ApiError(ClusterError):
    """The API server answered a request with an error status."""

    def __init__(self, code: int, reason: str, message: str, method: str = "",
                 path: str = "") -> None:
        super().__init__(f"{method} {path}: {code} {reason}: {message}".strip())
        self.code = code
        self.reason = reason
        self.message = message


class ConflictApiError(ApiError):
    """409: the object changed since it was read (or already exists)."""


class NotFoundApiError(ApiError):
    """404: no such object."""
