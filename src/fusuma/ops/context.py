"""The context an operation runs in: paths, the state file, the managers.

Light on purpose (every CLI command imports it): the DB and the managers are imported
when first used. Notices for the user (a take-over of an older state file, a partition
manager's remark, why a VM runs under TCG) go to ``notice``: stderr by default, the
CLI's own echo in the CLI (``fusuma.cli.common.make_ctx``)."""

from __future__ import annotations

import sys
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from fusuma.paths import Paths

if TYPE_CHECKING:
    from fusuma.network.manager import NetworkManager
    from fusuma.partition.manager import PartitionManager
    from fusuma.state import Database
    from fusuma.vm import VmManager


def to_stderr(text: str) -> None:
    """The default notice: one line on stderr."""
    sys.stderr.write(text + "\n")
    sys.stderr.flush()


@dataclass
class Ctx:
    paths: Paths
    _db: Database | None = None
    _parts: PartitionManager | None = None
    _vms: VmManager | None = None
    notices: set[str] = field(default_factory=set)
    notice: Callable[[str], None] = to_stderr
    # Root's CLI: may name host paths that root then runs or reads (a partition's QEMU
    # binary, a directory for a segment). The API and the cluster agent may not.
    host_paths: bool = False

    @property
    def db(self) -> Database:
        if self._db is None:
            from fusuma.state import Database

            self.paths.ensure_parents()
            self._db = Database(self.paths.db)
            from fusuma.capacity import take_over

            for line in take_over(self._db):
                self.notice(line)
        return self._db

    @property
    def parts(self) -> PartitionManager:
        if self._parts is None:
            from fusuma.partition.manager import PartitionManager
            from fusuma.recovery import in_process

            self._parts = in_process(PartitionManager(self.paths, self.db))
            self._parts.notice = self.notice
            self._parts.host_paths = self.host_paths
        return self._parts

    @property
    def nets(self) -> NetworkManager:
        """Networks (fusuma.network): made per use, it holds nothing but the DB."""
        from fusuma.network.manager import NetworkManager

        return NetworkManager(self.paths, self.db, self.notice)

    @property
    def vms(self) -> VmManager:
        if self._vms is None:
            from fusuma.vm import VmManager

            self._vms = VmManager(self.paths, self.db, self.parts)
        return self._vms

    def accel_notice(self, requested: str) -> None:
        """Say once per command why a VM runs under TCG."""
        from fusuma.host.accel import probe_accel

        choice = probe_accel(requested)
        if choice.notice and choice.notice not in self.notices:
            self.notices.add(choice.notice)
            self.notice(choice.notice)


class ThreadContexts:
    """One context per thread, for the daemons (the API, the agent): a state-file
    connection is per thread."""

    def __init__(self, paths: Paths) -> None:
        self.paths = paths
        self._local = threading.local()

    def get(self) -> Ctx:
        """This thread's context."""
        c: Ctx | None = getattr(self._local, "ctx", None)
        if c is None:
            c = Ctx(self.paths)
            self._local.ctx = c
        return c
