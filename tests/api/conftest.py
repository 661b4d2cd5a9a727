"""A node's control plane on doubles (tests/doubles): the real API app over the real
orchestrator and catalog, with the node's keys, reached in-process. What needs no real VM (bad
input, keys, limits) is tested here; the rest in tests/e2e."""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest

from aenv.api.app import create_api, node_builder
from aenv.api.keys import KeyStore
from aenv.config import Config
from aenv.orchestrator.builds import Builder
from aenv.orchestrator.lifecycle import Orchestrator
from tests.doubles.node import double_node
from tests.support.wait import eventually

API_KEY = "e2b_" + "5" * 40


@dataclass
class Node:
    client: httpx.AsyncClient
    orchestrator: Orchestrator
    config: Config
    keys: KeyStore


@pytest.fixture
def settings() -> dict[str, Any]:
    """Configuration the node starts with; a test overrides this fixture for other limits."""
    return {}


@pytest.fixture
async def node(tmp_path: Path, settings: dict[str, Any]) -> AsyncIterator[Node]:
    async with double_node(tmp_path, **settings) as doubles:
        keys = KeyStore(tmp_path / "api-keys.json")
        keys.add(API_KEY, "test")
        app = create_api(doubles.orchestrator, doubles.config, keys)
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(
            transport=transport, base_url="http://node", headers={"X-API-KEY": API_KEY}
        ) as client:
            yield Node(client, doubles.orchestrator, doubles.config, keys)


@dataclass
class BuildNode:
    client: httpx.AsyncClient
    builder: Builder
    context: Path  # the SDK's file context: what COPY steps copy from


@pytest.fixture
async def build_node(tmp_path: Path, settings: dict[str, Any]) -> AsyncIterator[BuildNode]:
    """A node whose template builder the test holds, and a file context for COPY steps."""
    async with double_node(tmp_path / "node", **settings) as doubles:
        keys = KeyStore(tmp_path / "api-keys.json")
        keys.add(API_KEY, "test")
        builder = node_builder(doubles.orchestrator, doubles.config)
        app = create_api(doubles.orchestrator, doubles.config, keys, builder)
        async with httpx.AsyncClient(
            transport=httpx.ASGITransport(app=app),
            base_url="http://node",
            headers={"X-API-KEY": API_KEY},
        ) as client:
            context = tmp_path / "context"
            context.mkdir()
            yield BuildNode(client, builder, context)


async def build(
    node: BuildNode, ids: tuple[str, str], steps: list[dict[str, Any]]
) -> dict[str, Any]:
    """Start the requested build `ids` (template, build) with `steps`; its final status."""
    template_id, build_id = ids
    started = await node.client.post(
        f"/v2/templates/{template_id}/builds/{build_id}",
        json={"fromTemplate": "base", "steps": steps},
    )
    assert started.status_code == 202, started.text
    ended: dict[str, Any] = {}

    async def done() -> bool:
        status = await node.client.get(f"/templates/{template_id}/builds/{build_id}/status")
        ended.update(status.json())
        return ended["status"] in ("ready", "error")

    await eventually(done, f"build {build_id} ended", interval=0.02)
    return ended


async def request(node: BuildNode, name: str) -> tuple[str, str]:
    """A build of `name` requested, as the SDK does first: (template id, build id)."""
    requested = (await node.client.post("/v3/templates", json={"name": name})).json()
    return requested["templateID"], requested["buildID"]
