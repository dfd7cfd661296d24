"""fusuma's state: one SQLite file under FUSUMA_HOME shared by the CLI and supervisors.

The CLI owns the definitions (partitions, disks, VM configuration); each partition's
supervisor owns the runtime columns of its own VMs (state, pid, accelerator, last
error). SQLite in WAL mode with a busy timeout lets all of them write safely.
"""

from fusuma.state.db import Database, DiskRecord, PartitionRecord, VmRecord, VmState

__all__ = ["Database", "DiskRecord", "PartitionRecord", "VmRecord", "VmState"]
