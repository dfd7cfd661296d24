"""Templates: the manager that makes them from running VMs, lists and deletes them."""

from __future__ import annotations

from typing import TYPE_CHECKING

from fusuma.ops.context import Ctx

if TYPE_CHECKING:
    from fusuma.ops.template_manager import TemplateManager


def template_manager(c: Ctx) -> TemplateManager:
    from fusuma.ops.template_manager import TemplateManager

    return TemplateManager(c.paths, c.db, c.parts)
