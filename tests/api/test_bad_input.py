"""Requests no node should serve with a 500: each gets a JSON 4xx naming what is wrong."""

from __future__ import annotations

from urllib.parse import urlencode

import pytest

from aenv.api.models import DEFAULT_TIMEOUT_V2, MAX_METADATA_ENTRIES
from tests.api.conftest import Node


@pytest.mark.parametrize("route", ["/sandboxes", "/v2/sandboxes"])
async def test_a_metadata_filter_is_bounded(node: Node, route: str) -> None:
    many = urlencode({f"k{n}": "v" for n in range(1100)})
    response = await node.client.get(route, params={"metadata": many})
    assert response.status_code == 400
    assert response.json() == {
        "code": 400,
        "message": f"metadata filter: at most {MAX_METADATA_ENTRIES} entries",
    }
    # The most a sandbox can have still filters (and matches nothing here).
    most = urlencode({f"k{n}": "v" for n in range(MAX_METADATA_ENTRIES)})
    response = await node.client.get(route, params={"metadata": most})
    assert (response.status_code, response.json()) == (200, [])


async def test_a_fork_timeout_of_null_is_refused(node: Node) -> None:
    """E2B's `SandboxForkRequest.timeout` is an integer with a default: the SDKs leave it out
    rather than send null, so a null is a mistake, not a request for the default."""
    created = await node.client.post("/sandboxes", json={"templateID": "base"})
    sandbox_id = created.json()["sandboxID"]
    refused = await node.client.post(f"/sandboxes/{sandbox_id}/fork", json={"timeout": None})
    assert refused.status_code == 400 and "timeout" in refused.json()["message"]
    assert [r.id for r in node.orchestrator.list()] == [sandbox_id]
    forked = await node.client.post(f"/sandboxes/{sandbox_id}/fork", json={})
    assert forked.status_code == 201, forked.text
    child = forked.json()[0]["sandbox"]["sandboxID"]
    assert node.orchestrator.get(child).timeout == DEFAULT_TIMEOUT_V2
