"""The dashboard over a node's real API app on doubles (tests/doubles), with two API keys: the
node's own, and a second one a test may revoke."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
from starlette.types import ASGIApp

from aenv.api.app import create_api
from aenv.api.keys import KeyStore
from aenv.dashboard.app import Dashboard
from aenv.orchestrator.lifecycle import Orchestrator
from tests.doubles.driver import DoubleDriver
from tests.doubles.node import double_node

KEY = "e2b_" + "5" * 40
SECOND_KEY = "e2b_" + "6" * 40


@dataclass
class Site:
    dashboard: Dashboard
    orchestrator: Orchestrator
    driver: DoubleDriver
    keys: KeyStore
    # The API as an SDK reaches it (with `KEY`), through the dashboard's router.
    api: httpx.AsyncClient

    async def create(self, **metadata: str) -> str:
        body = {"templateID": "base", "metadata": metadata}
        created = await self.api.post("/sandboxes", json=body)
        assert created.status_code == 201, created.text
        sandbox_id: str = created.json()["sandboxID"]
        return sandbox_id

    async def build(self, name: str, steps: list[dict[str, Any]]) -> tuple[str, str]:
        """A build of template `name` started from `base` with `steps`: (template, build)."""
        requested = (await self.api.post("/v3/templates", json={"name": name})).json()
        ids = requested["templateID"], requested["buildID"]
        started = await self.api.post(
            f"/v2/templates/{ids[0]}/builds/{ids[1]}",
            json={"fromTemplate": "base", "steps": steps},
        )
        assert started.status_code == 202, started.text
        return ids

    async def build_status(self, ids: tuple[str, str]) -> str:
        answer = await self.api.get(f"/templates/{ids[0]}/builds/{ids[1]}/status")
        status: str = answer.json()["status"]
        return status


@pytest.fixture
async def site(tmp_path: Path) -> AsyncIterator[Site]:
    async with double_node(tmp_path) as doubles:
        keys = KeyStore(tmp_path / "api-keys.json")
        keys.add(KEY, "test")
        keys.add(SECOND_KEY, "second")
        api = create_api(doubles.orchestrator, doubles.config, keys)
        dashboard = Dashboard(api, live_interval=0.05, stream_s=0.3)
        async with httpx.AsyncClient(
            transport=httpx.ASGITransport(app=dashboard),
            base_url="http://node",
            headers={"X-API-KEY": KEY},
        ) as client:
            yield Site(dashboard, doubles.orchestrator, doubles.driver, keys, client)


ORIGIN = "http://node"


@asynccontextmanager
async def page_client(app: ASGIApp) -> AsyncIterator[httpx.AsyncClient]:
    """A client as a browser on the dashboard's own pages (`app`): no API key, its own
    cookies, requests from the dashboard's own origin."""
    async with httpx.AsyncClient(
        transport=httpx.ASGITransport(app=app),
        base_url=ORIGIN,
        headers={"Origin": ORIGIN, "Sec-Fetch-Site": "same-origin"},
    ) as client:
        yield client
