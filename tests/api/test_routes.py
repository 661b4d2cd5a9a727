"""The control plane's routes over a node on doubles, served by uvicorn on loopback: status
codes, JSON errors, and what each route changes in the orchestrator."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import httpx

from aenv.api.app import create_api
from aenv.api.keys import KeyStore
from aenv.orchestrator import checkpoints
from aenv.orchestrator.kinds import SaveMode
from aenv.orchestrator.states import SandboxState
from aenv.runtime.driver import MANIFEST_VERSION, SNAPSHOT_MANIFEST, Snapshot
from tests.doubles.node import DoubleNode, assert_clean, double_node
from tests.support import loopback_api

KEY = "e2b_" + "ab" * 20


@asynccontextmanager
async def served(node: DoubleNode) -> AsyncIterator[httpx.AsyncClient]:
    """The node's API on a loopback port; a client sending the API key."""
    keys = KeyStore(node.config.home / "api-keys.json")
    keys.add(KEY, "test")
    async with (
        loopback_api.served(create_api(node.orchestrator, node.config, keys)) as url,
        # Plain HTTP: the client loads no CA store (30 ms of CPU, for each of ~80 tests).
        httpx.AsyncClient(base_url=url, headers={"X-API-Key": KEY}, verify=False) as client,
    ):
        yield client


def error(response: httpx.Response, status: int) -> str:
    """The message of a JSON error with `status` (every error is one)."""
    assert response.status_code == status, response.text
    body: dict[str, Any] = response.json()
    assert body["code"] == status and isinstance(body["message"], str)
    return str(body["message"])


async def test_create_get_pause_resume_kill(tmp_path: Path) -> None:
    async with double_node(tmp_path) as node, served(node) as api:
        created = await api.post(
            "/sandboxes",
            json={"templateID": "base", "metadata": {"m": "1"}, "autoPauseMemory": False},
        )
        assert created.status_code == 201, created.text
        sandbox_id = created.json()["sandboxID"]
        assert created.json()["envdAccessToken"] == node.row(sandbox_id).envd_access_token
        detail = (await api.get(f"/sandboxes/{sandbox_id}")).json()
        assert (detail["state"], detail["pauseMode"], detail["metadata"]) == (
            "running",
            "filesystem",
            {"m": "1"},
        )
        assert node.row(sandbox_id).auto_pause_mode is SaveMode.FILESYSTEM

        assert (await api.post(f"/sandboxes/{sandbox_id}/pause")).status_code == 204
        assert node.row(sandbox_id).state is SandboxState.PAUSED
        assert (await api.get(f"/sandboxes/{sandbox_id}")).json()["state"] == "paused"
        error(await api.post(f"/sandboxes/{sandbox_id}/pause"), 409)
        resumed = await api.post(f"/sandboxes/{sandbox_id}/resume", json={"timeout": 60})
        assert resumed.status_code == 201, resumed.text
        assert node.row(sandbox_id).state is SandboxState.RUNNING

        assert (await api.delete(f"/sandboxes/{sandbox_id}")).status_code == 204
        error(await api.delete(f"/sandboxes/{sandbox_id}"), 404)
        error(await api.get(f"/sandboxes/{sandbox_id}"), 404)
        assert_clean(node)


async def test_bad_requests_are_refused_with_json_errors(tmp_path: Path) -> None:
    async with double_node(tmp_path) as node, served(node) as api:
        bad_type = await api.post("/sandboxes", json={"templateID": "base", "timeout": "x"})
        assert "timeout" in error(bad_type, 400)
        error(
            await api.post(
                "/sandboxes", content=b"{not json", headers={"Content-Type": "application/json"}
            ),
            400,
        )
        error(await api.post("/sandboxes", json={"templateID": "nope"}), 404)
        error(await api.post("/sandboxes", json={"templateID": "base", "timeout": -1}), 400)
        error(await api.get("/sandboxes", headers={"X-API-Key": "e2b_" + "00" * 20}), 401)
        assert node.catalog.list() == []  # nothing was started by any of them


async def test_node_full_answers_429(tmp_path: Path) -> None:
    async with double_node(tmp_path, max_sandboxes=1) as node, served(node) as api:
        assert (await api.post("/sandboxes", json={"templateID": "base"})).status_code == 201
        error(await api.post("/sandboxes", json={"templateID": "base"}), 429)
        assert len(node.catalog.list()) == 1


async def test_failed_resume_answers_an_error_and_stays_paused(tmp_path: Path) -> None:
    async with double_node(tmp_path, repository="off") as node, served(node) as api:
        sandbox_id = (await api.post("/sandboxes", json={"templateID": "base"})).json()["sandboxID"]
        assert (await api.post(f"/sandboxes/{sandbox_id}/pause")).status_code == 204
        node.driver.fail_next("restore")
        response = await api.post(f"/sandboxes/{sandbox_id}/resume", json={"timeout": 60})
        assert response.status_code >= 500
        error(response, response.status_code)
        assert (await api.get(f"/sandboxes/{sandbox_id}")).json()["state"] == "paused"


async def test_resume_of_a_corrupt_checkpoint_is_refused_and_keeps_it(tmp_path: Path) -> None:
    """A byte of the paused sandbox's data changed on disk: the resume answers 422 naming the
    file rather than restoring other data, the sandbox stays paused with its files as they are,
    and once the byte is back (and the manifest its own) it resumes with what it had."""
    async with double_node(tmp_path, repository="off") as node, served(node) as api:
        sandbox_id = (await api.post("/sandboxes", json={"templateID": "base"})).json()["sandboxID"]
        node.guest(sandbox_id).write("/work", "before the pause")
        assert (await api.post(f"/sandboxes/{sandbox_id}/pause")).status_code == 204
        seq = node.row(sandbox_id).checkpoint_seq
        checkpoint = checkpoints.pause_dir(node.config.paths.sandboxes / sandbox_id, seq)
        files = Snapshot.load_manifest(checkpoint).files()
        role, path = next((r, p) for r, p in files.items() if b"before the pause" in p.read_bytes())
        saved = path.read_bytes()
        path.write_bytes(saved.replace(b"before the pause", b"bEfore the pause"))
        corrupt = {p: p.read_bytes() for p in files.values()}

        response = await api.post(f"/sandboxes/{sandbox_id}/resume", json={"timeout": 60})
        message = error(response, 422)
        assert f"is corrupt: file {role} ({path}) checksum mismatch" in message
        assert response.headers["Should-Retry"] == "false"
        row = node.row(sandbox_id)
        assert (row.state, row.checkpoint_seq) == (SandboxState.PAUSED, seq)
        assert {p: p.read_bytes() for p in files.values()} == corrupt

        path.write_bytes(saved)
        # A manifest of a newer format is refused the same way.
        manifest = checkpoint / SNAPSHOT_MANIFEST
        written = manifest.read_text()
        manifest.write_text(json.dumps({**json.loads(written), "version": MANIFEST_VERSION + 1}))
        response = await api.post(f"/sandboxes/{sandbox_id}/resume", json={"timeout": 60})
        assert f"written by format version {MANIFEST_VERSION + 1}" in error(response, 422)
        assert node.row(sandbox_id).state is SandboxState.PAUSED

        manifest.write_text(written)
        resumed = await api.post(f"/sandboxes/{sandbox_id}/resume", json={"timeout": 60})
        assert resumed.status_code == 201, resumed.text
        assert node.guest(sandbox_id).read("/work") == "before the pause"


async def test_listing_leaves_out_internal_sandboxes(tmp_path: Path) -> None:
    async with double_node(tmp_path) as node, served(node) as api:
        await node.orchestrator.create(node.request(internal=True))
        mine = (await api.post("/sandboxes", json={"templateID": "base"})).json()["sandboxID"]
        listed = (await api.get("/v2/sandboxes")).json()
        assert [s["sandboxID"] for s in listed] == [mine]


async def test_metrics_come_from_envd_and_the_vmm(tmp_path: Path) -> None:
    async with double_node(tmp_path) as node, served(node) as api:
        sandbox_id = (await api.post("/sandboxes", json={"templateID": "base"})).json()["sandboxID"]
        response = await api.get(f"/sandboxes/{sandbox_id}/metrics")
        assert response.status_code == 200, response.text
        sample = response.json()[0]
        # Memory is the guest's (envd's); CPU the VMM's on the host (a double's used none).
        assert sample["memUsed"] == 100 << 20 and sample["cpuUsedPct"] == 0.0
