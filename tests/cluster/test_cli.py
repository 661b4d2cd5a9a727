"""`aenv node` as a user runs it: configuration problems are one clear line and exit code 2,
before anything starts (starting a full node boots VMs, which the membership tests cover on
doubles). `aenv nodes` and `aenv node drain/undrain` against a real redis-server."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import redis.asyncio as aioredis

from aenv.cluster.drain import Drains
from aenv.cluster.registry import Capacity, NodeRegistry, NodeReport
from tests.cluster.shared import SECRET
from tests.support.redis_server import RedisServer


def aenv_node(home: Path, *args: str, **env: str) -> subprocess.CompletedProcess[str]:
    environment = {k: v for k, v in os.environ.items() if not k.startswith("AENV_")}
    environment |= {"AENV_HOME": str(home), **env}
    command = [sys.executable, "-m", "aenv.cli", "node", *args]
    return subprocess.run(command, capture_output=True, text=True, timeout=60, env=environment)


@pytest.mark.parametrize(
    ("args", "env", "message"),
    [
        ((), {"AENV_CLUSTER_SECRET": SECRET.value}, "redis_url (AENV_REDIS_URL) is required"),
        (("--redis-url", "redis://127.0.0.1:1"), {}, "cluster_secret (AENV_CLUSTER_SECRET)"),
        (
            ("--redis-url", "redis://127.0.0.1:1"),
            {"AENV_CLUSTER_SECRET": "short"},
            "cluster_secret: the cluster secret must be at least 16 characters",
        ),
        (
            ("--redis-url", "redis://127.0.0.1:1"),
            {"AENV_CLUSTER_SECRET": SECRET.value, "AENV_LEASE_TTL": "1"},
            "heartbeat_interval must be above 0 and below lease_ttl",
        ),
    ],
)
def test_configuration_errors_are_one_clear_line(
    tmp_path: Path, args: tuple[str, ...], env: dict[str, str], message: str
) -> None:
    result = aenv_node(tmp_path, *args, **env)
    assert result.returncode == 2, result.stderr
    assert message in result.stderr
    assert "Traceback" not in result.stderr
    # Nothing started: the data directory was not even created.
    assert not any(tmp_path.iterdir())


def aenv(
    home: Path, redis_url: str, *args: str, secret: str = SECRET.value
) -> subprocess.CompletedProcess[str]:
    environment = {k: v for k, v in os.environ.items() if not k.startswith("AENV_")}
    environment |= {
        "AENV_HOME": str(home),
        "AENV_REDIS_URL": redis_url,
        "AENV_CLUSTER_SECRET": secret,
    }
    command = [sys.executable, "-m", "aenv.cli", *args]
    return subprocess.run(command, capture_output=True, text=True, timeout=60, env=environment)


async def test_nodes_lists_state_capacity_and_load_and_drains(
    tmp_path: Path, redis: RedisServer, client: aioredis.Redis
) -> None:
    registry = NodeRegistry(client, SECRET)
    for name, running in (("n1", 3), ("n2", 0)):
        capacity = Capacity(cpus=4, memory_mb=8192, memory_free_mb=4096, running=running, paused=1)
        await registry.heartbeat(name, NodeReport(name, f"10.0.0.{running}:3000", capacity), 60)
    # A node with nothing routed to it drains at once; one not live is refused, but marked.
    drained = aenv(tmp_path, redis.url, "node", "drain", "n2", "--json")
    assert drained.returncode == 0, drained.stderr
    assert json.loads(drained.stdout) == {"nodeID": "n2", "released": []}
    missing = aenv(tmp_path, redis.url, "node", "drain", "n9")
    assert missing.returncode == 1 and "node n9 is not live" in missing.stderr
    listed = aenv(tmp_path, redis.url, "nodes", "--json")
    assert listed.returncode == 0, listed.stderr
    # Load: running per CPU plus the share of memory in use (3/4 + 0.5, 0 + 0.5).
    shown = [(n["nodeID"], n["state"], n["running"], n["load"]) for n in json.loads(listed.stdout)]
    assert shown == [("n1", "ready", 3, 1.25), ("n2", "draining", 0, 0.5)]
    assert aenv(tmp_path, redis.url, "node", "undrain", "n2").returncode == 0
    assert await Drains(client).draining() == {"n9"}


def test_nodes_without_redis_is_one_clear_line(tmp_path: Path) -> None:
    down = aenv(tmp_path, "redis://127.0.0.1:1", "nodes")
    assert down.returncode == 1 and "unavailable while checking the cluster secret" in down.stderr
    assert "Traceback" not in down.stderr


async def test_a_wrong_cluster_secret_changes_nothing(
    tmp_path: Path, redis: RedisServer, client: aioredis.Redis
) -> None:
    registry = NodeRegistry(client, SECRET)
    capacity = Capacity(cpus=4, memory_mb=8192, memory_free_mb=4096, running=0, paused=0)
    await registry.heartbeat("n1", NodeReport("n1", "127.0.0.1:9", capacity), 60)
    await Drains(client).drain("n2")
    wrong = "another-cluster-secret-0123456789"
    for args in (("node", "drain", "n1"), ("node", "undrain", "n2"), ("nodes",)):
        refused = aenv(tmp_path, redis.url, *args, secret=wrong)
        assert refused.returncode == 1, (args, refused.stdout)
        assert "differs from the one the cluster's nodes registered with" in refused.stderr
        assert "Traceback" not in refused.stderr
    assert await Drains(client).draining() == {"n2"}


async def test_node_events_are_listed_newest_first(
    tmp_path: Path, redis: RedisServer, client: aioredis.Redis
) -> None:
    registry = NodeRegistry(client, SECRET)
    capacity = Capacity(cpus=2, memory_mb=1024, memory_free_mb=512, running=0, paused=0)
    await registry.heartbeat("t1", NodeReport("n1", "127.0.0.1:1", capacity, []), ttl=60)
    await Drains(client).drain("n1")
    listed = aenv(tmp_path, redis.url, "node", "events", "--json")
    assert listed.returncode == 0, listed.stderr
    assert [(e["type"], e["nodeID"]) for e in json.loads(listed.stdout)] == [
        ("node.drained", "n1"),
        ("node.back", "n1"),
    ]
    table = aenv(tmp_path, redis.url, "node", "events", "--node", "n2")
    assert table.returncode == 0 and table.stdout == ""
    text = aenv(tmp_path, redis.url, "node", "events", "--limit", "1").stdout.split()
    assert text[2:] == ["node.drained", "n1"]
