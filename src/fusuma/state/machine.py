"""The VM state machine: every state, and every legal transition, in one table.

The table is checked where the state is written (``Database.transition``: a
conditional update inside one IMMEDIATE transaction), so two processes can never both
believe they moved the same VM out of the same state.

    stopped ──> starting ──> running <──> paused
       ^           │  │        │  │ ^        │
       │           │  └─┐      │  v │        │
       └── stopping <───┼──────┘ migrating ──┘   (a move ends running, paused or
              │         v          │              crashed: never two QEMUs)
              └─────> crashed <────┘
"""

from __future__ import annotations

import enum

from fusuma.errors import StateError


class VmState(enum.StrEnum):
    """Lifecycle of a VM as recorded in the state file."""

    STOPPED = "stopped"
    STARTING = "starting"
    RUNNING = "running"
    PAUSED = "paused"          # QEMU alive, guest not running (QMP STOP), no job on it
    STOPPING = "stopping"
    CRASHED = "crashed"
    MIGRATING = "migrating"


S = VmState
TRANSITIONS: dict[VmState, frozenset[VmState]] = {
    S.STOPPED: frozenset({S.STARTING}),
    S.STARTING: frozenset({S.RUNNING, S.PAUSED, S.STOPPED, S.CRASHED}),
    S.RUNNING: frozenset({S.PAUSED, S.STOPPING, S.MIGRATING, S.CRASHED}),
    S.PAUSED: frozenset({S.RUNNING, S.STOPPING, S.MIGRATING, S.CRASHED}),
    S.STOPPING: frozenset({S.STOPPED, S.CRASHED}),
    S.MIGRATING: frozenset({S.RUNNING, S.PAUSED, S.CRASHED}),
    S.CRASHED: frozenset({S.STARTING, S.STOPPED}),
}

# States in which a QEMU process should exist.
ALIVE = frozenset({S.STARTING, S.RUNNING, S.PAUSED, S.STOPPING, S.MIGRATING})
# States in which a VM's definition may be deleted.
DELETABLE = frozenset({S.STOPPED, S.CRASHED})


def valid_transition(old: VmState, new: VmState) -> bool:
    return new == old or new in TRANSITIONS[old]


def check_transition(vm: str, old: VmState, new: VmState) -> None:
    if not valid_transition(old, new):
        raise StateError(f"VM {vm!r} is {old.value}; it cannot become {new.value} from "
                         "there (see `fusuma ps`).")


def lifecycle_action(old: VmState, new: VmState) -> str | None:
    """The lifecycle event a transition is (``vm-started``, ...), None for the steps a
    move or a stop takes on the way (the move's own event carries its numbers)."""
    if new == old:
        return None
    if new == S.RUNNING:
        return {S.STARTING: "vm-started", S.PAUSED: "vm-resumed"}.get(old)
    return {S.STOPPED: "vm-stopped", S.CRASHED: "vm-crashed",
            S.PAUSED: "vm-paused"}.get(new)
