"""A node's control plane without VMs: the real API app over a real orchestrator and catalog in
a temp dir, reached in-process. What needs no running sandbox (bad input, keys, limits) is
tested here; the rest in tests/e2e."""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from aenv.api.app import create_api
from aenv.api.keys import KeyStore
from aenv.config import Config
from aenv.network import NetworkConfig, SlotPool
from aenv.orchestrator.catalog import Catalog
from aenv.orchestrator.lifecycle import Orchestrator
from aenv.orchestrator.templates import TemplateStore
from aenv.runtime.qemu import QemuDriver

API_KEY = "e2b_" + "5" * 40


@dataclass
class Node:
    client: httpx.AsyncClient
    orchestrator: Orchestrator
    config: Config
    keys: KeyStore


@pytest.fixture
def config(tmp_path: Path) -> Config:
    """The node's configuration; a test overrides this fixture for other limits."""
    return Config(home=tmp_path)


@pytest.fixture
async def node(tmp_path: Path, config: Config) -> AsyncIterator[Node]:
    catalog = Catalog(config.paths.catalog)
    templates = TemplateStore(config.paths.templates, tmp_path / "memory")
    slots = SlotPool(NetworkConfig(prefix="aenvapi"))
    orc = Orchestrator(config, catalog, QemuDriver(), slots, templates)
    keys = KeyStore(tmp_path / "api-keys.json")
    keys.add(API_KEY, "test")
    app = create_api(orc, config, keys)
    transport = httpx.ASGITransport(app=app)
    headers = {"X-API-KEY": API_KEY}
    try:
        async with httpx.AsyncClient(
            transport=transport, base_url="http://node", headers=headers
        ) as client:
            yield Node(client, orc, config, keys)
    finally:
        await orc.close()
        catalog.close()
