"""VMs: definitions kept by the CLI, QEMU processes run by partition supervisors."""

from fusuma.vm.manager import ExecOutput, VmManager, VmView

__all__ = ["ExecOutput", "VmManager", "VmView"]
