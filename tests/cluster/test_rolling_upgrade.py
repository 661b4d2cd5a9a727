"""A rolling upgrade, for real: the previous release (the last commit before version 1 of the
internal API, taken from this repository's history) runs a node and a gateway beside this
release's node and gateway, each in a process of its own (`member_on_doubles.py`,
`aenv gateway`), on loopback with a real redis-server. Through either gateway a sandbox on
either node is created, paused, resumed and killed, a template read, and the refusals a client
sees are the same: the new gateway speaks version 0 to the old node, the old gateway version 0
to the new one.
"""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import tarfile
import time
from collections.abc import AsyncIterator
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
import redis.asyncio as aioredis

from aenv.api.internal_models import INTERNAL_VERSIONS, REPLAY
from aenv.cluster.drain import Drains
from aenv.cluster.keys import ClusterKeys
from aenv.cluster.registry import NodeRegistry
from aenv.cluster.routing import Routes
from tests.cluster.shared import SECRET
from tests.support.ports import free_port
from tests.support.process_group import stop_group
from tests.support.redis_server import RedisServer

REPO = Path(__file__).resolve().parents[2]
# The file version 1 came with: the commit before the one that added it is the previous release.
FIRST_OF_V1 = "src/aenv/api/internal_models.py"
MEMBER = Path(__file__).with_name("member_on_doubles.py")


def previous_release(into: Path) -> Path:
    """The source tree (`src`, `tests`) of the last commit before version 1, unpacked into
    `into`; skips when this checkout lacks that history (a shallow clone)."""
    added = _git("log", "--diff-filter=A", "--format=%H", "--", FIRST_OF_V1).split()
    if not added:
        pytest.skip(
            f"no history of {FIRST_OF_V1} in this checkout: the previous release is unknown"
        )
    before = _git("rev-parse", "--verify", "--quiet", f"{added[-1]}^")
    if not before:
        pytest.skip(f"the parent of {added[-1][:12]} is not in this (shallow) clone")
    archive = into / "previous.tar"
    with archive.open("wb") as out:
        subprocess.run(
            ["git", "-C", str(REPO), "archive", before.strip(), "src", "tests"],
            stdout=out,
            check=True,
        )
    tree = into / "previous"
    with tarfile.open(archive) as tar:
        tar.extractall(tree, filter="data")
    return tree


def _git(*args: str) -> str:
    done = subprocess.run(["git", "-C", str(REPO), *args], capture_output=True, text=True)
    return done.stdout.strip() if done.returncode == 0 else ""


@dataclass
class Process:
    name: str
    proc: subprocess.Popen[bytes]
    log: Path

    def alive(self) -> None:
        assert self.proc.poll() is None, f"{self.name} exited:\n{self.log.read_text()[-3000:]}"


# Runs a script or module with `tree`'s packages first on the path, ahead of whatever the
# interpreter's site set-up put there (an editable install of this tree, say).
_LAUNCH = """
import runpy, sys
tree, kind, target, *args = sys.argv[1:]
sys.path[:0] = [tree + "/src", tree]
sys.argv = [target, *args]
run = runpy.run_path if kind == "path" else runpy.run_module
run(target, run_name="__main__")
"""


def _start(
    stack: ExitStack, name: str, tree: Path, command: list[str], env: dict[str, str], logs: Path
) -> Process:
    """`command` (`path <script> args...` or `module <name> args...`) run on `tree`."""
    log = logs / f"{name}.log"
    with log.open("wb") as out:
        proc = subprocess.Popen(
            [sys.executable, "-c", _LAUNCH, str(tree), *command],
            env={**os.environ, **env, "PYTHONPATH": f"{tree / 'src'}{os.pathsep}{tree}"},
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    stack.callback(stop_group, proc, 20)
    return Process(name, proc, log)


@dataclass
class Cluster:
    client: aioredis.Redis
    nodes: dict[str, Process]
    gateways: dict[str, str]  # release -> URL
    key: str
    requests: dict[str, Path]  # node -> the requests it took (`member_on_doubles.py`)

    async def only(self, node_id: str) -> None:
        """Placement leaves every other node out."""
        drains = Drains(self.client)
        for other in self.nodes:
            await (drains.undrain if other == node_id else drains.drain)(other)


@pytest.fixture
async def cluster(
    tmp_path: Path, redis: RedisServer, client: aioredis.Redis
) -> AsyncIterator[Cluster]:
    trees = {"old": previous_release(tmp_path), "new": REPO}
    cluster_env = {"AENV_REDIS_URL": redis.url, "AENV_CLUSTER_SECRET": SECRET.value}
    _, key = await ClusterKeys(client).new("user")
    with ExitStack() as stack:
        nodes, gateways = {}, {}
        for release, tree in trees.items():
            node_env = {
                **cluster_env,
                "AENV_HOME": str(tmp_path / f"{release}-node"),
                "AENV_PORT": str(free_port()),
                "AENV_NODE_ID": release,
            }
            command = ["path", str(MEMBER)]
            nodes[release] = _start(stack, f"{release}-node", tree, command, node_env, tmp_path)
            port = free_port()
            gateway_env = {**cluster_env, "AENV_HOME": str(tmp_path / f"{release}-gateway")}
            command = ["module", "aenv.cli", "gateway", "--host", "127.0.0.1", "--port", str(port)]
            gateway = _start(stack, f"{release}-gateway", tree, command, gateway_env, tmp_path)
            gateways[release] = f"http://127.0.0.1:{port}"
            nodes[f"{release}-gateway"] = gateway
        registry = NodeRegistry(client, SECRET)

        async def up() -> bool:
            for process in nodes.values():
                process.alive()
            live = {n.node_id for n in await registry.live()}
            return live == set(trees) and all(_answers(url) for url in gateways.values())

        # Far above a start under load (imports, the doubles' template); a crash fails at once.
        deadline = time.monotonic() + 300
        while not await up():
            assert time.monotonic() < deadline, "the nodes and gateways never all came up"
            await asyncio.sleep(0.2)
        members = {k: v for k, v in nodes.items() if k in trees}
        requests = {n: tmp_path / f"{n}-node" / "requests.log" for n in members}
        yield Cluster(client, members, gateways, key, requests)


def _answers(url: str) -> bool:
    try:
        return httpx.get(f"{url}/health", timeout=2).status_code == 204
    except httpx.HTTPError:
        return False


async def test_a_sandbox_lives_through_either_gateway_on_either_node(cluster: Cluster) -> None:
    reports = {n.node_id: n for n in await NodeRegistry(cluster.client, SECRET).live()}
    assert reports["old"].internal_versions == (REPLAY,)
    assert reports["new"].internal_versions == INTERNAL_VERSIONS
    for gateway in cluster.gateways:
        for node in cluster.nodes:
            await cluster.only(node)
            await _lifecycle(cluster, gateway, node)
    for process in cluster.nodes.values():
        process.alive()
    # Each gateway spoke the highest version both sides serve.
    new_node, old_node = (cluster.requests[n].read_text().splitlines() for n in ("new", "old"))
    assert "POST /internal/v1/sandboxes" in new_node
    assert "POST /internal/v1/templates/base/info" in new_node
    assert "POST /internal/v1/lists/sandboxes-v2" in new_node
    assert "POST /internal/sandboxes" in new_node  # the old gateway's replay
    assert not [r for r in old_node if r.startswith("POST /internal/v1/")]
    assert "POST /internal/sandboxes" in old_node


async def _lifecycle(cluster: Cluster, gateway: str, node: str) -> None:
    """Create, pause, resume and kill through `gateway` on `node`; the refusals on the way
    (paused twice, killed twice, an unknown template) are E2B's, as from one node."""
    routes = Routes(cluster.client)
    headers = {"X-API-Key": cluster.key}
    where = f"through the {gateway} gateway on the {node} node"
    with httpx.Client(base_url=cluster.gateways[gateway], headers=headers, timeout=120) as http:
        made = http.post("/sandboxes", json={"templateID": "base", "timeout": 120})
        assert made.status_code == 201, f"{where}: {made.text}"
        sandbox_id = made.json()["sandboxID"]
        # Routed inside the create, or at the node's next heartbeat when Redis was slow.
        deadline = time.monotonic() + 30
        while (routed := await routes.lookup(sandbox_id)) != node:
            assert routed is None and time.monotonic() < deadline, f"{where}: routed to {routed}"
            await asyncio.sleep(0.1)
        assert http.post(f"/sandboxes/{sandbox_id}/pause").status_code == 204, where
        again = http.post(f"/sandboxes/{sandbox_id}/pause")
        assert again.status_code == 409, f"{where}: {again.text}"
        listed = http.get("/v2/sandboxes", params={"state": "paused"}).json()
        assert [s["sandboxID"] for s in listed] == [sandbox_id], where
        resumed = http.post(f"/sandboxes/{sandbox_id}/connect", json={"timeout": 60})
        assert resumed.status_code == 201, f"{where}: {resumed.text}"
        assert http.get(f"/sandboxes/{sandbox_id}").json()["state"] == "running", where
        assert http.delete(f"/sandboxes/{sandbox_id}").status_code == 204, where
        gone = http.delete(f"/sandboxes/{sandbox_id}")
        unknown = http.post("/sandboxes", json={"templateID": "nowhere"})
        template = http.get("/templates/base")
        no_template = http.get("/templates/nowhere")
    assert template.status_code == 200 and template.json()["templateID"] == "base", where
    assert no_template.json() == {"code": 404, "message": "template 'nowhere' not found"}, where
    assert gone.status_code == 404, where
    assert gone.json() == {"code": 404, "message": f"sandbox '{sandbox_id}' not found"}, where
    assert unknown.status_code == 404, where
    assert unknown.json() == {"code": 404, "message": "template 'nowhere' not found"}, where
