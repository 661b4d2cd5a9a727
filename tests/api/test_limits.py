"""Limits, answered 429 as E2B does: requests a second per key; per team, sandboxes at once,
creates a second and disk."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from aenv.api.extensions import WAIT_HEADER
from aenv.api.limits import RateLimiter
from aenv.orchestrator.teams import TeamStore
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
        return {"team_max_sandboxes": 2}

    async def test_a_team_at_its_sandbox_limit_gets_429(self, node: Node) -> None:
        created = [await node.client.post("/sandboxes", json={"templateID": "base"}) for _ in "ab"]
        assert [r.status_code for r in created] == [201, 201]
        refused = await node.client.post("/sandboxes", json={"templateID": "base"})
        assert refused.status_code == 429
        body = refused.json()
        assert body["code"] == 429
        assert "maximum number of concurrent sandboxes for this team (2)" in body["message"]
        # Another key of the same team shares its count...
        _key, same = node.keys.create("same team")
        shared = await node.client.post(
            "/sandboxes", json={"templateID": "base"}, headers={"X-API-KEY": same}
        )
        assert shared.status_code == 429
        # ...a key of another team has a count of its own.
        team = TeamStore(node.orchestrator.catalog).create("other")
        _key, other = node.keys.create("other", team.id)
        again = await node.client.post(
            "/sandboxes", json={"templateID": "base"}, headers={"X-API-KEY": other}
        )
        assert again.status_code == 201
        assert len(node.orchestrator.list()) == 3


class TestTeamCreates:
    @pytest.fixture
    def settings(self) -> dict[str, Any]:
        return {"team_creates_per_s": 0.01}

    async def test_a_team_past_its_creates_a_second_gets_429(self, node: Node) -> None:
        first = await node.client.post("/sandboxes", json={"templateID": "base"})
        assert first.status_code == 201, first.text
        refused = await node.client.post("/sandboxes", json={"templateID": "base"})
        assert refused.status_code == 429
        assert "sandbox creates a second per team" in refused.json()["message"]
        assert int(refused.headers["Retry-After"]) >= 1
        forked = await node.client.post(f"/sandboxes/{first.json()['sandboxID']}/fork")
        assert forked.status_code == 429  # forks start sandboxes too
        assert len(node.orchestrator.list()) == 1
        # Other routes are not counted; another team has its own bucket.
        assert (await node.client.get("/v2/sandboxes")).status_code == 200
        team = TeamStore(node.orchestrator.catalog).create("other")
        _key, other = node.keys.create("other", team.id)
        theirs = await node.client.post(
            "/sandboxes", json={"templateID": "base"}, headers={"X-API-KEY": other}
        )
        assert theirs.status_code == 201


class TestTeamCreatesWithWait:
    @pytest.fixture
    def settings(self) -> dict[str, Any]:
        return {"team_creates_per_s": 5}

    async def test_creates_past_the_team_s_rate_that_may_wait_take_their_turn(
        self, node: Node
    ) -> None:
        """A burst of the team's rate and as many more: those that may wait are held for their
        turn (spread at 5 a second), not refused; one that may not wait is refused."""
        waiting = {WAIT_HEADER: "60"}
        burst = [
            node.client.post("/sandboxes", json={"templateID": "base"}, headers=waiting)
            for _ in range(10)
        ]
        answers = await asyncio.gather(*burst)
        assert [a.status_code for a in answers] == [201] * 10, [a.text for a in answers]
        refused = await node.client.post("/sandboxes", json={"templateID": "base"})
        assert refused.status_code == 429, refused.text
        assert int(refused.headers["Retry-After"]) >= 1


class TestTeamDisk:
    @pytest.fixture
    def settings(self) -> dict[str, Any]:
        # The doubles' base template has a disk of 2048 MiB: one sandbox and one volume fit.
        return {"team_max_disk_mb": 2100, "volume_size_mb": 48}

    async def test_a_team_past_its_disk_gets_429(self, node: Node) -> None:
        made = await node.client.post("/volumes", json={"name": "data"})
        assert made.status_code == 201, made.text
        sandbox = await node.client.post("/sandboxes", json={"templateID": "base"})
        assert sandbox.status_code == 201, sandbox.text
        refused = await node.client.post("/volumes", json={"name": "more"})
        assert refused.status_code == 429
        assert "limit of 2100 MiB" in refused.json()["message"]
        second = await node.client.post("/sandboxes", json={"templateID": "base"})
        assert second.status_code == 429
        assert [v.name for v in node.orchestrator.volumes.list()] == ["data"]
        assert len(node.orchestrator.list()) == 1
        killed = await node.client.delete(f"/sandboxes/{sandbox.json()['sandboxID']}")
        assert killed.status_code == 204
        assert (await node.client.post("/volumes", json={"name": "more"})).status_code == 201
