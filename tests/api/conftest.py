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

from aenv.api.app import create_api
from aenv.api.keys import KeyStore
from aenv.config import Config
from aenv.orchestrator.lifecycle import Orchestrator
from tests.doubles.node import double_node

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
