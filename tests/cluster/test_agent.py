"""The node agent against a real redis-server: publishing, rebuilding after Redis is wiped or
restarted, and a node that keeps its state while Redis is down."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import redis.asyncio as aioredis

from aenv.cluster.agent import NodeAgent, NodeState
from aenv.cluster.builds import BuildPlaces
from aenv.cluster.drain import DrainMemory, Drains
from aenv.cluster.holders import FileKind, FileRef, Holders
from aenv.cluster.parked import Parked, ParkedSandbox
from aenv.cluster.quota import KeyLimitReached, KeyQuota
from aenv.cluster.registry import Capacity, NodeRegistry
from aenv.cluster.routing import Routes
from aenv.cluster.saved import SavedRecords
from aenv.cluster.store import ClusterUnavailable
from aenv.cluster.webhooks import ClusterWebhooks
from aenv.orchestrator.secrets import SecretRecord
from aenv.orchestrator.webhooks import Webhook, new_webhook
from tests.cluster.shared import SECRET
from tests.support.redis_server import RedisServer


@dataclass
class Node:
    """A node's own record of what it has, as its catalog would hold it."""

    sandboxes: set[str] = field(default_factory=set)
    templates: set[str] = field(default_factory=lambda: {"base"})
    snapshots: set[str] = field(default_factory=set)
    parked: dict[str, str] = field(default_factory=dict)
    saved: dict[str, str] = field(default_factory=dict)
    builds: set[str] = field(default_factory=set)
    owners: dict[str, set[str]] = field(default_factory=dict)  # key id -> running sandboxes
    webhooks: list[Webhook] = field(default_factory=list)  # the cluster's, as last mirrored
    secrets: list[tuple[SecretRecord, str]] = field(default_factory=list)  # the same

    async def state(self) -> NodeState:
        capacity = Capacity(2, 4096, 2048, running=len(self.sandboxes), paused=0)
        return NodeState(
            capacity,
            set(self.sandboxes),
            set(self.templates),
            set(self.snapshots),
            dict(self.parked),
            dict(self.saved),
            set(self.builds),
        )

    async def forget(self, sandbox_id: str) -> None:
        self.sandboxes.discard(sandbox_id)
        self.parked.pop(sandbox_id, None)

    async def running_by_key(self) -> dict[str, set[str]]:
        return {key: set(ids) for key, ids in self.owners.items()}

    async def disk_by_team(self) -> dict[str, int]:
        return {}

    async def mirror_webhooks(self, hooks: Sequence[Webhook]) -> None:
        self.webhooks = list(hooks)

    async def mirror_secrets(self, secrets: Sequence[tuple[SecretRecord, str]]) -> None:
        self.secrets = list(secrets)


async def snapshot_of(client: aioredis.Redis, node_ids: list[str]) -> dict[str, object]:
    """Everything a gateway could read about these nodes."""
    registry = NodeRegistry(client, SECRET)
    routes, holders = Routes(client), Holders(registry)
    return {
        "live": sorted(n.node_id for n in await registry.live()),
        "routes": {i: sorted(await routes.of_node(i)) for i in node_ids},
        "lookups": {s: await routes.lookup(s) for i in node_ids for s in await routes.of_node(i)},
        "base": sorted(await holders.of(FileRef(FileKind.TEMPLATE, "base"))),
        "snap": sorted(await holders.of(FileRef(FileKind.SNAPSHOT, "snap"))),
    }


async def three_nodes(client: aioredis.Redis) -> list[tuple[Node, NodeAgent]]:
    nodes = []
    for i in range(3):
        node = Node(sandboxes={f"sbx{i}a", f"sbx{i}b"}, snapshots={"snap"} if i == 1 else set())
        agent = NodeAgent(client, f"n{i}", f"10.0.0.{i}:3000", node, SECRET, ttl=30)
        assert await agent.beat()
        nodes.append((node, agent))
    return nodes


async def test_first_beat_publishes_later_ones_renew(client: aioredis.Redis) -> None:
    node = Node(sandboxes={"sbx1"})
    agent = NodeAgent(client, "n1", "10.0.0.1:3000", node, SECRET, ttl=30)
    assert await agent.beat()
    assert not await agent.beat()
    await agent.sandbox_routed("sbx2")
    node.sandboxes.add("sbx2")
    await agent.sandbox_gone("sbx1")
    node.sandboxes.discard("sbx1")
    assert await snapshot_of(client, ["n1"]) == {
        "live": ["n1"], "routes": {"n1": ["sbx2"]}, "lookups": {"sbx2": "n1"},
        "base": ["n1"], "snap": [],
    }  # fmt: skip
    assert agent.status.connected and agent.status.republishes == 1
    await agent.close()
    assert (await snapshot_of(client, ["n1"]))["live"] == []


async def test_the_heartbeats_end_when_cancelled_though_a_beat_absorbed_it(
    client: aioredis.Redis,
) -> None:
    """redis-py may absorb a cancel that lands during a command (redis/redis-py#2028): here the
    node's state read does, at a known point. The loop must end all the same, or the node's
    shutdown waits on it forever."""
    entered = asyncio.Event()

    class Absorbing(Node):
        async def state(self) -> NodeState:
            if not entered.is_set():
                entered.set()
                with contextlib.suppress(asyncio.CancelledError):
                    await asyncio.Event().wait()
            return await super().state()

    agent = NodeAgent(client, "n1", "127.0.0.1:9", Absorbing(), SECRET, ttl=30)
    beats = asyncio.create_task(agent.run(60))
    await entered.wait()
    beats.cancel()
    done, _ = await asyncio.wait({beats}, timeout=10)
    if not done:
        beats.cancel()
        await asyncio.wait({beats}, timeout=10)
    assert done and beats.cancelled()
    await agent.close()


async def test_a_sandbox_counts_in_the_nodes_report_as_it_comes_and_goes(
    client: aioredis.Redis,
) -> None:
    """Placement reads the report: a create's sandbox must count before the next beat."""
    node = Node()
    agent = NodeAgent(client, "n1", "127.0.0.1:9", node, SECRET, ttl=30)
    registry = NodeRegistry(client, SECRET)
    await agent.beat()
    node.sandboxes.add("sbx1")
    await agent.sandbox_routed("sbx1")
    report = await registry.report("n1")
    assert report is not None and report.capacity.running == 1
    node.sandboxes.discard("sbx1")
    await agent.sandbox_gone("sbx1")
    report = await registry.report("n1")
    assert report is not None and report.capacity.running == 0
    # Another process's lease is not written over.
    await agent.close()
    other = NodeAgent(client, "n1", "127.0.0.1:9", Node(sandboxes={"x", "y"}), SECRET, ttl=30)
    await other.beat()
    await agent.sandbox_routed("sbx1")
    report = await registry.report("n1")
    assert report is not None and report.capacity.running == 2


async def test_a_drain_is_the_nodes_own_and_outlives_a_redis_wipe(
    client: aioredis.Redis, tmp_path: Path
) -> None:
    drains = Drains(client)
    memory = tmp_path / "cluster-drain.json"

    def agent() -> NodeAgent:
        """The node's agent, as a (re)started node process has it."""
        return NodeAgent(
            client, "n1", "127.0.0.1:9", Node(), SECRET, ttl=30, drain=DrainMemory(memory)
        )

    first = agent()
    await first.beat()
    assert not DrainMemory(memory).state.draining
    await drains.drain("n1")
    await first.beat()
    assert DrainMemory(memory).state.draining
    await client.flushall()
    await first.beat()
    assert await drains.draining() == {"n1"}
    # Undrained while the node was down, in the same data set: the node takes the operator's word.
    await first.close()
    await drains.undrain("n1")
    second = agent()
    await second.beat()
    assert not DrainMemory(memory).state.draining
    await client.flushall()
    await second.beat()
    assert await drains.draining() == set()
    # Drained in a new data set before the node's first beat there: it stays drained.
    await client.flushall()
    await drains.drain("n1")
    await second.beat()
    assert await drains.draining() == {"n1"} and DrainMemory(memory).state.draining


@pytest.mark.parametrize("loss", ["flushall", "restart"])
async def test_nodes_rebuild_redis_after_a_loss(
    client: aioredis.Redis, redis: RedisServer, loss: str
) -> None:
    agents = [agent for _, agent in await three_nodes(client)]
    before = await snapshot_of(client, ["n0", "n1", "n2"])
    assert before["lookups"] == {f"sbx{i}{s}": f"n{i}" for i in range(3) for s in "ab"}
    if loss == "flushall":
        await client.flushall()
    else:
        redis.restart()
    assert (await snapshot_of(client, ["n0", "n1", "n2"]))["live"] == []
    assert all([await agent.beat() for agent in agents])
    assert await snapshot_of(client, ["n0", "n1", "n2"]) == before


async def test_redis_down_the_node_keeps_its_state(
    client: aioredis.Redis, redis: RedisServer
) -> None:
    node = Node(sandboxes={"sbx1", "sbx2"})
    agent = NodeAgent(client, "n1", "10.0.0.1:3000", node, SECRET, ttl=30)
    await agent.beat()
    redis.stop()
    with pytest.raises(ClusterUnavailable, match=f"Redis at 127.0.0.1:{redis.port}"):
        await agent.beat()
    # Creates and kills while Redis is down succeed on the node; the routes catch up later.
    await agent.sandbox_routed("sbx3")
    node.sandboxes.add("sbx3")
    await agent.sandbox_gone("sbx1")
    node.sandboxes.discard("sbx1")
    assert not agent.status.connected
    assert agent.status.error is not None and "unavailable while" in agent.status.error
    redis.start()
    assert await agent.beat()
    assert agent.status.connected and agent.status.error is None
    assert (await snapshot_of(client, ["n1"]))["lookups"] == {"sbx2": "n1", "sbx3": "n1"}


async def test_heartbeat_loop_recovers_on_its_own(
    client: aioredis.Redis, redis: RedisServer
) -> None:
    """Counted in heartbeats, not seconds: a loaded machine slows every beat alike."""
    node = CountingNode(sandboxes={"sbx1"})
    agent = NodeAgent(client, "n1", "10.0.0.1:3000", node, SECRET, ttl=30)
    loop = asyncio.create_task(agent.run(interval=0.05))
    try:
        await node.beats_started(2)  # the first one finished
        assert agent.status.connected
        assert await Routes(client).lookup("sbx1") == "n1"
        redis.stop()
        await node.beats_started(2)  # one whole beat ran while Redis was down
        assert not agent.status.connected
        redis.start()  # empty (no persistence): everything must be written again
        await node.beats_started(2)  # one whole beat ran after Redis came back
        assert agent.status.connected
        assert agent.status.republishes == 2
        assert await Routes(client).lookup("sbx1") == "n1"
    finally:
        loop.cancel()
        await asyncio.gather(loop, return_exceptions=True)


@dataclass
class CountingNode(Node):
    """A node that lets a test wait for the agent's next heartbeats (each reads the state
    first), whatever their pace."""

    started: int = 0
    _beat: asyncio.Condition = field(default_factory=asyncio.Condition)

    async def state(self) -> NodeState:
        async with self._beat:
            self.started += 1
            self._beat.notify_all()
        return await super().state()

    async def beats_started(self, count: int) -> None:
        async with self._beat:
            target = self.started + count
            await self._beat.wait_for(lambda: self.started >= target)


async def test_heartbeats_carry_the_nodes_changes(client: aioredis.Redis) -> None:
    node = Node(sandboxes={"sbx1", "sbx2"})
    agent = NodeAgent(client, "n1", "10.0.0.1:3000", node, SECRET, ttl=30)
    assert await agent.beat()
    # The catalog changed without the agent being told: the next beat writes the difference.
    node.sandboxes = {"sbx2", "sbx3"}
    node.snapshots = {"snap"}
    node.templates = set()
    assert not await agent.beat()
    assert await snapshot_of(client, ["n1"]) == {
        "live": ["n1"], "routes": {"n1": ["sbx2", "sbx3"]},
        "lookups": {"sbx2": "n1", "sbx3": "n1"}, "base": [], "snap": ["n1"],
    }  # fmt: skip
    assert agent.status.republishes == 1


async def test_paused_sandboxes_are_published_for_other_nodes(client: aioredis.Redis) -> None:
    node = Node(sandboxes={"sbx1", "sbx2"}, parked={"sbx1": '{"id": "sbx1"}'})
    agent = NodeAgent(client, "n1", "10.0.0.1:3000", node, SECRET, ttl=30)
    await agent.beat()
    parked = Parked(client, SECRET)
    assert await parked.get("sbx1") == ParkedSandbox("sbx1", "n1", '{"id": "sbx1"}')
    assert await parked.get("sbx2") is None
    # Resumed here: withdrawn. Released for a drain (published by nobody): left for an adopter.
    node.parked = {"sbx2": '{"id": "sbx2"}'}
    await agent.beat()
    assert await parked.get("sbx1") is None
    await parked.released("sbx2", '{"id": "sbx2", "released": true}')
    # A beat that read the catalog before the release does not take it back.
    assert not await parked.publish("n1", "sbx2", '{"id": "sbx2"}')
    node.parked, node.sandboxes = {}, {"sbx1"}
    await agent.beat()
    assert await parked.get("sbx2") == ParkedSandbox("sbx2", "", '{"id": "sbx2", "released": true}')


async def test_a_node_back_from_a_partition_lets_go_of_moved_sandboxes(
    client: aioredis.Redis, redis: RedisServer
) -> None:
    """While n1 was cut off, sbx1 moved to n2: back, n1 forgets it instead of routing it to
    itself again (it must not run twice), and keeps the rest."""
    node = Node(sandboxes={"sbx1", "sbx2"}, parked={"sbx1": '{"id": "sbx1"}'})
    agent = NodeAgent(client, "n1", "10.0.0.1:3000", node, SECRET, ttl=30)
    await agent.beat()
    redis.stop()
    with pytest.raises(ClusterUnavailable):
        await agent.beat()
    redis.start()
    other = NodeAgent(client, "n2", "10.0.0.2:3000", Node(sandboxes={"sbx1"}), SECRET, ttl=30)
    await other.beat()
    # sbx3 was adopted here just before its route was written: its old node is dead, keep it.
    node.sandboxes.add("sbx3")
    await Routes(client).assign("sbx3", "n9")
    assert await agent.beat()  # a republish after the failed beat
    assert node.sandboxes == {"sbx2", "sbx3"}
    routes = Routes(client)
    assert [await routes.lookup(s) for s in ("sbx1", "sbx2", "sbx3")] == ["n2", "n1", "n1"]
    assert await Parked(client, SECRET).get("sbx1") is None


async def test_snapshots_in_the_repository_are_published_and_withdrawn(
    client: aioredis.Redis,
) -> None:
    first = '{"template_id": "snap1", "aliases": ["one"], "created_at": 5}'
    node = Node(saved={"snap1": first})
    agent = NodeAgent(client, "n1", "10.0.0.1:3000", node, SECRET, ttl=30)
    saved = SavedRecords(client)
    assert await agent.beat()
    found = await saved.find("one:latest")
    assert found is not None and found.template_id == "snap1" and found.record == first
    # A wipe of Redis is rebuilt by the next beat.
    await client.flushall()
    assert await agent.beat()
    assert [r.template_id for r in await saved.all()] == ["snap1"]
    node.saved = {}  # deleted on the node
    assert not await agent.beat()
    assert await saved.all() == [] and await saved.find("one") is None


async def test_a_node_whose_lease_lapsed_writes_back_routes_a_gateway_dropped(
    client: aioredis.Redis,
) -> None:
    """n1 stalled past its lease; a gateway, finding sbx1 on no live node and not parked, dropped
    its route. n1 still runs it: its next beat takes the lease anew and routes it again."""
    node = Node(sandboxes={"sbx1", "sbx2"})
    agent = NodeAgent(client, "n1", "10.0.0.1:3000", node, SECRET, ttl=30)
    assert await agent.beat()
    routes = Routes(client)
    assert not await routes.clear_lost("sbx1", "n1")  # its lease is current: kept
    await client.delete(NodeRegistry(client, SECRET).keys.lease("n1"))  # as if it lapsed
    assert await routes.clear_lost("sbx1", "n1")
    assert await routes.lookup("sbx1") is None and await routes.of_node("n1") == {"sbx2"}
    assert await agent.beat()
    assert await routes.lookup("sbx1") == "n1" and await routes.of_node("n1") == {"sbx1", "sbx2"}
    assert not await agent.beat()


async def test_builds_in_progress_are_found_again_after_a_wipe(client: aioredis.Redis) -> None:
    """The node records its builds where no node is recorded: after a wipe its build of tpl1 is
    found on it again, and a build of tpl2 a gateway placed on n2 since is left there."""
    node = Node(builds={"tpl1"})
    agent = NodeAgent(client, "n1", "10.0.0.1:3000", node, SECRET, ttl=30)
    builds = BuildPlaces(client)
    assert await agent.beat()
    assert await builds.node_of("tpl1") == "n1"
    await client.flushall()
    await builds.place("tpl2", "n2")
    node.builds.add("tpl2")
    assert await agent.beat()
    assert [await builds.node_of(t) for t in ("tpl1", "tpl2")] == ["n1", "n2"]
    # Between republishes a beat writes only the builds new since the last one.
    await client.delete(builds.keys.build("tpl1"))
    node.builds = {"tpl1", "tpl3"}
    assert not await agent.beat()
    assert [await builds.node_of(t) for t in ("tpl1", "tpl3")] == [None, "n1"]


async def test_a_keys_sandboxes_are_counted_across_nodes(client: aioredis.Redis) -> None:
    """k1 runs two sandboxes on n1 and one on n2: with a limit of 4 one create may start, a
    second at once is refused; a kill on n1 frees a slot at once (its residency event), a node
    lost frees its sandboxes' slots, and a wipe is counted again by the next beats."""
    n1 = Node(sandboxes={"a", "b"}, owners={"k1": {"a", "b"}, "k2": {"c"}})
    n2 = Node(sandboxes={"d"}, owners={"k1": {"d"}})
    agents = [
        NodeAgent(client, f"n{i}", f"10.0.0.{i}:3000", node, SECRET, ttl=30)
        for i, node in ((1, n1), (2, n2))
    ]
    for agent in agents:
        await agent.beat()
    quota = KeyQuota(client)
    first = await quota.reserve("k1", 4)
    with pytest.raises(KeyLimitReached, match=r"concurrent E2B sandboxes \(4\).* holds 4"):
        await quota.reserve("k1", 4)
    assert await quota.reserve("k2", 2)  # each key its own count
    n1.owners["k1"].discard("a")
    await agents[0].sandbox_gone("a")
    second = await quota.reserve("k1", 4)
    await quota.release("k1", first)
    await quota.release("k1", second)
    await agents[1].close()  # n2 gone: its sandbox no longer counts
    for _ in range(3):
        await quota.reserve("k1", 4)
    await client.flushall()
    await agents[0].beat()
    with pytest.raises(KeyLimitReached, match="holds 1"):
        await quota.reserve("k1", 1)


async def test_every_beat_mirrors_the_clusters_webhooks(client: aioredis.Redis) -> None:
    node = Node()
    agent = NodeAgent(client, "n1", "10.0.0.1:3000", node, SECRET)
    await agent.beat()
    assert node.webhooks == []
    hooks = ClusterWebhooks(client)
    hook = new_webhook("local", "h", "https://hooks.example.com/", True, ["x"], "secret")
    await hooks.put(hook)
    await agent.beat()
    assert node.webhooks == [hook]
    assert await hooks.get("other team", hook.id) is None
    assert await hooks.delete("local", hook.id)
    await agent.beat()
    assert node.webhooks == []
