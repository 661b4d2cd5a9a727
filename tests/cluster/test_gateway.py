"""The gateway's control plane against a real redis-server and node doubles served on loopback
(`node_double`): placement with affinity and retries, draining nodes left out, forwarding by
route, paused sandboxes of a lost node moved to another, merged pages, snapshots of other and lost
nodes (created from, listed, deleted), template builds followed to their node (and ended when
it dies), volumes and the creates mounting them kept on their node, and Redis being down.
The same over real nodes and the SDK is `test_gateway_cluster.py`."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import secrets
import socket
import threading
import time
from collections.abc import AsyncIterator, Iterator
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
import redis.asyncio as aioredis
from e2b import AsyncSandbox, SandboxNotFoundException

from aenv.api.extensions import WAIT_HEADER
from aenv.api.internal_models import INTERNAL_VERSIONS, REPLAY, Refusal
from aenv.api.keys import KeyStore
from aenv.cluster.agent import NodeAgent
from aenv.cluster.builds import BuildPlaces
from aenv.cluster.directory import Directory
from aenv.cluster.drain import Drains
from aenv.cluster.holders import FileKind, FileRef, Holders
from aenv.cluster.keys import ClusterKeys, sync_keys
from aenv.cluster.parked import Parked
from aenv.cluster.quota import KeyQuota
from aenv.cluster.registry import Capacity, NodeRegistry, NodeReport
from aenv.cluster.routing import Routes
from aenv.cluster.saved import SavedRecord, SavedRecords
from aenv.cluster.source import CatalogSource
from aenv.cluster.store import Keys, connect
from aenv.cluster.volumes import VolumePlaces
from aenv.cluster.webhooks import ClusterWebhooks
from aenv.config import Config, Paths
from aenv.gateway.evacuate import Released, evacuate
from aenv.gateway.nodes import NodeClient
from aenv.gateway.team_quota import DEFAULT_TEAM_LIMITS, TeamLimitSettings
from aenv.ids import TEAM_ID
from aenv.orchestrator.build_records import BuildStatus
from aenv.orchestrator.catalog import Archived, Catalog, VolumeMount, record_to_json
from aenv.orchestrator.events import EventType
from aenv.orchestrator.kinds import TemplateKind
from aenv.orchestrator.states import SandboxState
from aenv.orchestrator.templates import Template, template_to_json
from tests.cluster.node_double import NodeDouble, snapshot
from tests.cluster.shared import SECRET, gateway_over
from tests.proxy.support import serve
from tests.support.ports import free_port
from tests.support.redis_server import RedisServer
from tests.support.wait import eventually
from tests.support.webhooks import QUIET_WEBHOOK

NEW = {"templateID": "base"}


@dataclass
class Setup:
    url: str
    key: str
    key_id: str
    nodes: dict[str, NodeDouble]
    keys: ClusterKeys
    home: Paths  # the gateway's, where it keeps its copy of the cluster's keys

    def client(self) -> httpx.Client:
        return httpx.Client(base_url=self.url, headers={"X-API-Key": self.key}, timeout=30)


@pytest.fixture
def doubles(tmp_path: Path) -> Iterator[dict[str, NodeDouble]]:
    nodes = {
        name: NodeDouble(name, tmp_path / name, Catalog(tmp_path / f"{name}.db"))
        for name in ("a", "b")
    }
    yield nodes
    for node in nodes.values():
        node.catalog.close()


@pytest.fixture
def versions() -> tuple[int, ...]:
    """The internal API versions the nodes report: this release's, unless a test runs the
    previous release's too (parametrized)."""
    return INTERNAL_VERSIONS


@pytest.fixture
def key_limit() -> int:
    """The gateway's `key_max_sandboxes` (the default, unless a test sets its own)."""
    return Config().key_max_sandboxes


@pytest.fixture
def team_limit() -> int:
    """The gateway's `team_max_sandboxes` (the default, unless a test sets its own)."""
    return Config().team_max_sandboxes


@pytest.fixture
def team_limits() -> TeamLimitSettings:
    """The gateway's team rate and disk settings (the defaults, unless a test sets its own)."""
    return DEFAULT_TEAM_LIMITS


@pytest.fixture
async def setup(
    tmp_path: Path,
    redis: RedisServer,
    client: aioredis.Redis,
    doubles: dict[str, NodeDouble],
    versions: tuple[int, ...],
    key_limit: int,
    team_limit: int,
    team_limits: TeamLimitSettings,
) -> AsyncIterator[Setup]:
    gateway_keys = ClusterKeys(client)
    record, value = await gateway_keys.new("user")
    node_keys = KeyStore(tmp_path / "node-keys.json")
    node_keys.create("node")
    registry = NodeRegistry(client, SECRET)
    with ExitStack() as stack:
        for name, node in doubles.items():
            port = free_port()
            stack.enter_context(serve(node.app(node_keys), port))
            capacity = Capacity(cpus=2, memory_mb=1024, memory_free_mb=512, running=0, paused=0)
            report = NodeReport(
                name,
                f"127.0.0.1:{port}",
                capacity,
                ["base"] if name == "a" else [],
                internal_versions=versions,
            )
            await registry.heartbeat(secrets.token_hex(8), report, ttl=60)
        await Holders(registry).add("a", FileRef(FileKind.TEMPLATE, "base"))
        # The gateway's own client: it serves on a loop of its own.
        gateway_client = connect(redis.url, timeout=0.5)
        gateway = gateway_over(
            gateway_client,
            key_max_sandboxes=key_limit,
            team_max_sandboxes=team_limit,
            team_limits=team_limits,
        )
        url = stack.enter_context(serve(gateway, free_port()))
        yield Setup(url, value, record.id, doubles, gateway_keys, Paths(tmp_path / "gateway"))


async def test_a_create_goes_to_the_holder_first_and_to_another_node_when_refused(
    setup: Setup,
) -> None:
    setup.nodes["a"].create_answers = [429]
    with setup.client() as http:
        answer = http.post("/sandboxes", json={"templateID": "base"})
    assert answer.status_code == 201, answer.text
    assert answer.json()["node"] == "b"
    # Each node acted for the key the gateway checked, never seeing the key itself.
    assert setup.nodes["a"].creates_seen == [setup.key_id]
    assert setup.nodes["b"].creates_seen == [setup.key_id]


async def test_creates_under_way_spread_over_idle_nodes(
    setup: Setup, client: aioredis.Redis
) -> None:
    """Four creates overlap (each node still booting what it took): they split two and two,
    though every node's report, as of its last heartbeat, says it runs nothing."""
    await Holders(NodeRegistry(client, SECRET)).add("b", FileRef(FileKind.TEMPLATE, "base"))
    # b a shade busier, so that without counting the creates under way all would go to a.
    stored = await client.get(Keys().node("b"))
    assert stored is not None
    report = json.loads(stored)
    busier = {**report, "capacity": {**report["capacity"], "memory_free_mb": 500}}
    await client.set(Keys().node("b"), json.dumps(busier), keepttl=True)
    gate = threading.Event()
    for node in setup.nodes.values():
        node.create_gate = gate
    headers = {"X-API-Key": setup.key}
    async with httpx.AsyncClient(base_url=setup.url, headers=headers, timeout=30) as http:
        creates = []
        for sent in range(1, 5):
            creates.append(
                asyncio.create_task(http.post("/sandboxes", json={"templateID": "base"}))
            )

            async def taken(count: int = sent) -> bool:
                return sum(len(n.creates_seen) for n in setup.nodes.values()) == count

            await eventually(taken, f"create {sent} reached a node")
        gate.set()
        answers = await asyncio.gather(*creates)
    assert [a.status_code for a in answers] == [201] * 4
    assert {name: len(n.creates_seen) for name, n in setup.nodes.items()} == {"a": 2, "b": 2}
    # Answered: no longer counted as under way.
    assert await Directory(client, SECRET).creating.counts(["a", "b"]) == {"a": 0, "b": 0}


async def test_a_create_no_node_takes_is_429_naming_why(setup: Setup) -> None:
    setup.nodes["a"].create_answers = [503]
    setup.nodes["b"].create_answers = [429]
    with setup.client() as http:
        answer = http.post("/sandboxes", json={"templateID": "base"})
    assert answer.status_code == 429
    message = answer.json()["message"]
    assert "node a: 503 a refuses" in message and "node b: 429 b refuses" in message


@pytest.mark.parametrize("versions", [(REPLAY,), INTERNAL_VERSIONS], ids=["v0", "v1"])
async def test_a_nodes_refusal_is_read_from_its_kind_in_version_1(
    setup: Setup, versions: tuple[int, ...]
) -> None:
    """A 503 the node says is the client's (rejected) is the answer in version 1; a node of
    the previous release (version 0 only) is read by its status: another node is tried."""
    setup.nodes["a"].create_answers = [(503, Refusal.REJECTED)]
    setup.nodes["b"].create_answers = [(429, Refusal.DRAINING)]
    with setup.client() as http:
        answer = http.post("/sandboxes", json={"templateID": "base"})
    if versions == (REPLAY,):
        assert answer.status_code == 429
        assert "node a: 503 a refuses" in answer.json()["message"]
        assert "node b: 429 b refuses" in answer.json()["message"]
    else:
        assert answer.status_code == 503
        assert answer.json() == {"code": 503, "message": "a refuses"}
        assert setup.nodes["b"].creates_seen == []


@pytest.mark.parametrize("versions", [(REPLAY,), INTERNAL_VERSIONS], ids=["v0", "v1"])
async def test_a_create_that_may_wait_waits_on_a_node_once_all_are_full(setup: Setup) -> None:
    """Every node's room now first, without the wait; then the nodes again with what is left
    of it, the first one placed waiting in its queue."""
    a, b = setup.nodes["a"], setup.nodes["b"]
    a.create_answers = [429, 201]
    b.create_answers = [429]
    with setup.client() as http:
        answer = http.post("/sandboxes", json=NEW, headers={WAIT_HEADER: "60"})
    assert answer.status_code == 201, answer.text
    assert answer.json()["node"] == "a"
    assert a.create_waits[0] is None and b.create_waits == [None]
    assert 0 < float(str(a.create_waits[1])) <= 60
    # Its wait ran out there (429): the others get what is left of it, and the answer is 429.
    a.create_answers, b.create_answers = [429, 429], [429, 429]
    with setup.client() as http:
        refused = http.post("/sandboxes", json=NEW, headers={WAIT_HEADER: "60"})
    assert refused.status_code == 429
    assert a.create_waits[2] is None and 0 < float(str(a.create_waits[3])) <= 60
    assert b.create_waits[1] is None and float(str(b.create_waits[2])) <= 60


@pytest.mark.parametrize("key_limit", [1])
async def test_a_create_that_may_wait_waits_for_a_slot_of_its_keys_limit(setup: Setup) -> None:
    """With the key's one slot held by a create under way, another that may wait waits at the
    gateway (never reaching a node) and goes on once the first is answered; one that may not
    wait is refused at once."""
    gate = threading.Event()
    setup.nodes["a"].create_gate = gate
    headers = {"X-API-Key": setup.key}
    async with httpx.AsyncClient(base_url=setup.url, headers=headers, timeout=30) as http:
        first = asyncio.create_task(http.post("/sandboxes", json=NEW))
        await eventually(lambda: len(setup.nodes["a"].creates_seen) == 1, "the first create")
        second = asyncio.create_task(http.post("/sandboxes", json=NEW, headers={WAIT_HEADER: "60"}))

        async def queued() -> bool:
            queue = (await http.get("/aenv/queue")).json()
            return bool(queue["keyLimitWaiting"] == 1)

        await eventually(queued, "the second create waiting for a slot")
        refused = await http.post("/sandboxes", json=NEW)
        assert refused.status_code == 429
        assert "maximum number of concurrent E2B sandboxes (1)" in refused.json()["message"]
        assert sum(len(n.creates_seen) for n in setup.nodes.values()) == 1
        gate.set()
        answers = [await first, await second]
    assert [a.status_code for a in answers] == [201, 201], [a.text for a in answers]
    assert sum(len(n.creates_seen) for n in setup.nodes.values()) == 2


@pytest.mark.parametrize("key_limit", [1])
async def test_a_wait_for_a_slot_that_runs_out_is_a_429(setup: Setup) -> None:
    gate = threading.Event()
    setup.nodes["a"].create_gate = gate
    headers = {"X-API-Key": setup.key}
    async with httpx.AsyncClient(base_url=setup.url, headers=headers, timeout=30) as http:
        first = asyncio.create_task(http.post("/sandboxes", json=NEW))
        await eventually(lambda: len(setup.nodes["a"].creates_seen) == 1, "the first create")
        refused = await http.post("/sandboxes", json=NEW, headers={WAIT_HEADER: "0.5"})
        gate.set()
        assert (await first).status_code == 201
    assert refused.status_code == 429
    assert "(waited 0.5 s for room)" in refused.json()["message"]
    assert sum(len(n.creates_seen) for n in setup.nodes.values()) == 1


@pytest.mark.parametrize("team_limit", [1])
async def test_a_create_waiting_for_its_team_s_slot_is_counted_in_the_queue(
    setup: Setup,
) -> None:
    """The team's one slot held by a create of one key: another key's create of the same team
    that may wait waits at the gateway, and `/aenv/queue` says so (`teamLimitWaiting`), not as
    a wait for its key's slot."""
    gate = threading.Event()
    setup.nodes["a"].create_gate = gate
    _, other = await setup.keys.new("same team", TEAM_ID)
    async with (
        httpx.AsyncClient(base_url=setup.url, headers={"X-API-Key": setup.key}) as one,
        httpx.AsyncClient(base_url=setup.url, headers={"X-API-Key": other}) as two,
    ):
        first = asyncio.create_task(one.post("/sandboxes", json=NEW, timeout=30))
        await eventually(lambda: len(setup.nodes["a"].creates_seen) == 1, "the first create")
        waiting = {WAIT_HEADER: "60"}
        second = asyncio.create_task(two.post("/sandboxes", json=NEW, headers=waiting, timeout=30))

        async def queued() -> bool:
            queue = (await two.get("/aenv/queue")).json()
            return bool(queue["teamLimitWaiting"] == 1 and queue["keyLimitWaiting"] == 0)

        await eventually(queued, "the second create waiting for its team's slot")
        assert (await one.get("/aenv/queue")).json()["teamLimitWaiting"] == 1  # the team's
        gate.set()
        answers = [await first, await second]
    assert [a.status_code for a in answers] == [201, 201], [a.text for a in answers]


@pytest.mark.parametrize("team_limits", [TeamLimitSettings(creates_per_s=0.5)])
async def test_a_team_s_creates_a_second_are_counted_across_gateways(
    setup: Setup, redis: RedisServer, team_limits: TeamLimitSettings
) -> None:
    """Two gateways draw from one bucket of the team's creates: past it, E2B's 429 with
    `Retry-After` through either (a fork too), or, for a create that may wait, its turn."""
    other = gateway_over(connect(redis.url, timeout=0.5), team_limits=team_limits)
    with serve(other, free_port()) as second_url:
        headers = {"X-API-Key": setup.key}
        async with (
            httpx.AsyncClient(base_url=setup.url, headers=headers, timeout=30) as one,
            httpx.AsyncClient(base_url=second_url, headers=headers, timeout=30) as two,
        ):
            made = await one.post("/sandboxes", json=NEW)
            assert made.status_code == 201, made.text
            refused = await two.post("/sandboxes", json=NEW)
            assert refused.status_code == 429, refused.text
            assert "at most 0.5 sandbox creates a second per team" in refused.json()["message"]
            assert int(refused.headers["Retry-After"]) >= 1
            forked = await two.post(f"/sandboxes/{made.json()['sandboxID']}/fork", json={})
            assert forked.status_code == 429, forked.text
            assert sum(len(n.creates_seen) for n in setup.nodes.values()) == 1
            waited = await two.post("/sandboxes", json=NEW, headers={WAIT_HEADER: "30"})
            assert waited.status_code == 201, waited.text
        assert sum(len(n.creates_seen) for n in setup.nodes.values()) == 2


@pytest.mark.parametrize("team_limits", [TeamLimitSettings(max_disk_mb=1000)])
async def test_a_team_s_disk_is_counted_across_nodes(setup: Setup, client: aioredis.Redis) -> None:
    """Each node writes its teams' disk beside its keys' counts (as its agent does); a gateway
    refuses a volume or a create that would take the team past its disk on all nodes, holding
    a volume's until its node counts it; another team has its own."""
    quota = KeyQuota(client)
    await quota.publish("a", {}, 60, {TEAM_ID: 400})
    await quota.publish("b", {}, 60, {TEAM_ID: 300, "beta": 900})
    with setup.client() as http:
        fits = http.post("/volumes", json={"name": "v1", "sizeMB": 250})
        assert fits.status_code == 201, fits.text
        # 400 + 300 + the 250 held until a node counts it: 100 more does not fit.
        refused = http.post("/volumes", json={"name": "v2", "sizeMB": 100})
        assert refused.status_code == 429, refused.text
        message = refused.json()["message"]
        assert "hold 950 MiB of disk across the cluster" in message, message
        assert "limit of 1000 MiB" in message
        # The nodes' counts moved on: a create past the limit is refused before any node.
        await quota.publish("a", {}, 60, {TEAM_ID: 900})
        over = http.post("/sandboxes", json=NEW)
        assert over.status_code == 429, over.text
        assert not any(n.creates_seen for n in setup.nodes.values())
    # Another team's disk is its own: beta's 900 MiB leave room for a sandbox of its own.
    _, beta = await setup.keys.new("beta's", "beta")
    theirs = httpx.post(f"{setup.url}/sandboxes", json=NEW, headers={"X-API-Key": beta})
    assert theirs.status_code == 201, theirs.text


async def test_a_webhook_changed_through_two_gateways_at_once_keeps_every_change(
    setup: Setup, redis: RedisServer, client: aioredis.Redis
) -> None:
    """Concurrent `PATCH`es of different fields through two gateways all stay; a `DELETE`
    racing `PATCH`es leaves the webhook deleted (each a 200 or a 404, never a webhook back)."""
    other = gateway_over(connect(redis.url, timeout=0.5))
    with serve(other, free_port()) as second_url:
        headers = {"X-API-Key": setup.key}
        async with (
            httpx.AsyncClient(base_url=setup.url, headers=headers, timeout=30) as one,
            httpx.AsyncClient(base_url=second_url, headers=headers, timeout=30) as two,
        ):
            hook = await one.post("/events/webhooks", json=QUIET_WEBHOOK)
            assert hook.status_code == 201, hook.text
            path = f"/events/webhooks/{hook.json()['id']}"
            changes = [
                (one, {"name": "renamed"}),
                (two, {"url": "https://other.example.com/e2b"}),
                (one, {"events": ["sandbox.lifecycle.killed"]}),
                (two, {"signatureSecret": "t" * 32}),
            ]
            answers = await asyncio.gather(*(c.patch(path, json=b) for c, b in changes * 5))
            assert [a.status_code for a in answers] == [200] * 20, [a.text for a in answers]
            stored = (await two.get(path)).json()
            assert (stored["name"], stored["url"], stored["events"]) == (
                "renamed",
                "https://other.example.com/e2b",
                ["sandbox.lifecycle.killed"],
            )
            hooks = await ClusterWebhooks(client).all()
            assert [h.secret for h in hooks] == ["t" * 32]
            racing = [one.delete(path)] + [
                two.patch(path, json={"name": f"n{i}"}) for i in range(5)
            ]
            statuses = [a.status_code for a in await asyncio.gather(*racing)]
            assert statuses[0] == 200 and set(statuses[1:]) <= {200, 404}, statuses
            assert (await one.get(path)).status_code == 404
            assert (await two.get("/events/webhooks")).json() == []


@pytest.mark.parametrize("versions", [(7,)])
async def test_a_node_sharing_no_version_with_the_gateway_is_skipped_saying_so(
    setup: Setup,
) -> None:
    with setup.client() as http:
        answer = http.post("/sandboxes", json={"templateID": "base"})
    assert answer.status_code == 429
    message = answer.json()["message"]
    assert "node a speaks internal API versions [7], this gateway [0, 1]" in message
    assert setup.nodes["a"].creates_seen == [] and setup.nodes["b"].creates_seen == []


async def test_a_node_not_holding_a_held_template_is_a_refusal(setup: Setup) -> None:
    """A snapshot not in the repository yet is its maker's only: another node's 404 for it
    must not be the answer when the maker is merely full."""
    setup.nodes["a"].create_answers = [429]
    setup.nodes["b"].create_answers = [404]
    with setup.client() as http:
        answer = http.post("/sandboxes", json={"templateID": "base"})
    assert answer.status_code == 429
    assert "node b: 404 b refuses" in answer.json()["message"]


async def test_a_create_leaves_draining_nodes_out(setup: Setup, client: aioredis.Redis) -> None:
    await Drains(client).drain("a")  # the template's holder
    with setup.client() as http:
        answer = http.post("/sandboxes", json={"templateID": "base"})
        await Drains(client).drain("b")
        none = http.post("/sandboxes", json={"templateID": "base"})
    assert answer.status_code == 201 and answer.json()["node"] == "b"
    assert setup.nodes["a"].creates_seen == []
    assert none.status_code == 429 and "no live node" in none.json()["message"]


def _paused_record(setup: Setup, sandbox_id: str) -> str:
    """A paused sandbox's record with its checkpoint in the repository, as a node parks it."""
    catalog = setup.nodes["a"].catalog
    setup.nodes["a"].add(sandbox_id, 1000.0)
    catalog.update(sandbox_id, checkpoint_seq=1, archived=Archived(1, "m1"))
    catalog.transition(sandbox_id, [SandboxState.RUNNING], SandboxState.PAUSING)
    record = catalog.transition(sandbox_id, [SandboxState.PAUSING], SandboxState.PAUSED)
    catalog.delete(sandbox_id)
    assert record is not None
    return record_to_json(record)


async def test_a_paused_sandbox_of_a_lost_node_moves_to_another(
    setup: Setup, client: aioredis.Redis
) -> None:
    parked = Parked(client, SECRET)
    await parked.publish("gone", "sbmoved", _paused_record(setup, "sbmoved"))
    await Routes(client).assign("sbmoved", "gone")  # its node's lease lapsed
    await Drains(client).drain("a")
    with setup.client() as http:
        moved = http.get("/sandboxes/sbmoved")
        again = http.get("/sandboxes/sbmoved")
    assert moved.status_code == 200 and moved.json() == {"sandboxID": "sbmoved", "node": "b"}
    assert again.json() == moved.json()
    assert await Routes(client).lookup("sbmoved") == "b"
    assert await parked.get("sbmoved") is None
    held = setup.nodes["b"].catalog.get("sbmoved")
    assert held is not None and held.state is SandboxState.PAUSED


async def test_a_lost_nodes_paused_sandbox_is_listed_paused(
    setup: Setup, client: aioredis.Redis
) -> None:
    parked = Parked(client, SECRET)
    await parked.publish("gone", "sblost", _paused_record(setup, "sblost"))
    await parked.publish("a", "sbkept", '{"id": "sbkept"}')  # a live node's: not moved
    setup.nodes["b"].add("sbrunning", 2000.0)
    with setup.client() as http:
        listed = http.get("/v2/sandboxes", params={"state": "paused"})
        everything = http.get("/v2/sandboxes")
    assert listed.status_code == 200, listed.text
    assert [(s["sandboxID"], s["state"]) for s in listed.json()] == [("sblost", "paused")]
    assert [s["sandboxID"] for s in everything.json()] == ["sbrunning", "sblost"]
    assert await parked.get("sblost") is None and await parked.lost({"a", "b"}) == set()
    assert (await parked.get("sbkept")) is not None


async def test_sandbox_traffic_moves_a_lost_nodes_paused_sandbox_too(
    setup: Setup, client: aioredis.Redis
) -> None:
    """The data plane moves it as the control plane does; the adopting node's proxy answers
    (here a double without one: its 404 shows the request reached it)."""
    await Parked(client, SECRET).publish("gone", "sbport", _paused_record(setup, "sbport"))
    sandbox = {"E2b-Sandbox-Port": "49983"}
    with setup.client() as http:
        moved = http.get("/files", headers={**sandbox, "E2b-Sandbox-Id": "sbport"})
        unknown = http.get("/files", headers={**sandbox, "E2b-Sandbox-Id": "sbnone"})
    assert moved.status_code == 404, moved.text
    assert await Routes(client).lookup("sbport") in ("a", "b")
    assert await Parked(client, SECRET).get("sbport") is None
    assert unknown.status_code == 502 and "was not found" in unknown.json()["message"]


async def test_a_sandbox_no_node_adopts_stays_parked(setup: Setup, client: aioredis.Redis) -> None:
    parked = Parked(client, SECRET)
    record = _paused_record(setup, "sbstuck")
    await parked.released("sbstuck", record)
    await parked.publish("a", "sblive", _paused_record(setup, "sblive"))
    setup.nodes["a"].adopt_answers = [500]
    setup.nodes["b"].adopt_answers = [429]
    with setup.client() as http:
        stuck = http.get("/sandboxes/sbstuck")
        # Published by a live node that has not routed it yet: not lost, not moved.
        live = http.get("/sandboxes/sblive")
    assert stuck.status_code == 503
    assert (
        "no other took it" in stuck.json()["message"] and "node b: 429" in stuck.json()["message"]
    )
    assert await parked.get("sbstuck") is not None
    assert await Routes(client).lookup("sbstuck") is None
    assert live.status_code == 404


async def test_a_drained_node_is_emptied_into_parked_records(
    setup: Setup, client: aioredis.Redis
) -> None:
    a = setup.nodes["a"]
    routes, parked = Routes(client), Parked(client, SECRET)
    for sandbox_id in ("sb1", "sb2"):
        a.add(sandbox_id, 1000.0)
        await routes.assign(sandbox_id, "a")
    a.unreleasable = {"sb2"}
    nodes = NodeClient(SECRET)
    directory = Directory(client, SECRET)
    try:
        released = await evacuate(directory, nodes, "a")
        with pytest.raises(LookupError, match="node gone is not live"):
            await evacuate(directory, nodes, "gone")
    finally:
        await nodes.aclose()
    assert released[0] == Released("sb1", None)
    assert released[1].sandbox_id == "sb2" and "409" in str(released[1].error)
    entry = await parked.get("sb1")
    assert entry is not None and entry.node_id == "" and '"id": "sb1"' in entry.record
    assert await parked.get("sb2") is None and a.catalog.get("sb2") is not None


@pytest.mark.parametrize("versions", [(REPLAY,), INTERNAL_VERSIONS], ids=["v0", "v1"])
async def test_calls_for_a_sandbox_go_to_its_node(setup: Setup, client: aioredis.Redis) -> None:
    setup.nodes["b"].add("sbonb", 1000.0)
    routes = Routes(client)
    await routes.assign("sbonb", "b")
    await routes.assign("lost", "gone")  # a running sandbox of a node whose lease lapsed
    with setup.client() as http:
        found = http.get("/sandboxes/sbonb")
        # The node's extensions of one sandbox go to its node too.
        reset = http.post("/aenv/sandboxes/sbonb/reset", json={"snapshotID": "s"})
        unrouted = http.get("/sandboxes/nosuch")
        keyless = httpx.get(f"{setup.url}/sandboxes/sbonb")
        lost = http.delete("/sandboxes/lost")
    assert found.status_code == 200 and found.json() == {"sandboxID": "sbonb", "node": "b"}
    assert reset.status_code == 200 and reset.json() == {"sandboxID": "sbonb", "node": "b"}
    assert unrouted.status_code == 404
    assert unrouted.json() == {"code": 404, "message": "sandbox 'nosuch' not found"}
    assert keyless.status_code == 401
    # Gone with its node, not parked: 404, and its route goes; a live node's stays.
    assert lost.status_code == 404
    assert await routes.lookup("lost") is None and await routes.lookup("sbonb") == "b"


async def test_a_killed_nodes_sandboxes_answer_clearly_until_its_lease_lapses(
    setup: Setup, client: aioredis.Redis
) -> None:
    """Node c was killed (nothing listens at its address) but its lease runs a few seconds
    more: the API says so with a 503 to retry after the lease, which the SDK waits out and then
    gets E2B's 404; the data plane says the node does not answer, not that the port is closed."""
    capacity = Capacity(cpus=2, memory_mb=1024, memory_free_mb=512, running=1, paused=0)
    dead = NodeReport("c", f"127.0.0.1:{free_port()}", capacity)
    await NodeRegistry(client, SECRET).heartbeat(secrets.token_hex(8), dead, ttl=2)
    await Routes(client).assign("sbdead", "c")
    with setup.client() as http:
        info = http.get("/sandboxes/sbdead")
        envd = http.get(
            "/health", headers={"E2b-Sandbox-Id": "sbdead", "E2b-Sandbox-Port": "49983"}
        )
    assert info.status_code == 503, info.text
    assert 1 <= int(info.headers["Retry-After"]) <= 2
    assert info.json()["code"] == 503
    assert "is on node c, which does not answer" in info.json()["message"]
    assert envd.status_code == 502, envd.text
    message = envd.json()["message"]
    assert "its node c does not answer" in message
    assert "was not found" not in message and "port is not open" not in message

    # What an SDK user sees: the SDK waits Retry-After, retries, and gets the 404 then.
    with pytest.raises(SandboxNotFoundException):
        await AsyncSandbox.get_info("sbdead", api_key=setup.key, api_url=setup.url)
    assert await AsyncSandbox.kill("sbdead", api_key=setup.key, api_url=setup.url) is False


@pytest.mark.parametrize("versions", [(REPLAY,), INTERNAL_VERSIONS], ids=["v0", "v1"])
async def test_a_bulk_kill_runs_on_every_node_and_merges_their_entries(setup: Setup) -> None:
    a, b = setup.nodes["a"], setup.nodes["b"]
    a.add("sba", 1000.0, run="42")
    b.add("sbb", 1001.0, run="42")
    b.add("sbother", 1002.0, run="7")
    with setup.client() as http:
        killed = http.post("/aenv/bulk/sandboxes/kill", params={"metadata": "run=42"})
        refused = http.post("/aenv/bulk/sandboxes/kill", params={"state": "running"})
    assert killed.status_code == 200, killed.text
    assert sorted(e["sandboxID"] for e in killed.json()["sandboxes"]) == ["sba", "sbb"]
    assert [r.id for r in b.catalog.list()] == ["sbother"] and a.catalog.list() == []
    assert refused.status_code == 400  # the nodes' answer to a bad query


async def test_routes_the_gateway_does_not_serve_yet_are_501_naming_them(setup: Setup) -> None:
    with setup.client() as http:
        answer = http.get("/nodes/a")  # one node's detail (the list is served)
    assert answer.status_code == 501
    assert answer.json()["message"].startswith("GET /nodes/a is not served by the cluster")


@pytest.mark.parametrize("versions", [(REPLAY,), INTERNAL_VERSIONS], ids=["v0", "v1"])
async def test_batch_metrics_ask_each_sandboxs_node(setup: Setup, client: aioredis.Redis) -> None:
    routes = Routes(client)
    for node, sandbox_id in (("a", "sbma"), ("b", "sbmb"), ("b", "sbmb2")):
        setup.nodes[node].add(sandbox_id, 1000.0)
        await routes.assign(sandbox_id, node)
    await routes.assign("sblost", "gone")  # its node's lease lapsed
    with setup.client() as http:
        ids = "sbma,sbmb,sbmb2,sblost,nosuch,sbma"
        found = http.get("/sandboxes/metrics", params={"sandbox_ids": ids})
        empty = http.get("/sandboxes/metrics", params={"sandbox_ids": ""})
        extra = http.get("/sandboxes/metrics", params={"sandbox_ids": "sbma", "x": "1"})
    assert found.status_code == 200, found.text
    assert found.json() == {
        "sandboxes": {"sbma": {"node": "a"}, "sbmb": {"node": "b"}, "sbmb2": {"node": "b"}}
    }
    assert (empty.status_code, extra.status_code) == (400, 400)
    assert "between 1 and 100" in empty.json()["message"]


@pytest.mark.parametrize("versions", [(REPLAY,), INTERNAL_VERSIONS], ids=["v0", "v1"])
async def test_a_builds_calls_follow_it_to_its_node_and_end_when_it_dies(
    setup: Setup, client: aioredis.Redis
) -> None:
    files_hash = "ab" * 32
    with setup.client() as http:
        requested = http.post("/v3/templates", json={"name": "web"})
        assert requested.status_code == 202, requested.text
        template_id, build_id = requested.json()["templateID"], requested.json()["buildID"]
        node_id = await BuildPlaces(client).node_of(template_id)
        assert node_id in setup.nodes
        builder = setup.nodes[node_id].builder
        assert builder is not None and builder.get(template_id, build_id) is not None
        other = next(n for name, n in setup.nodes.items() if name != node_id).builder
        assert other is not None and other.builds_of(template_id) == []

        # The upload is sent to the gateway with the client's key, and streams to the node.
        files = http.get(f"/templates/{template_id}/files/{files_hash}")
        assert files.status_code == 201, files.text
        upload = files.json()
        assert upload == {
            "present": False,
            "url": f"{setup.url}/templates/{template_id}/files/{files_hash}",
            "headers": {"x-api-key": setup.key},
        }
        chunks = [b"\x1f\x8b" + b"x" * 65534] + [b"x" * 65536] * 7  # gzip, by its magic
        put = http.put(upload["url"], content=iter(chunks), headers=upload["headers"])
        assert put.status_code == 201, put.text
        assert builder.files.path(template_id, files_hash).read_bytes() == b"".join(chunks)
        again = http.get(f"/templates/{template_id}/files/{files_hash}")
        assert again.json() == {**upload, "present": True}
        status = http.get(f"/templates/{template_id}/builds/{build_id}/status")
        assert status.status_code == 200 and status.json()["status"] == "waiting"
        assert http.get(f"/templates/{template_id}/builds/{build_id}/logs").status_code == 200
        # Seen ready: its node holds the template from then on, before its next heartbeat.
        build = builder.get(template_id, build_id)
        assert build is not None
        build.status = BuildStatus.READY
        status = http.get(f"/templates/{template_id}/builds/{build_id}/status")
        assert status.json()["status"] == "ready"
        holders = Holders(NodeRegistry(client, SECRET))
        assert await holders.of(FileRef(FileKind.TEMPLATE, template_id)) == {node_id}

        # Its node is killed as it answers a poll (the connection drops, no answer): the poll
        # ends in an error naming it, not in a transport error.
        keys = Keys()
        stored = await client.get(keys.node(node_id))
        assert stored is not None
        report = json.loads(stored)
        with _dropping_listener() as dropping:
            await client.set(keys.node(node_id), json.dumps({**report, "address": dropping}))
            cut = http.get(f"/templates/{template_id}/builds/{build_id}/status")
        assert cut.status_code == 200 and cut.json()["status"] == "error", cut.text
        assert f"node {node_id}, which ran this build, is gone" in cut.json()["reason"]["message"]

        # Its node's lease lapses: the status poll ends in an error naming it.
        await client.delete(keys.lease(node_id), keys.node(node_id))
        ended = http.get(f"/templates/{template_id}/builds/{build_id}/status")
        assert ended.status_code == 200
        assert ended.json()["status"] == "error"
        assert f"node {node_id}, which ran this build, is gone" in ended.json()["reason"]["message"]
        start = http.post(f"/v2/templates/{template_id}/builds/{build_id}", json={})
        assert start.status_code == 503
        assert start.json()["message"].startswith(f"node {node_id}, which runs the build")
        # Had it finished and published its template, the build is ready.
        built = dataclasses.replace(
            snapshot(template_id, 1000.0, "web"), kind=TemplateKind.TEMPLATE, build_id=build_id
        )
        await SavedRecords(client).publish(SavedRecord.of(template_to_json(built)))
        ready = http.get(f"/templates/{template_id}/builds/{build_id}/status")
        assert ready.json()["status"] == "ready"
        # Built templates are not snapshots.
        assert http.get("/snapshots").json() == []
        unknown = http.get(f"/templates/nosuch/files/{files_hash}")
        assert unknown.status_code == 404
        assert unknown.json()["message"] == "no build of template 'nosuch' in this cluster"


@pytest.mark.parametrize("versions", [(REPLAY,), INTERNAL_VERSIONS], ids=["v0", "v1"])
async def test_a_create_right_after_a_build_finds_the_node_that_built_it(
    setup: Setup, client: aioredis.Redis
) -> None:
    """The build's node has not heartbeated since (its template is not published, and the
    gateway knows no holder of the name): a create naming it is not the first node's 404."""
    with setup.client() as http:
        requested = http.post("/v3/templates", json={"name": "fresh"})
        assert requested.status_code == 202, requested.text
        template_id, build_id = requested.json()["templateID"], requested.json()["buildID"]
        node_id = await BuildPlaces(client).node_of(template_id)
        assert node_id is not None
        builder, other = setup.nodes[node_id], next(n for n in setup.nodes if n != node_id)
        # The builder reports itself busier, so placement tries the other node first.
        stored = await client.get(Keys().node(node_id))
        assert stored is not None
        report = json.loads(stored)
        busy = {**report, "capacity": {**report["capacity"], "running": 10}}
        await client.set(Keys().node(node_id), json.dumps(busy), keepttl=True)
        # The build ends: the template is in the builder's store, by its name.
        assert builder.builder is not None
        build = builder.builder.get(template_id, build_id)
        assert build is not None
        build.status = BuildStatus.READY
        built = snapshot(template_id, 1000.0, "fresh")
        builder.holds(dataclasses.replace(built, kind=TemplateKind.TEMPLATE, manifest_id=None))
        status = http.get(f"/templates/{template_id}/builds/{build_id}/status")
        assert status.json()["status"] == "ready"

        created = http.post("/sandboxes", json={"templateID": "fresh"})
        assert created.status_code == 201, created.text
        assert created.json()["node"] == node_id
        assert [b["templateID"] for b in setup.nodes[other].create_bodies] == ["fresh"]
        # A template no node has is still the nodes' 404.
        missing = http.post("/sandboxes", json={"templateID": "nosuch"})
        assert missing.status_code == 404, missing.text
        assert missing.json()["message"] == "template 'nosuch' not found"


@contextlib.contextmanager
def _dropping_listener() -> Iterator[str]:
    """An address whose server takes each connection and closes it unanswered."""
    listener = socket.create_server(("127.0.0.1", 0))
    listener.settimeout(0.1)  # accept() wakes to see `stop`
    stop = threading.Event()

    def drop() -> None:
        while not stop.is_set():
            with contextlib.suppress(OSError):
                conn, _ = listener.accept()
                conn.recv(65536)  # the request arrived; the answer never comes
                conn.close()

    thread = threading.Thread(target=drop, daemon=True)
    thread.start()
    try:
        yield f"127.0.0.1:{listener.getsockname()[1]}"
    finally:
        stop.set()
        listener.close()
        thread.join(5)


async def test_a_build_in_progress_is_followed_again_after_a_redis_wipe(
    setup: Setup, client: aioredis.Redis
) -> None:
    """Redis is wiped during a build; the nodes' next heartbeats (real agents over the doubles'
    catalogs, template stores and builders) record the build's node again, so its calls, not
    only its status, reach it."""
    registry = NodeRegistry(client, SECRET)
    addresses = {name: (await registry.report(name)) for name in setup.nodes}
    setup.home.home.mkdir()
    assert not await sync_keys(setup.keys, setup.home)  # the gateway's copy of the keys
    with setup.client() as http:
        requested = http.post("/v3/templates", json={"name": "api"})
        assert requested.status_code == 202, requested.text
        template_id, build_id = requested.json()["templateID"], requested.json()["buildID"]
        node_id = await BuildPlaces(client).node_of(template_id)
        await client.flushall()
        assert not await sync_keys(setup.keys, setup.home)  # the keys given back
        for name, node in setup.nodes.items():
            report = addresses[name]
            assert node.builder is not None and node.templates is not None and report
            source = CatalogSource(node.catalog, node.templates, builder=node.builder)
            agent = NodeAgent(client, name, report.address, source, SECRET, ttl=60)
            assert await agent.beat()
        assert await BuildPlaces(client).node_of(template_id) == node_id
        build = f"/templates/{template_id}/builds/{build_id}"
        status = http.get(f"{build}/status")
        assert status.status_code == 200 and status.json()["status"] == "waiting"
        assert http.get(f"{build}/logs").status_code == 200
        files = http.get(f"/templates/{template_id}/files/{'cd' * 32}")
        assert files.status_code == 201 and files.json()["present"] is False


async def test_a_create_from_another_nodes_snapshot_adopts_it_first(
    setup: Setup, client: aioredis.Redis
) -> None:
    a, b = setup.nodes["a"], setup.nodes["b"]
    made = snapshot("snapone", 1000.0, "mine")
    a.snapshots[made.template_id] = made
    await SavedRecords(client).publish(SavedRecord.of(template_to_json(made)))
    await Holders(NodeRegistry(client, SECRET)).add("a", FileRef(FileKind.SNAPSHOT, "snapone"))
    a.create_answers = [429]  # its maker is full: b adopts it, by its name
    with setup.client() as http:
        answer = http.post("/sandboxes", json={"templateID": "mine:latest"})
    assert answer.status_code == 201, answer.text
    assert answer.json()["node"] == "b"
    assert b.snapshots["snapone"] == made
    # A holder is not asked to adopt it.
    b.snapshots.clear()
    with setup.client() as http:
        assert http.post("/sandboxes", json={"templateID": "snapone"}).status_code == 201
    assert b.snapshots == {}
    assert len(a.creates_seen) == 2


async def test_a_fork_too_big_for_its_node_spills_over_to_another(
    setup: Setup, client: aioredis.Redis, redis: RedisServer
) -> None:
    a, b = setup.nodes["a"], setup.nodes["b"]
    a.add("sbparent", 1000.0)
    await Routes(client).assign("sbparent", "a")
    saved = SavedRecords(client)

    async def stored(made: Template) -> None:
        # On the node double's own event loop: a client of its own.
        own = connect(redis.url)
        try:
            await SavedRecords(own).publish(SavedRecord.of(template_to_json(made)))
        finally:
            await own.aclose()

    a.on_snapshot = stored
    a.fork_room = 1
    a.create_answers = [429, 429]  # full for creates too
    with setup.client() as http:
        forked = http.post("/sandboxes/sbparent/fork", json={"count": 3, "timeout": 60})
    assert forked.status_code == 201, forked.text
    assert [e["sandbox"]["node"] for e in forked.json()] == ["a", "b", "b"]
    assert [body["templateID"] for body in b.create_bodies] == ["snapofsbparent"] * 2
    assert all(body["timeout"] == 60 for body in b.create_bodies)
    # The snapshot served its purpose: deleted on both nodes, withdrawn.
    assert a.snapshots == {} and b.snapshots == {} and await saved.all() == []
    # A fork that fits stays on the parent's node, no snapshot taken.
    a.fork_room = 100
    with setup.client() as http:
        fits = http.post("/sandboxes/sbparent/fork", json={"count": 2})
    assert [e["sandbox"]["node"] for e in fits.json()] == ["a", "a"]
    assert len(b.create_bodies) == 2
    # A batch fork spills over alike, each child elsewhere with its own labels.
    a.fork_room = 1
    a.create_answers = [429, 429]
    children = [{"metadata": {"rank": str(i)}, "envVars": {"RANK": str(i)}} for i in range(3)]
    with setup.client() as http:
        batch = http.post("/aenv/sandboxes/sbparent/fork", json={"children": children})
    assert batch.status_code == 201, batch.text
    assert [e["sandbox"]["node"] for e in batch.json()] == ["a", "b", "b"]
    assert [(c["metadata"], c["envVars"]) for c in b.create_bodies[2:]] == [
        ({"rank": "1"}, {"RANK": "1"}),
        ({"rank": "2"}, {"RANK": "2"}),
    ]


async def test_a_fork_of_a_sandbox_with_volumes_stays_on_its_node(
    setup: Setup, client: aioredis.Redis
) -> None:
    """Its children must mount its volumes, which live on its node: no spill-over."""
    a, b = setup.nodes["a"], setup.nodes["b"]
    a.add("sbvol", 1000.0, volume_mounts=(VolumeMount("volone", "/mnt"),))
    await Routes(client).assign("sbvol", "a")
    a.fork_room = 1
    with setup.client() as http:
        forked = http.post("/sandboxes/sbvol/fork", json={"count": 2})
    assert forked.status_code == 201, forked.text
    assert forked.json()[0]["sandbox"]["node"] == "a"
    assert forked.json()[1] == {"error": {"code": 429, "message": "a is full"}}
    assert a.snapshots == {} and b.create_bodies == []


async def test_snapshots_are_listed_once_across_nodes_and_deleted_everywhere(
    setup: Setup, client: aioredis.Redis
) -> None:
    a, b = setup.nodes["a"], setup.nodes["b"]
    shared, fresh = snapshot("snapshared", 1000.0, "s"), snapshot("snapfresh", 3000.0)
    lost = snapshot("snaplost", 2000.0)  # made by a node that is gone: only its record is left
    a.snapshots |= {"snapshared": shared, "snapfresh": fresh}
    b.snapshots["snapshared"] = shared
    for made in (shared, lost):
        await SavedRecords(client).publish(SavedRecord.of(template_to_json(made)))
    with setup.client() as http:
        listed = http.get("/snapshots")
        first = http.get("/snapshots", params={"limit": 2})
        rest = http.get(
            "/snapshots", params={"limit": 2, "nextToken": first.headers["X-Next-Token"]}
        )
        named = http.get("/snapshots", params={"name": "s"})
        bad = http.get("/snapshots", params={"limit": 0})
    assert listed.status_code == 200, listed.text
    # Newest first; one not in the repository yet is the newest.
    assert [s["snapshotID"] for s in listed.json()] == ["snapfresh", "snaplost", "snapshared"]
    assert [s["snapshotID"] for s in first.json() + rest.json()] == [
        "snapfresh", "snaplost", "snapshared",
    ]  # fmt: skip
    assert "X-Next-Token" not in rest.headers
    assert named.json() == [{"snapshotID": "snapshared", "names": ["s"]}]
    assert bad.status_code == 400 and bad.json()["code"] == 400

    with setup.client() as http:
        deleted = http.delete("/templates/snapshared")
        lost_deleted = http.delete("/templates/snaplost")
        unknown = http.delete("/templates/nosuch")
        after = http.get("/snapshots")
    assert deleted.status_code == 204 and lost_deleted.status_code == 204
    assert "snapshared" not in a.snapshots and "snapshared" not in b.snapshots
    assert await SavedRecords(client).all() == []
    assert unknown.status_code == 404 and unknown.json()["code"] == 404
    assert [s["snapshotID"] for s in after.json()] == ["snapfresh"]


async def test_a_bulk_delete_of_snapshots_reaches_every_node_and_the_records(
    setup: Setup, client: aioredis.Redis
) -> None:
    a, b = setup.nodes["a"], setup.nodes["b"]

    def labelled(template_id: str, run: str) -> Template:
        return dataclasses.replace(snapshot(template_id, 1000.0), metadata={"run": run})

    mine, copy, theirs = (
        labelled("snapmine", "42"),
        labelled("snapcopy", "42"),
        labelled("snapkept", "7"),
    )
    lost = labelled("snaplost", "42")  # made by a node that is gone: only its record is left
    a.snapshots |= {"snapmine": mine, "snapkept": theirs}
    b.snapshots["snapcopy"] = copy
    for made in (mine, theirs, lost):
        await SavedRecords(client).publish(SavedRecord.of(template_to_json(made)))
    with setup.client() as http:
        deleted = http.delete("/aenv/bulk/snapshots", params={"metadata": "run=42"})
        refused = http.delete("/aenv/bulk/snapshots")
    assert deleted.status_code == 200, deleted.text
    assert deleted.json() == {
        "snapshots": [{"snapshotID": i} for i in ("snapcopy", "snaplost", "snapmine")]
    }
    assert list(a.snapshots) == ["snapkept"] and b.snapshots == {}
    assert [r.template_id for r in await SavedRecords(client).all()] == ["snapkept"]
    assert refused.status_code == 400


@pytest.mark.parametrize("versions", [(REPLAY,), INTERNAL_VERSIONS], ids=["v0", "v1"])
async def test_the_list_pages_over_every_node_in_order(setup: Setup) -> None:
    a, b = setup.nodes["a"], setup.nodes["b"]
    for index, node in enumerate([a, b, a, b, a]):
        node.add(f"sb{index}", 1000.0 + index, team="x" if index != 2 else "y")
    for order, expected in [
        ("desc", ["sb4", "sb3", "sb1", "sb0"]),
        ("asc", ["sb0", "sb1", "sb3", "sb4"]),
    ]:
        seen: list[str] = []
        token = None
        with setup.client() as http:
            while True:
                params = {"limit": "2", "order": order, "metadata": "team=x"}
                if token:
                    params["nextToken"] = token
                page = http.get("/v2/sandboxes", params=params)
                assert page.status_code == 200, page.text
                assert "x-aenv-cursors" not in page.headers
                seen += [s["sandboxID"] for s in page.json()]
                token = page.headers.get("x-next-token")
                if token is None:
                    break
        assert seen == expected


async def test_the_dashboard_lists_every_nodes_sandboxes(setup: Setup) -> None:
    setup.nodes["a"].add("sba", 1000.0, team="x")
    setup.nodes["b"].add("sbb", 1001.0, team="x")
    origin = {"Origin": setup.url, "Sec-Fetch-Site": "same-origin"}
    with httpx.Client(base_url=setup.url, headers=origin, timeout=30) as browser:
        refused = browser.post("/dashboard/sign-in", data={"key": "e2b_" + "0" * 40})
        assert refused.status_code == 401
        signed_in = browser.post("/dashboard/sign-in", data={"key": setup.key})
        assert signed_in.status_code == 303, signed_in.text
        page = browser.get("/dashboard/sandboxes")
        assert page.status_code == 200
        assert 'data-sandbox="sba"' in page.text and 'data-sandbox="sbb"' in page.text
        # The rest is still the gateway's API.
        assert browser.get("/v2/sandboxes").status_code == 401


@pytest.mark.parametrize("versions", [(REPLAY,), INTERNAL_VERSIONS], ids=["v0", "v1"])
async def test_events_of_every_node_are_merged_in_time_order(setup: Setup) -> None:
    created, killed = EventType.CREATED, EventType.KILLED
    for node, sandbox_id, kind in (
        ("a", "sbea", created),
        ("b", "sbeb", created),
        ("a", "sbea2", created),
        ("b", "sbeb", killed),
    ):
        double = setup.nodes[node]
        if kind is created:
            double.add(sandbox_id, time.time(), run="events")
        record = double.catalog.get(sandbox_id)
        assert double.events is not None and record is not None
        double.events.record(kind, record)
    with setup.client() as http:
        ascending = http.get("/events/sandboxes", params={"orderAsc": "true"}).json()
        assert [e["sandboxId"] for e in ascending] == ["sbea", "sbeb", "sbea2", "sbeb"]
        assert http.get("/events/sandboxes").json() == ascending[::-1]
        page = http.get("/events/sandboxes", params={"orderAsc": "true", "offset": 1, "limit": 2})
        assert page.json() == ascending[1:3]
        mine = http.get("/events/sandboxes/sbeb", params={"orderAsc": "true"}).json()
        assert mine == [ascending[1], ascending[3]]
        kills = http.get("/events/sandboxes", params={"types": killed.value})
        assert kills.json() == [ascending[3]]
        for params in ({"limit": 0}, {"offset": 9_995, "limit": 10}, {"types": "nope"}):
            assert http.get("/events/sandboxes", params=params).status_code == 400, params


@pytest.mark.parametrize("versions", [(REPLAY,), INTERNAL_VERSIONS], ids=["v0", "v1"])
async def test_webhooks_are_the_clusters_and_their_logs_every_nodes(setup: Setup) -> None:
    hook_body = {
        "name": "h",
        "url": "https://hooks.example.com/e2b",
        "events": ["sandbox.lifecycle.created"],
        "signatureSecret": "s",
    }
    with setup.client() as http:
        created = http.post("/events/webhooks", json=hook_body)
        assert created.status_code == 201, created.text
        hook = created.json()
        assert "signatureSecret" not in hook
        assert http.get("/events/webhooks").json() == [hook]
        changed = http.patch(f"/events/webhooks/{hook['id']}", json={"name": "renamed"})
        assert changed.json() == {**hook, "name": "renamed"}
        bad = http.post("/events/webhooks", json={**hook_body, "url": "ftp://x/"})
        assert bad.status_code == 400
        # Each node mirrors it (as its agent would) and queues its own sandboxes' events.
        [stored] = await ClusterWebhooks(setup.keys.client).all()
        assert stored.secret == "s" and stored.name == "renamed"
        for name, sandbox_id in (("a", "sbwa"), ("b", "sbwb")):
            double = setup.nodes[name]
            assert double.webhooks is not None and double.events is not None
            double.webhooks.store.mirror([stored])
            double.add(sandbox_id, time.time())
            record = double.catalog.get(sandbox_id)
            assert record is not None
            double.events.record(EventType.CREATED, record)
        log = http.get(f"/events/webhooks/{hook['id']}/deliveries").json()
        assert [d["state"] for d in log] == ["pending", "pending"]
        events = http.get("/events/sandboxes", params={"orderAsc": "true"}).json()
        assert [d["eventID"] for d in log] == [e["id"] for e in events][::-1]
        assert http.delete(f"/events/webhooks/{hook['id']}").status_code == 200
        assert http.get(f"/events/webhooks/{hook['id']}").status_code == 404
        assert http.get("/events/webhooks").json() == []


async def test_node_events_are_listed_for_operators(setup: Setup) -> None:
    with setup.client() as http:
        listed = http.get("/events/nodes", params={"limit": 100}).json()
        assert sorted((e["type"], e["nodeID"]) for e in listed) == [
            ("node.back", "a"),
            ("node.back", "b"),
        ]
        assert http.get("/events/nodes", params={"node": "b"}).json() == [
            e for e in listed if e["nodeID"] == "b"
        ]
        assert http.get("/events/nodes", params={"limit": 0}).status_code == 400
        assert http.get("/events/nodes", params={"type": "x"}).status_code == 400


async def test_a_bad_list_query_is_the_nodes_400(setup: Setup) -> None:
    with setup.client() as http:
        answer = http.get("/v2/sandboxes", params={"limit": "0"})
    assert answer.status_code == 400
    assert answer.json() == {"code": 400, "message": "limit must be between 1 and 100"}


async def test_redis_down_is_503_until_it_is_back(setup: Setup, redis: RedisServer) -> None:
    setup.home.home.mkdir()
    assert not await sync_keys(setup.keys, setup.home)  # the gateway's copy of the keys
    redis.stop()
    with setup.client() as http:
        down = http.get("/v2/sandboxes")
        health = http.get("/health")
        data = http.get("/files", headers={"E2b-Sandbox-Id": "abc", "E2b-Sandbox-Port": "49983"})
        redis.start()
        # Restarted without its data: the keys are back once the gateway syncs them.
        lost = http.get("/v2/sandboxes")
        assert not await sync_keys(setup.keys, setup.home)
        back = http.get("/v2/sandboxes")
    assert down.status_code == 503 and "unavailable" in down.json()["message"]
    assert down.json()["code"] == 503
    assert lost.status_code == 401
    assert health.status_code == 503
    assert data.status_code == 503 and data.json()["code"] == 503
    # An empty Redis (restarted without its data) has no live node until they heartbeat again.
    assert back.status_code == 200 and back.json() == []


@pytest.mark.parametrize("versions", [(REPLAY,), INTERNAL_VERSIONS], ids=["v0", "v1"])
async def test_a_volume_stays_on_its_node_with_the_sandboxes_that_mount_it(
    setup: Setup, client: aioredis.Redis
) -> None:
    places = VolumePlaces(client)
    with setup.client() as http:
        made = http.post("/volumes", json={"name": "data"})
        assert made.status_code == 201, made.text
        volume_id, token = made.json()["volumeID"], made.json()["token"]
        place = await places.find("data", TEAM_ID)
        assert place is not None and place.volume_id == volume_id
        home, other = (
            setup.nodes[place.node_id],
            next(n for name, n in setup.nodes.items() if name != place.node_id),
        )
        taken = http.post("/volumes", json={"name": "data"})
        assert taken.status_code == 400
        assert taken.json()["message"] == "a volume named 'data' already exists"
        assert [v["volumeID"] for v in http.get("/volumes").json()] == [volume_id]

        # Its files, by its token, on its node: streamed there and back.
        content = f"/volumecontent/{volume_id}/file"
        bearer = {"Authorization": f"Bearer {token}"}
        put = http.put(content, params={"path": "/a.txt"}, content=b"kept", headers=bearer)
        assert put.status_code in (200, 201), put.text
        assert (home.home / "volumes" / volume_id / "a.txt").read_bytes() == b"kept"
        got = httpx.get(f"{setup.url}{content}", params={"path": "/a.txt"}, headers=bearer)
        assert got.status_code == 200 and got.content == b"kept"
        wrong = httpx.get(f"{setup.url}{content}", params={"path": "/a.txt"})
        assert wrong.status_code == 401
        unknown = httpx.get(f"{setup.url}/volumecontent/nosuch/file", params={"path": "/a"})
        assert unknown.status_code == 401

        # Creates that mount it go to its node only, or say why not, naming it.
        mount = {"templateID": "base", "volumeMounts": [{"name": "data", "path": "/mnt"}]}
        for _ in range(3):
            assert http.post("/sandboxes", json=mount).json()["node"] == place.node_id
        assert other.create_bodies == []
        home.create_answers = [429]
        full = http.post("/sandboxes", json=mount)
        assert full.status_code == 429
        lives = f"volume 'data' lives on node {place.node_id}"
        assert full.json()["message"].startswith(f"{lives}, which has no room")
        await Drains(client).drain(place.node_id)
        draining = http.post("/sandboxes", json=mount)
        assert draining.status_code == 409 and lives in draining.json()["message"]
        await Drains(client).undrain(place.node_id)
        assert other.create_bodies == []

        # Its record lost (a Redis wipe): found again on the nodes.
        await client.delete(Keys().volume(volume_id), Keys().volume_names)
        assert http.get(f"/volumes/{volume_id}").json()["name"] == "data"
        assert await places.find("data", TEAM_ID) == place

        # A deleted volume is gone from its node and its record; deleted again, E2B's 404.
        scratch = http.post("/volumes", json={"name": "scratch"}).json()["volumeID"]
        assert http.delete(f"/volumes/{scratch}").status_code == 204
        assert await places.find("scratch", TEAM_ID) is None
        again = http.delete(f"/volumes/{scratch}")
        assert again.status_code == 404 and again.json()["code"] == 404
        # By its name as well: the gateway knows where it lives and asks its node by id.
        http.post("/volumes", json={"name": "named"})
        assert http.get("/volumes/named").json()["name"] == "named"
        assert http.delete("/volumes/named").status_code == 204
        assert await places.find("named", TEAM_ID) is None
        assert [v["name"] for v in http.get("/volumes").json()] == ["data"]

        await client.delete(Keys().lease(place.node_id), Keys().node(place.node_id))
        gone = http.post("/sandboxes", json=mount)
        assert gone.status_code == 503 and gone.json()["message"] == f"{lives}, which is gone"
        assert http.get(f"/volumes/{volume_id}").status_code == 503


async def test_a_rebuild_goes_to_the_templates_holder_or_adopts_it_first_and_it_is_listed(
    setup: Setup, client: aioredis.Redis
) -> None:
    a = setup.nodes["a"]
    built = dataclasses.replace(snapshot("tplweb", 1000.0, "web"), kind=TemplateKind.TEMPLATE)
    await SavedRecords(client).publish(SavedRecord.of(template_to_json(built)))
    await Holders(NodeRegistry(client, SECRET)).add("b", FileRef(FileKind.TEMPLATE, "tplweb"))
    builds = BuildPlaces(client)
    with setup.client() as http:
        first = http.post("/v3/templates", json={"name": "web:v2"})
        assert first.status_code == 202, first.text
        assert await builds.node_of(first.json()["templateID"]) == "b"
        assert a.snapshots == {}  # a holder is not asked to adopt it
        await Drains(client).drain("b")
        second = http.post("/v3/templates", json={"name": "web"})
        assert second.status_code == 202, second.text
        # Listed from its published record though no node lists it (a's adopted copy is in
        # the double's snapshots, not its template store, so a's build is of a template of
        # its own, listed as waiting).
        listed = http.get("/templates")
        assert listed.status_code == 200, listed.text
        ready = [t for t in listed.json() if t["buildStatus"] == "ready"]
        assert [(t["templateID"], t["names"]) for t in ready] == [("tplweb", ["web"])]
        # Read from it too, as no node answers for it.
        info = http.get("/templates/tplweb")
        assert info.status_code == 200, info.text
        assert info.json()["names"] == ["web"]
        assert [b["buildID"] for b in info.json()["builds"]] == [built.build_id]
        alias = http.get("/templates/aliases/web")
        assert alias.json() == {"templateID": "tplweb", "public": False}
        assert http.get("/templates/tplweb?limit=0").status_code == 400
        assert http.get("/templates/nosuch").status_code == 404
    assert await builds.node_of(second.json()["templateID"]) == "a"
    assert a.snapshots["tplweb"] == built  # adopted before the build was asked of it


@pytest.mark.parametrize("versions", [(REPLAY,), INTERNAL_VERSIONS], ids=["v0", "v1"])
async def test_tags_reach_every_holder_and_the_published_record(
    setup: Setup, client: aioredis.Redis
) -> None:
    """Both nodes hold `tagged`: a tag given through the gateway is on both and in its
    published record, which a node adopting a template takes with it; a template whose nodes
    are gone has its tags changed and listed from its record."""
    tagged = dataclasses.replace(
        snapshot("tpltagged", 1000.0, "tagged"), kind=TemplateKind.TEMPLATE, build_id="b7"
    )
    gone = dataclasses.replace(
        snapshot("tplgone", 1000.0, "gone"), kind=TemplateKind.TEMPLATE, build_id="b9"
    )
    records = SavedRecords(client)
    for template in (tagged, gone):
        await records.publish(SavedRecord.of(template_to_json(template)))
    holders = Holders(NodeRegistry(client, SECRET))
    for node in setup.nodes.values():
        node.holds(tagged)
        await holders.add(node.name, FileRef(FileKind.TEMPLATE, "tpltagged"))
    tag_stores = [n.builder.tags for n in setup.nodes.values() if n.builder is not None]
    with setup.client() as http:
        given = http.post("/templates/tags", json={"target": "tagged:latest", "tags": ["v1"]})
        assert given.status_code == 201, given.text
        assert given.json() == {"tags": ["v1"], "buildID": "b7"}
        assert [store.builds("tpltagged") for store in tag_stores] == [{"v1": "b7"}] * 2
        published = await records.find("tagged")
        assert published is not None and published.tags == {"v1": "b7"}
        listed = http.get("/templates/tpltagged/tags")
        assert [(t["tag"], t["buildID"]) for t in listed.json()] == [("v1", "b7")]
        bad = http.post("/templates/tags", json={"target": "tagged", "tags": ["no/slash"]})
        assert bad.status_code == 400
        unknown = http.post("/templates/tags", json={"target": "nosuch", "tags": ["v1"]})
        assert unknown.status_code == 404
        body = {"name": "tagged", "tags": ["v1"]}
        removed = http.request("DELETE", "/templates/tags", json=body)
        assert removed.status_code == 204, removed.text
        assert [store.builds("tpltagged") for store in tag_stores] == [{}] * 2
        assert (await records.find("tagged")) == SavedRecord.of(template_to_json(tagged))

        # No live node holds `gone`: tagged in its record, listed from it, adopted with it.
        given = http.post("/templates/tags", json={"target": "gone", "tags": ["stable"]})
        assert given.status_code == 201, given.text
        assert given.json() == {"tags": ["stable"], "buildID": "b9"}
        listed = http.get("/templates/tplgone/tags")
        assert listed.status_code == 200, listed.text
        assert [(t["tag"], t["buildID"]) for t in listed.json()] == [("stable", "b9")]
        made = http.post("/sandboxes", json={"templateID": "gone:stable"})
        assert made.status_code == 201, made.text
    adopter = setup.nodes[made.json()["node"]]
    assert adopter.builder is not None and adopter.snapshots["tplgone"] == gone
    assert adopter.builder.tags.builds("tplgone") == {"stable": "b9"}


async def test_a_create_past_the_keys_cluster_wide_limit_is_e2bs_429(
    setup: Setup, redis: RedisServer, client: aioredis.Redis
) -> None:
    """With 2 sandboxes at most per key, counted across nodes: a key holding one on each node
    is refused by a gateway (E2B's message); once a node's count drops, the create goes on."""
    quota = KeyQuota(client)
    await quota.publish("a", {setup.key_id: {"sba1"}}, ttl=60)
    await quota.publish("b", {setup.key_id: {"sbb1"}, "other": {"sbb2"}}, ttl=60)
    gateway_client = connect(redis.url, timeout=0.5)
    gateway = gateway_over(gateway_client, key_max_sandboxes=2)
    with serve(gateway, port := free_port()):
        headers = {"X-API-Key": setup.key}
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", headers=headers) as http:
            refused = await http.post("/sandboxes", json={"templateID": "base"})
            assert refused.status_code == 429, refused.text
            message = refused.json()["message"]
            assert message.startswith("you have reached the maximum number of concurrent E2B")
            assert [n.creates_seen for n in setup.nodes.values()] == [[], []]
            await quota.publish("b", {"other": {"sbb2"}}, ttl=60)  # killed there
            made = await http.post("/sandboxes", json={"templateID": "base"})
            assert made.status_code == 201, made.text
    # The create's reservation is gone with its answer (the node counts its sandbox itself).
    assert await client.hlen(Keys().key_creates(setup.key_id)) == 0


async def test_nodes_without_their_own_list_are_described_from_their_heartbeat(
    setup: Setup, client: aioredis.Redis
) -> None:
    # The doubles serve no `GET /nodes` (as a node of a release without it).
    await Drains(client).drain("b")
    with setup.client() as http:
        nodes = http.get("/nodes").json()
    assert [(n["id"], n["status"]) for n in nodes] == [("a", "ready"), ("b", "draining")]
    assert nodes[0]["metrics"]["memoryTotalBytes"] == 1024 << 20
    assert nodes[0]["metrics"]["memoryUsedBytes"] == 512 << 20
