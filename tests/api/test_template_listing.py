"""`GET /templates` lists a template from its first build on, with the newest build's state:
one waiting, building or failed is not invisible until it is ready (`aenv template ls` and
E2B's dashboard read this list), and a ready template shows a failed rebuild."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from aenv.api.app import create_api, node_builder
from aenv.api.keys import KeyStore
from aenv.orchestrator.builds import Builder
from tests.api.conftest import API_KEY
from tests.doubles.node import double_node


@pytest.fixture
async def api(tmp_path: Path) -> AsyncIterator[tuple[httpx.AsyncClient, Builder]]:
    async with double_node(tmp_path) as doubles:
        keys = KeyStore(tmp_path / "api-keys.json")
        keys.add(API_KEY, "test")
        builder = node_builder(doubles.orchestrator, doubles.config)
        app = create_api(doubles.orchestrator, doubles.config, keys, builder)
        async with httpx.AsyncClient(
            transport=httpx.ASGITransport(app=app),
            base_url="http://node",
            headers={"X-API-KEY": API_KEY},
        ) as client:
            yield client, builder


def _listed(templates: list[dict[str, Any]], name: str) -> dict[str, Any]:
    return next(t for t in templates if name in t["aliases"])


async def test_a_first_build_is_listed_while_waiting_and_once_failed(
    api: tuple[httpx.AsyncClient, Builder],
) -> None:
    client, builder = api
    requested = (await client.post("/v3/templates", json={"name": "later"})).json()
    waiting = _listed((await client.get("/templates")).json(), "later")
    assert waiting["buildStatus"] == "waiting"
    assert (waiting["templateID"], waiting["buildID"]) == (
        requested["templateID"],
        requested["buildID"],
    )
    builder.abandon(builder.reserve("other"), "the registry did not answer")
    listed = (await client.get("/templates")).json()
    assert _listed(listed, "other")["buildStatus"] == "error"
    assert _listed(listed, "later")["buildStatus"] == "waiting"
    base = _listed(listed, "base")
    assert base["buildStatus"] == "ready"


async def test_a_ready_template_shows_its_newest_build(
    api: tuple[httpx.AsyncClient, Builder],
) -> None:
    client, builder = api
    builder.abandon(builder.reserve("base"), "rebuild stopped")
    base = _listed((await client.get("/templates")).json(), "base")
    assert base["buildStatus"] == "error"
    # Its files are still the last ready build's: sandboxes start from it as before.
    assert base["buildID"] != builder.latest()[base["templateID"]].build_id
    created = await client.post("/sandboxes", json={"templateID": "base"})
    assert created.status_code == 201
