"""Requests no node should serve with a 500: each gets a JSON 4xx naming what is wrong."""

from __future__ import annotations

from urllib.parse import urlencode

import pytest

from aenv.api.models import MAX_METADATA_ENTRIES
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
