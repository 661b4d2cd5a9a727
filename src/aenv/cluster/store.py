"""The connection to the cluster's Redis: opening it, naming its keys, and turning Redis being
unreachable into one clear error.

Every key carries the hash tag `{aenv}`, so all of them live in one slot: scripts and
transactions that touch several keys then also work on Redis Cluster.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import cast

import redis.asyncio as aioredis
from redis import exceptions
from redis.asyncio.retry import Retry
from redis.backoff import ExponentialBackoff

from aenv.ids import TEAM_ID

# What Redis raises when it cannot answer now (down, failing over, loading its data set), as
# opposed to a bug in a command, which propagates as is.
UNAVAILABLE = (
    exceptions.ConnectionError,
    exceptions.TimeoutError,
    exceptions.BusyLoadingError,
    exceptions.ReadOnlyError,
)


class ClusterUnavailable(Exception):
    """Redis did not answer; nothing was changed that the caller can rely on, and a retry later
    is safe (every write here is idempotent)."""


@dataclass(frozen=True)
class Keys:
    """The name of every key, in one place."""

    prefix: str = "{aenv}"

    @property
    def epoch(self) -> str:
        """A random value set once per data set: its change or loss means Redis was wiped."""
        return f"{self.prefix}:epoch"

    @property
    def secret(self) -> str:
        """The fingerprint of the cluster secret the first node registered with."""
        return f"{self.prefix}:secret"

    @property
    def nodes(self) -> str:
        """The ids of nodes that registered (live or lapsed; a lease key decides)."""
        return f"{self.prefix}:nodes"

    def lease(self, node_id: str) -> str:
        """The instance token of the node process holding the id; expires with the lease."""
        return f"{self.prefix}:lease:{node_id}"

    def node(self, node_id: str) -> str:
        """The node's last report (JSON); expires with the lease."""
        return f"{self.prefix}:node:{node_id}"

    def route(self, sandbox_id: str) -> str:
        return f"{self.prefix}:route:{sandbox_id}"

    def dashboard_session(self, digest: str) -> str:
        """A gateway dashboard's session, by the SHA-256 of its cookie's token (sealed JSON,
        expiring with the session: `aenv.cluster.sessions`)."""
        return f"{self.prefix}:dashboard-session:{digest}"

    def node_sandboxes(self, node_id: str) -> str:
        return f"{self.prefix}:node-sandboxes:{node_id}"

    def node_files(self, node_id: str) -> str:
        return f"{self.prefix}:node-files:{node_id}"

    def holders(self, file_key: str) -> str:
        return f"{self.prefix}:holders:{file_key}"

    def chunk_holders(self, manifest_id: str) -> str:
        """The nodes whose chunk caches hold a repository manifest's chunks (a set;
        `aenv.cluster.peers`)."""
        return f"{self.prefix}:chunk-holders:{manifest_id}"

    def parked(self, sandbox_id: str) -> str:
        """A paused sandbox's record whose checkpoint is in the shared repository (a hash: the
        node publishing it, or none once released, and the record), for another node to adopt."""
        return f"{self.prefix}:parked:{sandbox_id}"

    @property
    def saved(self) -> str:
        """Snapshots stored in the shared repository (a hash: id -> template record), for any
        node to start sandboxes from."""
        return f"{self.prefix}:saved"

    @property
    def webhooks(self) -> str:
        """The cluster's webhooks (a hash: id -> record; `aenv.cluster.webhooks`)."""
        return f"{self.prefix}:webhooks"

    @property
    def secrets(self) -> str:
        """The cluster's secrets (a hash: id -> record, its value sealed;
        `aenv.cluster.secrets`)."""
        return f"{self.prefix}:secrets"

    @property
    def secret_names(self) -> str:
        """The same secrets by team and name (a hash: `team/name` -> id)."""
        return f"{self.prefix}:secret-names"

    @property
    def node_events(self) -> str:
        """Nodes drained, failed, back (a capped stream; `aenv.cluster.node_events`)."""
        return f"{self.prefix}:node-events"

    @property
    def saved_names(self) -> str:
        """The names of those snapshots (a hash: name -> id)."""
        return f"{self.prefix}:saved-names"

    def parked_by(self, node_id: str) -> str:
        """The ids of the sandboxes a node published as parked ("" for released ones): how a
        gateway finds a lost node's paused sandboxes to list them."""
        return f"{self.prefix}:parked-by:{node_id}"

    @property
    def parked_nodes(self) -> str:
        """The node ids with a `parked_by` set."""
        return f"{self.prefix}:parked-nodes"

    def moving(self, sandbox_id: str) -> str:
        """The gateway moving a sandbox to another node now; expires if that gateway dies."""
        return f"{self.prefix}:moving:{sandbox_id}"

    def build(self, template_id: str) -> str:
        """The node running the builds of a template (`aenv.cluster.builds`)."""
        return f"{self.prefix}:build:{template_id}"

    def volume(self, volume_id: str) -> str:
        """The node holding a volume's files (`aenv.cluster.volumes`)."""
        return f"{self.prefix}:volume:{volume_id}"

    @property
    def volume_names(self) -> str:
        """Volume name -> id (a hash); "" while a gateway creates it."""
        return f"{self.prefix}:volume-names"

    @property
    def teams(self) -> str:
        """The cluster's teams but the default one (a hash: id -> record; `aenv.cluster.teams`)."""
        return f"{self.prefix}:teams"

    @property
    def team_names(self) -> str:
        """The same teams by name (a hash: name -> id)."""
        return f"{self.prefix}:team-names"

    @property
    def api_keys(self) -> str:
        """The cluster's API keys (a hash: SHA-256 of the value -> the key's record, JSON)."""
        return f"{self.prefix}:api-keys"

    @property
    def api_key_ids(self) -> str:
        """The same keys by id (a hash: id -> digest)."""
        return f"{self.prefix}:api-key-ids"

    @property
    def api_key_used(self) -> str:
        """When each key was last used (a hash: id -> UNIX time)."""
        return f"{self.prefix}:api-key-used"

    def node_keys(self, node_id: str) -> str:
        """A node's running sandboxes per API key (a hash: key id -> ids; `aenv.cluster.quota`),
        and the disk each team's sandboxes and volumes take there (`disk/<team>` -> MiB);
        expires with the node's lease."""
        return f"{self.prefix}:node-keys:{node_id}"

    def node_creates(self, node_id: str) -> str:
        """The creates gateways sent to a node and await (`aenv.cluster.creating`)."""
        return f"{self.prefix}:node-creates:{node_id}"

    def key_creates(self, key_id: str) -> str:
        """An API key's creates under way through gateways (a hash: token -> when it lapses)."""
        return f"{self.prefix}:key-creates:{key_id}"

    def team_rate(self, team_id: str) -> str:
        """A team's bucket of creates a second across the gateways (a hash: tokens, at;
        `aenv.cluster.team_limits`); expires once full again."""
        return f"{self.prefix}:team-rate:{team_id}"

    def team_disk(self, team_id: str) -> str:
        """A team's disk held by creates under way through gateways (a hash: token -> when it
        lapses and its MiB; `aenv.cluster.team_limits`)."""
        return f"{self.prefix}:team-disk:{team_id}"

    @property
    def draining(self) -> str:
        """The ids of nodes that take no new sandboxes."""
        return f"{self.prefix}:draining"


# Connections one client keeps to Redis: requests beyond it wait for one to come free. redis-py's
# default pool refuses the 101st concurrent command outright ("Too many connections"), which a
# burst of 200 creates through one gateway reached.
POOL_SIZE = 64


def team_field(team_id: str, name: str) -> str:
    """The field of the team's `name` in a hash of names (volumes', snapshots'): the name alone
    for the default team, as before teams (so older gateways still find them), else
    `<team>/<name>`; team ids are random, so the two never meet."""
    return name if team_id == TEAM_ID else f"{team_id}/{name}"


def connect(url: str, timeout: float = 2.0) -> aioredis.Redis:
    """A client for `url` (redis://, rediss:// or unix://); it connects on first use.

    The socket timeout bounds how long a node waits on a Redis that hangs, so a heartbeat fails
    clearly instead of stalling the node. A pooled connection to a Redis that restarted fails
    once: the client retries on a new one, which is safe because every write here is idempotent.
    At most `POOL_SIZE` commands are in flight; more wait their turn (bounded by `guarded`).
    """
    pool = aioredis.BlockingConnectionPool.from_url(
        url,
        max_connections=POOL_SIZE,
        timeout=DEADLINE,
        decode_responses=True,
        socket_timeout=timeout,
        socket_connect_timeout=timeout,
        retry=Retry(ExponentialBackoff(cap=timeout / 2, base=0.02), retries=2),
        retry_on_error=[exceptions.ConnectionError, exceptions.TimeoutError],
    )
    return aioredis.Redis.from_pool(pool)


def describe(client: aioredis.Redis) -> str:
    """Where the client points, without credentials, for error messages."""
    kwargs = client.connection_pool.connection_kwargs
    if "path" in kwargs:
        return f"unix:{kwargs['path']}"
    return f"{kwargs.get('host', '?')}:{kwargs.get('port', '?')}"


async def members(client: aioredis.Redis, key: str) -> set[str]:
    """SMEMBERS with its asyncio type (redis-py annotates set commands for both clients)."""
    return set(await cast("Awaitable[set[str]]", client.smembers(key)))


# The longest a body may wait on Redis: the client's own timeouts and retries stop well before
# (3 tries of 2 s each), so this bounds a wait the client does not, e.g. a pool that never hands
# out a connection, and the node's heartbeat goes on instead of stalling behind it.
DEADLINE = 15.0


@asynccontextmanager
async def guarded(client: aioredis.Redis, doing: str) -> AsyncIterator[None]:
    """Runs the body within `DEADLINE`; Redis being unreachable or too slow becomes
    `ClusterUnavailable` naming `doing`."""
    try:
        async with asyncio.timeout(DEADLINE):
            yield
    except UNAVAILABLE as error:
        message = f"cluster store (Redis at {describe(client)}) unavailable while {doing}: {error}"
        raise ClusterUnavailable(message) from error
    except TimeoutError as error:
        where = f"cluster store (Redis at {describe(client)})"
        message = f"{where} did not answer within {DEADLINE:g} s while {doing}"
        raise ClusterUnavailable(message) from error
