"""VMs: definitions kept by the CLI, QEMU processes run by partition supervisors.

``VmView`` (what `fusuma ps` shows) is light; ``VmManager`` pulls in the partition
manager, cgroups and the supervisor client, so it is imported on first use.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from fusuma.vm.view import VmView

if TYPE_CHECKING:
    from fusuma.vm.manager import ExecOutput, VmManager

__all__ = ["ExecOutput", "VmManager", "VmView"]


def __getattr__(name: str) -> Any:
    if name in ("ExecOutput", "VmManager"):
        from fusuma.vm import manager

        return getattr(manager, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
