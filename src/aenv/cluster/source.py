"""A node's state for its heartbeats, read from its own catalog, template store, builder and
host: the sandboxes it holds, those of them any node could resume (paused, their newest
checkpoint in the shared repository), the templates and snapshots whose files it has (and the
snapshots and built templates stored in that repository, with their tags), the templates it is
building, its running sandboxes per API key, each team's disk, and its capacity; and where the
cluster's webhooks and secrets are mirrored."""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Sequence

import psutil

from aenv.cluster.agent import NodeState
from aenv.cluster.quota import team_owner
from aenv.cluster.registry import Capacity
from aenv.orchestrator.builds import Builder
from aenv.orchestrator.capacity import disk_of
from aenv.orchestrator.catalog import Catalog, SandboxRecord, record_to_json
from aenv.orchestrator.kinds import TemplateKind
from aenv.orchestrator.secrets import SecretRecord, SecretStore
from aenv.orchestrator.states import SandboxState
from aenv.orchestrator.tags import with_tags
from aenv.orchestrator.templates import TemplateStore, template_to_json
from aenv.orchestrator.webhook_delivery import WebhookDispatcher
from aenv.orchestrator.webhooks import Webhook

# Sandboxes on their way in or out still live here: a route must reach them until they are gone.
_PAUSED = {SandboxState.PAUSED, SandboxState.PAUSING}


class CatalogSource:
    """The `StateSource` of a real node."""

    def __init__(
        self,
        catalog: Catalog,
        templates: TemplateStore,
        forget: Callable[[str], Awaitable[object]] | None = None,
        builder: Builder | None = None,
        webhooks: WebhookDispatcher | None = None,
        secrets: SecretStore | None = None,
    ) -> None:
        self.catalog = catalog
        self.templates = templates
        self._forget = forget
        self.builder = builder
        self.webhooks = webhooks
        self.secrets = secrets

    async def mirror_webhooks(self, hooks: Sequence[Webhook]) -> None:
        if self.webhooks is not None:
            self.webhooks.store.mirror(hooks)
            self.webhooks.wake()  # a webhook enabled again: its queue goes on

    async def mirror_secrets(self, secrets: Sequence[tuple[SecretRecord, str]]) -> None:
        if self.secrets is not None:
            self.secrets.mirror(secrets)

    async def forget(self, sandbox_id: str) -> None:
        if self._forget is not None:
            await self._forget(sandbox_id)

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
        snapshots = self.templates.list(TemplateKind.SNAPSHOT)
        built = self.templates.list(TemplateKind.TEMPLATE)
        return NodeState(
            capacity,
            {r.id for r in records},
            {t.template_id for t in built},
            {t.template_id for t in snapshots},
            {r.id: record_to_json(r) for r in records if _parked(r)},
            {
                t.template_id: with_tags(template_to_json(t), self._tags(t.template_id))
                for t in (*snapshots, *built)
                if t.manifest_id is not None
            },
            set() if self.builder is None else self.builder.unfinished_templates(),
        )

    async def running_by_key(self) -> dict[str, set[str]]:
        running: dict[str, set[str]] = {}
        for r in self.catalog.list():
            if not r.internal and r.state.public == "running":
                if r.owner is not None:
                    running.setdefault(r.owner, set()).add(r.id)
                running.setdefault(team_owner(r.team_id), set()).add(r.id)
        return running

    async def disk_by_team(self) -> dict[str, int]:
        teams = {r.team_id for r in self.catalog.list() if not r.internal}
        teams |= {v.team_id for v in self.catalog.volumes()}
        return {team: disk_of(self.catalog, team) for team in teams}

    def _tags(self, template_id: str) -> dict[str, str]:
        return {} if self.builder is None else self.builder.tags.builds(template_id)


def _parked(record: SandboxRecord) -> bool:
    archived = record.archived
    return (
        record.state is SandboxState.PAUSED
        and archived is not None
        and archived.seq == record.checkpoint_seq
    )
