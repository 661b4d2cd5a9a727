"""The cluster's API keys in a real redis-server: stored as digests only, checked, renamed and
revoked as on a node; each gateway's copy gives a wiped Redis its keys back; and through two
real gateways (over one node double, `node_double`), a key made through one works through the
other, and revoked through that one stops working on the first. The same through real nodes
and the SDK is in `test_gateway_cluster.py`."""

from __future__ import annotations

import dataclasses
import json
import os
import secrets
import stat
import subprocess
import sys
from collections.abc import AsyncIterator
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path
from unittest.mock import ANY

import httpx
import pytest
import redis.asyncio as aioredis

from aenv.api.keys import KeyStore, LastKey
from aenv.cluster.keys import ClusterKeys, sync_keys
from aenv.cluster.registry import Capacity, NodeRegistry, NodeReport
from aenv.cluster.store import connect
from aenv.config import Paths
from aenv.orchestrator.catalog import Catalog
from tests.cluster.node_double import NodeDouble
from tests.cluster.shared import SECRET, gateway_over
from tests.proxy.support import serve
from tests.support.ports import free_port
from tests.support.redis_server import RedisServer


async def _stored(client: aioredis.Redis) -> str:
    """Every key and value in Redis, as one string."""
    dump = []
    async for name in client.scan_iter():
        kind = await client.type(name)
        dump.append(name)
        if kind == "hash":
            dump.append(str(await client.hgetall(name)))
        elif kind == "string":
            dump.append(str(await client.get(name)))
    return "\n".join(dump)


async def test_keys_are_digests_checked_renamed_and_revoked(client: aioredis.Redis) -> None:
    keys = ClusterKeys(client)
    first, first_value = await keys.new("first")
    second, second_value = await keys.new("second")
    stored = await _stored(client)
    assert first.digest in stored
    assert first_value not in stored and second_value not in stored
    found = await keys.find(f" {first_value}\n")  # as a header may carry it
    assert found is not None and found.id == first.id and found.last_used is not None
    assert await keys.find(first_value[:-1] + "x") is None
    assert await keys.find("") is None and await keys.find(None) is None
    assert (await keys.rename(second.id, "renamed")).name == "renamed"
    listed = await keys.keys()
    assert [(k.id, k.name) for k in listed] == [(first.id, "first"), (second.id, "renamed")]
    assert listed[0].last_used is not None and listed[1].last_used is None
    await keys.revoke(first.id)
    assert await keys.find(first_value) is None
    with pytest.raises(KeyError):
        await keys.revoke(first.id)
    with pytest.raises(KeyError):
        await keys.rename(first.id, "back")
    with pytest.raises(LastKey):
        await keys.revoke(second.id)
    assert await keys.find(second_value) is not None


async def test_a_gateways_copy_makes_the_first_key_and_restores_a_wiped_redis(
    tmp_path: Path, client: aioredis.Redis
) -> None:
    keys = ClusterKeys(client)
    first, second = Paths(tmp_path / "first"), Paths(tmp_path / "second")
    first.home.mkdir()
    second.home.mkdir()
    assert await sync_keys(keys, first)  # an empty cluster: a key generated
    value = first.api_key.read_text().strip()
    assert stat.S_IMODE(first.api_key.stat().st_mode) == 0o600
    assert not await sync_keys(keys, second)  # the cluster has one: none made, none written
    assert not second.api_key.exists()
    made, made_value = await keys.new("made later")
    assert not await sync_keys(keys, second)
    assert value not in second.api_keys.read_text()  # digests only in the copy too

    await client.flushall()
    assert await keys.find(value) is None
    assert not await sync_keys(keys, second)  # the copy goes back, no new key
    assert [k.id for k in await keys.keys()] == [k.id for k in KeyStore(second.api_keys).list()]
    assert await keys.find(value) is not None and await keys.find(made_value) is not None
    assert made.id in {k.id for k in await keys.keys()}


@dataclass
class Pair:
    urls: list[str]
    key: str  # a key of the cluster, made before the gateways started


@pytest.fixture
async def pair(tmp_path: Path, redis: RedisServer, client: aioredis.Redis) -> AsyncIterator[Pair]:
    node = NodeDouble("a", tmp_path / "a", Catalog(tmp_path / "a.db"))
    node_keys = KeyStore(tmp_path / "node-keys.json")
    node_keys.create("node")
    _, value = await ClusterKeys(client).new("operator")
    with ExitStack() as stack:
        port = free_port()
        stack.enter_context(serve(node.app(node_keys), port))
        capacity = Capacity(cpus=2, memory_mb=1024, memory_free_mb=512, running=0, paused=0)
        report = NodeReport("a", f"127.0.0.1:{port}", capacity, [])
        await NodeRegistry(client, SECRET).heartbeat(secrets.token_hex(8), report, ttl=60)
        urls = []
        for _ in range(2):
            # Each gateway its own client: each serves on a loop of its own.
            own = connect(redis.url, timeout=0.5)
            gateway = gateway_over(own, rate=50)
            urls.append(stack.enter_context(serve(gateway, free_port())))
        yield Pair(urls, value)
    node.catalog.close()


def _http(url: str, key: str) -> httpx.Client:
    return httpx.Client(base_url=url, headers={"X-API-Key": key}, timeout=30)


def test_a_key_made_through_one_gateway_works_through_another_until_revoked(pair: Pair) -> None:
    one, other = pair.urls
    with _http(one, pair.key) as http:
        made = http.post("/api-keys", json={"name": "agents"})
        assert made.status_code == 201, made.text
        body = made.json()
        assert body["name"] == "agents" and body["mask"]["prefix"] == "e2b_"
        assert body["key"].endswith(body["mask"]["maskedValueSuffix"])
        refused = http.post("/api-keys", json={"name": "x", "team": "t"})
        assert refused.status_code == 400 and "team" in refused.json()["message"]
    new_key, key_id = body["key"], body["id"]
    with _http(other, new_key) as http:
        created = http.post("/sandboxes", json={"templateID": "base"})
        assert created.status_code == 201, created.text
        assert http.patch(f"/api-keys/{key_id}", json={"name": "renamed"}).status_code == 200
        names = {k["id"]: k["name"] for k in http.get("/api-keys").json()}
        assert names[key_id] == "renamed" and len(names) == 2
    with _http(other, pair.key) as http:
        assert http.delete(f"/api-keys/{key_id}").status_code == 204
        assert http.delete(f"/api-keys/{key_id}").status_code == 404
    with _http(one, new_key) as http:
        revoked = http.get("/v2/sandboxes")
    assert revoked.status_code == 401
    assert revoked.json() == {"code": 401, "message": "Invalid API key"}
    with _http(one, pair.key) as http:
        assert http.get("/v2/sandboxes").status_code == 200
        (only,) = http.get("/api-keys").json()
        last = http.delete(f"/api-keys/{only['id']}")
    assert last.status_code == 400 and "last API key" in last.json()["message"]
    with _http(other, "e2b_" + "0" * 40) as http:
        wrong = http.get("/api-keys")
    assert wrong.status_code == 401


def test_redis_down_makes_a_key_check_a_503(pair: Pair, redis: RedisServer) -> None:
    redis.stop()
    with _http(pair.urls[0], pair.key) as http:
        down = http.get("/api-keys")
    assert down.status_code == 503 and down.json()["code"] == 503
    assert "unavailable" in down.json()["message"]


async def test_a_mounted_key_file_is_the_clusters_first_key(
    tmp_path: Path, client: aioredis.Redis
) -> None:
    """As the Kubernetes manifests run gateways: each with the same key file from a Secret."""
    keys = ClusterKeys(client)
    value = "e2b_" + "5" * 40
    homes = [Paths(tmp_path / name) for name in ("one", "two")]
    for home in homes:
        home.home.mkdir()
        home.api_key.write_text(value + "\n")
    assert not await sync_keys(keys, homes[0])  # no key made: the file's is the first
    assert not await sync_keys(keys, homes[1])
    (only,) = await keys.keys()
    assert await keys.find(value) == dataclasses.replace(only, last_used=ANY)
    await client.flushall()
    assert not await sync_keys(keys, homes[1])  # its copy and its file: one key, the same
    assert [k.id for k in await keys.keys()] == [only.id]


def test_aenv_keys_through_one_gateway_manages_every_gateways_keys(
    pair: Pair, tmp_path: Path
) -> None:
    def aenv_keys(url: str, *args: str) -> str:
        env = {**os.environ, "E2B_API_URL": url, "E2B_API_KEY": pair.key}
        done = subprocess.run(
            [sys.executable, "-m", "aenv.cli", "keys", *args, "--home", str(tmp_path / "cli")],
            env=env, capture_output=True, text=True, timeout=60, check=False,
        )  # fmt: skip
        assert done.returncode == 0, done.stdout + done.stderr
        return done.stdout

    one, other = pair.urls
    made = json.loads(aenv_keys(one, "create", "from-cli", "--json"))
    listed = json.loads(aenv_keys(other, "list", "--json"))
    assert {k["id"]: k["name"] for k in listed}[made["id"]] == "from-cli"
    with _http(other, made["key"]) as http:
        assert http.get("/v2/sandboxes").status_code == 200
