"""API keys: stored hashed, several per node, managed through E2B's `/api-keys` routes and
`aenv keys`; an older node's single key file keeps working; no key reaches a log line."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest

from aenv.api.app import create_api
from aenv.api.keys import KeyStore, LastKey, open_keys
from aenv.config import Paths
from tests.api.conftest import API_KEY, Node
from tests.proxy.support import serve
from tests.support.ports import free_port


def test_a_store_holds_digests_not_keys(tmp_path: Path) -> None:
    store = KeyStore(tmp_path / "api-keys.json")
    first, first_value = store.create("first")
    second, second_value = store.create("second")
    stored = (tmp_path / "api-keys.json").read_text()
    assert first_value not in stored and second_value not in stored
    reopened = KeyStore(tmp_path / "api-keys.json")
    assert reopened.verify(first_value) == reopened.get(first.id)
    assert reopened.verify(f" {second_value}\n") is not None  # as a header may carry it
    assert reopened.verify(first_value[:-1] + "x") is None
    assert reopened.verify("") is None and reopened.verify(None) is None
    reopened.revoke(first.id)
    assert reopened.verify(first_value) is None
    with pytest.raises(LastKey):
        reopened.revoke(second.id)
    with pytest.raises(KeyError):
        reopened.revoke(first.id)


def test_an_older_node_s_key_file_keeps_working(tmp_path: Path) -> None:
    paths = Paths(tmp_path)
    paths.api_key.write_text(API_KEY + "\n")  # all an older node had
    store, created = open_keys(paths)
    assert not created
    assert store.verify(API_KEY) is not None
    assert API_KEY not in paths.api_keys.read_text()
    again, _ = open_keys(paths)  # a second start imports nothing twice
    assert len(again.list()) == 1


def test_a_revoked_default_key_stays_revoked_after_a_restart(tmp_path: Path) -> None:
    paths = Paths(tmp_path)
    store, _ = open_keys(paths)
    first = paths.api_key.read_text().strip()
    _, second = store.create("ci")
    store.revoke(store.list()[0].id)
    reopened, created = open_keys(paths)  # the key file still holds the revoked value
    assert not created
    assert reopened.verify(first) is None
    assert reopened.verify(second) is not None
    assert [k.name for k in reopened.list()] == ["ci"]


def test_a_first_start_generates_a_key(tmp_path: Path) -> None:
    paths = Paths(tmp_path)
    store, created = open_keys(paths)
    value = paths.api_key.read_text().strip()
    assert created and store.verify(value) is not None
    assert paths.api_key.stat().st_mode & 0o777 == 0o600


async def test_keys_through_the_api(node: Node) -> None:
    listed = (await node.client.get("/api-keys")).json()
    assert [k["name"] for k in listed] == ["test"]
    assert listed[0]["mask"] == {
        "prefix": "e2b_",
        "valueLength": 40,
        "maskedValuePrefix": API_KEY[4:6],
        "maskedValueSuffix": API_KEY[-4:],
    }
    assert "key" not in listed[0] and listed[0]["lastUsed"] is not None
    created = await node.client.post("/api-keys", json={"name": "ci"})
    assert created.status_code == 201
    new = created.json()
    assert new["key"].startswith("e2b_") and len(new["key"]) == 44
    headers = {"X-API-KEY": new["key"]}
    assert (await node.client.get("/api-keys", headers=headers)).status_code == 200
    renamed = await node.client.patch(f"/api-keys/{new['id']}", json={"name": "ci-2"})
    assert renamed.status_code == 200
    names = {k["name"] for k in (await node.client.get("/api-keys")).json()}
    assert names == {"test", "ci-2"}
    assert (await node.client.delete(f"/api-keys/{new['id']}")).status_code == 204
    refused = await node.client.get("/api-keys", headers=headers)
    assert (refused.status_code, refused.json()["message"]) == (401, "Invalid API key")


@pytest.mark.parametrize(
    ("method", "path", "body", "status", "message"),
    [
        ("DELETE", "/api-keys/nope", None, 404, "nope"),
        ("PATCH", "/api-keys/nope", {"name": "x"}, 404, "nope"),
        ("POST", "/api-keys", {"name": ""}, 400, "name"),
        ("POST", "/api-keys", {"name": "x", "scopes": ["all"]}, 400, "scopes"),
        ("POST", "/api-keys", {}, 400, "name"),
        ("POST", "/api-keys", {"name": "ci\nfake-row"}, 400, "control characters"),
        ("POST", "/api-keys", {"name": "\x1b[2Jci"}, 400, "name"),
        ("POST", "/api-keys", {"name": "ci\x7f"}, 400, "name"),
        ("POST", "/api-keys", {"name": "ci\x9b"}, 400, "name"),
        ("PATCH", "/api-keys/nope", {"name": "a\x00b"}, 400, "name"),
    ],
)
async def test_bad_key_requests(
    node: Node, method: str, path: str, body: object, status: int, message: str
) -> None:
    response = await node.client.request(method, path, json=body)
    assert response.status_code == status
    assert response.json()["code"] == status and message in response.json()["message"]


async def test_the_last_key_cannot_be_revoked(node: Node) -> None:
    (only,) = (await node.client.get("/api-keys")).json()
    response = await node.client.delete(f"/api-keys/{only['id']}")
    assert response.status_code == 400
    assert (await node.client.get("/api-keys")).status_code == 200


async def test_no_key_reaches_a_log_line(node: Node, caplog: pytest.LogCaptureFixture) -> None:
    wrong = "e2b_" + "f" * 40
    with caplog.at_level(logging.DEBUG):
        created = (await node.client.post("/api-keys", json={"name": "logged?"})).json()
        await node.client.get("/api-keys", headers={"X-API-KEY": wrong})
        await node.client.get("/v2/sandboxes", headers={"Authorization": f"Bearer {wrong}"})
        await node.client.get("/sandboxes/nope", headers={"X-API-KEY": created["key"]})
    assert caplog.records  # the run logged something to look through
    for secret in (API_KEY, wrong, created["key"]):
        assert secret not in caplog.text


def test_the_cli_manages_keys(node: Node) -> None:
    app = create_api(node.orchestrator, node.config, node.keys)
    with serve(app, free_port()) as url:
        env = {**os.environ, "E2B_API_URL": url, "E2B_API_KEY": API_KEY}

        def aenv(*args: str) -> str:
            done = subprocess.run(
                [sys.executable, "-m", "aenv.cli", "keys", *args],
                env=env,
                capture_output=True,
                text=True,
                check=True,
            )
            return done.stdout

        value = aenv("create", "from-cli").strip()
        assert node.keys.verify(value) is not None
        listed = json.loads(aenv("list", "--json"))
        mine = next(k for k in listed if k["name"] == "from-cli")
        assert value not in json.dumps(listed)
        aenv("revoke", mine["id"])
    assert node.keys.verify(value) is None
