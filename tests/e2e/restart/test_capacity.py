"""A node at `max_sandboxes` (test_server.py restarts the server with a small
`AENV_MAX_SANDBOXES` for this suite) refuses further creates with 429 and E2B's JSON error, the
SDK raises its RateLimitException, a create racing for the last place wins it alone, and nothing
of the refused creates is left."""

from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest
from e2b import RateLimitException, Sandbox

from aenv.config import Paths
from tests.e2e.vmm_procs import vmm_sandbox_ids

HOME = Path(os.environ["AENV_HOME"])


def _create(server: str) -> httpx.Response:
    return httpx.post(
        f"{server}/v2/sandboxes",
        json={"templateID": "base", "timeout": 120},
        headers={"X-API-KEY": os.environ["E2B_API_KEY"]},
        timeout=120,
    )


def _failed_creates(server: str) -> str:
    metrics = httpx.get(f"{server}/metrics").text.splitlines()
    return next(line for line in metrics if line.startswith('aenv_creates_total{result="failure"}'))


def test_creates_beyond_the_cap_get_429_and_leave_nothing(server: str) -> None:
    cap = int(os.environ["AENV_MAX_SANDBOXES"])
    before = {s.sandbox_id for s in Sandbox.list().next_items()}  # paused ones count too
    failed = _failed_creates(server)
    made = [Sandbox.create(timeout=120) for _ in range(cap - len(before))]
    try:
        refused = _create(server)
        assert refused.status_code == 429
        assert refused.json()["code"] == 429 and refused.json()["message"]
        assert refused.json()["error_code"] == "sandbox_capacity_unavailable"
        with pytest.raises(RateLimitException):
            Sandbox.create(timeout=60)
        # Three creates race for the one place a kill frees: one wins, two are refused.
        assert made, "the node was full before this test"
        made.pop().kill()
        with ThreadPoolExecutor(3) as pool:
            statuses = sorted(r.status_code for r in pool.map(lambda _: _create(server), range(3)))
        assert statuses == [201, 429, 429]
    finally:
        for sandbox in Sandbox.list().next_items():
            if sandbox.sandbox_id not in before:
                Sandbox.kill(sandbox.sandbox_id)
    assert {s.sandbox_id for s in Sandbox.list().next_items()} == before
    assert _failed_creates(server) == failed  # a refusal is not a failed create
    assert vmm_sandbox_ids(HOME) <= before
    assert {p.name for p in Paths(HOME).sandboxes.iterdir()} <= before
