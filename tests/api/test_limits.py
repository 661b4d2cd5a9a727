"""Per-key limits: requests a second and sandboxes at once, both answered 429 as E2B does."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from aenv.config import Config
from aenv.orchestrator.catalog import SandboxRecord
from aenv.orchestrator.states import SandboxState
from aenv.orchestrator.templates import Template
from tests.api.conftest import API_KEY, Node


class TestRate:
    @pytest.fixture
    def config(self, tmp_path: Path) -> Config:
        return Config(home=tmp_path, key_requests_per_s=1, key_request_burst=3)

    async def test_a_key_past_its_rate_gets_429(self, node: Node) -> None:
        statuses = [(await node.client.get("/v2/sandboxes")).status_code for _ in range(3)]
        assert statuses == [200, 200, 200]  # the burst
        limited = [await node.client.get("/v2/sandboxes") for _ in range(10)]
        refused = [r for r in limited if r.status_code == 429]
        assert refused, "ten more requests at once, and none refused"
        assert refused[0].json()["code"] == 429
        assert "Rate limit exceeded" in refused[0].json()["message"]
        assert int(refused[0].headers["Retry-After"]) >= 1
        # Another key has its own bucket.
        _key, other = node.keys.create("other")
        assert (await node.client.get("/v2/sandboxes", headers={"X-API-KEY": other})).is_success
        # The open paths are not counted.
        assert (await node.client.get("/health")).status_code == 204


def _row(n: int, owner: str, state: SandboxState) -> SandboxRecord:
    return SandboxRecord(
        id=f"{owner[:8]}{n:012d}",
        template_id="base",
        alias=None,
        state=state,
        cpu_count=1,
        memory_mb=256,
        disk_size_mb=1024,
        started_at=time.time(),
        end_at=time.time() + 600,
        metadata={},
        env_vars={},
        envd_access_token="t",
        owner=owner,
    )


class TestConcurrentSandboxes:
    @pytest.fixture
    def config(self, tmp_path: Path) -> Config:
        # Shutdown kills the rows the test made up (no VM runs them to pause).
        return Config(home=tmp_path, key_max_sandboxes=2, pause_on_shutdown=False)

    async def test_a_key_at_its_sandbox_limit_gets_429(self, node: Node, tmp_path: Path) -> None:
        key = node.keys.verify(API_KEY)
        assert key is not None
        other = "someone-else"
        catalog = node.orchestrator.catalog
        for n, (owner, state) in enumerate(
            [(key.id, SandboxState.RUNNING)] * 2
            + [(key.id, SandboxState.PAUSED)] * 3
            + [(other, SandboxState.RUNNING)] * 5
        ):
            catalog.insert(_row(n, owner, state))
        node.orchestrator.templates.save(_template(tmp_path))
        response = await node.client.post("/sandboxes", json={"templateID": "base"})
        assert response.status_code == 429
        body = response.json()
        assert body["code"] == 429
        assert "maximum number of concurrent sandboxes for this API key (2)" in body["message"]
        # Nothing was admitted: the rows are as they were.
        assert len(catalog.list()) == 10


def _template(tmp_path: Path) -> Template:
    directory = tmp_path / "templates" / "base" / "b1"
    directory.mkdir(parents=True)
    return Template(
        template_id="base",
        build_id="b1",
        aliases=("base",),
        cpu_count=1,
        memory_mb=256,
        disk_size_mb=1024,
        envd_version="0.1",
        envd_access_token="",
        created_at=time.time(),
        snapshot_dir=str(directory),
    )
