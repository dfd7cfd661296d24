"""What the reconcilers, the move between hosts and the placement controller need from
the agent, as protocols: they depend on this narrow interface, the agent (``agent``)
implements it and builds them, so none of them imports the agent.

``AgentConfig`` lives here too: the reconcilers read it (the Lease duration)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

from fusuma.cluster.events import Recorder
from fusuma.cluster.informer import Informer
from fusuma.cluster.kube import Kind, Kube, Obj
from fusuma.cluster.moveslots import DEFAULT_PER_PAIR, PairSlots
from fusuma.cluster.owners import Owners
from fusuma.cluster.resources import FAILED, VmView
from fusuma.frozen import frozen

if TYPE_CHECKING:
    from fusuma.ops.context import Ctx


# Set (to 1) in an agent's environment, moves between hosts from and to it go in the
# clear: the benchmark's before (fusuma_bench.cluster). Both hosts of a move must agree,
# or the source refuses it.
PLAIN_MOVES_ENV = "FUSUMA_BENCH_PLAIN_MOVES"


@frozen
class AgentConfig:
    host: str
    address: str | None = None
    namespace: str | None = None
    lease_seconds: int = 40
    workers: int = 8
    plain_moves: bool = False
    # Moves between hosts this agent runs at once to any one other host.
    moves_per_pair: int = DEFAULT_PER_PAIR


class VmMoves(Protocol):
    """The VM reconciler, as a move between hosts uses it: its refusals and the
    record of failed moves (spec generation, when)."""

    @property
    def move_failed(self) -> dict[str, tuple[int, float]]: ...

    def fail(self, v: VmView, reason: str, message: str, *, event: bool = True,
             state: str = FAILED) -> None: ...


class AgentContext(Protocol):
    """One host's agent: its names, its API client and caches, its owners, its
    contexts on this host, and the helpers that change objects safely."""

    @property
    def host(self) -> str: ...

    @property
    def address(self) -> str: ...

    @property
    def cfg(self) -> AgentConfig: ...

    @property
    def kube(self) -> Kube: ...

    @property
    def events(self) -> Recorder: ...

    @property
    def owners(self) -> Owners: ...

    @property
    def hosts_informer(self) -> Informer: ...

    @property
    def parts_informer(self) -> Informer: ...

    @property
    def vms_informer(self) -> Informer: ...

    @property
    def leases_informer(self) -> Informer: ...

    @property
    def vm_rec(self) -> VmMoves: ...

    @property
    def move_slots(self) -> PairSlots:
        """The slots of the moves out of this host, per destination host."""
        ...

    def ctx(self) -> Ctx:
        """This thread's context on this host."""
        ...

    def add_finalizer(self, kind: Kind, obj: Obj) -> None: ...

    def remove_finalizer(self, kind: Kind, obj: Obj) -> None: ...

    def host_lost(self, host: str) -> bool: ...

    def move_creds(self) -> None:
        """Fetch this host's move certificate into the host's store, or ClusterError."""
        ...

    def qemu_version_of(self, binary: str | None) -> str | None: ...
