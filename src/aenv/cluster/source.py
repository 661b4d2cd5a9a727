"""A node's state for its heartbeats, read from its own catalog, template store and host: the
sandboxes it holds, the templates and snapshots whose files it has, and its capacity."""

from __future__ import annotations

import psutil

from aenv.cluster.agent import NodeState
from aenv.cluster.registry import Capacity
from aenv.orchestrator.catalog import Catalog
from aenv.orchestrator.kinds import TemplateKind
from aenv.orchestrator.states import SandboxState
from aenv.orchestrator.templates import TemplateStore

# Sandboxes on their way in or out still live here: a route must reach them until they are gone.
_PAUSED = {SandboxState.PAUSED, SandboxState.PAUSING}


class CatalogSource:
    """The `StateSource` of a real node."""

    def __init__(self, catalog: Catalog, templates: TemplateStore) -> None:
        self.catalog = catalog
        self.templates = templates

    async def state(self) -> NodeState:
        # Build VMs are the node's own business, never routed.
        records = [r for r in self.catalog.list() if not r.internal]
        paused = sum(1 for r in records if r.state in _PAUSED)
        memory = psutil.virtual_memory()
        capacity = Capacity(
            cpus=psutil.cpu_count() or 1,
            memory_mb=memory.total // 2**20,
            memory_free_mb=memory.available // 2**20,
            running=len(records) - paused,
            paused=paused,
        )
        return NodeState(
            capacity,
            {r.id for r in records},
            {t.template_id for t in self.templates.list(TemplateKind.TEMPLATE)},
            {t.template_id for t in self.templates.list(TemplateKind.SNAPSHOT)},
        )
