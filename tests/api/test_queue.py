"""Creates and forks that wait for capacity over HTTP (`X-Aenv-Wait`), on a node on doubles
served on loopback: answered 201 once a kill frees room, 429 naming the reason when the wait
runs out, visible in `GET /aenv/queue` and /metrics while they wait, out of the queue when their
client disconnects, and asked for by an unmodified E2B SDK through its headers."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import httpx
from e2b import AsyncSandbox

from aenv.api.extensions import WAIT_HEADER
from tests.api.test_routes import KEY, error, served
from tests.doubles.node import DoubleNode, assert_clean, double_node
from tests.support.wait import eventually

WAIT = {WAIT_HEADER: "3600"}
NEW = {"templateID": "base"}


async def _full(api: httpx.AsyncClient) -> str:
    """The one place of a node with `max_sandboxes=1`, taken."""
    made = await api.post("/sandboxes", json=NEW)
    assert made.status_code == 201, made.text
    sandbox_id: str = made.json()["sandboxID"]
    return sandbox_id


async def _clean(api: httpx.AsyncClient, node: DoubleNode) -> None:
    for record in node.orchestrator.list():
        assert (await api.delete(f"/sandboxes/{record.id}")).status_code == 204
    assert len(node.orchestrator.waiting) == 0
    assert_clean(node)


async def test_a_create_waits_for_a_kill_and_shows_its_place(tmp_path: Path) -> None:
    async with (
        double_node(tmp_path, max_sandboxes=1, create_max_wait=3600) as node,
        served(node) as api,
    ):
        running = await _full(api)
        waiting = asyncio.create_task(api.post("/sandboxes", json=NEW, headers=WAIT))
        await eventually(lambda: len(node.orchestrator.waiting) == 1, "the create waiting")
        queue = (await api.get("/aenv/queue")).json()
        assert queue == {"waiting": 1, "positions": [1], "maxWait": 3600}
        metrics = (await api.get("/metrics")).text
        assert "aenv_create_waiting 1.0" in metrics
        assert (await api.delete(f"/sandboxes/{running}")).status_code == 204
        made = await waiting
        assert made.status_code == 201, made.text
        assert (await api.get("/aenv/queue")).json()["positions"] == []
        assert 'aenv_create_waits_total{result="admitted"} 1.0' in (await api.get("/metrics")).text
        await _clean(api, node)


async def test_a_wait_that_runs_out_is_a_429_naming_the_reason(tmp_path: Path) -> None:
    async with double_node(tmp_path, max_sandboxes=1) as node, served(node) as api:
        await _full(api)
        refused = await api.post("/sandboxes", json=NEW, headers={WAIT_HEADER: "0.05"})
        message = error(refused, 429)
        assert "maximum of 1 sandboxes" in message and "waited 0.05 s" in message
        await _clean(api, node)


async def test_a_bad_wait_is_refused(tmp_path: Path) -> None:
    async with double_node(tmp_path) as node, served(node) as api:
        for bad in ("soon", "-1", "nan", "inf"):
            answer = await api.post("/sandboxes", json=NEW, headers={WAIT_HEADER: bad})
            assert WAIT_HEADER in error(answer, 400)
        assert node.orchestrator.list() == []


async def test_a_client_that_disconnects_leaves_the_queue(tmp_path: Path) -> None:
    async with (
        double_node(tmp_path, max_sandboxes=1, create_max_wait=3600) as node,
        served(node) as api,
    ):
        running = await _full(api)
        waiting = asyncio.create_task(api.post("/sandboxes", json=NEW, headers=WAIT))
        await eventually(lambda: len(node.orchestrator.waiting) == 1, "the create waiting")
        waiting.cancel()  # the client closes its connection
        await eventually(lambda: len(node.orchestrator.waiting) == 0, "the waiter gone")
        assert node.orchestrator.waiting.stats.left == 1
        assert (await api.delete(f"/sandboxes/{running}")).status_code == 204
        assert node.orchestrator.list() == []  # nothing started for the client that left
        await _clean(api, node)


async def test_fork_children_wait_for_room(tmp_path: Path) -> None:
    async with (
        double_node(tmp_path, max_sandboxes=2, create_max_wait=3600) as node,
        served(node) as api,
    ):
        source = await _full(api)
        path = f"/aenv/sandboxes/{source}/fork"
        forking = asyncio.create_task(api.post(path, json={"children": [{}, {}]}, headers=WAIT))
        await eventually(lambda: len(node.orchestrator.waiting) == 1, "a child waiting")
        assert (await api.delete(f"/sandboxes/{source}")).status_code == 204
        answer = await forking
        assert answer.status_code == 201, answer.text
        assert all("sandbox" in entry for entry in answer.json()), answer.text
        await _clean(api, node)


async def test_the_e2b_sdk_asks_to_wait_through_its_headers(tmp_path: Path) -> None:
    async with (
        double_node(tmp_path, max_sandboxes=1, create_max_wait=3600) as node,
        served(node) as api,
    ):
        running = await _full(api)
        opts: dict[str, Any] = {"api_key": KEY, "api_url": str(api.base_url)}
        creating = asyncio.create_task(AsyncSandbox.create("base", api_headers=WAIT, **opts))
        await eventually(lambda: len(node.orchestrator.waiting) == 1, "the SDK's create waiting")
        assert (await api.delete(f"/sandboxes/{running}")).status_code == 204
        sandbox = await creating
        assert node.row(sandbox.sandbox_id).state.public == "running"
        await _clean(api, node)
