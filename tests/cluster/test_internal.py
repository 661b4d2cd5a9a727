"""A node's internal API: only the cluster token opens it, a user's API key never does, and
what passes reaches the node's routes as a client's request would, acting for the named key."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from websockets.exceptions import InvalidStatus
from websockets.sync.client import connect as ws_connect

from aenv.api.keys import KeyStore
from aenv.cluster.internal import CALLER_HEADER, TOKEN_HEADER
from aenv.cluster.secret import ClusterSecret
from aenv.orchestrator.catalog import Catalog
from tests.cluster.node_double import NodeDouble
from tests.cluster.shared import SECRET
from tests.proxy.support import serve
from tests.support.ports import free_port


@pytest.fixture
def node(tmp_path: Path) -> Iterator[tuple[str, str]]:
    keys = KeyStore(tmp_path / "keys.json")
    _, user_key = keys.create("user")
    double = NodeDouble("a", tmp_path / "home", Catalog(tmp_path / "a.db"))
    double.add("sbone", 1000.0)
    try:
        with serve(double.app(keys), free_port()) as url:
            yield url, user_key
    finally:
        double.catalog.close()


def test_without_the_token_internal_routes_are_401_saying_why(node: tuple[str, str]) -> None:
    url, user_key = node
    missing = httpx.get(f"{url}/internal/sandboxes/sbone")
    wrong = httpx.get(
        f"{url}/internal/sandboxes/sbone",
        headers={TOKEN_HEADER: ClusterSecret("another-secret-0123456789").bearer},
    )
    user = httpx.get(
        f"{url}/internal/sandboxes/sbone",
        headers={"X-API-Key": user_key, "Authorization": f"Bearer {user_key}"},
    )
    assert missing.status_code == 401
    assert missing.json() == {
        "code": 401,
        "message": f"internal routes need the cluster's token in {TOKEN_HEADER}",
    }
    assert wrong.status_code == 401 and "wrong cluster token" in wrong.json()["message"]
    assert user.status_code == 401


def test_with_the_token_the_prefix_is_stripped_and_the_caller_acts(
    node: tuple[str, str],
) -> None:
    url, _ = node
    headers = {TOKEN_HEADER: SECRET.bearer, CALLER_HEADER: "key-123"}
    found = httpx.get(f"{url}/internal/sandboxes/sbone", headers=headers)
    created = httpx.post(f"{url}/internal/sandboxes", headers=headers, json={})
    assert found.status_code == 200 and found.json() == {"sandboxID": "sbone", "node": "a"}
    assert created.status_code == 201
    # Naming no key, the token's holder acts as the cluster.
    listed = httpx.get(f"{url}/internal/v2/sandboxes", headers={TOKEN_HEADER: SECRET.bearer})
    assert listed.status_code == 200
    assert [s["sandboxID"] for s in listed.json()] == ["asb1", "sbone"]


def test_public_routes_stay_behind_the_users_key(node: tuple[str, str]) -> None:
    url, user_key = node
    assert httpx.get(f"{url}/sandboxes/sbone").status_code == 401
    # The cluster token is no API key: public routes do not take it.
    assert (
        httpx.get(f"{url}/sandboxes/sbone", headers={TOKEN_HEADER: SECRET.bearer}).status_code
        == 401
    )
    assert httpx.get(f"{url}/sandboxes/sbone", headers={"X-API-Key": user_key}).status_code == 200


def test_a_websocket_without_the_token_is_refused_with_401(node: tuple[str, str]) -> None:
    url, _ = node
    with pytest.raises(InvalidStatus) as refused:
        ws_connect(url.replace("http", "ws") + "/internal/anything", open_timeout=10)
    assert refused.value.response.status_code == 401
    assert b"cluster's token" in refused.value.response.body
