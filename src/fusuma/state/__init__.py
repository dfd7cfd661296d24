"""fusuma's state: one SQLite file under FUSUMA_HOME shared by the CLI and supervisors.

The CLI owns the definitions (partitions, disks, VM configuration); a VM's state moves
only through the transition table of ``fusuma.state.machine``, and every long operation
holds a job (``fusuma.state.jobs``). SQLite in WAL mode with a busy timeout lets all
processes write safely; conditional updates make their races lose cleanly.
"""

from fusuma.state.db import (
    Database,
    DiskRecord,
    NetworkRecord,
    NicRecord,
    PartitionRecord,
    VmRecord,
)
from fusuma.state.jobs import (
    LOCAL_JOBS,
    Decision,
    Job,
    JobKind,
    JobOwner,
    MovePhase,
    busy_sentence,
    identity_obj,
    partition_obj,
    vm_obj,
)
from fusuma.state.machine import ALIVE, VmState

__all__ = ["ALIVE", "LOCAL_JOBS", "Database", "Decision", "DiskRecord", "Job", "JobKind",
           "JobOwner", "MovePhase", "NetworkRecord", "NicRecord", "PartitionRecord",
           "VmRecord", "VmState",
           "busy_sentence", "identity_obj", "partition_obj", "vm_obj"]
