"""Idempotent creates over a node on doubles, served on loopback: retries with one
`Idempotency-Key`, sequential or concurrent, start one sandbox and all get it."""

from __future__ import annotations

import asyncio
from pathlib import Path

from tests.api.test_routes import error, served
from tests.doubles.node import double_node

BODY = {"templateID": "base", "metadata": {"try": "1"}}


async def test_concurrent_retries_start_one_sandbox(tmp_path: Path) -> None:
    async with double_node(tmp_path) as node, served(node) as api:
        held = node.driver.hold("restore")  # the first create is still starting for the others
        headers = {"Idempotency-Key": "create-1"}
        tries = [
            asyncio.create_task(api.post("/v2/sandboxes", json=BODY, headers=headers))
            for _ in range(20)
        ]
        await held.reached.wait()
        await asyncio.sleep(0.05)
        held.release()
        answers = await asyncio.gather(*tries)
        assert {a.status_code for a in answers} == {201}
        assert len({a.json()["sandboxID"] for a in answers}) == 1
        assert node.driver.calls["restore"] == 1 and len(node.catalog.list()) == 1
        later = await api.post("/v2/sandboxes", json=BODY, headers=headers)
        assert later.json() == answers[0].json()
        other = await api.post("/v2/sandboxes", json=BODY, headers={"Idempotency-Key": "create-2"})
        assert other.json()["sandboxID"] != later.json()["sandboxID"]
        assert len(node.catalog.list()) == 2


async def test_a_key_is_not_reused_for_another_request(tmp_path: Path) -> None:
    async with double_node(tmp_path) as node, served(node) as api:
        headers = {"Idempotency-Key": "k"}
        assert (await api.post("/v2/sandboxes", json=BODY, headers=headers)).status_code == 201
        changed = await api.post("/v2/sandboxes", json={**BODY, "timeout": 60}, headers=headers)
        assert "different create request" in error(changed, 422)
        v1 = await api.post("/sandboxes", json=BODY, headers=headers)  # another default timeout
        error(v1, 422)
        bad = await api.post("/v2/sandboxes", json=BODY, headers={"Idempotency-Key": "a b"})
        assert "Idempotency-Key" in error(bad, 400)
        assert len(node.catalog.list()) == 1


async def test_a_failed_create_is_retried(tmp_path: Path) -> None:
    async with double_node(tmp_path) as node, served(node) as api:
        headers = {"Idempotency-Key": "again"}
        node.driver.fail_next("restore")
        error(await api.post("/v2/sandboxes", json=BODY, headers=headers), 500)
        assert node.catalog.list() == []
        retried = await api.post("/v2/sandboxes", json=BODY, headers=headers)
        assert retried.status_code == 201, retried.text
        assert [r.id for r in node.catalog.list()] == [retried.json()["sandboxID"]]


async def test_a_key_whose_sandbox_is_gone_starts_a_new_one(tmp_path: Path) -> None:
    async with double_node(tmp_path) as node, served(node) as api:
        headers = {"Idempotency-Key": "short-lived"}
        first = (await api.post("/v2/sandboxes", json=BODY, headers=headers)).json()
        assert (await api.delete(f"/sandboxes/{first['sandboxID']}")).status_code == 204
        again = await api.post("/v2/sandboxes", json=BODY, headers=headers)
        assert again.status_code == 201, again.text
        assert again.json()["sandboxID"] != first["sandboxID"]
        assert [r.id for r in node.catalog.list()] == [again.json()["sandboxID"]]
        # The new one is what the key answers now.
        replayed = await api.post("/v2/sandboxes", json=BODY, headers=headers)
        assert replayed.json() == again.json()
        assert len(node.catalog.list()) == 1
