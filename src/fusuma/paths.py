"""Where fusuma keeps its state, sockets, guest RAM files and image cache.

All four roots can be moved with environment variables, which is how tests run in a
temporary directory without touching the host's real fusuma:

- ``FUSUMA_HOME``        state DB, per-VM and per-partition logs (default /var/lib/fusuma)
- ``FUSUMA_RUNTIME_DIR`` UNIX sockets and pidfiles (default /run/fusuma)
- ``FUSUMA_SHM_DIR``     shared guest-RAM files (default /dev/shm/fusuma)
- ``FUSUMA_CACHE``       built guest images (default /var/cache/fusuma)
- ``FUSUMA_CGROUP_PREFIX`` name of fusuma's parent cgroup (default "fusuma")
- ``FUSUMA_CPU_EXCLUSIVE`` "0" to skip the kernel's exclusive cpusets (default "1").
  fusuma always refuses overlapping partitions itself; the kernel flag also keeps
  every other cgroup off the partitions' cores, which on cgroup v1 means only one
  fusuma prefix at a time can hold cores. Tests turn it off so that several test
  namespaces (or a test run beside `make demo`) can coexist.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

# sockaddr_un.sun_path is 108 bytes including the NUL.
MAX_SOCKET_PATH = 107


@dataclass(frozen=True)
class Paths:
    """Resolved fusuma directories for one host namespace."""

    home: Path
    runtime: Path
    shm: Path
    cache: Path
    cgroup_prefix: str
    cpu_exclusive: bool = True

    @classmethod
    def from_env(cls) -> Paths:
        env = os.environ
        return cls(
            home=Path(env.get("FUSUMA_HOME", "/var/lib/fusuma")),
            runtime=Path(env.get("FUSUMA_RUNTIME_DIR", "/run/fusuma")),
            shm=Path(env.get("FUSUMA_SHM_DIR", "/dev/shm/fusuma")),
            cache=Path(env.get("FUSUMA_CACHE", "/var/cache/fusuma")),
            cgroup_prefix=env.get("FUSUMA_CGROUP_PREFIX", "fusuma"),
            cpu_exclusive=env.get("FUSUMA_CPU_EXCLUSIVE", "1") != "0",
        )

    @property
    def db(self) -> Path:
        return self.home / "state.db"

    def vm_dir(self, vm: str) -> Path:
        """Logs and per-VM files that outlive the QEMU process."""
        return self.home / "vms" / vm

    def vm_run_dir(self, vm: str) -> Path:
        """Sockets and pidfile of a VM's QEMU."""
        return self.runtime / "vms" / vm

    def partition_dir(self, partition: str) -> Path:
        return self.home / "partitions" / partition

    def supervisor_socket(self, partition: str) -> Path:
        return self.runtime / "partitions" / f"{partition}.sock"

    def supervisor_pidfile(self, partition: str) -> Path:
        return self.runtime / "partitions" / f"{partition}.pid"

    @property
    def segments_dir(self) -> Path:
        """Shared segments: ``<name>.erofs`` files that VMs map as virtio-pmem."""
        return self.home / "segments"

    def segment_file(self, name: str) -> Path:
        return self.segments_dir / f"{name}.erofs"

    def ram_file(self, vm: str) -> Path:
        return self.shm / f"{vm}.ram"

    def as_env(self) -> dict[str, str]:
        """The environment that makes a child process see the same roots."""
        return {
            "FUSUMA_HOME": str(self.home),
            "FUSUMA_RUNTIME_DIR": str(self.runtime),
            "FUSUMA_SHM_DIR": str(self.shm),
            "FUSUMA_CACHE": str(self.cache),
            "FUSUMA_CGROUP_PREFIX": self.cgroup_prefix,
            "FUSUMA_CPU_EXCLUSIVE": "1" if self.cpu_exclusive else "0",
        }
