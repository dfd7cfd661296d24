"""The governor: a VM's CPU share set by policy, not left to the host scheduler.

- ``qos``      the three QoS classes, their cgroup policies and floors, admission
- ``measure``  per-VM CPU use and run delay from /proc schedstat (and PSI)
- ``policy``   the pure decision function (unit-tested with fake measurements)
- ``loop``     the asyncio control loop each partition supervisor runs

It raises no errors of its own: admission refusals are ``ResourceError`` and cgroup
failures ``CgroupError`` (see ``fusuma.errors``).
"""

from fusuma.governor.qos import QOS_NAMES, QosClass, check_admission

__all__ = ["QOS_NAMES", "QosClass", "check_admission"]
