"""The batch fork (`POST /aenv/sandboxes/{id}/fork`) over a node on doubles served on loopback:
children labelled one by one from one prepared state, each child's outcome in the order asked
(started, refused for room, failed), the refusals of bad bodies, and the SDK helpers."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import httpx
from e2b import AsyncSandbox
from e2b.exceptions import RateLimitException

from aenv.sdk import ForkChild, fork_batch, fork_batch_async
from tests.api.test_routes import KEY, error, served
from tests.doubles.node import DoubleNode, double_node


async def _prepared(api: httpx.AsyncClient, node: DoubleNode) -> str:
    made = await api.post(
        "/v2/sandboxes",
        json={"templateID": "base", "metadata": {"run": "9"}, "envVars": {"TASK": "all"}},
    )
    sandbox_id: str = made.json()["sandboxID"]
    node.guest(sandbox_id).write("/prepared", "once")
    return sandbox_id


def _ranks(count: int) -> list[dict[str, Any]]:
    return [{"metadata": {"rank": str(i)}, "envVars": {"RANK": str(i)}} for i in range(count)]


async def test_children_get_their_own_labels_in_the_order_asked(tmp_path: Path) -> None:
    async with double_node(tmp_path) as node, served(node) as api:
        source = await _prepared(api, node)
        path = f"/aenv/sandboxes/{source}/fork"
        answer = await api.post(path, json={"children": _ranks(3), "timeout": 120})
        assert answer.status_code == 201, answer.text
        ids = [entry["sandbox"]["sandboxID"] for entry in answer.json()]
        assert len(set(ids)) == 3 and source not in ids
        for rank, child in enumerate(ids):
            assert node.row(child).metadata == {"run": "9", "rank": str(rank)}
            guest = node.guest(child)
            assert (guest.env["RANK"], guest.env["TASK"]) == (str(rank), "all")
            assert guest.read("/prepared") == "once"
        # From a snapshot: its sandbox's metadata, with each child's over it.
        snap = await api.post(f"/sandboxes/{source}/snapshots", json={"name": "prepared"})
        assert snap.status_code == 201
        from_snapshot = await api.post(
            "/aenv/sandboxes/prepared/fork", json={"children": [{"metadata": {"run": "10"}}]}
        )
        child = from_snapshot.json()[0]["sandbox"]["sandboxID"]
        assert node.row(child).metadata == {"run": "10"}


async def test_each_child_reports_its_own_outcome(tmp_path: Path) -> None:
    async with double_node(tmp_path, max_sandboxes=3) as node, served(node) as api:
        source = await _prepared(api, node)
        path = f"/aenv/sandboxes/{source}/fork"
        node.driver.fail_next("restore")  # the first child to start
        entries = (await api.post(path, json={"children": _ranks(4)})).json()
        outcomes = sorted(entry["error"]["code"] if "error" in entry else 201 for entry in entries)
        # Room for two beside the source: one failed, one started, two refused for room.
        assert outcomes == [201, 429, 429, 500]
        refused = [e["error"]["message"] for e in entries if e.get("error", {}).get("code") == 429]
        assert refused == ["this node holds its maximum of 3 sandboxes"] * 2


async def test_bad_batches_are_refused_by_field(tmp_path: Path) -> None:
    async with double_node(tmp_path) as node, served(node) as api:
        source = await _prepared(api, node)
        path = f"/aenv/sandboxes/{source}/fork"
        assert "children" in error(await api.post(path, json={"children": []}), 400)
        assert "children" in error(await api.post(path, json={"children": _ranks(101)}), 400)
        odd = {"children": [{"metadata": {"a": "b"}, "count": 2}]}
        assert "count" in error(await api.post(path, json=odd), 400)
        assert "timeout" in error(await api.post(path, json={"children": [{}], "timeout": 0}), 400)
        unknown = "/aenv/sandboxes/nosuchsandbox0000000/fork"
        assert "not found" in error(await api.post(unknown, json={"children": [{}]}), 404)
        assert [r.id for r in node.catalog.list()] == [source]


async def test_the_sdk_helpers_give_sandboxes_or_the_sdks_exceptions(tmp_path: Path) -> None:
    async with double_node(tmp_path, max_sandboxes=3) as node, served(node) as api:
        opts: dict[str, Any] = {"api_key": KEY, "api_url": str(api.base_url)}
        source = await _prepared(api, node)
        labels = [ForkChild(metadata={"rank": "0"}, envs={"RANK": "0"}), ForkChild()]
        started = await fork_batch_async(source, labels, 120, **opts)
        assert all(isinstance(s, AsyncSandbox) for s in started), started
        first = started[0]
        assert isinstance(first, AsyncSandbox)
        assert node.guest(first.sandbox_id).env["RANK"] == "0"
        assert (await first.get_info()).metadata == {"run": "9", "rank": "0"}
        # Full now: the sync helper (in a thread: the node serves on this loop) says why.
        refused = await asyncio.to_thread(fork_batch, source, [ForkChild()], 120, **opts)
        assert len(refused) == 1 and isinstance(refused[0], RateLimitException)
        assert "maximum of 3 sandboxes" in str(refused[0])
