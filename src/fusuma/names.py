"""Object names (partitions, disks, VMs, segments): the one rule and its check.

Kept apart from fusuma.spec (which needs pydantic) so that commands that only read
state, such as `fusuma ps`, can check names without importing pydantic.
"""

from __future__ import annotations

import re

from fusuma.errors import SpecError

# Names become file names, socket names and cgroup names: keep them boring. \Z, not $:
# Python's $ also matches before a final newline, and "vm0\n" is no name.
NAME = "[a-z0-9][a-z0-9_-]{0,31}"          # the rule, unanchored (to build others on)
NAME_RE = re.compile(rf"\A{NAME}\Z")
# The same rule as the API's OpenAPI document states it (JSON Schema: ECMA regex).
NAME_PATTERN = f"^{NAME}$"
NAME_HINT = "1-32 characters of a-z, 0-9, '-' and '_', starting with a letter or digit"


def check_name(kind: str, name: str) -> str:
    """Return ``name`` or raise SpecError: names must not escape their directory."""
    if not NAME_RE.match(name):
        raise SpecError(f"{kind} name {name!r} is not allowed: use {NAME_HINT}.")
    return name


def vm_leaf(vm: str) -> str:
    """The cgroup leaf of a VM's QEMU in its partition."""
    return f"vm.{vm}"


# The cgroup leaf of a partition's supervisor (beside its VMs' ``vm.*`` leaves).
SUPERVISOR_LEAF = "supervisor"
