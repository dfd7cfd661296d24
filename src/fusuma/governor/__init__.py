"""The governors: a VM's CPU share and memory set by policy, not left to the host's
scheduler and OOM killer.

- ``qos``       the three QoS classes, their cgroup policies and floors, admission
- ``measure``   per-VM CPU use and run delay from /proc schedstat (and PSI)
- ``policy``    the CPU governor's pure decision function (unit-tested as data)
- ``loop``      the CPU governor's asyncio control loop each partition supervisor runs
- ``mempolicy`` the memory governor's pure decision function: reclaim from burstable
  VMs (fusuma.capacity's memory classes), cheapest first, and give back
- ``memloop``   the memory governor's loop: balloons by QMP, the guest agent

It raises no errors of its own: admission refusals are ``ResourceError`` and cgroup
failures ``CgroupError`` (see ``fusuma.errors``).
"""

from typing import TYPE_CHECKING, Any

__all__ = ["QOS_NAMES", "QosClass", "check_admission"]

if TYPE_CHECKING:
    from fusuma.governor.qos import QOS_NAMES, QosClass, check_admission
else:
    def __getattr__(name: str) -> Any:
        """``qos``'s names, imported when first asked for: a partition's files
        (``balloons``) come without the cgroup drivers ``qos`` needs."""
        if name in __all__:
            from fusuma.governor import qos

            return getattr(qos, name)
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
