"""Sandbox lifecycle events (`/events/sandboxes`) over a node on doubles: what each operation
writes, E2B's shape and query parameters, the retention, and events surviving a restart."""

from __future__ import annotations

import asyncio
import sqlite3
import time
from pathlib import Path
from typing import Any

import httpx

from aenv.api.app import create_api
from aenv.api.keys import KeyStore
from aenv.ids import TEAM_ID
from aenv.orchestrator.events import EventQuery
from aenv.orchestrator.states import SandboxState
from tests.api.conftest import API_KEY, Node
from tests.doubles.node import double_node
from tests.support.wait import eventually

CREATED, UPDATED, PAUSED, RESUMED, CHECKPOINTED, KILLED = (
    f"sandbox.lifecycle.{name}"
    for name in ("created", "updated", "paused", "resumed", "checkpointed", "killed")
)


async def _sandbox(client: httpx.AsyncClient, **body: Any) -> str:
    response = await client.post("/sandboxes", json={"templateID": "base", **body})
    assert response.status_code == 201, response.text
    return str(response.json()["sandboxID"])


async def _events(client: httpx.AsyncClient, path: str, **params: Any) -> list[dict[str, Any]]:
    response = await client.get(path, params=params)
    assert response.status_code == 200, response.text
    events = response.json()
    assert isinstance(events, list)
    return events


async def test_each_operation_writes_its_event_in_order(node: Node) -> None:
    client = node.client
    sandbox_id = await _sandbox(client, metadata={"run": "7"})
    assert (
        await client.post(f"/sandboxes/{sandbox_id}/timeout", json={"timeout": 120})
    ).status_code == 204
    assert (await client.post(f"/sandboxes/{sandbox_id}/snapshots", json={})).status_code == 201
    assert (await client.post(f"/sandboxes/{sandbox_id}/pause")).status_code == 204
    resumed = await client.post(f"/sandboxes/{sandbox_id}/resume", json={"timeout": 60})
    assert resumed.status_code == 201, resumed.text
    assert (await client.delete(f"/sandboxes/{sandbox_id}")).status_code == 204

    events = await _events(client, f"/events/sandboxes/{sandbox_id}", orderAsc="true")
    assert [e["type"] for e in events] == [
        CREATED,
        UPDATED,
        CHECKPOINTED,
        PAUSED,
        RESUMED,
        KILLED,
    ]
    build = node.orchestrator.templates.get("base").build_id
    for event in events:
        assert event["version"] == "v2"
        assert event["sandboxId"] == sandbox_id
        assert event["sandboxTemplateId"] == "base"
        assert event["sandboxBuildId"] == build
        assert event["sandboxTeamId"] == TEAM_ID
        assert event["eventData"]["sandbox_metadata"] == {"run": "7"}
        assert event["timestamp"].endswith("Z")
    assert len({e["id"] for e in events}) == len(events)
    created, updated, _, paused, resumed_event, killed = events
    assert "set_timeout" in updated["eventData"]
    # One execution from the create to the pause, another from the resume to the kill.
    first, second = created["sandboxExecutionId"], resumed_event["sandboxExecutionId"]
    assert first and second and first != second
    assert paused["sandboxExecutionId"] == first
    assert killed["sandboxExecutionId"] == second
    for ended in (paused, killed):
        execution = ended["eventData"]["execution"]
        assert execution["vcpu_count"] >= 1 and execution["memory_mb"] >= 1
        assert execution["execution_time"] >= 0
        assert execution["started_at"].endswith("Z")
    assert "execution" not in created["eventData"]
    assert killed["eventData"]["kill_reason"] == "request"

    newest_first = await _events(client, f"/events/sandboxes/{sandbox_id}")
    assert newest_first == events[::-1]


async def test_query_parameters_page_and_filter(node: Node) -> None:
    client = node.client
    first = await _sandbox(client)
    second = await _sandbox(client)
    assert (await client.delete(f"/sandboxes/{first}")).status_code == 204

    team = await _events(client, "/events/sandboxes", orderAsc="true")
    assert [(e["type"], e["sandboxId"]) for e in team] == [
        (CREATED, first),
        (CREATED, second),
        (KILLED, first),
    ]
    page = await _events(client, "/events/sandboxes", orderAsc="true", offset=1, limit=1)
    assert page == team[1:2]
    killed = await _events(client, "/events/sandboxes", types=KILLED)
    assert [e["sandboxId"] for e in killed] == [first]
    both = await client.get("/events/sandboxes", params=[("types", KILLED), ("types", CREATED)])
    assert len(both.json()) == 3
    assert await _events(client, "/events/sandboxes/neverseen") == []

    for params in (
        {"limit": 0},
        {"limit": 101},
        {"offset": -1},
        {"orderAsc": "yes"},
        {"types": "sandbox.lifecycle.exploded"},
        {"sandboxID": first},
    ):
        response = await client.get("/events/sandboxes", params=params)
        assert response.status_code == 400, params
        assert response.json()["code"] == 400


async def test_events_past_their_retention_are_removed(node: Node) -> None:
    sandbox_id = await _sandbox(node.client)
    assert (await node.client.delete(f"/sandboxes/{sandbox_id}")).status_code == 204
    old = time.time() - 8 * 86400
    node.orchestrator.catalog.db.execute(
        "UPDATE events SET created_at = ? WHERE type = ?", (old, CREATED)
    )
    assert node.orchestrator.events.sweep(node.config.events_retention_days) == 1
    remaining = await _events(node.client, f"/events/sandboxes/{sandbox_id}")
    assert [e["type"] for e in remaining] == [KILLED]


async def test_events_survive_a_restart(tmp_path: Path) -> None:
    keys = KeyStore(tmp_path / "api-keys.json")
    keys.add(API_KEY, "test")
    async with double_node(tmp_path / "node") as doubles:
        record, _ = await doubles.orchestrator.create(doubles.request())
        await doubles.orchestrator.kill(record.id)
    catalog = sqlite3.connect(doubles.config.paths.catalog)
    try:
        assert catalog.execute("SELECT COUNT(*) FROM events").fetchone()[0] == 2
    finally:
        catalog.close()
    reopened = doubles.reopen()
    await reopened.orchestrator.start()
    try:
        app = create_api(reopened.orchestrator, reopened.config, keys)
        async with httpx.AsyncClient(
            transport=httpx.ASGITransport(app=app),
            base_url="http://node",
            headers={"X-API-KEY": API_KEY},
        ) as client:
            events = await _events(client, f"/events/sandboxes/{record.id}", orderAsc="true")
        assert [e["type"] for e in events] == [CREATED, KILLED]
    finally:
        await reopened.orchestrator.close()
        reopened.catalog.close()


async def test_a_timeout_kill_says_so(node: Node) -> None:
    sandbox_id = await _sandbox(node.client)
    node.orchestrator.set_timeout(sandbox_id, 0)

    async def killed() -> list[dict[str, Any]]:
        return await _events(node.client, f"/events/sandboxes/{sandbox_id}", types=KILLED)

    async def seen() -> bool:
        return bool(await killed())

    await eventually(seen, "the timeout's kill")
    (event,) = await killed()
    assert event["eventData"]["kill_reason"] == "timeout"
    assert event["eventData"]["execution"]["execution_time"] >= 0


async def test_a_restart_ends_the_executions_the_crash_cut(tmp_path: Path) -> None:
    """After a crash, a running sandbox is reclaimed (killed, `orphaned`) and one caught
    mid-pause is paused at its previous checkpoint (paused), each ending its execution."""
    async with double_node(tmp_path) as node:
        orc = node.orchestrator
        running, _ = await orc.create(node.request())
        pausing, _ = await orc.create(node.request())
        await orc.pause(pausing.id)
        await orc.resume(pausing.id, 300)
        held = node.driver.hold("snapshot")
        cut = asyncio.create_task(orc.pause(pausing.id))
        await held.reached.wait()
        restarted = node.reopen()  # the crash: the catalog as the node left it
        await restarted.orchestrator.start()
        try:
            log = restarted.orchestrator.events
            for sandbox_id, kind in ((running.id, KILLED), (pausing.id, PAUSED)):
                query = EventQuery(TEAM_ID, limit=1, sandbox_id=sandbox_id)
                (last,) = log.page(query)
                assert last["type"] == kind
                assert last["eventData"]["execution"]["vcpu_count"] >= 1
            (reclaimed,) = log.page(EventQuery(TEAM_ID, limit=1, sandbox_id=running.id))
            assert reclaimed["eventData"]["kill_reason"] == "orphaned"
            assert restarted.row(pausing.id).state is SandboxState.PAUSED
        finally:
            await restarted.orchestrator.close()
            restarted.catalog.close()
            held.release()
            await asyncio.gather(cut, return_exceptions=True)
