"""Waiting for guest agents side by side. A benchmark starts its VMs from its own
thread (the state DB connection is that thread's) and then waits for their agents,
each in a thread of its own: booting VMs on different cores need not wait in turn."""

from __future__ import annotations

import threading
from collections.abc import Sequence
from typing import TYPE_CHECKING

from fusuma.supervisor import rpc

if TYPE_CHECKING:
    from fusuma.partition.manager import PartitionManager


def wait_agents(parts: PartitionManager, pairs: Sequence[tuple[str, str]],
                timeout: float) -> None:
    """Wait until the guest agent of each started (VM, partition) pair answers; once
    every wait has ended, raise the first error if there was one."""
    clients = [(vm, parts.client(partition)) for vm, partition in pairs]
    errors: list[BaseException] = []

    def wait(i: int) -> None:
        vm, client = clients[i]
        try:
            client.send(rpc.WaitAgent(vm, timeout=timeout), timeout=timeout + 10)
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=wait, args=(i,)) for i in range(len(clients))]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    if errors:
        raise errors[0]
