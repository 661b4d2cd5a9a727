"""The operator's routes behind the node's admin token (never an API key): teams and their keys,
E2B's admin routes (a team's keys, killing its sandboxes, cancelling its builds, running counts),
and `aenv teams` / `aenv keys create --team`."""

from __future__ import annotations

import json
import os
import stat
import subprocess
import sys

from aenv.api.app import create_api
from aenv.ids import TEAM_ID
from aenv.orchestrator.build_records import BuildStatus
from aenv.orchestrator.teams import TeamStore
from tests.api.conftest import API_KEY, BuildNode, Node
from tests.api.test_routes import error
from tests.proxy.support import serve
from tests.support.ports import free_port


def _token(node: Node) -> dict[str, str]:
    return {"X-Admin-Token": node.config.paths.admin_token.read_text().strip()}


async def test_only_the_admin_token_opens_the_admin_routes(node: Node) -> None:
    path = node.config.paths.admin_token
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    for headers in ({}, {"X-Admin-Token": "aenv_admin_" + "0" * 48}):
        refused = await node.client.get("/aenv/admin/teams", headers=headers)
        assert "admin token" in error(refused, 401)
        assert error(await node.client.get("/admin/sandboxes/running-counts", headers=headers), 401)
    # The client sends its API key too: a key is no admin token.
    assert error(await node.client.post(f"/admin/teams/{TEAM_ID}/sandboxes/kill"), 401)
    # And the token is no API key.
    headers = {"X-API-KEY": path.read_text().strip()}
    assert error(await node.client.get("/v2/sandboxes", headers=headers), 401)
    listed = await node.client.get("/aenv/admin/teams", headers=_token(node))
    assert [t["teamID"] for t in listed.json()] == [TEAM_ID]


async def test_teams_and_their_keys_are_the_operator_s(node: Node) -> None:
    admin = _token(node)
    made = await node.client.post("/aenv/admin/teams", json={"name": "beta"}, headers=admin)
    assert made.status_code == 201, made.text
    team = made.json()["teamID"]
    again = await node.client.post("/aenv/admin/teams", json={"name": "beta"}, headers=admin)
    assert "already exists" in error(again, 409)
    assert error(await node.client.post("/aenv/admin/teams", json={}, headers=admin), 400)
    unknown = await node.client.post(
        "/admin/teams/no-such-team/api-keys", json={"name": "k"}, headers=admin
    )
    assert "team" in error(unknown, 404)
    key = await node.client.post(f"/admin/teams/{team}/api-keys", json={"name": "k"}, headers=admin)
    assert key.status_code == 201, key.text
    theirs = {"X-API-KEY": key.json()["key"]}
    assert (await node.client.get("/teams", headers=theirs)).json()[0]["name"] == "beta"
    # A sandbox of the team; the counts by team; the team cannot go while it has one.
    sandbox = await node.client.post("/sandboxes", json={"templateID": "base"}, headers=theirs)
    assert sandbox.status_code == 201, sandbox.text
    mine = await node.client.post("/sandboxes", json={"templateID": "base"})
    counts = await node.client.get("/admin/sandboxes/running-counts", headers=admin)
    assert counts.json() == {TEAM_ID: 1, team: 1}
    volume = await node.client.post("/volumes", json={"name": "data"}, headers=theirs)
    assert volume.status_code == 201, volume.text
    refused = await node.client.delete(f"/aenv/admin/teams/{team}", headers=admin)
    assert "still owns 1 sandboxes, 1 volumes: remove them first" in error(refused, 409)
    held = (await node.client.get(f"/aenv/admin/teams/{team}/holdings", headers=admin)).json()
    assert held == {
        "sandboxes": [sandbox.json()["sandboxID"]],
        "volumes": [volume.json()["volumeID"]],
        "templates": [],
        "snapshots": [],
    }
    assert error(await node.client.get(f"/aenv/admin/teams/{team}/holdings"), 401)
    killed = await node.client.post(f"/admin/teams/{team}/sandboxes/kill", headers=admin)
    assert killed.json() == {"killedCount": 1, "failedCount": 0}
    assert [r.id for r in node.orchestrator.list()] == [mine.json()["sandboxID"]]
    # Its volume still keeps it.
    refused = await node.client.delete(f"/aenv/admin/teams/{team}", headers=admin)
    assert "still owns 1 volumes" in error(refused, 409)
    gone = await node.client.delete(f"/volumes/{volume.json()['volumeID']}", headers=theirs)
    assert gone.status_code == 204, gone.text
    # A key of another team is not this team's to delete.
    other = next(k for k in node.keys.list() if k.team_id == TEAM_ID)
    assert error(
        await node.client.delete(f"/admin/teams/{team}/api-keys/{other.id}", headers=admin), 404
    )
    # The team goes, its keys with it; the default team stays.
    assert (await node.client.delete(f"/aenv/admin/teams/{team}", headers=admin)).status_code == 204
    assert error(await node.client.get("/teams", headers=theirs), 401)
    assert error(await node.client.delete(f"/aenv/admin/teams/{TEAM_ID}", headers=admin), 409)
    assert [t.id for t in TeamStore(node.orchestrator.catalog).list()] == [TEAM_ID]


async def test_a_team_s_builds_are_cancelled(build_node: BuildNode) -> None:
    client = build_node.client
    home = build_node.builder.orc.config.paths
    admin = {"X-Admin-Token": home.admin_token.read_text().strip()}
    requested = await client.post("/v3/templates", json={"name": "waiting"})
    assert requested.status_code == 202, requested.text
    build = build_node.builder.get("waiting", requested.json()["buildID"])
    assert build is not None and build.status is BuildStatus.WAITING
    cancelled = await client.post(f"/admin/teams/{TEAM_ID}/builds/cancel", headers=admin)
    assert cancelled.json() == {"cancelledCount": 1, "failedCount": 0}
    assert build.status is BuildStatus.ERROR and "cancelled" in str(build.reason)
    nothing = await client.post(f"/admin/teams/{TEAM_ID}/builds/cancel", headers=admin)
    assert nothing.json() == {"cancelledCount": 0, "failedCount": 0}


def test_the_cli_manages_teams(node: Node) -> None:
    app = create_api(node.orchestrator, node.config, node.keys)
    with serve(app, free_port()) as url:
        env = {**os.environ, "E2B_API_URL": url, "E2B_API_KEY": API_KEY}
        env.pop("AENV_ADMIN_TOKEN", None)

        def aenv(*args: str) -> str:
            done = subprocess.run(
                [sys.executable, "-m", "aenv.cli", *args, "--home", str(node.config.home)],
                env=env,
                capture_output=True,
                text=True,
                check=True,
            )
            return done.stdout

        team = aenv("teams", "create", "gamma").strip()
        listed = json.loads(aenv("teams", "list", "--json"))
        assert {t["name"] for t in listed} == {TEAM_ID, "gamma"}
        value = aenv("keys", "create", "ci", "--team", "gamma").strip()
        key = node.keys.verify(value)
        assert key is not None and key.team_id == team
        aenv("teams", "delete", "gamma")
    assert node.keys.verify(value) is None
