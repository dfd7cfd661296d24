"""The roles an API identity holds, least first: ``metrics`` < ``viewer`` <
``operator`` < ``admin``; each may do what the roles below it may. A token's role is
kept in the state file's tokens table; the API's routes declare the least role they
need (``fusuma.api.roles``)."""

from __future__ import annotations

from enum import StrEnum


class Role(StrEnum):
    METRICS = "metrics"
    VIEWER = "viewer"
    OPERATOR = "operator"
    ADMIN = "admin"

    def includes(self, needed: Role) -> bool:
        """Whether this role may do what ``needed`` may."""
        return ROLES.index(self) >= ROLES.index(needed)


ROLES: tuple[Role, ...] = tuple(Role)          # least first

# What each may do, in the words the CLI's help and the docs use.
MAY = {
    Role.METRICS: "GET /metrics only (a Prometheus scrape)",
    Role.VIEWER: "read everything: the API's GETs, the event stream, /metrics, "
                 "the dashboard (a host process by pid is admin's)",
    Role.OPERATOR: "a viewer's reads, and the VMs' lifecycle (create, change, start, "
                   "stop, kill, delete), moves, exec, trim, templates, partition "
                   "restart and maintain (with an installed QEMU version), cancelling "
                   "operations; no host paths, no QEMU binaries, no partitions, disks, "
                   "segments, image builds or KSM",
    Role.ADMIN: "everything, and so root-equivalent: an admin can name host files, "
                "devices and binaries that root opens or runs",
}

