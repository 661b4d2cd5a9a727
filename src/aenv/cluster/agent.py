"""The node agent: keeps one node's lease, routes and files published in Redis.

The node is the source of truth. Each heartbeat renews the lease with a fresh report and
writes what changed in the node's sandboxes and files since the last one. When the Redis data set
is not the one the agent last published into (its epoch key changed or vanished, or its server's
run id changed), or a write failed while Redis was down, or its lease had lapsed (gateways may
have dropped its routes meanwhile), it republishes them as a whole instead.
Redis being down never stops the node: the agent records the error and tries again next beat.

It also publishes the node's paused sandboxes whose checkpoints are in the shared repository
(`parked`), so another node can resume them if this one dies, and before writing routes it lets
go of any sandbox whose route another node holds: that sandbox moved while this node was cut
off, and it must not run twice (`StateSource.forget`). Snapshots and built templates whose
copies are in the repository are published too (`saved`), for any node to start sandboxes from.
The templates with a build in progress here are recorded as built here (`builds`) where no node
is, so a build's calls still find this node after a Redis wipe. The node's running sandboxes per
API key are written with every beat and at once on a create or kill (`quota`), with each
team's disk there (`team_limits`), so a key's and a team's limits are counted across the
cluster; its report is written then too, so a new sandbox counts in
placement at once. A drained node remembers it and marks itself draining again in a
wiped Redis (`drain`). The cluster's webhooks and secrets are mirrored into the node at every
beat (`webhooks`, `secrets`).
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import secrets
from collections.abc import Awaitable, Mapping, Sequence, Set
from dataclasses import dataclass, field
from typing import Protocol

import redis.asyncio as aioredis

from aenv.api.internal_models import INTERNAL_VERSIONS
from aenv.cluster.builds import BuildPlaces
from aenv.cluster.drain import DrainMemory, Drains, DrainState
from aenv.cluster.holders import FileKind, FileRef, Holders
from aenv.cluster.parked import Parked
from aenv.cluster.quota import KeyQuota
from aenv.cluster.registry import (
    Capacity,
    NodeIdTaken,
    NodeRegistry,
    NodeReport,
    WrongClusterSecret,
)
from aenv.cluster.routing import Routes
from aenv.cluster.saved import SavedRecord, SavedRecords
from aenv.cluster.secret import ClusterSecret
from aenv.cluster.secrets import ClusterSecrets
from aenv.cluster.store import ClusterUnavailable, Keys, guarded
from aenv.cluster.webhooks import ClusterWebhooks
from aenv.orchestrator.secrets import SecretRecord
from aenv.orchestrator.webhooks import Webhook

log = logging.getLogger("aenv.cluster")


@dataclass(frozen=True)
class NodeState:
    """What a node has, read from its own catalog and stores."""

    capacity: Capacity
    sandboxes: Set[str]
    templates: Set[str]
    snapshots: Set[str]
    # Paused sandboxes whose newest checkpoint is in the shared repository: id -> record JSON.
    parked: Mapping[str, str] = field(default_factory=dict)
    # Snapshots and built templates whose copy is in the shared repository: id -> the record
    # they are published with (`tags.with_tags`).
    saved: Mapping[str, str] = field(default_factory=dict)
    # Templates with a build waiting or running here.
    builds: Set[str] = frozenset()

    @property
    def files(self) -> set[FileRef]:
        return {FileRef(FileKind.TEMPLATE, t) for t in self.templates} | {
            FileRef(FileKind.SNAPSHOT, s) for s in self.snapshots
        }


class StateSource(Protocol):
    """Where the agent reads the node's state on every heartbeat."""

    async def state(self) -> NodeState: ...

    async def running_by_key(self) -> Mapping[str, Set[str]]:
        """The running sandboxes here per API key (owner) id, and per team (`team_owner`), as
        their limits count them."""
        ...

    async def disk_by_team(self) -> Mapping[str, int]:
        """The disk (MiB) each team's sandboxes (paused ones too) and volumes take here, as
        `team_max_disk_mb` counts it."""
        ...

    async def forget(self, sandbox_id: str) -> None:
        """Drop a sandbox that another node holds now (stopped, its files removed here)."""
        ...

    async def mirror_webhooks(self, hooks: Sequence[Webhook]) -> None:
        """Make the node's webhooks the cluster's (`aenv.cluster.webhooks`)."""
        ...

    async def mirror_secrets(self, secrets: Sequence[tuple[SecretRecord, str]]) -> None:
        """Make the node's secrets the cluster's, with their current values
        (`aenv.cluster.secrets`)."""
        ...


@dataclass(frozen=True)
class AgentStatus:
    """The agent's view of Redis after its last attempt."""

    connected: bool
    error: str | None
    republishes: int


class NodeAgent:
    def __init__(
        self,
        client: aioredis.Redis,
        node_id: str,
        address: str,
        source: StateSource,
        secret: ClusterSecret,
        ttl: float = 15.0,
        keys: Keys | None = None,
        drain: DrainMemory | None = None,
    ) -> None:
        self.client = client
        self.node_id = node_id
        self.address = address
        self.source = source
        self.ttl = ttl
        self.token = secrets.token_hex(16)
        self.registry = NodeRegistry(client, secret, keys)
        self.routes = Routes(client, self.registry.keys)
        self.holders = Holders(self.registry)
        self.parked = Parked(client, secret, self.registry.keys)
        self.saved = SavedRecords(client, self.registry.keys)
        self.builds = BuildPlaces(client, self.registry.keys)
        self.quota = KeyQuota(client, self.registry.keys)
        self.drains = Drains(client, self.registry.keys)
        self.webhooks = ClusterWebhooks(client, self.registry.keys)
        self.secrets = ClusterSecrets(client, secret, self.registry.keys)
        self.drain = drain
        # One count per key written at a time: a beat's must not overwrite a create's newer one.
        self._counting = asyncio.Lock()
        # The data set the node's routes and files were last written into in full, and what
        # they were after the last beat.
        self._published: tuple[str, str] | None = None
        self._sandboxes: set[str] = set()
        self._files: set[FileRef] = set()
        self._parked: dict[str, str] = {}
        self._saved: dict[str, str] = {}
        self._builds: set[str] = set()
        self._status = AgentStatus(connected=False, error=None, republishes=0)

    @property
    def status(self) -> AgentStatus:
        return self._status

    async def beat(self) -> bool:
        """One heartbeat; True if it republished everything. Raises `ClusterUnavailable` (after
        recording it in `status`), `NodeIdTaken` or `WrongClusterSecret`."""
        state = await self.source.state()
        report = self._report(state)
        try:
            lease = await self.registry.heartbeat(self.token, report, self.ttl)
            await self._keep_drain(lease.epoch)
            state = await self._let_go_of_moved(state)
            generation = (lease.epoch, await self._run_id())
            # A lease taken anew follows a lapse, in which gateways may have dropped routes of
            # this node's sandboxes (`Routes.clear_lost`): they are written back whole.
            republish = generation != self._published or lease.fresh
            if republish:
                await self.routes.replace(self.node_id, state.sandboxes)
                await self.holders.replace(self.node_id, state.files)
                self._parked = {}
                self._saved = {}
                self._published = generation
            else:
                await self._write_changes(state)
            await self._write_parked(state.parked)
            await self._write_saved(state.saved)
            await self.builds.claim(
                state.builds - (set() if republish else self._builds), self.node_id
            )
            await self._count_by_key()
            await self.source.mirror_webhooks(await self.webhooks.all())
            await self.source.mirror_secrets(await self.secrets.current())
            self._sandboxes, self._files = set(state.sandboxes), state.files
            self._builds = set(state.builds)
        except ClusterUnavailable as error:
            self._failed(error)
            raise
        republishes = self._status.republishes + int(republish)
        self._status = AgentStatus(connected=True, error=None, republishes=republishes)
        if republish:
            log.info("published node %s: %d sandboxes", self.node_id, len(state.sandboxes))
        return republish

    async def sandbox_routed(self, sandbox_id: str) -> None:
        """Records now, not at the next beat, that the sandbox lives here (created, resumed);
        never raises for Redis being down: the next heartbeat republishes."""
        await self._best_effort(self.routes.assign(sandbox_id, self.node_id))
        await self._best_effort(self._count_by_key())
        await self._best_effort(self._report_now())

    async def sandbox_gone(self, sandbox_id: str) -> None:
        """Records that the sandbox no longer lives here (killed); best effort as above."""
        await self._best_effort(self.routes.clear(sandbox_id, self.node_id))
        await self._best_effort(self._count_by_key())
        await self._best_effort(self._report_now())

    async def run(self, interval: float) -> None:
        """Heartbeats every `interval` seconds until cancelled."""
        while True:
            try:
                await self.beat()
            except (ClusterUnavailable, NodeIdTaken, WrongClusterSecret) as error:
                # The node keeps serving its own sandboxes; a lapsed lease only hides it.
                log.warning("node %s heartbeat failed: %s", self.node_id, error)
            # redis-py may absorb a cancel that lands during a command (redis/redis-py#2028):
            # the loop ends all the same, or the node's shutdown would wait on it forever.
            task = asyncio.current_task()
            if task is not None and task.cancelling():
                raise asyncio.CancelledError
            await asyncio.sleep(interval)

    async def close(self) -> None:
        """Gives the node id up; a Redis that is down lets the lease lapse instead."""
        try:
            await self.registry.release(self.token, self.node_id)
        except ClusterUnavailable as error:
            log.warning("node %s left without releasing its lease: %s", self.node_id, error)

    async def _write_changes(self, state: NodeState) -> None:
        for sandbox_id in self._sandboxes - state.sandboxes:
            await self.routes.clear(sandbox_id, self.node_id)
        for sandbox_id in state.sandboxes - self._sandboxes:
            await self.routes.assign(sandbox_id, self.node_id)
        for file in self._files - state.files:
            await self.holders.remove(self.node_id, file)
        for file in state.files - self._files:
            await self.holders.add(self.node_id, file)

    async def _let_go_of_moved(self, state: NodeState) -> NodeState:
        """The state without the sandboxes routed to another live node, which the source
        forgets. A route to a dead node is this node's to take back (an adoption here whose
        route was not written yet)."""
        owners = await self.routes.owners(sorted(state.sandboxes))
        others = {o for o in owners.values() if o is not None and o != self.node_id}
        live = await self.registry.alive(sorted(others))
        moved = {i for i, owner in owners.items() if owner in live}
        for sandbox_id in moved:
            log.warning(
                "sandbox %s moved to node %s: forgetting it here", sandbox_id, owners[sandbox_id]
            )
            await self.source.forget(sandbox_id)
            await self.parked.withdraw(self.node_id, sandbox_id)
        if not moved:
            return state
        parked = {i: r for i, r in state.parked.items() if i not in moved}
        kept = set(state.sandboxes) - moved
        return dataclasses.replace(state, sandboxes=kept, parked=parked)

    def _report(self, state: NodeState) -> NodeReport:
        return NodeReport(
            self.node_id,
            self.address,
            state.capacity,
            sorted(state.templates),
            sorted(state.snapshots),
            internal_versions=INTERNAL_VERSIONS,
        )

    async def _report_now(self) -> None:
        """The node's report written now, with its running count as of this change: gateways
        placing creates read it (a create's sandbox must count before the next beat)."""
        await self.registry.refresh(self.token, self._report(await self.source.state()))

    async def _keep_drain(self, epoch: str) -> None:
        """Reads the node's drain from Redis in the data set it last read it in, and marks it
        draining again in any other (`aenv.cluster.drain`)."""
        if self.drain is None:
            return
        known = self.drain.state
        draining = await self.drains.is_draining(self.node_id)
        if known.epoch != epoch and known.draining and not draining:
            log.warning("node %s drains: marked so again in a new Redis data set", self.node_id)
            await self.drains.drain(self.node_id)
            draining = True
        self.drain.remember(DrainState(draining, epoch))

    async def _count_by_key(self) -> None:
        """Writes the node's running sandboxes per API key (`aenv.cluster.quota`) and each
        team's disk (`aenv.cluster.team_limits`), read now."""
        async with self._counting:
            running = await self.source.running_by_key()
            disk = await self.source.disk_by_team()
            await self.quota.publish(self.node_id, running, self.ttl, disk)

    async def _write_parked(self, parked: Mapping[str, str]) -> None:
        for sandbox_id in self._parked.keys() - parked.keys():
            await self.parked.withdraw(self.node_id, sandbox_id)
        for sandbox_id, record in parked.items():
            if self._parked.get(sandbox_id) != record:
                await self.parked.publish(self.node_id, sandbox_id, record)
        self._parked = dict(parked)

    async def _write_saved(self, saved: Mapping[str, str]) -> None:
        for template_id in self._saved.keys() - saved.keys():
            gone = SavedRecord.of(self._saved[template_id])
            await self.saved.withdraw(template_id, gone.names, gone.team_id)
        for template_id, record in saved.items():
            if self._saved.get(template_id) != record:
                await self.saved.publish(SavedRecord.of(record))
        self._saved = dict(saved)

    async def _run_id(self) -> str:
        async with guarded(self.client, "reading the server's run id"):
            info = await self.client.info("server")
        return str(info.get("run_id", ""))

    async def _best_effort(self, write: Awaitable[object]) -> None:
        try:
            await write
        except ClusterUnavailable as error:
            self._failed(error)
            log.warning("node %s: %s; republishing on the next heartbeat", self.node_id, error)

    def _failed(self, error: ClusterUnavailable) -> None:
        # The next successful heartbeat must rewrite everything, missed writes included.
        self._published = None
        self._status = AgentStatus(False, str(error), self._status.republishes)
