"""End to end: two real `aenv node`s (real VMs, each in a network namespace of its own) and a real
`aenv gateway` in front of them, driven by the official Python e2b SDK pointed at the gateway
only. Creates are spread over both nodes, commands and files go through the gateway's data plane,
the list pages over the sandboxes of both, kills work, and routes change at once (the
orchestrator tells the node agent, no heartbeat waited for). A node's internal API refuses
callers without the cluster token, and a gateway with another secret does not start. A burst
of creates past the nodes' and the keys' limits that may wait all start, none refused.

On the same cluster (one boot of two nodes is most of the time), with one S3 repository for
both: a template built with `Template.build` through the gateway on one node starts a sandbox,
with the build's files, on the other while the builder is drained; a volume created through the
gateway, written by a sandbox, is read by a sandbox created through a second gateway, both on
the volume's node; a paused sandbox whose node is drained (`aenv node drain`) resumes on the
other node with its files; a snapshot made on the drained node starts a sandbox on the other
(which pulls it from the repository), is listed once and deleted from both; creates avoid the
draining node (`aenv nodes` shows it); after a `kill -9` of a node, its paused sandbox resumes
on the survivor and its running one answers 404, and is listed paused before; a fork too big for
its node starts the rest of its children on the other; with two gateways, one killed with `kill
-9`, the other serves the same sandboxes and new ones."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import re
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import redis.asyncio as aioredis

from aenv.cluster.builds import BuildPlaces
from aenv.cluster.drain import DrainMemory, Drains
from aenv.cluster.parked import Parked
from aenv.cluster.registry import NodeRegistry
from aenv.cluster.routing import Routes
from aenv.cluster.saved import SavedRecords
from aenv.cluster.secret import ClusterSecret
from aenv.cluster.store import connect
from aenv.cluster.volumes import VolumePlaces
from aenv.config import Paths
from aenv.ids import TEAM_ID
from aenv.orchestrator.images import prepare_images
from tests.cluster.cluster_ns import GATEWAY_PORT, Cluster, Gateway, cluster
from tests.cluster.shared import SECRET
from tests.support.guest import GUEST_CACHE, MIRROR
from tests.support.js import JS_DIR, ensure_npm_sdk
from tests.support.process_group import stop_group
from tests.support.redis_server import RedisServer

# Two nodes build their first template under TCG side by side: minutes on a loaded machine.
pytestmark = [pytest.mark.slow, pytest.mark.timeout(1200)]

SCRIPT = str(Path(__file__).parent / "sdk" / "through_gateway.py")
MOVES = str(Path(__file__).parent / "sdk" / "moves.py")
NPM_SCRIPT = str(JS_DIR / "cluster_gateway.mjs")
BUILDS = str(Path(__file__).parent / "sdk" / "builds.py")
VOLUMES = str(Path(__file__).parent / "sdk" / "volumes.py")
BURST = str(Path(__file__).parent / "sdk" / "burst.py")
NODES = ["node-a", "node-b"]


def sdk_env(gateway: Gateway, key: str | None = None) -> dict[str, str]:
    """The SDK's settings for `gateway`, with `key` (the gateway's first by default)."""
    url = gateway.url
    return {"E2B_API_URL": url, "E2B_SANDBOX_URL": url, "E2B_API_KEY": key or gateway.api_key}


def sdk(
    c: Cluster,
    *args: str,
    script: str = SCRIPT,
    gateway: Gateway | None = None,
    key: str | None = None,
    runner: str = sys.executable,
) -> dict[str, Any]:
    """A run of an SDK script (by `runner`: Python's, or node for the npm SDK) against `gateway`
    (the cluster's first by default) with `key` (the gateway's first by default)."""
    gateway = gateway or c.gateway
    code, out = gateway.run([runner, script, *args], env=sdk_env(gateway, key))
    assert code == 0, out + gateway.log.read_text()[-3000:]
    result: dict[str, Any] = json.loads(out.strip().splitlines()[-1])
    return result


def api(gateway: Gateway, method: str, path: str, key: str, body: str = "") -> tuple[int, Any]:
    """One call to the gateway's API (curl in its namespace): the status and the JSON body."""
    data = ["-H", "Content-Type: application/json", "-d", body] if body else []
    code, out = gateway.run(
        ["curl", "-s", "-w", "\n%{http_code}", "-X", method, "-H", f"X-API-Key: {key}", *data,
         f"{gateway.url}{path}"]
    )  # fmt: skip
    assert code == 0, out
    text, status = out.rsplit("\n", 1)
    return int(status), json.loads(text) if text else None


async def a_burst_past_capacity(c: Cluster, routes: Routes) -> None:
    """8 creates at once against 2 nodes of 3 sandboxes each: 6 start, 3 on each node, the
    other 2 are 429 (no 5xx, no other error), and killing the 6 leaves nothing behind."""
    burst = sdk(c, "burst", "8")
    assert burst["errors"] == ["429", "429"], burst
    homes = [await routes.lookup(sandbox_id) for sandbox_id in burst["ids"]]
    assert sorted(str(h) for h in homes) == sorted(NODES * 3), homes
    assert sdk(c, "kill", *burst["ids"])["killed"] == [True] * 6
    assert [await routes.lookup(i) for i in burst["ids"]] == [None] * 6
    assert [await routes.of_node(n) for n in NODES] == [set(), set()]
    listed = c.internal(NODES[0], "/internal/v2/sandboxes", SECRET.bearer).json()
    assert listed == []


async def a_burst_that_waits(c: Cluster, routes: Routes) -> None:
    """40 creates at once that may wait (`X-Aenv-Wait`), from two keys (30, then 10), through
    a gateway whose keys may each run 4 sandboxes, over 2 nodes of 3: every one starts, none
    refused (the SDK's retries are off: no client-side retry hides a 429), runs a command and
    is killed. Creates were seen waiting in `/aenv/queue`, the first key's also at the gateway
    for a slot of its limit; the second key, sent last, is not served last; nothing is left."""
    third = dataclasses.replace(
        c.gateway, log=c.gateway.log.with_name("gateway-3.log"), proc=None, port=GATEWAY_PORT + 2
    )
    third.start({"AENV_KEY_MAX_SANDBOXES": "4"})
    try:
        third.wait_ready()
        status, made = api(third, "POST", "/api-keys", c.gateway.api_key, '{"name": "burst"}')
        assert status == 201, made
        keys = [f"a={c.gateway.api_key}:30", f"b={made['key']}:10"]
        code, out = third.run(
            [sys.executable, BURST, "1200", *keys], env=sdk_env(third), timeout=1800
        )
        assert code == 0, out + third.log.read_text()[-3000:]
        burst = json.loads([line for line in out.splitlines() if line.startswith("{")][-1])
        for label, sent in (("a", 30), ("b", 10)):
            mine = burst["keys"][label]
            assert (mine["started"], mine["ran"], mine["failed"]) == (sent, sent, {}), burst
        assert burst["queue"]["most_waiting"] > 0, burst
        assert burst["queue"]["most_at_key_limit"]["a"] > 0, burst
        assert burst["order"][-1] == "a", burst
        assert [await routes.of_node(n) for n in NODES] == [set(), set()]
        assert api(third, "DELETE", f"/api-keys/{made['id']}", third.api_key)[0] == 204
    finally:
        third.stop()


def keys_across_gateways(c: Cluster, second: Gateway) -> None:
    """A key made through one gateway works through the other (an SDK create and command)
    until it is revoked there; then the first refuses it too."""
    status, made = api(c.gateway, "POST", "/api-keys", c.gateway.api_key, '{"name": "second"}')
    assert status == 201, made
    used = sdk(c, "create", "1", "0", gateway=second, key=made["key"])
    assert used["outputs"] == ["hello 0\n"]
    assert sdk(c, "kill", *used["ids"], gateway=second)["killed"] == [True]
    assert api(second, "DELETE", f"/api-keys/{made['id']}", second.api_key)[0] == 204
    status, refused = api(c.gateway, "GET", "/v2/sandboxes", made["key"])
    assert (status, refused) == (401, {"code": 401, "message": "Invalid API key"})
    assert api(second, "GET", "/v2/sandboxes", "e2b_" + "0" * 40)[0] == 401


def the_npm_sdk(c: Cluster) -> None:
    """The npm SDK through the gateway: create, command, files, pause, connect, kill."""
    assert sdk(c, script=NPM_SCRIPT, runner="node") == {
        "run": "js through the gateway\n",
        "read": "kept by js",
        "paused": True,
        "stateWhilePaused": "paused",
        "readAfterResume": "kept by js",
        "runAfterResume": "resumed\n",
        "killed": True,
        "gone": True,
    }


def aenv(c: Cluster, *args: str) -> Any:
    """An `aenv` command's JSON output, run where the gateway runs, with its settings."""
    code, out = c.gateway.run([sys.executable, "-m", "aenv.cli", *args, "--json"])
    assert code == 0, out
    return json.loads(out.strip().splitlines()[-1])


async def until(check: Any, what: str, timeout: float = 300) -> None:
    deadline = time.monotonic() + timeout
    while not await check():
        assert time.monotonic() < deadline, what
        await asyncio.sleep(0.5)


@dataclass
class RunningBuild:
    """A `Template.build` left running in the gateway's namespace, its output in `out`."""

    proc: subprocess.Popen[bytes]
    out: Path
    template_id: str


DOOMED = "lost-with-its-node"


async def a_build_running_on(
    c: Cluster, client: aioredis.Redis, node: str, elsewhere: str, scratch: Path
) -> RunningBuild:
    """`Template.build` through the gateway, placed on `node` (`elsewhere` drained meanwhile),
    running its hour-long step."""
    out = scratch / "doomed-build.out"
    drains = Drains(client)
    await drains.drain(elsewhere)
    proc = c.gateway.spawn([sys.executable, BUILDS, "doomed", DOOMED], out, sdk_env(c.gateway))
    try:
        try:
            created = re.compile(r"Template created with ID: ([^,]+),")

            async def placed() -> bool:
                return created.search(out.read_text()) is not None

            await until(placed, "the build was never placed")
        finally:
            await drains.undrain(elsewhere)
        found = created.search(out.read_text())
        assert found is not None
        assert await BuildPlaces(client).node_of(found[1]) == node

        async def stepping() -> bool:
            return "] RUN sleep 3600" in out.read_text()

        await until(stepping, "the build never ran its step")
    except BaseException:
        stop_group(proc, grace_s=5)
        raise
    return RunningBuild(proc, out, found[1])


async def a_build_lost_with_its_node(
    c: Cluster, client: aioredis.Redis, build: RunningBuild, lost: str
) -> None:
    """Its node was killed mid-build: the SDK's build ends with the error naming the node, and
    no sandbox starts from the half-built template. (A rebuild placed on another node is
    `test_gateway.py`'s: a real one here would cost a whole build and upload of CI time.)"""
    try:
        await asyncio.to_thread(build.proc.wait, 300)
    finally:
        stop_group(build.proc, grace_s=5)
    ended = json.loads(build.out.read_text().strip().splitlines()[-1])
    assert f"node {lost}, which ran this build, is gone" in ended.get("error", ""), ended
    saved = SavedRecords(client)
    assert await saved.find(DOOMED) is None and await saved.find(build.template_id) is None
    refused = sdk(c, "try-create", DOOMED, script=BUILDS)
    assert "error" in refused and "not found" in refused["error"].lower(), refused


async def sandboxes_move(
    c: Cluster, registry: NodeRegistry, routes: Routes, parked: Parked, scratch: Path
) -> None:
    kept = "kept across nodes"
    parked_one = sdk(c, "park", kept, script=MOVES)
    sandbox_id, snapshot_id = parked_one["id"], parked_one["snapshot"]
    first = await routes.lookup(sandbox_id)
    assert first in NODES
    other = next(n for n in NODES if n != first)

    drained = aenv(c, "node", "drain", first)
    assert drained == {"nodeID": first, "released": [{"sandboxID": sandbox_id, "error": None}]}
    assert await routes.lookup(sandbox_id) is None
    released = await parked.get(sandbox_id)
    assert released is not None and released.node_id == ""
    states = {n["nodeID"]: n["state"] for n in aenv(c, "nodes")}
    assert states == {first: "draining", other: "ready"}

    assert sdk(c, "resume", sandbox_id, script=MOVES) == {"file": kept, "echo": "moved\n"}
    assert await routes.lookup(sandbox_id) == other
    assert await parked.get(sandbox_id) is None
    await snapshots_travel(c, routes, SavedRecords(parked.client), snapshot_id, other, kept)
    running = sdk(c, "create", script=MOVES)["id"]
    assert await routes.lookup(running) == other  # not on the draining node

    # Paused on `other`, its checkpoint uploaded: published for any node to resume.
    assert sdk(c, "pause", sandbox_id, script=MOVES) == {"paused": True}

    async def published() -> bool:
        entry = await parked.get(sandbox_id)
        return entry is not None and entry.node_id == other

    await until(published, "the paused sandbox was never published")
    code, out = c.gateway.run([sys.executable, "-m", "aenv.cli", "node", "undrain", first])
    assert code == 0, out
    # `other` holds two of its three: one child fits there, the rest start on `first` from a
    # snapshot of the parent through the repository.
    children = sdk(c, "fork", running, "3", script=MOVES)["children"]
    assert [file for _, file in children] == ["forked state"] * 3, children
    homes = [await routes.lookup(child) for child, _ in children]
    assert sorted(str(h) for h in homes) == sorted([other, first, first]), homes
    assert sdk(c, "kill", *(child for child, _ in children))["killed"] == [True] * 3
    doomed = await a_build_running_on(c, parked.client, other, first, scratch)
    c.nodes[other].kill_9()

    async def lapsed() -> bool:
        return [n.node_id for n in await registry.live()] == [first]

    await until(lapsed, "the killed node's lease never lapsed")
    # Listed paused, as on one node, though its node is gone (the list moves it to `first`).
    assert sdk(c, "listed", script=MOVES)["listed"] == [[sandbox_id, "paused"]]
    assert sdk(c, "resume", sandbox_id, script=MOVES) == {"file": kept, "echo": "moved\n"}
    assert await routes.lookup(sandbox_id) == first
    assert sdk(c, "gone", running, script=MOVES)["gone"] is True
    await a_build_lost_with_its_node(c, parked.client, doomed, other)

    # Two gateways; one killed: the other serves the same sandbox and new ones.
    second = dataclasses.replace(
        c.gateway, log=c.gateway.log.with_name("gateway-2.log"), proc=None, port=GATEWAY_PORT + 1
    )
    second.start()
    try:
        second.wait_ready()
        keys_across_gateways(c, second)
        c.gateway.kill_9()
        assert sdk(c, "resume", sandbox_id, script=MOVES, gateway=second)["file"] == kept
        made = sdk(c, "create", "1", "0", gateway=second)
        assert made["outputs"] == ["hello 0\n"] and made["listed"] == made["ids"]
        gone = sdk(c, "kill", sandbox_id, *made["ids"], gateway=second)
        assert gone == {"killed": [True, True], "listed": []}
    finally:
        second.stop()


async def templates_travel(c: Cluster, scratch: Path, client: aioredis.Redis) -> None:
    """`Template.build` through the gateway runs on one node; with that node drained, a sandbox
    from the template starts on the other (which adopts it and pulls it from the repository)."""
    context = scratch / "build-context"
    (context / "app").mkdir(parents=True)
    (context / "app" / "hello.txt").write_text("copied through the gateway\n")
    built = sdk(c, "build", "cluster-built", str(context), script=BUILDS)
    builder = await BuildPlaces(client).node_of(built["templateID"])
    assert builder in NODES
    saved = SavedRecords(client)

    async def published() -> bool:
        record = await saved.find("cluster-built")
        return record is not None and record.build_id == built["buildID"]

    # Ready means stored in the repository; its node publishes it with its next heartbeat.
    await until(published, "the built template was never published", timeout=30)
    drains = Drains(client)
    await drains.drain(builder)
    try:
        made = sdk(c, "from-template", "cluster-built", script=BUILDS)
    finally:
        await drains.undrain(builder)

        # The node reads its drain at its heartbeat and refuses creates until then (a create
        # that must go there, as volumes_stay's do, would get its 503).
        async def undrained() -> bool:
            memory = DrainMemory(Paths(c.nodes[builder].home).cluster_drain)
            return not memory.state.draining

        await until(undrained, "the node never saw its undrain")
    assert made["files"] == "built by a cluster node\ncopied through the gateway\n"
    assert await Routes(client).lookup(made["id"]) not in (None, builder)
    assert sdk(c, "kill", made["id"])["killed"] == [True]


async def volumes_stay(c: Cluster, client: aioredis.Redis) -> None:
    """A volume created through one gateway, written by a sandbox, is read by a sandbox created
    through a second gateway: both on the volume's node. (Volume sandboxes cold-boot: two are
    kept; pause and resume change no route, and `test_gateway.py` covers the refusals.)"""
    second = dataclasses.replace(
        c.gateway, log=c.gateway.log.with_name("gateway-v.log"), proc=None, port=GATEWAY_PORT + 2
    )
    second.start()
    try:
        second.wait_ready()
        wrote = sdk(c, "write", "cluster-data", "kept-on-its-node", script=VOLUMES)
        assert wrote["read"] == "kept-on-its-node\n"
        place = await VolumePlaces(client).find("cluster-data", TEAM_ID)
        assert place is not None and place.volume_id == wrote["volume"]
        read = sdk(c, "read", "cluster-data", script=VOLUMES, gateway=second)
        assert read["read"] == "kept-on-its-node\n"
        routes = Routes(client)
        assert [await routes.lookup(s) for s in (wrote["id"], read["id"])] == [place.node_id] * 2
        gone = sdk(c, "destroy", place.volume_id, wrote["id"], read["id"], script=VOLUMES)
        assert gone == {"killed": [True, True], "destroyed": True}
        assert await VolumePlaces(client).find("cluster-data", TEAM_ID) is None
    finally:
        second.stop()


async def snapshots_travel(
    c: Cluster, routes: Routes, saved: SavedRecords, snapshot_id: str, other: str, kept: str
) -> None:
    """A snapshot made on the draining node: a sandbox from it (by name) starts on `other`."""

    async def stored() -> bool:
        return await saved.find(snapshot_id) is not None

    await until(stored, "the snapshot never reached the repository")
    child = sdk(c, "from-snapshot", "travels", script=MOVES)
    assert child["file"] == kept
    assert await routes.lookup(child["id"]) == other
    # Both nodes hold it now: listed once.
    assert sdk(c, "snapshots", script=MOVES)["ids"] == [snapshot_id]
    assert sdk(c, "delete-snapshot", snapshot_id, script=MOVES) == {"deleted": True}
    assert sdk(c, "snapshots", script=MOVES)["ids"] == []

    async def withdrawn() -> bool:
        # A heartbeat that read its node's snapshots before the delete may publish it again
        # once; the next one withdraws it.
        return await saved.find(snapshot_id) is None

    await until(withdrawn, "the deleted snapshot stayed published")
    assert sdk(c, "kill", child["id"])["killed"] == [True]


async def test_two_nodes_behind_a_gateway_with_the_sdk(redis: RedisServer) -> None:
    # The gateway's namespace has no route to the npm registry: installed from here.
    assert ensure_npm_sdk() is not None, "node and npm are needed for the npm SDK"
    scratch = Path(tempfile.mkdtemp(prefix="aenv-cluster-gw-"))
    for node_id in NODES:
        await prepare_images(Paths(scratch / node_id).cache, GUEST_CACHE, MIRROR)
    client = connect(redis.url)
    registry, routes = NodeRegistry(client, SECRET), Routes(client)
    settings = {
        "AENV_REDIS_URL": redis.unix_url,
        "AENV_CLUSTER_SECRET": SECRET.value,
        # Longer than a create: routes must appear through the orchestrator's hook, not a beat.
        "AENV_HEARTBEAT_INTERVAL": "3",
        # Small, so that a fork spills over to the other node.
        "AENV_MAX_SANDBOXES": "3",
        "AENV_LEASE_TTL": "15",
    }
    try:
        with cluster(scratch, NODES, settings, shared_repository=True) as c:
            deadline = time.monotonic() + 900
            while sorted(n.node_id for n in await registry.live()) != NODES:
                for node in c.nodes.values():
                    assert node.proc is not None and node.proc.poll() is None, node.log.read_text()
                assert time.monotonic() < deadline, "the nodes never registered"
                await asyncio.sleep(0.5)

            wrong = ClusterSecret("another-cluster-secret-0123456")
            c.gateway.start({"AENV_CLUSTER_SECRET": wrong.value}).wait(timeout=60)
            assert c.gateway.proc is not None and c.gateway.proc.returncode == 1
            assert "cluster secret differs" in c.gateway.log.read_text()

            c.gateway.start()
            c.gateway.wait_ready()
            made = sdk(c, "create", "2", "4")
            ids: list[str] = made["ids"]
            assert len(ids) == 2
            assert made["outputs"] == ["hello 0\n", "hello 1\n"]
            assert made["files"] == ["note 0", "note 1"]
            # Listed one per page: the gateway's token pages over both nodes' sandboxes.
            assert sorted(made["listed"]) == sorted(ids)
            placed = {sandbox_id: await routes.lookup(sandbox_id) for sandbox_id in ids}
            assert sorted(str(n) for n in placed.values()) == NODES, placed

            node_of = placed[ids[0]]
            assert node_of is not None
            refused = c.internal(node_of, "/internal/v2/sandboxes", None)
            assert refused.status_code == 401 and "cluster's token" in refused.json()["message"]
            wrong_token = c.internal(node_of, "/internal/v2/sandboxes", wrong.bearer)
            assert wrong_token.status_code == 401
            assert "wrong cluster token" in wrong_token.json()["message"]
            user_key = c.internal(node_of, "/internal/v2/sandboxes", c.gateway.api_key)
            assert user_key.status_code == 401
            allowed = c.internal(node_of, "/internal/v2/sandboxes", SECRET.bearer)
            assert allowed.status_code == 200, allowed.text

            gone = sdk(c, "kill", *ids)
            assert gone == {"killed": [True, True], "listed": []}
            assert [await routes.lookup(sandbox_id) for sandbox_id in ids] == [None, None]
            await a_burst_past_capacity(c, routes)
            await a_burst_that_waits(c, routes)
            the_npm_sdk(c)

            await templates_travel(c, scratch, client)
            await volumes_stay(c, client)
            await sandboxes_move(c, registry, routes, Parked(client, SECRET), scratch)
    finally:
        await client.aclose()
        shutil.rmtree(scratch, ignore_errors=True)
