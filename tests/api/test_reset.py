"""The reset-in-place route (`POST /aenv/sandboxes/{id}/reset`) and `aenv.sdk.reset`, over a node
on doubles served on loopback, with the unmodified E2B SDK."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from e2b import AsyncSandbox
from e2b.exceptions import NotFoundException, SandboxException

from aenv.sdk import reset_async
from tests.api.test_routes import KEY, error, served
from tests.doubles.node import double_node


async def test_the_route_resets_in_place_and_refuses_what_it_cannot(tmp_path: Path) -> None:
    async with double_node(tmp_path) as node, served(node) as api:
        made = (await api.post("/v2/sandboxes", json={"templateID": "base"})).json()
        sandbox_id = made["sandboxID"]
        node.guest(sandbox_id).write("/data", "before")
        snap = await api.post(f"/sandboxes/{sandbox_id}/snapshots", json={"name": "ep"})
        snapshot_id = snap.json()["snapshotID"]
        node.guest(sandbox_id).write("/data", "after")
        path = f"/aenv/sandboxes/{sandbox_id}/reset"
        end = node.row(sandbox_id).end_at
        answer = await api.post(path, json={"snapshotID": "ep"})
        assert answer.status_code == 200, answer.text
        body = answer.json()
        assert (body["sandboxID"], body["envdAccessToken"]) == (
            sandbox_id,
            made["envdAccessToken"],
        )
        assert body["templateID"] == snapshot_id
        assert node.guest(sandbox_id).read("/data") == "before"
        assert node.row(sandbox_id).end_at == end  # no timeout given: its end stays
        longer = await api.post(path, json={"snapshotID": "ep", "timeout": 3000})
        assert longer.status_code == 200 and node.row(sandbox_id).end_at > end + 2000
        too_long = {"snapshotID": "ep", "timeout": node.config.max_timeout + 1}
        assert "at most" in error(await api.post(path, json=too_long), 400)
        events = (await api.get(f"/events/sandboxes/{sandbox_id}")).json()
        resets = [e for e in events if "reset" in (e["eventData"] or {})]
        assert [e["eventData"]["reset"] for e in resets] == [snapshot_id] * 2
        assert "snapshot 'nope'" in error(await api.post(path, json={"snapshotID": "nope"}), 404)
        unknown = "/aenv/sandboxes/nosuchsandbox0000000/reset"
        assert "sandbox" in error(await api.post(unknown, json={"snapshotID": "ep"}), 404)
        assert "snapshotID" in error(await api.post(path, json={}), 400)
        assert "other" in error(await api.post(path, json={"snapshotID": "ep", "other": 1}), 400)
        assert "q" in error(await api.post(path + "?q=1", json={"snapshotID": "ep"}), 400)
        # The fork checkpoints of the node are not for users to reset to.
        forked = await api.post(f"/sandboxes/{sandbox_id}/fork", json={"count": 1})
        assert forked.status_code == 201
        fork_template = forked.json()[0]["sandbox"]["templateID"]
        assert fork_template == snapshot_id  # a child shows its parent's template
        assert (await api.post(f"/sandboxes/{sandbox_id}/pause")).status_code == 204
        assert "running" in error(await api.post(path, json={"snapshotID": "ep"}), 409)


async def test_the_sdk_helper_resets_a_sandbox_the_sdk_made(tmp_path: Path) -> None:
    async with double_node(tmp_path) as node, served(node) as api:
        opts: dict[str, Any] = {"api_key": KEY, "api_url": str(api.base_url)}
        sandbox = await AsyncSandbox.create("base", **opts)
        node.guest(sandbox.sandbox_id).write("/data", "before")
        snapshot = await sandbox.create_snapshot()
        node.guest(sandbox.sandbox_id).write("/data", "after")
        await reset_async(sandbox, snapshot.snapshot_id)
        assert node.guest(sandbox.sandbox_id).read("/data") == "before"
        with pytest.raises(NotFoundException):
            await reset_async(sandbox, "no-such-snapshot")
        await sandbox.pause()
        with pytest.raises(SandboxException, match="running"):
            await reset_async(sandbox, snapshot.snapshot_id)
