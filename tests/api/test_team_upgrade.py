"""A data directory from before teams works after the upgrade: its catalog (schema 4, as the
release before teams wrote it: migrations never change once shipped), its key store and its
`template.json` files carry no team; all of it becomes the default team's, whose keys see and
drive it as before, while a new team sees none of it."""

from __future__ import annotations

import json
import sqlite3
from pathlib import Path

import httpx

from aenv.api.app import create_api
from aenv.api.keys import KeyStore
from aenv.ids import TEAM_ID
from aenv.orchestrator.migrations import MIGRATIONS, upgrade
from aenv.orchestrator.states import SandboxState
from aenv.orchestrator.teams import TeamStore
from tests.api.test_routes import KEY, served
from tests.doubles.node import DoubleNode, double_node
from tests.support import loopback_api

BEFORE_TEAMS = 4  # the schema version of the release before teams


def _as_before_teams(node: DoubleNode) -> None:
    """Rewrite the node's catalog, key store and templates as the release before teams kept
    them (the node is closed)."""
    path = node.config.paths.catalog
    current = sqlite3.connect(path)
    current.row_factory = sqlite3.Row
    sandboxes = [dict(row) for row in current.execute("SELECT * FROM sandboxes")]
    volumes = current.execute("SELECT id, name, token, created_at, size_mb FROM volumes").fetchall()
    current.close()
    for suffix in ("", "-wal", "-shm"):
        Path(f"{path}{suffix}").unlink(missing_ok=True)
    old = sqlite3.connect(path, isolation_level=None)
    old.execute("BEGIN IMMEDIATE")
    upgrade(old, str(path), MIGRATIONS[:BEFORE_TEAMS])
    old.execute("COMMIT")
    for row in sandboxes:
        del row["team_id"]
        marks = ", ".join("?" for _ in row)
        old.execute(
            f"INSERT INTO sandboxes ({', '.join(row)}) VALUES ({marks})",
            tuple(row.values()),
        )
    old.executemany("INSERT INTO volumes VALUES (?, ?, ?, ?, ?)", volumes)
    assert old.execute("PRAGMA user_version").fetchone()[0] == BEFORE_TEAMS
    old.close()
    keys = node.config.home / "api-keys.json"
    stored = json.loads(keys.read_text())
    keys.write_text(json.dumps([{k: v for k, v in e.items() if k != "team_id"} for e in stored]))
    for meta in node.config.paths.templates.glob("*/template.json"):
        raw = json.loads(meta.read_text())
        del raw["team_id"], raw["public"]
        meta.write_text(json.dumps(raw))


async def test_a_data_directory_from_before_teams_keeps_working(tmp_path: Path) -> None:
    async with double_node(tmp_path) as node:
        async with served(node) as api:
            made = await api.post("/v2/sandboxes", json={"templateID": "base"})
            sandbox = made.json()["sandboxID"]
            snap = await api.post(f"/sandboxes/{sandbox}/snapshots", json={"name": "s"})
            snapshot = snap.json()["snapshotID"]
            volume = (await api.post("/volumes", json={"name": "data"})).json()["volumeID"]
            assert (await api.post(f"/sandboxes/{sandbox}/pause")).status_code == 204
        await node.orchestrator.close()
        node.catalog.close()
        _as_before_teams(node)

        upgraded = node.reopen()
        node.orchestrator, node.catalog = upgraded.orchestrator, upgraded.catalog
        await upgraded.orchestrator.start()
        assert upgraded.row(sandbox).team_id == TEAM_ID
        assert upgraded.templates.get(snapshot).team_id == TEAM_ID
        assert [t.id for t in TeamStore(upgraded.catalog).list()] == [TEAM_ID]
        keys = KeyStore(node.config.home / "api-keys.json")
        assert [k.team_id for k in keys.list()] == [TEAM_ID]
        other = TeamStore(upgraded.catalog).create("new")
        _key, value = keys.create("new", other.id)
        app = create_api(upgraded.orchestrator, upgraded.config, keys)
        async with (
            loopback_api.served(app) as url,
            httpx.AsyncClient(base_url=url, headers={"X-API-Key": KEY}) as old,
            httpx.AsyncClient(base_url=url, headers={"X-API-Key": value}) as new,
        ):
            assert [s["sandboxID"] for s in (await old.get("/v2/sandboxes")).json()] == [sandbox]
            assert [s["snapshotID"] for s in (await old.get("/snapshots")).json()] == [snapshot]
            assert [v["volumeID"] for v in (await old.get("/volumes")).json()] == [volume]
            assert (await old.get("/teams")).json()[0]["teamID"] == TEAM_ID
            resumed = await old.post(f"/sandboxes/{sandbox}/connect", json={"timeout": 60})
            assert resumed.status_code == 201, resumed.text
            assert upgraded.row(sandbox).state is SandboxState.RUNNING
            # The new team sees none of it.
            assert (await new.get("/v2/sandboxes")).json() == []
            assert (await new.get("/snapshots")).json() == []
            assert (await new.get("/volumes")).json() == []
            assert (await new.get(f"/sandboxes/{sandbox}")).status_code == 404
            # Volume names are per team now: the new team may use the old one's.
            assert (await new.post("/volumes", json={"name": "data"})).status_code == 201
