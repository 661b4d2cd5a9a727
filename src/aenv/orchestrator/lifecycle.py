"""The sandbox lifecycle on one node, as one facade (`Orchestrator`) that the API, the server,
the cluster agent and the template builder use: create, kill, timeouts, lookups; pause and
resume; snapshots and forks; network changes; moves between nodes.

Each operation lives in a module of its own, as functions of the node's shared state
(`node.Node`), with its steps numbered in its docstring:

    create            admission, the queue, a pooled or launched VM
    save              pause (and hibernation's save)
    snapshot          snapshots, template builds' saves, fork checkpoints
    restore           resume, connect, wake, the proxy's lookup
    fork              children of a sandbox or snapshot
    reset             a running sandbox back to a saved state, in place
    ending            kill, timeouts, crashed or vanished VMs
    hibernate         idle sandboxes hibernated
    pooling           warm pools' VMs
    network_updates   network checks and egress changes
    moves             release and adopt between nodes
    startup           start-up recovery and shutdown
    housekeeping      reconcile, console caps, metrics samples
    launch, capacity, queries   what several of them share

Calls flow one way: this facade -> the operation modules -> `node` -> runtime, storage and
network. Every change of state goes through the catalog's conditional transition, so a crash
leaves either the old or the new state; every operation on one sandbox runs under its lock.
"""

from __future__ import annotations

import asyncio
import builtins
import dataclasses
from collections.abc import Awaitable, Callable
from pathlib import Path

from aenv.config import Config
from aenv.ids import TEAM_ID
from aenv.network import SlotProvider
from aenv.network.identity import Signer
from aenv.network.settings import SandboxNetwork
from aenv.orchestrator import (
    create,
    ending,
    fork,
    hibernate,
    housekeeping,
    moves,
    network_updates,
    queries,
    reset,
    restore,
    save,
    snapshot,
    startup,
)
from aenv.orchestrator.archive import Archive
from aenv.orchestrator.catalog import Catalog, SandboxRecord
from aenv.orchestrator.create import CreateRequest
from aenv.orchestrator.detach import Detacher
from aenv.orchestrator.envd_client import EnvdClient
from aenv.orchestrator.errors import (
    CapacityReached,
    CreateFailed,
    GuestUnhealthy,
    InvalidNetwork,
    InvalidState,
    OperationFailed,
    SandboxNotFound,
    VolumeInUse,
)
from aenv.orchestrator.events import EventLog
from aenv.orchestrator.fork import Child
from aenv.orchestrator.hibernation import Hibernation
from aenv.orchestrator.kinds import SaveMode, TemplateKind
from aenv.orchestrator.lazy import pulls_lazily
from aenv.orchestrator.metrics_history import MetricsHistory, Sample
from aenv.orchestrator.node import CreateStats, Node, host_reserve
from aenv.orchestrator.queries import GuestEndpoint
from aenv.orchestrator.residency import ResidencyListener
from aenv.orchestrator.saved import SavedStates
from aenv.orchestrator.secrets import SecretStore, node_key
from aenv.orchestrator.templates import Template, TemplateStore
from aenv.orchestrator.volumes import VolumeBacking, VolumeStore
from aenv.orchestrator.waiting import WaitQueue
from aenv.orchestrator.warm import WarmPools
from aenv.orchestrator.webhook_delivery import DeliverySettings, WebhookDispatcher
from aenv.orchestrator.webhooks import WebhookStore
from aenv.runtime.driver import Driver
from aenv.storage.volume_images import ImageBacking

# What callers import from here: the facade's requests, results and errors.
__all__ = [
    "CapacityReached",
    "CreateFailed",
    "CreateRequest",
    "GuestEndpoint",
    "GuestUnhealthy",
    "InvalidNetwork",
    "InvalidState",
    "OperationFailed",
    "Orchestrator",
    "SandboxNotFound",
    "VolumeInUse",
]


class Orchestrator:
    """The node's sandbox operations, each delegated to its module with the node's state."""

    def __init__(
        self,
        config: Config,
        catalog: Catalog,
        driver: Driver,
        slots: SlotProvider,
        templates: TemplateStore,
        archive: Archive | None = None,
        volume_backing: VolumeBacking | None = None,
        secrets: SecretStore | None = None,
        signer: Signer | None = None,
    ) -> None:
        """`volume_backing`: what holds sized volumes, by default ext4 images mounted on the
        host (`storage.volume_images`, which needs root). `secrets`: the store the slots'
        egress proxies read too, by default one over `catalog` with the node's key. `signer`:
        who signs the slots' workload identity tokens, whose keys the API publishes (none:
        no route publishes any)."""
        self.secrets = secrets or SecretStore(catalog, node_key(config))
        self.signer = signer
        # Guest memory under the template store's root, which restores map.
        paths = dataclasses.replace(config.paths, memory_override=templates.memory_dir)
        self.node = Node(
            config=config,
            paths=paths,
            catalog=catalog,
            driver=driver,
            slots=slots,
            templates=templates,
            saved=SavedStates(
                catalog,
                templates,
                paths.sandboxes,
                archive,
                driver,
                max_uploads=config.max_concurrent_uploads,
                lazy_pulls=pulls_lazily(config, archive),
                lazy_prefetch=config.lazy_prefetch,
            ),
            detacher=Detacher(driver, slots, paths.detach, paths.detach_memory),
            volumes=VolumeStore(
                catalog,
                paths.volumes,
                volume_backing or ImageBacking(paths.volumes, paths.volume_images),
                host_reserve(config),
                config.volume_size_mb,
                driver.no_shares,
            ),
            on_timeout=ending.expire,
            on_vanished=ending.remove_vanished,
            pools=WarmPools(config.pool_max),
            # Idle hibernation; the server gives it the proxy's view of the traffic.
            hibernation=Hibernation(config.hibernate_after),
            events=EventLog(catalog, templates, config.webhook_queue_limit),
            webhooks=WebhookDispatcher(
                WebhookStore(catalog),
                DeliverySettings(
                    attempts=config.webhook_attempts,
                    retry_delay=config.webhook_retry_delay,
                    timeout=config.webhook_timeout,
                    internal_allowed=config.webhook_internal_allowed,
                    denied=slots.denied,
                ),
            ),
            admission=asyncio.Semaphore(config.max_concurrent_creates),
        )
        self.node.events.recorded.append(self.node.webhooks.wake)
        catalog.changed.append(self.node.waiting.changed)

    # -- the node's parts, for its callers ------------------------------------------------

    @property
    def config(self) -> Config:
        return self.node.config

    @config.setter
    def config(self, config: Config) -> None:
        """Settings changed while the node runs (tests of admission and pools)."""
        self.node.config = config

    @property
    def catalog(self) -> Catalog:
        return self.node.catalog

    @property
    def driver(self) -> Driver:
        return self.node.driver

    @property
    def slots(self) -> SlotProvider:
        return self.node.slots

    @property
    def templates(self) -> TemplateStore:
        return self.node.templates

    @property
    def saved(self) -> SavedStates:
        return self.node.saved

    @property
    def detacher(self) -> Detacher:
        return self.node.detacher

    @property
    def volumes(self) -> VolumeStore:
        return self.node.volumes

    @property
    def pools(self) -> WarmPools:
        return self.node.pools

    @property
    def hibernation(self) -> Hibernation:
        return self.node.hibernation

    @property
    def events(self) -> EventLog:
        return self.node.events

    @property
    def webhooks(self) -> WebhookDispatcher:
        return self.node.webhooks

    @property
    def stats(self) -> CreateStats:
        return self.node.stats

    @property
    def waiting(self) -> WaitQueue:
        return self.node.waiting

    @property
    def metrics(self) -> MetricsHistory:
        return self.node.metrics

    @metrics.setter
    def metrics(self, metrics: MetricsHistory) -> None:
        """Another history (tests of its intervals)."""
        self.node.metrics = metrics

    @property
    def vm_stopped(self) -> builtins.list[Callable[[str, str], None]]:
        """Told (sandbox id, VM id) whenever a sandbox's VM stops, whatever the reason."""
        return self.node.vm_stopped

    @property
    def residency(self) -> builtins.list[ResidencyListener]:
        """Told which sandboxes come and go (a cluster node's agent)."""
        return self.node.residency

    @property
    def chores(self) -> builtins.list[Callable[[], Awaitable[None]]]:
        """Run with every reconcile round (the template builder's sweep of its uploads)."""
        return self.node.chores

    @property
    def template_deleted(self) -> builtins.list[Callable[[str], Awaitable[None]]]:
        """Told the id of each template deleted for users."""
        return self.node.template_deleted

    # -- start-up and shutdown ------------------------------------------------------------

    async def start(self) -> None:
        await startup.start(self.node)

    async def close(self) -> None:
        await startup.close(self.node)

    # -- queries --------------------------------------------------------------------------

    def get(self, sandbox_id: str) -> SandboxRecord:
        return self.node.get(sandbox_id)

    def list(self) -> builtins.list[SandboxRecord]:
        return queries.listed(self.node)

    def guest_endpoint(self, sandbox_id: str) -> GuestEndpoint:
        return queries.guest_endpoint(self.node, sandbox_id)

    def is_paused(self, sandbox_id: str) -> bool:
        return queries.is_paused(self.node, sandbox_id)

    def console_logs(self, sandbox_id: str) -> builtins.list[Path]:
        return queries.console_logs(self.node, sandbox_id)

    def envd(self, sandbox_id: str) -> EnvdClient:
        return queries.envd(self.node, sandbox_id)

    async def guest_metrics(self, sandbox_id: str) -> dict[str, float]:
        return await queries.guest_metrics(self.node, sandbox_id)

    def snapshots(self) -> builtins.list[Template]:
        return self.templates.list(kind=TemplateKind.SNAPSHOT)

    async def sample_metrics(self) -> None:
        await housekeeping.sample_metrics(self.node)

    async def sample_now(self, sandbox_id: str) -> Sample:
        return await housekeeping.sample_now(self.node, sandbox_id)

    async def reconcile(self) -> None:
        await housekeeping.reconcile(self.node)

    # -- create, fork, kill, timeouts -----------------------------------------------------

    async def create(self, request: CreateRequest) -> tuple[SandboxRecord, Template]:
        return await create.create(self.node, request)

    async def fork(
        self,
        source: str,
        count: int,
        timeout: int,
        *,
        owner: str | None = None,
        team_id: str = TEAM_ID,
        wait: float = 0.0,
    ) -> builtins.list[SandboxRecord | BaseException]:
        return await self.fork_batch(
            source, [Child()] * count, timeout, owner=owner, team_id=team_id, wait=wait
        )

    async def fork_batch(
        self,
        source: str,
        children: builtins.list[Child],
        timeout: int,
        *,
        owner: str | None = None,
        team_id: str = TEAM_ID,
        wait: float = 0.0,
        gone: asyncio.Event | None = None,
    ) -> builtins.list[SandboxRecord | BaseException]:
        """A fork whose every child adds its own metadata and env vars to the source's; each
        may wait `wait` seconds for capacity, unless `gone` (its client left) is set."""
        return await fork.fork(
            self.node, source, children, timeout, owner=owner, team_id=team_id, wait=wait, gone=gone
        )

    async def reset(self, sandbox_id: str, source: str) -> SandboxRecord:
        return await reset.reset(self.node, sandbox_id, source)

    async def kill(self, sandbox_id: str) -> bool:
        return await ending.kill(self.node, sandbox_id)

    def set_timeout(self, sandbox_id: str, timeout: int) -> SandboxRecord:
        return ending.set_timeout(self.node, sandbox_id, timeout)

    def set_auto_pause(self, sandbox_id: str, auto_pause: bool) -> SandboxRecord:
        return ending.set_auto_pause(self.node, sandbox_id, auto_pause)

    def extend_timeout(self, sandbox_id: str, timeout: int) -> SandboxRecord:
        return ending.extend_timeout(self.node, sandbox_id, timeout)

    # -- pause, resume, hibernation -------------------------------------------------------

    async def pause(
        self, sandbox_id: str, *, mode: SaveMode = SaveMode.FULL, require_healthy: bool = False
    ) -> SandboxRecord:
        return await save.pause(self.node, sandbox_id, mode=mode, require_healthy=require_healthy)

    async def resume(
        self, sandbox_id: str, timeout: int, *, mode: SaveMode = SaveMode.FULL
    ) -> tuple[SandboxRecord, bool]:
        return await restore.resume(self.node, sandbox_id, timeout, mode=mode)

    async def connect(
        self, sandbox_id: str, timeout: int, *, mode: SaveMode = SaveMode.FULL
    ) -> tuple[SandboxRecord, bool]:
        return await restore.connect(self.node, sandbox_id, timeout, mode=mode)

    async def wake(self, sandbox_id: str) -> None:
        await restore.wake(self.node, sandbox_id)

    async def endpoint_for_traffic(self, sandbox_id: str) -> GuestEndpoint:
        return await restore.endpoint_for_traffic(self.node, sandbox_id)

    async def hibernate_idle(self) -> None:
        await hibernate.hibernate_idle(self.node)

    # -- snapshots and templates ----------------------------------------------------------

    async def snapshot(
        self, sandbox_id: str, *, name: str | None = None, mode: SaveMode = SaveMode.FULL
    ) -> Template:
        return await snapshot.snapshot(self.node, sandbox_id, name=name, mode=mode)

    async def save_template(
        self, sandbox_id: str, template_id: str, kind: TemplateKind, aliases: tuple[str, ...]
    ) -> Template:
        return await snapshot.save_template(self.node, sandbox_id, template_id, kind, aliases)

    async def delete_template(self, template_id: str) -> None:
        await snapshot.delete_template(self.node, template_id)

    # -- network --------------------------------------------------------------------------

    async def check_network(self, network: SandboxNetwork) -> None:
        await network_updates.check_network(self.node, network)

    async def set_egress(self, sandbox_id: str, rules: SandboxNetwork) -> SandboxRecord:
        return await network_updates.set_egress(self.node, sandbox_id, rules)

    # -- moving between nodes -------------------------------------------------------------

    async def release(self, sandbox_id: str) -> SandboxRecord:
        return await moves.release(self.node, sandbox_id)

    async def adopt(self, record: SandboxRecord) -> SandboxRecord:
        return await moves.adopt(self.node, record)

    async def adopt_template(self, template: Template) -> Template:
        return await moves.adopt_template(self.node, template)

    async def forget(self, sandbox_id: str) -> bool:
        return await moves.forget(self.node, sandbox_id)
