"""Secrets (`/secrets`) over a node on doubles: the E2B SDK's `Secret` against the routes,
every field and refusal, versions, values never in a response, encrypted at rest, kept over a
restart."""

from __future__ import annotations

import sqlite3
from pathlib import Path
from typing import Any

import httpx
import pytest
from e2b import AsyncSecret, SecretNotFoundException

from aenv.orchestrator.catalog import Catalog
from aenv.orchestrator.secrets import SecretStore, load_key
from tests.api.test_routes import KEY, error, served
from tests.doubles.node import double_node

VALUE = "sk-live-0123456789abcdef"
OTHER = "sk-live-fedcba9876543210"


async def test_the_sdk_creates_reads_updates_and_deletes(tmp_path: Path) -> None:
    async with double_node(tmp_path) as node, served(node) as api:
        opts: dict[str, Any] = {"api_key": KEY, "api_url": str(api.base_url)}
        created = await AsyncSecret.create("OpenAI-Key", VALUE, {"team": "ml"}, **opts)
        assert created.name == "openai-key"  # canonical: lower case
        assert created.secret_id.startswith("sec_")
        assert (created.version, created.metadata) == (1, {"team": "ml"})
        for ref in (created.secret_id, "openai-key", "OPENAI-KEY"):
            assert (await AsyncSecret.get_info(ref, **opts)).secret_id == created.secret_id
        updated = await AsyncSecret.update("openai-key", OTHER, **opts)
        assert (updated.version, updated.metadata) == (2, {"team": "ml"})  # metadata kept
        assert updated.updated_at >= created.updated_at
        replaced = await AsyncSecret.update(created.secret_id, VALUE, {"new": "1"}, **opts)
        assert (replaced.version, replaced.metadata) == (3, {"new": "1"})
        assert node.orchestrator.secrets.value("openai-key") == VALUE

        for i in range(3):
            await AsyncSecret.create(f"s{i}", VALUE, **opts)
        paginator = AsyncSecret.list(limit=2, **opts)
        names = []
        while paginator.has_next:
            names += [s.name for s in await paginator.next_items()]
        assert names == ["openai-key", "s0", "s1", "s2"]  # oldest first, in pages of 2

        assert await AsyncSecret.exists("S0", **opts)
        assert await AsyncSecret.destroy("s0", **opts) is True
        assert await AsyncSecret.destroy("s0", **opts) is False
        assert not await AsyncSecret.exists("s0", **opts)
        with pytest.raises(SecretNotFoundException):
            await AsyncSecret.update("s0", VALUE, **opts)
        assert node.orchestrator.secrets.value("s0") is None


async def _every_answer(api: httpx.AsyncClient) -> list[httpx.Response]:
    """One response of each route, the failing ones included."""
    made = await api.post("/secrets", json={"name": "a", "value": VALUE, "metadata": {}})
    assert made.status_code == 201, made.text
    sid = made.json()["secretID"]
    return [
        made,
        await api.post("/secrets", json={"name": "A", "value": VALUE}),  # taken
        await api.post("/secrets", json={"name": "b c", "value": VALUE}),
        await api.post("/secrets", json={"name": "b", "value": VALUE + "\n"}),
        await api.post(f"/secrets/{sid}", json={"value": OTHER}),
        await api.post(f"/secrets/{sid}", json={"value": OTHER, "version": 1}),
        await api.get("/secrets"),
        await api.get(f"/secrets/{sid}"),
        await api.get("/secrets/A"),
        await api.delete("/secrets/a"),
    ]


async def test_no_answer_carries_a_value(tmp_path: Path) -> None:
    async with double_node(tmp_path) as node, served(node) as api:
        answers = await _every_answer(api)
        assert [a.status_code for a in answers] == [
            201,
            409,
            400,
            400,
            200,
            400,
            200,
            200,
            200,
            204,
        ]
        for answer in answers:
            assert VALUE not in answer.text and OTHER not in answer.text
            assert "value" not in (answer.json() if answer.content else {})
        shown = answers[6].json()[0]
        assert sorted(shown) == [
            "createdAt", "currentVersion", "metadata", "name", "secretID", "updatedAt",
        ]  # fmt: skip
        assert shown["metadata"] == {} and shown["currentVersion"] == 2


async def test_refusals(tmp_path: Path) -> None:
    async with double_node(tmp_path) as node, served(node) as api:

        async def create(**body: Any) -> httpx.Response:
            return await api.post("/secrets", json={"name": "k", "value": "v", **body})

        assert "pattern" in error(await create(name="a.b"), 400)
        assert "at most 128" in error(await create(name="a" * 129), 400)
        assert "at least 1" in error(await create(name=""), 400)
        assert "reserved" in error(await create(name="SEC_x"), 400)
        assert "'version'" in error(await create(version=2), 400)
        assert "value" in error(await api.post("/secrets", json={"name": "k"}), 400)
        assert "header" in error(await create(value=" padded"), 400)
        assert "header" in error(await create(value="x" * 8193), 400)
        too_many = {str(i): "" for i in range(33)}
        assert "at most 32 entries" in error(await create(metadata=too_many), 400)
        assert "128 bytes" in error(await create(metadata={"k" * 129: ""}), 400)
        assert "1024 bytes" in error(await create(metadata={"k": "é" * 513}), 400)
        big = {f"k{i}": "v" * 1000 for i in range(9)}
        assert "8192 bytes" in error(await create(metadata=big), 400)
        assert (await create(metadata={"k" * 128: "v" * 1024})).status_code == 201
        assert "already exists" in error(await create(name="K"), 409)
        assert "limit" in error(await api.get("/secrets?limit=0"), 400)
        assert "limit" in error(await api.get("/secrets?limit=101"), 400)
        assert "nextToken" in error(await api.get("/secrets?nextToken=sec_x"), 400)
        assert "'team'" in error(await api.get("/secrets?team=x"), 400)
        for call in (api.get, api.delete):
            assert "not found" in error(await call("/secrets/missing"), 404)
        assert "not found" in error(await api.post("/secrets/missing", json={"value": "v"}), 404)


async def test_values_are_encrypted_at_rest_and_kept_over_a_restart(tmp_path: Path) -> None:
    async with double_node(tmp_path) as node, served(node) as api:
        made = await api.post("/secrets", json={"name": "k", "value": VALUE})
        assert made.status_code == 201
        key_file = node.config.paths.secrets_key
        assert key_file.stat().st_mode & 0o777 == 0o600
        node.orchestrator.catalog.db.execute("PRAGMA wal_checkpoint(FULL)")
        raw = node.config.paths.catalog.read_bytes()
        assert b"sk-live" not in raw
    reopened = Catalog(node.config.paths.catalog)
    try:
        store = SecretStore(reopened, load_key(key_file, create=False))
        assert store.value("K") == VALUE
        # Another key (another node's, a lost one) reads nothing, rather than garbage.
        other = tmp_path / "other.key"
        assert SecretStore(reopened, load_key(other, create=True)).value("k") is None
        # A version's ciphertext is bound to its row: moved to another secret, it opens not.
        store.create("local", "j", OTHER, {})
        db: sqlite3.Connection = reopened.db
        db.execute(
            "UPDATE secret_versions SET value = (SELECT value FROM secret_versions v"
            " JOIN secrets s ON s.id = v.secret_id WHERE s.name = 'k')"
            " WHERE secret_id = (SELECT id FROM secrets WHERE name = 'j')"
        )
        assert store.value("j") is None
    finally:
        reopened.close()


def test_an_operators_key_file_must_exist_and_hold_a_key(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="No such file"):
        load_key(tmp_path / "missing", create=False)
    short = tmp_path / "short"
    short.write_text("c2hvcnQ=\n")
    with pytest.raises(ValueError, match="5 bytes, not 32"):
        load_key(short, create=False)
    made = load_key(tmp_path / "made", create=True)
    assert load_key(tmp_path / "made", create=False) == made
    assert made != load_key(tmp_path / "again", create=True)  # a new key each time
