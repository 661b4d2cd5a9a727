"""Per-key limits: requests a second and sandboxes at once, both answered 429 as E2B does."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from aenv.api.extensions import WAIT_HEADER
from aenv.api.limits import RateLimiter
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


def test_a_request_that_may_wait_takes_a_later_token_within_its_wait() -> None:
    limiter = RateLimiter(rate=10, burst=2, max_wait=60)
    assert [limiter.take("k"), limiter.take("k")] == [0.0, 0.0]  # the burst
    assert limiter.take("k") is None  # no wait asked: refused, nothing spent
    assert limiter.take("k", wait=0.01) is None  # not within its wait
    held = [limiter.take("k", wait=60) for _ in range(3)]
    assert all(h is not None for h in held), held
    first, second, third = (float(h) for h in held if h is not None)
    assert 0 < first < second < third  # each behind the one before
    # A request that does not wait is counted behind the promised ones.
    assert limiter.retry_in("k") > third
    # The node's `create_max_wait` bounds any wait asked.
    assert RateLimiter(rate=10, burst=0, max_wait=0.05).take("k", wait=60) is None
    assert limiter.take("other") == 0.0  # a bucket per key


class TestRateWithWait:
    @pytest.fixture
    def settings(self) -> dict[str, Any]:
        return {"key_requests_per_s": 20, "key_request_burst": 2}

    async def test_requests_past_the_rate_that_may_wait_are_held_not_refused(
        self, node: Node
    ) -> None:
        waiting = {WAIT_HEADER: "60"}
        calls = [node.client.get("/v2/sandboxes", headers=waiting) for _ in range(8)]
        assert [r.status_code for r in await asyncio.gather(*calls)] == [200] * 8


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
