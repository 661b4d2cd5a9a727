"""Bulk operations by metadata (`/aenv/bulk/...`) over a node on doubles served on loopback: what
the filter selects, each sandbox's own outcome, the refusals, and the SDK helpers."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any
from urllib.parse import urlencode

import httpx
from e2b import AsyncSandbox

from aenv.orchestrator.states import SandboxState
from aenv.sdk import delete_snapshots_by_metadata_async, kill_by_metadata_async
from tests.api.test_routes import KEY, error, served
from tests.doubles.node import double_node


async def _made(api: httpx.AsyncClient, metadata: dict[str, str]) -> str:
    made = await api.post("/v2/sandboxes", json={"templateID": "base", "metadata": metadata})
    assert made.status_code == 201, made.text
    sandbox_id: str = made.json()["sandboxID"]
    return sandbox_id


def _filter(**metadata: str) -> dict[str, str]:
    """E2B's `metadata` query parameter, as the SDKs encode it."""
    return {"metadata": urlencode(metadata)}


async def _three(api: httpx.AsyncClient) -> tuple[str, str, str]:
    """Two sandboxes of run 42 (one of them paused) and one of run 7."""
    first = await _made(api, {"run": "42", "rank": "0"})
    second = await _made(api, {"run": "42", "rank": "1"})
    other = await _made(api, {"run": "7"})
    assert (await api.post(f"/sandboxes/{second}/pause")).status_code == 204
    return first, second, other


async def test_kill_pause_and_timeout_by_metadata(tmp_path: Path) -> None:
    async with double_node(tmp_path) as node, served(node) as api:
        first, second, other = await _three(api)
        base = "/aenv/bulk/sandboxes"
        # Pause: only the running ones of run 42.
        paused = await api.post(f"{base}/pause", params=_filter(run="42"))
        assert paused.json() == {"sandboxes": [{"sandboxID": first}]}
        assert node.row(first).state is SandboxState.PAUSED
        # Timeout: both of run 42, paused or not; the other's end stays.
        other_end = node.row(other).end_at
        set_to = await api.post(f"{base}/timeout", params=_filter(run="42"), json={"timeout": 5})
        assert {s["sandboxID"] for s in set_to.json()["sandboxes"]} == {first, second}
        assert node.row(first).end_at <= time.time() + 5
        assert node.row(other).end_at == other_end
        # Two entries must all match.
        one = await api.post(f"{base}/kill", params=_filter(run="42", rank="1"))
        assert one.json() == {"sandboxes": [{"sandboxID": second}]}
        killed = await api.post(f"{base}/kill", params=_filter(run="42"))
        assert killed.json() == {"sandboxes": [{"sandboxID": first}]}
        assert [r.id for r in node.catalog.list()] == [other]
        nothing = await api.post(f"{base}/kill", params=_filter(run="42"))
        assert nothing.json() == {"sandboxes": []}


async def test_each_sandbox_reports_its_own_failure(tmp_path: Path) -> None:
    async with double_node(tmp_path) as node, served(node) as api:
        ids = {await _made(api, {"run": "1"}) for _ in range(2)}
        node.driver.fail_next("snapshot")  # the first of the two pauses
        answer = await api.post("/aenv/bulk/sandboxes/pause", params=_filter(run="1"))
        outcomes = answer.json()["sandboxes"]
        assert {o["sandboxID"] for o in outcomes} == ids
        failed = [o for o in outcomes if "error" in o]
        assert len(failed) == 1 and failed[0]["error"]["code"] == 500
        assert "pause" in failed[0]["error"]["message"]
        states = {i: node.row(i).state for i in ids}
        assert states[failed[0]["sandboxID"]] is SandboxState.RUNNING
        assert sorted(states.values()) == [SandboxState.PAUSED, SandboxState.RUNNING]


async def test_bulk_routes_refuse_a_missing_or_bad_filter(tmp_path: Path) -> None:
    async with double_node(tmp_path) as node, served(node) as api:
        sandbox_id = await _made(api, {"run": "1"})
        for path in ("/aenv/bulk/sandboxes/kill", "/aenv/bulk/sandboxes/pause"):
            assert "filter is required" in error(await api.post(path), 400)
            assert "state" in error(await api.post(path, params={"state": "running"}), 400)
        timeout = "/aenv/bulk/sandboxes/timeout"
        assert "timeout" in error(await api.post(timeout, params=_filter(run="1"), json={}), 400)
        huge = {"timeout": node.config.max_timeout + 1}
        assert "at most" in error(await api.post(timeout, params=_filter(run="1"), json=huge), 400)
        assert "filter is required" in error(await api.delete("/aenv/bulk/snapshots"), 400)
        assert node.row(sandbox_id).state is SandboxState.RUNNING


async def test_snapshots_carry_their_sandboxs_metadata_and_go_by_filter(tmp_path: Path) -> None:
    async with double_node(tmp_path) as node, served(node) as api:
        opts: dict[str, Any] = {"api_key": KEY, "api_url": str(api.base_url)}
        mine = await AsyncSandbox.create("base", metadata={"run": "42"}, **opts)
        theirs = await AsyncSandbox.create("base", metadata={"run": "7"}, **opts)
        kept = await theirs.create_snapshot()
        gone = [(await mine.create_snapshot()).snapshot_id for _ in range(2)]
        deleted = await delete_snapshots_by_metadata_async({"run": "42"}, **opts)
        assert sorted(deleted) == sorted(gone)
        assert [t.template_id for t in node.orchestrator.snapshots()] == [kept.snapshot_id]
        killed = await kill_by_metadata_async({"run": "42"}, **opts)
        assert killed == {mine.sandbox_id: None}
        assert [r.id for r in node.catalog.list()] == [theirs.sandbox_id]
