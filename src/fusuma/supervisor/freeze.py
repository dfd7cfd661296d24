"""A guest's filesystems frozen through its guest agent around one instant (a
snapshot's, a backup's), and thawed after it, always.

The caller holds the VM's agent lock (``PartitionHost.agent_lock``) from the freeze
to the thaw, so no other agent command (an ``exec``, which would hang on a frozen
filesystem) runs between them. A guest whose agent does not answer, or answers the
freeze with anything but a count, is taken as it runs (crash-consistent): what a
guest says is not trusted, and a guest cannot stop the host's work by it."""

from __future__ import annotations

import asyncio

from fusuma.errors import FusumaError
from fusuma.qemu.instance import QemuInstance
from fusuma.supervisor.host import PartitionHost

CONNECT_S = 3.0      # a guest without an agent is taken without a freeze
FREEZE_S = 60.0      # the agent's freeze (it syncs every filesystem first)
THAW_S = 15.0
THAW_TRIES = 3


async def freeze(h: PartitionHost, inst: QemuInstance, what: str) -> bool:
    """Freeze the guest's filesystems for ``what`` (a word for the log); whether they
    are frozen. A freeze that failed after the agent answered may have frozen some:
    those are thawed before this returns False."""
    asked = False
    try:
        async with asyncio.timeout(CONNECT_S + FREEZE_S), h.agent(inst) as ga:
            await ga.connect(timeout=CONNECT_S)
            asked = True
            count = await ga.execute("guest-fsfreeze-freeze", timeout=FREEZE_S)
    except (FusumaError, OSError, TimeoutError) as exc:
        h.log.warning("%s of %s without a freeze: %s", what, inst.vm,
                      getattr(exc, "summary", None) or type(exc).__name__)
        if asked:
            await thaw(h, inst)
        return False
    if type(count) is not int or count < 0:
        h.log.warning("%s of %s without a freeze: its agent answered the freeze with "
                      "something other than a count", what, inst.vm)
        await thaw(h, inst)
        return False
    return True


async def thaw(h: PartitionHost, inst: QemuInstance) -> None:
    """Thaw the guest's filesystems (harmless when none is frozen), a few tries;
    never raises."""
    for _ in range(THAW_TRIES):
        try:
            async with asyncio.timeout(THAW_S), h.agent(inst) as ga:
                await ga.connect(timeout=CONNECT_S)
                await ga.execute("guest-fsfreeze-thaw", timeout=THAW_S)
            return
        except (FusumaError, OSError, TimeoutError) as exc:
            h.log.warning("thawing %s's filesystems: %s; trying again", inst.vm,
                          getattr(exc, "summary", None) or type(exc).__name__)
            await asyncio.sleep(0.5)
