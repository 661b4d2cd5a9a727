"""Per-key limits: requests a second and sandboxes at once, both answered 429 as E2B does."""

from __future__ import annotations

from typing import Any

import pytest

from tests.api.conftest import Node


class TestRate:
    @pytest.fixture
    def settings(self) -> dict[str, Any]:
        return {"key_requests_per_s": 1, "key_request_burst": 3}

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


class TestConcurrentSandboxes:
    @pytest.fixture
    def settings(self) -> dict[str, Any]:
        return {"key_max_sandboxes": 2}

    async def test_a_key_at_its_sandbox_limit_gets_429(self, node: Node) -> None:
        created = [await node.client.post("/sandboxes", json={"templateID": "base"}) for _ in "ab"]
        assert [r.status_code for r in created] == [201, 201]
        refused = await node.client.post("/sandboxes", json={"templateID": "base"})
        assert refused.status_code == 429
        body = refused.json()
        assert body["code"] == 429
        assert "maximum number of concurrent sandboxes for this API key (2)" in body["message"]
        # Another key has a count of its own.
        _key, other = node.keys.create("other")
        again = await node.client.post(
            "/sandboxes", json={"templateID": "base"}, headers={"X-API-KEY": other}
        )
        assert again.status_code == 201
        assert len(node.orchestrator.list()) == 3
