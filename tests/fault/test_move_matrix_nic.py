"""The move's kill matrix with a NIC attached (fusuma.network.queues): a few of the most
telling cases of ``test_move_matrix``, the guest on a managed network in namespaces
this module makes. After each kill: at most one QEMU holds the guest's tap and its
queues are attached (the kernel's word, through ``TUNGETIFF``), the guest answers on
its address again, and every check of the matrix without a NIC holds. `down` at the
module's end leaves no tap, bridge or nftables table (``world``'s teardown).

- prepared x cli: the destination joined the tap and is ended by the recovery; the
  source never stopped using it (its header size put back after the join);
- streamed x destination-qemu: decided back, the source's queues were never touched;
- streamed x destination-supervisor: the recovery commits forward, and hands the tap
  over as the destination's own task would have;
- resumed x source-qemu: the guest runs at the destination with its queues, the
  source's gone with their QEMU.
"""

from __future__ import annotations

import json
import subprocess
import time
from collections.abc import Iterator

import pytest

from fusuma_bench import netprobe
from tests.conftest import Host
from tests.fault.movekit import (
    Nic,
    check_truth,
    hold_move,
    kill,
    next_move_works,
    ready,
    wait_resolved,
)
from tests.integration.test_network_moves import holders, in_ns
from tests.integration.test_networks import Net, world

__all__ = ["world"]
pytestmark = [pytest.mark.fault, pytest.mark.timeout(240)]

NIC = Nic("lan0", "10.123.7.0/24", "10.123.7.40")
CASES = [("prepared", "cli"), ("streamed", "destination-qemu"),
         ("streamed", "destination-supervisor"), ("resumed", "source-qemu")]


@pytest.fixture
def nic_host(world: tuple[Host, Net]) -> Iterator[tuple[Host, Net]]:
    yield world


def answers(net: Net, ip: str, timeout: float = 20) -> bool:
    """The guest answers echoes on its address (100 a second, from fusuma's namespace)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        out = subprocess.run(in_ns(net, "python3", "-c", netprobe.ECHO, ip, "100"),
                             capture_output=True, text=True, timeout=30).stdout
        if json.loads(out)["received"] > 0:
            return True
    return False


@pytest.mark.parametrize(("phase", "target"), CASES)
def test_kill_during_move_with_a_nic(nic_host: tuple[Host, Net], phase: str,
                                     target: str) -> None:
    host, net = nic_host
    ready(host, nic=NIC)
    held = hold_move(host, phase, hold="2")
    kill(held.pids[target])
    wait_resolved(host, held)
    held.proc.communicate()
    truth = check_truth(host)
    if truth["checksum"] == "intact":
        holding = holders(tap(net), net.ns)
        assert list(holding) == [host.vm("vm0")["pid"]], holding
        assert all(q.attached for q in holding[host.vm("vm0")["pid"]]), holding
        assert answers(net, NIC.ip), f"{NIC.ip} does not answer after {phase} x {target}"
    next_move_works(host)
    assert answers(net, NIC.ip), f"{NIC.ip} does not answer after the next move"
    assert len(holders(tap(net), net.ns)) == 1


def tap(net: Net) -> str:
    return str(next(link["ifname"] for link in net.links()
                    if link["ifname"].startswith("fzt-")))
