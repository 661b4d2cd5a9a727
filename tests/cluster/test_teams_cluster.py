"""Teams across a cluster: two nodes on the doubles (`member_on_doubles.py`, each a process with
the real API, orchestrator, internal gate and heartbeats) and two gateways (`aenv gateway`),
on loopback with a real redis-server. Keys live in Redis with their team; whichever gateway a
team calls, another team's sandboxes, snapshots, webhooks and keys answer 404 and are left out
of its lists, and the public template is every team's. Plain HTTP and the official SDK."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import time
from collections.abc import AsyncIterator
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
import redis.asyncio as aioredis
from e2b import AsyncSandbox
from e2b.exceptions import NotFoundException

from aenv.cluster.directory import Directory
from aenv.cluster.keys import ClusterKeys
from aenv.cluster.registry import NodeRegistry
from aenv.cluster.saved import SavedRecord, SavedRecords
from aenv.cluster.store import Keys
from aenv.cluster.teams import ClusterTeams
from aenv.ids import TEAM_ID
from tests.cluster.shared import SECRET
from tests.support.ports import free_port
from tests.support.process_group import stop_group
from tests.support.redis_server import RedisServer
from tests.support.webhooks import QUIET_WEBHOOK

REPO = Path(__file__).resolve().parents[2]
MEMBER = Path(__file__).with_name("member_on_doubles.py")
NODES = ("n1", "n2")
BETA = "beta"
BETA_NAME = "the beta team"  # its name, which `GET /teams` answers, is not its id
# The gateways' limit of a team's sandboxes at once (the nodes keep their default).
TEAM_LIMIT = 4


@dataclass
class Cluster:
    gateways: tuple[str, str]
    key_a: str  # the default team's
    key_b: str  # team beta's
    home: Path  # the gateways' homes are its `g1` and `g2`


def _start(stack: ExitStack, command: list[str], env: dict[str, str], log: Path) -> Process:
    with log.open("wb") as out:
        proc = subprocess.Popen(
            [sys.executable, *command],
            env={**os.environ, **env, "PYTHONPATH": f"{REPO / 'src'}{os.pathsep}{REPO}"},
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    stack.callback(stop_group, proc, 20)
    return Process(proc, log)


@dataclass
class Process:
    proc: subprocess.Popen[bytes]
    log: Path

    def alive(self) -> None:
        exited = f"{self.proc.args!r} exited:\n{self.log.read_text()[-3000:]}"
        assert self.proc.poll() is None, exited


def _answers(url: str) -> bool:
    try:
        return httpx.get(f"{url}/health", timeout=2).status_code == 204
    except httpx.HTTPError:
        return False


@pytest.fixture
def gateway_settings() -> dict[str, str]:
    """Settings of the gateways beyond the team limit (none, unless a test gives its own)."""
    return {}


@pytest.fixture
async def cluster(
    tmp_path: Path,
    redis: RedisServer,
    client: aioredis.Redis,
    gateway_settings: dict[str, str],
) -> AsyncIterator[Cluster]:
    env = {"AENV_REDIS_URL": redis.url, "AENV_CLUSTER_SECRET": SECRET.value}
    keys = ClusterKeys(client)
    await ClusterTeams(client).create(BETA_NAME, BETA)
    _, key_a = await keys.new("a", TEAM_ID)
    _, key_b = await keys.new("b", BETA)
    with ExitStack() as stack:
        started = []
        for node in NODES:
            node_env = {
                **env,
                "AENV_HOME": str(tmp_path / node),
                "AENV_PORT": str(free_port()),
                "AENV_NODE_ID": node,
            }
            started.append(_start(stack, [str(MEMBER)], node_env, tmp_path / f"{node}.log"))
        urls = []
        for name in ("g1", "g2"):
            port = free_port()
            command = ["-m", "aenv.cli", "gateway", "--host", "127.0.0.1", "--port", str(port)]
            gateway_env = {
                **env,
                "AENV_HOME": str(tmp_path / name),
                "AENV_TEAM_MAX_SANDBOXES": str(TEAM_LIMIT),
                **gateway_settings,
            }
            started.append(_start(stack, command, gateway_env, tmp_path / f"{name}.log"))
            urls.append(f"http://127.0.0.1:{port}")
        registry = NodeRegistry(client, SECRET)
        deadline = time.monotonic() + 300  # far above a start under load; a crash fails at once
        while True:
            for process in started:
                process.alive()
            live = {n.node_id for n in await registry.live()}
            if live == set(NODES) and all(_answers(url) for url in urls):
                break
            assert time.monotonic() < deadline, "the nodes and gateways never all came up"
            await asyncio.sleep(0.2)
        yield Cluster((urls[0], urls[1]), key_a, key_b, tmp_path)


async def test_each_team_sees_its_own_through_either_gateway(cluster: Cluster) -> None:
    one, two = cluster.gateways
    async with (
        httpx.AsyncClient(base_url=one, headers={"X-API-Key": cluster.key_a}, timeout=60) as a,
        httpx.AsyncClient(base_url=two, headers={"X-API-Key": cluster.key_b}, timeout=60) as b,
    ):
        made = await a.post("/v2/sandboxes", json={"templateID": "base"})
        assert made.status_code == 201, made.text
        sandbox = made.json()["sandboxID"]
        hook = await a.post(
            "/events/webhooks",
            json=QUIET_WEBHOOK,
        )
        assert hook.status_code == 201, hook.text
        paused = (await a.post("/v2/sandboxes", json={"templateID": "base"})).json()["sandboxID"]
        assert (await a.post(f"/sandboxes/{paused}/pause")).status_code == 204
        snap_a = await a.post(f"/sandboxes/{sandbox}/snapshots", json={})
        assert snap_a.status_code == 201, snap_a.text
        snapshot_a = snap_a.json()["snapshotID"]
        volume = await a.post("/volumes", json={"name": "a-data"})
        assert volume.status_code == 201, volume.text
        vid = volume.json()["volumeID"]
        (key_a,) = (await a.get("/api-keys")).json()
        hook_path = f"/events/webhooks/{hook.json()['id']}"
        routes: list[tuple[str, str, dict[str, Any] | None]] = [
            ("GET", f"/sandboxes/{sandbox}", None),
            ("POST", f"/sandboxes/{sandbox}/timeout", {"timeout": 5}),
            ("POST", f"/sandboxes/{sandbox}/refreshes", {}),
            ("POST", f"/sandboxes/{sandbox}/connect", {"timeout": 60}),
            ("POST", f"/v2/sandboxes/{sandbox}/connect", {"timeout": 60}),
            ("GET", f"/sandboxes/{sandbox}/metrics", None),
            ("PUT", f"/sandboxes/{sandbox}/network", {"allowOut": ["1.1.1.1"]}),
            ("GET", f"/sandboxes/{sandbox}/logs", None),
            ("GET", f"/v2/sandboxes/{sandbox}/logs", None),
            ("POST", f"/sandboxes/{sandbox}/pause", {}),
            ("POST", f"/sandboxes/{paused}/resume", {}),
            ("POST", f"/sandboxes/{paused}/connect", {"timeout": 60}),
            ("POST", f"/sandboxes/{sandbox}/snapshots", {}),
            ("POST", f"/sandboxes/{sandbox}/fork", {}),
            ("POST", f"/aenv/sandboxes/{sandbox}/fork", {"children": [{}]}),
            ("POST", f"/aenv/sandboxes/{sandbox}/reset", {"snapshotID": snapshot_a}),
            ("GET", f"/events/sandboxes/{sandbox}", None),
            ("DELETE", f"/sandboxes/{sandbox}", None),
            ("GET", f"/templates/{snapshot_a}", None),
            ("PATCH", f"/templates/{snapshot_a}", {"public": True}),
            ("DELETE", f"/templates/{snapshot_a}", None),
            ("GET", f"/volumes/{vid}", None),
            ("DELETE", f"/volumes/{vid}", None),
            ("GET", hook_path, None),
            ("PATCH", hook_path, {"enabled": False}),
            ("DELETE", hook_path, None),
            ("GET", f"{hook_path}/deliveries", None),
            ("PATCH", f"/api-keys/{key_a['id']}", {"name": "taken"}),
            ("DELETE", f"/api-keys/{key_a['id']}", None),
        ]
        for method, path, body in routes:
            answer = await b.request(method, path, json=body)
            assert answer.status_code == 404, (method, path, answer.text)
        assert (await a.delete(f"/sandboxes/{paused}")).status_code == 204
        assert (await a.delete(f"/templates/{snapshot_a}")).status_code == 204
        assert (await a.delete(f"/volumes/{vid}")).status_code == 204
        assert (await b.get("/v2/sandboxes")).json() == []
        assert (await b.get("/sandboxes")).json() == []
        assert (await b.get("/events/webhooks")).json() == []
        events = (await b.get("/events/sandboxes", params={"limit": 100})).json()
        assert sandbox not in {e["sandboxId"] for e in events}
        assert [k["name"] for k in (await b.get("/api-keys")).json()] == ["b"]
        (team,) = (await b.get("/teams")).json()
        assert team == {
            "teamID": BETA,
            "name": BETA_NAME,
            "apiKey": cluster.key_b,
            "isDefault": True,
        }

        # B's own, and its snapshot, through the other gateway: A sees none of it.
        mine = await b.post("/v2/sandboxes", json={"templateID": "base"})
        assert mine.status_code == 201, mine.text
        theirs = mine.json()["sandboxID"]
        snap = await b.post(f"/sandboxes/{theirs}/snapshots", json={"name": "snap"})
        assert snap.status_code == 201, snap.text
        snapshot = snap.json()["snapshotID"]
        assert [s["sandboxID"] for s in (await a.get("/v2/sandboxes")).json()] == [sandbox]
        assert (await a.get("/snapshots")).json() == []
        assert (await a.get(f"/templates/{snapshot}")).status_code == 404
        assert (await a.delete(f"/templates/{snapshot}")).status_code == 404
        from_theirs = await a.post("/v2/sandboxes", json={"templateID": snapshot})
        assert from_theirs.status_code == 404, from_theirs.text
        assert [s["snapshotID"] for s in (await b.get("/snapshots")).json()] == [snapshot]
        # The node's template is everyone's; a team's snapshot is not a template of the other.
        names = {n for t in (await a.get("/templates")).json() for n in t["names"]}
        assert "base" in names and "snap" not in names
        assert "base" in {n for t in (await b.get("/templates")).json() for n in t["names"]}

        # The SDK through the other gateway, with B's key, finds none of A's.
        opts: dict[str, Any] = {"api_key": cluster.key_b, "api_url": one, "sandbox_url": one}
        with pytest.raises(NotFoundException):
            await AsyncSandbox.connect(sandbox, **opts)
        listed = await AsyncSandbox.list(**opts).next_items()
        assert [s.sandbox_id for s in listed] == [theirs]

        # Each kills its own; A's sandbox was there all along.
        assert (await a.delete(f"/sandboxes/{sandbox}")).status_code == 204
        assert (await b.delete(f"/sandboxes/{theirs}")).status_code == 204
        assert (await b.delete(f"/templates/{snapshot}")).status_code == 204


def _cli(cluster: Cluster, *args: str) -> str:
    """`aenv ARGS` as the first gateway's operator: its home, its URL."""
    done = subprocess.run(
        [sys.executable, "-m", "aenv.cli", *args, "--home", str(cluster.home / "g1")],
        env={**os.environ, "E2B_API_URL": cluster.gateways[0], "PYTHONPATH": str(REPO / "src")},
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    return done.stdout.strip()


async def test_the_operator_manages_teams_through_either_gateway(cluster: Cluster) -> None:
    one, two = cluster.gateways
    token = (cluster.home / "g1" / "admin-token").read_text().strip()
    assert token == SECRET.admin_token
    assert (cluster.home / "g2" / "admin-token").stat().st_mode & 0o077 == 0
    admin = {"X-Admin-Token": token}
    async with (
        httpx.AsyncClient(base_url=one, headers=admin, timeout=60) as op_one,
        httpx.AsyncClient(base_url=two, headers=admin, timeout=60) as op_two,
        httpx.AsyncClient(base_url=one, timeout=60) as anonymous,
    ):
        # Neither no token, a wrong one nor an API key opens the routes.
        for headers in (
            {},
            {"X-Admin-Token": "aenv_admin_" + "0" * 64},
            {"X-API-Key": cluster.key_a},
        ):
            for method, path in [
                ("GET", "/aenv/admin/teams"),
                ("GET", "/admin/sandboxes/running-counts"),
                ("POST", f"/admin/teams/{BETA}/sandboxes/kill"),
                ("POST", f"/admin/teams/{BETA}/api-keys"),
            ]:
                answer = await anonymous.request(method, path, headers=headers, json={"name": "x"})
                assert answer.status_code == 401, (headers, path, answer.text)

        # A team made with the CLI, its key made through the other gateway's admin route.
        gamma = _cli(cluster, "teams", "create", "gamma")
        listed = (await op_two.get("/aenv/admin/teams")).json()
        assert [(t["teamID"], t["name"]) for t in listed] == [
            (TEAM_ID, TEAM_ID),
            (BETA, BETA_NAME),
            (gamma, "gamma"),
        ]
        assert (await op_two.post("/aenv/admin/teams", json={"name": "gamma"})).status_code == 409
        made = await op_two.post(f"/admin/teams/{gamma}/api-keys", json={"name": "g"})
        assert made.status_code == 201, made.text
        key_g, key_g_id = made.json()["key"], made.json()["id"]
        cli_key = _cli(cluster, "keys", "create", "g2", "--team", "gamma")
        assert (
            await op_one.post("/admin/teams/nope/api-keys", json={"name": "g"})
        ).status_code == 404

        # Gamma's sandboxes through both gateways, with either key; counted across nodes.
        sandboxes = []
        for url, key in ((one, key_g), (two, cli_key), (one, key_g)):
            async with httpx.AsyncClient(base_url=url, headers={"X-API-Key": key}, timeout=60) as g:
                answer = await g.post("/v2/sandboxes", json={"templateID": "base"})
                assert answer.status_code == 201, answer.text
                sandboxes.append(answer.json()["sandboxID"])
                (team,) = (await g.get("/teams")).json()
                assert (team["teamID"], team["name"]) == (gamma, "gamma")
        async with httpx.AsyncClient(base_url=one, headers={"X-API-Key": cluster.key_b}) as b:
            mine = await b.post("/v2/sandboxes", json={"templateID": "base"})
            assert mine.status_code == 201, mine.text
        counts = (await op_one.get("/admin/sandboxes/running-counts")).json()
        assert counts == {gamma: 3, BETA: 1}
        async with httpx.AsyncClient(base_url=two, headers={"X-API-Key": key_g}) as g:
            on_nodes = {s["sandboxID"] for s in (await g.get("/v2/sandboxes")).json()}
        assert on_nodes == set(sandboxes)

        # A team with sandboxes or a volume stays, saying what it owns; killed on every node and
        # its volume deleted, it goes with its keys.
        async with httpx.AsyncClient(base_url=two, headers={"X-API-Key": cli_key}) as g:
            volume = await g.post("/volumes", json={"name": "data"})
            assert volume.status_code == 201, volume.text
        refused = await op_one.delete(f"/aenv/admin/teams/{gamma}")
        assert refused.status_code == 409, refused.text
        assert "still owns 3 sandboxes, 1 volumes" in refused.json()["message"]
        held = (await op_two.get(f"/aenv/admin/teams/{gamma}/holdings")).json()
        assert sorted(held["sandboxes"]) == sorted(sandboxes)
        assert held["volumes"] == [volume.json()["volumeID"]]
        assert (await op_one.delete(f"/aenv/admin/teams/{TEAM_ID}")).status_code == 409
        killed = await op_two.post(f"/admin/teams/{gamma}/sandboxes/kill")
        assert killed.json() == {"killedCount": 3, "failedCount": 0}, killed.text
        cancelled = await op_one.post(f"/admin/teams/{gamma}/builds/cancel")
        assert cancelled.json() == {"cancelledCount": 0, "failedCount": 0}, cancelled.text
        counts = (await op_two.get("/admin/sandboxes/running-counts")).json()
        assert counts == {BETA: 1}
        refused = await op_two.delete(f"/aenv/admin/teams/{gamma}")
        assert "still owns 1 volumes: remove them first" in refused.json()["message"]
        async with httpx.AsyncClient(base_url=one, headers={"X-API-Key": cli_key}) as g:
            assert (await g.delete("/volumes/data")).status_code == 204
        gone = await op_one.delete(f"/admin/teams/{gamma}/api-keys/{key_g_id}")
        assert gone.status_code == 204, gone.text
        assert (
            await anonymous.get("/v2/sandboxes", headers={"X-API-Key": key_g})
        ).status_code == 401
        assert (
            await anonymous.get("/v2/sandboxes", headers={"X-API-Key": cli_key})
        ).status_code == 200
        assert (await op_one.delete(f"/aenv/admin/teams/{gamma}")).status_code == 204
        assert (
            await anonymous.get("/v2/sandboxes", headers={"X-API-Key": cli_key})
        ).status_code == 401
        assert gamma not in {t["teamID"] for t in (await op_two.get("/aenv/admin/teams")).json()}
        assert (await op_two.post(f"/admin/teams/{BETA}/sandboxes/kill")).json()["killedCount"] == 1


async def test_a_teams_metrics_are_summed_over_the_nodes(
    cluster: Cluster, client: aioredis.Redis
) -> None:
    one, two = cluster.gateways
    async with (
        httpx.AsyncClient(base_url=one, headers={"X-API-Key": cluster.key_b}, timeout=60) as b,
        httpx.AsyncClient(base_url=two, headers={"X-API-Key": cluster.key_a}, timeout=60) as a,
    ):
        made = []
        for _ in range(4):
            answer = await b.post("/v2/sandboxes", json={"templateID": "base"})
            assert answer.status_code == 201, answer.text
            made.append(answer.json()["sandboxID"])
        routes = Directory(client, SECRET).routes
        assert {await routes.lookup(s) for s in made} == set(NODES)  # both nodes' points count
        assert (await b.delete(f"/sandboxes/{made[0]}")).status_code == 204
        end = int(time.time()) + 1
        span = {"start": end - 600, "end": end}  # 5 s steps
        points = (await a.get(f"/teams/{TEAM_ID}/metrics", params=span)).json()
        assert points[-1]["concurrentSandboxes"] == 0  # A's team ran none
        assert (await a.get(f"/teams/{BETA}/metrics", params=span)).status_code == 404
        points = (await b.get(f"/teams/{BETA}/metrics", params=span)).json()
        assert len(points) == 121 and points[-1]["timestampUnix"] == end
        assert points[-1]["concurrentSandboxes"] == 3
        assert round(sum(p["sandboxStartRate"] for p in points) * 5) == 4
        peak = await b.get(
            f"/teams/{BETA}/metrics/max", params={**span, "metric": "concurrent_sandboxes"}
        )
        assert peak.json()["value"] == 4, peak.text
        rate = await b.get(
            f"/teams/{BETA}/metrics/max", params={**span, "metric": "sandbox_start_rate"}
        )
        assert rate.json()["value"] == max(p["sandboxStartRate"] for p in points)
        too_long = await b.get(f"/teams/{BETA}/metrics", params={"start": 0, "end": end})
        assert too_long.status_code == 400, too_long.text
        for sandbox in made[1:]:
            assert (await b.delete(f"/sandboxes/{sandbox}")).status_code == 204


async def test_a_teams_limit_holds_across_keys_gateways_and_nodes(
    cluster: Cluster, client: aioredis.Redis
) -> None:
    one, two = cluster.gateways
    _, other_b = await ClusterKeys(client).new("b2", BETA)
    made: list[str] = []
    async with (
        httpx.AsyncClient(base_url=one, headers={"X-API-Key": cluster.key_b}, timeout=60) as b1,
        httpx.AsyncClient(base_url=two, headers={"X-API-Key": other_b}, timeout=60) as b2,
        httpx.AsyncClient(base_url=two, headers={"X-API-Key": cluster.key_a}, timeout=60) as a,
    ):
        for b in (b1, b2, b1, b2):
            answer = await b.post("/v2/sandboxes", json={"templateID": "base"})
            assert answer.status_code == 201, answer.text
            made.append(answer.json()["sandboxID"])
        routes = Directory(client, SECRET).routes
        assert {await routes.lookup(s) for s in made} == set(NODES)
        # The team's fifth is refused whichever key and gateway ask; no node ran it.
        for b in (b1, b2):
            refused = await b.post("/v2/sandboxes", json={"templateID": "base"})
            assert refused.status_code == 429, refused.text
            assert f"({TEAM_LIMIT}): this team holds {TEAM_LIMIT}" in refused.json()["message"]
        assert len((await b1.get("/v2/sandboxes")).json()) == TEAM_LIMIT
        # Another team is not held by it.
        theirs = await a.post("/v2/sandboxes", json={"templateID": "base"})
        assert theirs.status_code == 201, theirs.text
        assert (await a.delete(f"/sandboxes/{theirs.json()['sandboxID']}")).status_code == 204
        # A kill through one gateway frees the slot for the other.
        assert (await b1.delete(f"/sandboxes/{made.pop()}")).status_code == 204
        again = await b2.post("/v2/sandboxes", json={"templateID": "base"})
        assert again.status_code == 201, again.text
        made.append(again.json()["sandboxID"])
        for sandbox in made:
            assert (await b1.delete(f"/sandboxes/{sandbox}")).status_code == 204


async def test_volume_names_are_each_teams_own(cluster: Cluster) -> None:
    one, two = cluster.gateways
    async with (
        httpx.AsyncClient(base_url=one, headers={"X-API-Key": cluster.key_a}, timeout=60) as a,
        httpx.AsyncClient(base_url=two, headers={"X-API-Key": cluster.key_b}, timeout=60) as b,
    ):
        mine = await a.post("/volumes", json={"name": "data"})
        assert mine.status_code == 201, mine.text
        # The same name in another team is not taken, and says nothing of A's.
        theirs = await b.post("/volumes", json={"name": "data"})
        assert theirs.status_code == 201, theirs.text
        taken = await b.post("/volumes", json={"name": "data"})
        assert taken.status_code == 400, taken.text
        ids = {"a": mine.json()["volumeID"], "b": theirs.json()["volumeID"]}
        assert [v["volumeID"] for v in (await a.get("/volumes")).json()] == [ids["a"]]
        assert [v["volumeID"] for v in (await b.get("/volumes")).json()] == [ids["b"]]
        assert (await a.get("/volumes/data")).json()["volumeID"] == ids["a"]
        assert (await b.get("/volumes/data")).json()["volumeID"] == ids["b"]
        assert (await b.get(f"/volumes/{ids['a']}")).status_code == 404
        assert (await a.delete(f"/volumes/{ids['b']}")).status_code == 404
        # A create mounting `data` mounts the caller's own.
        mount = {"templateID": "base", "volumeMounts": [{"name": "data", "path": "/mnt"}]}
        made = await b.post("/v2/sandboxes", json=mount)
        assert made.status_code == 201, made.text
        sandbox = made.json()["sandboxID"]
        info = (await b.get(f"/sandboxes/{sandbox}")).json()
        assert info["volumeMounts"] == [{"name": "data", "path": "/mnt"}]
        assert (await b.delete(f"/sandboxes/{sandbox}")).status_code == 204
        # Each deletes its own by name; the other's stays.
        assert (await b.delete("/volumes/data")).status_code == 204
        assert (await a.get("/volumes/data")).json()["volumeID"] == ids["a"]
        assert (await b.get("/volumes/data")).status_code == 404
        assert (await a.delete("/volumes/data")).status_code == 204


async def test_snapshot_names_are_each_teams_own(cluster: Cluster) -> None:
    one, two = cluster.gateways
    async with (
        httpx.AsyncClient(base_url=one, headers={"X-API-Key": cluster.key_a}, timeout=60) as a,
        httpx.AsyncClient(base_url=two, headers={"X-API-Key": cluster.key_b}, timeout=60) as b,
    ):
        snapshots, sandboxes = {}, []
        for team, http in (("a", a), ("b", b)):
            made = await http.post("/v2/sandboxes", json={"templateID": "base"})
            assert made.status_code == 201, made.text
            sandboxes.append((http, made.json()["sandboxID"]))
            snap = await http.post(
                f"/sandboxes/{sandboxes[-1][1]}/snapshots", json={"name": "snap"}
            )
            assert snap.status_code == 201, snap.text
            snapshots[team] = snap.json()["snapshotID"]
        assert snapshots["a"] != snapshots["b"]
        # Each team's `snap` is its own, by name, whichever node holds it.
        for team, http in (("a", a), ("b", b)):
            listed = (await http.get("/snapshots")).json()
            assert [s["snapshotID"] for s in listed] == [snapshots[team]]
            assert (await http.get("/templates/snap")).json()["templateID"] == snapshots[team]
        for http, sandbox in sandboxes:
            assert (await http.delete(f"/sandboxes/{sandbox}")).status_code == 204
        # B withdraws its own; A's stays found by its name.
        assert (await b.delete("/templates/snap")).status_code == 204
        assert (await a.get("/templates/snap")).json()["templateID"] == snapshots["a"]
        assert (await b.get("/templates/snap")).status_code == 404
        assert (await a.delete("/templates/snap")).status_code == 204


async def test_published_names_are_found_by_their_own_team(client: aioredis.Redis) -> None:
    """What the gateways find a published snapshot by (these nodes publish none: they have no
    repository), in the real Redis."""
    saved = SavedRecords(client)

    def record(template_id: str, team: str) -> SavedRecord:
        raw = {"template_id": template_id, "aliases": ["snap"], "team_id": team}
        return SavedRecord.of(json.dumps(raw))

    await saved.publish(record("t-a", TEAM_ID))
    await saved.publish(record("t-b", BETA))
    # The default team's stays where a gateway from before teams reads it.
    assert await client.hget(Keys().saved_names, "snap") == "t-a"
    for team, wanted in ((TEAM_ID, "t-a"), (BETA, "t-b"), ("gamma", "t-a")):
        found = await saved.find("snap:latest", team)
        assert found is not None and found.template_id == wanted, team
    await saved.withdraw("t-a", ("snap",), TEAM_ID)
    found = await saved.find("snap", BETA)
    assert found is not None and found.template_id == "t-b"
    assert await saved.find("snap", TEAM_ID) is None
    await saved.withdraw("t-b", ("snap",), BETA)
    assert await client.hlen(Keys().saved_names) == 0


@pytest.mark.parametrize("gateway_settings", [{"AENV_TEAM_MAX_DISK_MB": "5000"}])
async def test_a_teams_disk_holds_across_nodes(cluster: Cluster) -> None:
    """Each node writes its teams' disk as a sandbox starts there; the gateways refuse the
    create that would take the team past its disk on all nodes (each node's own limit is far
    above it), whichever gateway asks."""
    one, two = cluster.gateways
    made = []
    async with (
        httpx.AsyncClient(base_url=one, headers={"X-API-Key": cluster.key_b}, timeout=60) as b1,
        httpx.AsyncClient(base_url=two, headers={"X-API-Key": cluster.key_b}, timeout=60) as b2,
        httpx.AsyncClient(base_url=two, headers={"X-API-Key": cluster.key_a}, timeout=60) as a,
    ):
        for b in (b1, b2):  # the doubles' base template: 2048 MiB of disk each
            answer = await b.post("/v2/sandboxes", json={"templateID": "base"})
            assert answer.status_code == 201, answer.text
            made.append(answer.json()["sandboxID"])
        for b in (b1, b2):
            refused = await b.post("/v2/sandboxes", json={"templateID": "base"})
            assert refused.status_code == 429, refused.text
            message = refused.json()["message"]
            assert "hold 4096 MiB of disk across the cluster" in message, message
        # Another team's disk is its own.
        theirs = await a.post("/v2/sandboxes", json={"templateID": "base"})
        assert theirs.status_code == 201, theirs.text
        assert (await a.delete(f"/sandboxes/{theirs.json()['sandboxID']}")).status_code == 204
        # A kill frees its disk for the next create, through the other gateway.
        assert (await b1.delete(f"/sandboxes/{made.pop()}")).status_code == 204
        again = await b2.post("/v2/sandboxes", json={"templateID": "base"})
        assert again.status_code == 201, again.text
        made.append(again.json()["sandboxID"])
        for sandbox in made:
            assert (await b1.delete(f"/sandboxes/{sandbox}")).status_code == 204
