"""Teams on one node (doubles, served on loopback): two teams, each with its own key; every route
that names an object answers another team 404 (never 403), every list shows a team its own, the
node's templates and published ones are shared, only their owner changes them. Through plain
HTTP and the official E2B SDK."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlencode

import httpx
import pytest
from e2b import AsyncSandbox, AsyncVolume
from e2b.exceptions import NotFoundException

from aenv.api.app import create_api
from aenv.api.internal import CALLER_STATE, OPERATOR_CALLER
from aenv.api.keys import KeyStore
from aenv.ids import TEAM_ID
from aenv.orchestrator.states import SandboxState
from aenv.orchestrator.team_metrics import step_for
from aenv.orchestrator.teams import TeamStore
from aenv.server import _Tenancy
from tests.api.test_routes import error
from tests.doubles.node import DoubleNode, double_node
from tests.support import loopback_api
from tests.support.webhooks import QUIET_WEBHOOK

KEY_A = "e2b_" + "a1" * 20
KEY_B = "e2b_" + "b2" * 20


@dataclass
class Teams:
    a: httpx.AsyncClient  # the default team's key
    b: httpx.AsyncClient  # team "beta"'s
    team_b: str
    keys: KeyStore

    def sdk(self, key: str) -> dict[str, Any]:
        return {"api_key": key, "api_url": str(self.a.base_url)}


@asynccontextmanager
async def two_teams(node: DoubleNode) -> AsyncIterator[Teams]:
    keys = KeyStore(node.config.home / "api-keys.json")
    keys.add(KEY_A, "a")
    beta = TeamStore(node.catalog).create("beta")
    keys.add(KEY_B, "b", beta.id)
    async with (
        loopback_api.served(create_api(node.orchestrator, node.config, keys)) as url,
        httpx.AsyncClient(base_url=url, headers={"X-API-Key": KEY_A}, verify=False) as a,
        httpx.AsyncClient(base_url=url, headers={"X-API-Key": KEY_B}, verify=False) as b,
    ):
        yield Teams(a, b, beta.id, keys)


async def _json(response: httpx.Response, status: int = 200) -> Any:
    assert response.status_code == status, response.text
    return response.json()


async def test_every_route_answers_another_team_404(tmp_path: Path) -> None:
    async with double_node(tmp_path) as node, two_teams(node) as teams:
        a, b = teams.a, teams.b
        made = await _json(
            await a.post("/v2/sandboxes", json={"templateID": "base", "metadata": {"run": "1"}}),
            201,
        )
        sandbox = made["sandboxID"]
        paused = (await _json(await a.post("/v2/sandboxes", json={"templateID": "base"}), 201))[
            "sandboxID"
        ]
        assert (await a.post(f"/sandboxes/{paused}/pause")).status_code == 204
        snapshot = (await _json(await a.post(f"/sandboxes/{sandbox}/snapshots", json={}), 201))[
            "snapshotID"
        ]
        volume = await _json(await a.post("/volumes", json={"name": "data"}), 201)
        hook = await _json(
            await a.post(
                "/events/webhooks",
                json=QUIET_WEBHOOK,
            ),
            201,
        )
        key_a = next(k for k in await _json(await a.get("/api-keys")) if k["name"] == "a")
        vid = volume["volumeID"]
        calls: list[tuple[str, str, dict[str, Any] | None]] = [
            ("GET", f"/sandboxes/{sandbox}", None),
            ("POST", f"/sandboxes/{sandbox}/timeout", {"timeout": 5}),
            ("POST", f"/sandboxes/{sandbox}/refreshes", {}),
            ("POST", f"/sandboxes/{sandbox}/connect", {"timeout": 60}),
            ("POST", f"/v2/sandboxes/{sandbox}/connect", {"timeout": 60}),
            ("GET", f"/sandboxes/{sandbox}/metrics", None),
            ("PUT", f"/sandboxes/{sandbox}/network", {"allowOut": ["1.1.1.1"]}),
            ("GET", f"/sandboxes/{sandbox}/logs", None),
            ("GET", f"/v2/sandboxes/{sandbox}/logs", None),
            ("POST", f"/sandboxes/{sandbox}/pause", {}),
            ("POST", f"/sandboxes/{paused}/resume", {}),
            ("POST", f"/sandboxes/{paused}/connect", {"timeout": 60}),
            ("POST", f"/sandboxes/{sandbox}/snapshots", {}),
            ("POST", f"/sandboxes/{sandbox}/fork", {}),
            ("POST", f"/sandboxes/{snapshot}/fork", {}),  # a fork of A's snapshot
            ("POST", f"/aenv/sandboxes/{sandbox}/fork", {"children": [{}]}),
            ("POST", f"/aenv/sandboxes/{sandbox}/reset", {"snapshotID": snapshot}),
            ("GET", f"/events/sandboxes/{sandbox}", None),
            ("DELETE", f"/sandboxes/{sandbox}", None),
            ("GET", f"/templates/{snapshot}", None),
            ("PATCH", f"/templates/{snapshot}", {"public": True}),
            ("DELETE", f"/templates/{snapshot}", None),
            ("GET", f"/volumes/{vid}", None),
            ("DELETE", f"/volumes/{vid}", None),
            ("GET", f"/events/webhooks/{hook['id']}", None),
            ("PATCH", f"/events/webhooks/{hook['id']}", {"enabled": False}),
            ("DELETE", f"/events/webhooks/{hook['id']}", None),
            ("PATCH", f"/api-keys/{key_a['id']}", {"name": "taken"}),
            ("DELETE", f"/api-keys/{key_a['id']}", None),
        ]
        for method, path, body in calls:
            answer = await b.request(method, path, json=body)
            assert answer.status_code == 404, (method, path, answer.text)
            assert answer.json()["code"] == 404
        # The same answer as for an id that does not exist: nothing tells the two apart.
        unknown = error(await b.get("/sandboxes/" + "x" * 20), 404)
        assert error(await b.get(f"/sandboxes/{sandbox}"), 404) == unknown.replace(
            "x" * 20, sandbox
        )
        # A's own reset of its sandbox to its snapshot works; B's reset of its own sandbox to
        # A's snapshot finds no such snapshot.
        mine = (await _json(await b.post("/v2/sandboxes", json={"templateID": "base"}), 201))[
            "sandboxID"
        ]
        reset = await b.post(f"/aenv/sandboxes/{mine}/reset", json={"snapshotID": snapshot})
        assert "snapshot" in error(reset, 404)
        # Volume mounts name the team's volumes only.
        mounted = await b.post(
            "/v2/sandboxes",
            json={"templateID": "base", "volumeMounts": [{"name": "data", "path": "/data"}]},
        )
        assert "data" in error(mounted, 400)
        # A sandbox from A's private snapshot is unknown to B.
        assert error(await b.post("/v2/sandboxes", json={"templateID": snapshot}), 404)
        # Nothing of A's changed.
        assert node.row(sandbox).state is SandboxState.RUNNING
        assert node.row(paused).state is SandboxState.PAUSED
        assert node.orchestrator.templates.get(snapshot).team_id == TEAM_ID
        assert (await a.get(f"/volumes/{vid}")).status_code == 200
        assert (await a.get(f"/events/webhooks/{hook['id']}")).status_code == 200
        assert len(teams.keys.list()) == 2
        assert (await a.get(f"/sandboxes/{sandbox}")).status_code == 200


async def test_lists_show_a_team_its_own(tmp_path: Path) -> None:
    async with double_node(tmp_path) as node, two_teams(node) as teams:
        a, b = teams.a, teams.b
        made = {}
        for name, client in (("a", a), ("b", b)):
            body = {"templateID": "base", "metadata": {"run": "1"}}
            sandbox = (await _json(await client.post("/v2/sandboxes", json=body), 201))["sandboxID"]
            snapshot = await _json(
                await client.post(f"/sandboxes/{sandbox}/snapshots", json={"name": "snap"}), 201
            )
            volume = await _json(await client.post("/volumes", json={"name": "data"}), 201)
            made[name] = (sandbox, snapshot["snapshotID"], volume["volumeID"])
        every = ",".join(m[0] for m in made.values())
        for name, client in (("a", a), ("b", b)):
            sandbox, snapshot, volume = made[name]
            team = TEAM_ID if name == "a" else teams.team_b
            listed = [s["sandboxID"] for s in await _json(await client.get("/sandboxes"))]
            assert listed == [sandbox]
            v2 = [s["sandboxID"] for s in await _json(await client.get("/v2/sandboxes"))]
            assert v2 == [sandbox]
            snapshots = [s["snapshotID"] for s in await _json(await client.get("/snapshots"))]
            assert snapshots == [snapshot]
            volumes = [v["volumeID"] for v in await _json(await client.get("/volumes"))]
            assert volumes == [volume]  # the same name in each team: names are per team
            templates = {t["templateID"] for t in await _json(await client.get("/templates"))}
            assert templates == {"base"}  # the public one; snapshots are listed apart
            events = await _json(await client.get("/events/sandboxes", params={"limit": 100}))
            assert {e["sandboxId"] for e in events} == {sandbox}
            assert {e["sandboxTeamId"] for e in events} == {team}
            metrics = await _json(
                await client.get("/sandboxes/metrics", params={"sandbox_ids": every})
            )
            assert set(metrics["sandboxes"]) <= {sandbox}
            # The snapshot named `snap` is each team's own: a sandbox from it is of that team.
            child = await _json(
                await client.post("/v2/sandboxes", json={"templateID": "snap"}), 201
            )
            assert child["templateID"] == snapshot
            assert node.row(child["sandboxID"]).team_id == team
        # Bulk operations select among the team's sandboxes only.
        killed = await _json(
            await b.post("/aenv/bulk/sandboxes/kill", params={"metadata": urlencode({"run": "1"})})
        )
        assert [s["sandboxID"] for s in killed["sandboxes"]] == [made["b"][0]]
        assert node.row(made["a"][0]).state is SandboxState.RUNNING
        deleted = await _json(
            await b.delete("/aenv/bulk/snapshots", params={"metadata": urlencode({"run": "1"})})
        )
        assert [s["snapshotID"] for s in deleted["snapshots"]] == [made["b"][1]]
        assert node.orchestrator.templates.get(made["a"][1]) is not None


async def test_public_templates_are_shared_and_changed_by_their_owner_only(
    tmp_path: Path,
) -> None:
    async with double_node(tmp_path) as node, two_teams(node) as teams:
        a, b = teams.a, teams.b
        base = next(t for t in await _json(await b.get("/templates")) if "base" in t["names"])
        assert base["public"] is True
        assert (await _json(await b.get("/templates/aliases/base")))["public"] is True
        # Anyone starts from the node's own template; none but its owner changes it.
        assert (await b.post("/v2/sandboxes", json={"templateID": "base"})).status_code == 201
        assert error(await b.delete("/templates/base"), 404)
        assert error(await b.patch("/templates/base", json={"public": False}), 404)
        # A publishes its snapshot: B sees it and starts from it, cannot change it.
        sandbox = (await _json(await a.post("/v2/sandboxes", json={"templateID": "base"}), 201))[
            "sandboxID"
        ]
        snapshot = (await _json(await a.post(f"/sandboxes/{sandbox}/snapshots", json={}), 201))[
            "snapshotID"
        ]
        assert error(await b.get(f"/templates/{snapshot}"), 404)
        await _json(await a.patch(f"/templates/{snapshot}", json={"public": True}))
        shown = await _json(await b.get(f"/templates/{snapshot}"))
        assert shown["public"] is True
        child = await _json(await b.post("/v2/sandboxes", json={"templateID": snapshot}), 201)
        assert node.row(child["sandboxID"]).team_id == teams.team_b
        assert error(await b.delete(f"/templates/{snapshot}"), 404)
        assert error(await b.patch(f"/templates/{snapshot}", json={"public": False}), 404)
        # Private again: gone for B, whose sandbox keeps running.
        await _json(await a.patch(f"/templates/{snapshot}", json={"public": False}))
        assert error(await b.get(f"/templates/{snapshot}"), 404)
        assert node.row(child["sandboxID"]).state is SandboxState.RUNNING
        # A build of B named as the public template makes B's own, leaving the node's alone.
        built = await _json(await b.post("/v3/templates", json={"name": "base"}), 202)
        assert built["templateID"] != node.orchestrator.templates.get("base").template_id


async def test_teams_and_keys_answer_the_caller_s_team(tmp_path: Path) -> None:
    async with double_node(tmp_path) as node, two_teams(node) as teams:
        a, b = teams.a, teams.b
        (mine,) = await _json(await b.get("/teams"))
        assert mine == {"teamID": teams.team_b, "name": "beta", "apiKey": KEY_B, "isDefault": True}
        (default,) = await _json(await a.get("/teams"))
        assert default["teamID"] == TEAM_ID and default["apiKey"] == KEY_A
        assert [k["name"] for k in await _json(await b.get("/api-keys"))] == ["b"]
        made = await _json(await b.post("/api-keys", json={"name": "ci"}), 201)
        assert sorted(k["name"] for k in await _json(await b.get("/api-keys"))) == ["b", "ci"]
        assert [k["name"] for k in await _json(await a.get("/api-keys"))] == ["a"]
        # The new key acts for its team.
        headers = {"X-API-Key": made["key"]}
        assert (await _json(await b.get("/teams", headers=headers)))[0]["teamID"] == teams.team_b
        assert (await b.delete(f"/api-keys/{made['id']}")).status_code == 204
        assert len(teams.keys.list()) == 2


async def test_the_sdk_sees_its_team_only(tmp_path: Path) -> None:
    async with double_node(tmp_path) as node, two_teams(node) as teams:
        theirs = await AsyncSandbox.create("base", metadata={"who": "a"}, **teams.sdk(KEY_A))
        mine = await AsyncSandbox.create("base", metadata={"who": "b"}, **teams.sdk(KEY_B))
        with pytest.raises(NotFoundException):
            await AsyncSandbox.connect(theirs.sandbox_id, **teams.sdk(KEY_B))
        with pytest.raises(NotFoundException):
            await AsyncSandbox.get_info(theirs.sandbox_id, **teams.sdk(KEY_B))
        assert not await AsyncSandbox.kill(theirs.sandbox_id, **teams.sdk(KEY_B))
        listed = await AsyncSandbox.list(**teams.sdk(KEY_B)).next_items()
        assert [s.sandbox_id for s in listed] == [mine.sandbox_id]
        # A's volume token is A's: B cannot read the volume's info, so not its token.
        volume = await AsyncVolume.create("files", **teams.sdk(KEY_A))
        with pytest.raises(NotFoundException):
            await AsyncVolume.connect(volume.volume_id, **teams.sdk(KEY_B))
        assert not await AsyncVolume.destroy(volume.volume_id, **teams.sdk(KEY_B))
        assert (await AsyncVolume.connect(volume.volume_id, **teams.sdk(KEY_A))).token
        assert node.row(theirs.sandbox_id).state is SandboxState.RUNNING


async def test_team_metrics_count_the_team_s_sandboxes(tmp_path: Path) -> None:
    async with double_node(tmp_path) as node, two_teams(node) as teams:
        a, b = teams.a, teams.b
        start = int(time.time()) - 1
        made = [
            (await _json(await b.post("/v2/sandboxes", json={"templateID": "base"}), 201))[
                "sandboxID"
            ]
            for _ in range(3)
        ]
        assert (await b.post(f"/sandboxes/{made[0]}/pause")).status_code == 204
        assert (await b.delete(f"/sandboxes/{made[1]}")).status_code == 204
        await _json(await a.post("/v2/sandboxes", json={"templateID": "base"}), 201)
        end = int(time.time()) + 1
        window = {"start": start, "end": end}
        path = f"/teams/{teams.team_b}/metrics"
        points = await _json(await b.get(path, params=window))
        assert points[-1]["timestampUnix"] == end
        assert points[-1]["concurrentSandboxes"] == 1  # one paused, one killed: one runs
        assert round(sum(p["sandboxStartRate"] for p in points) * step_for(start, end)) == 3
        top = await _json(
            await b.get(f"{path}/max", params={**window, "metric": "concurrent_sandboxes"})
        )
        assert top["value"] == 3 and start <= top["timestampUnix"] <= end
        rate = await _json(
            await b.get(f"{path}/max", params={**window, "metric": "sandbox_start_rate"})
        )
        assert rate["value"] > 0
        # A's team has its own; nobody reads another team's.
        theirs = await _json(
            await a.get(
                f"/teams/{TEAM_ID}/metrics/max",
                params={**window, "metric": "concurrent_sandboxes"},
            )
        )
        assert theirs["value"] == 1
        assert error(await a.get(path, params=window), 404)
        assert error(await b.get(f"{path}/max", params={**window, "metric": "x"}), 400)
        assert error(await b.get(path, params={"start": end, "end": start}), 400)
        # What a gateway merges across nodes is for its calls only.
        assert error(await b.get(f"{path}/changes", params=window), 404)
        assert node.row(made[2]).state is SandboxState.RUNNING


async def test_the_data_plane_knows_the_team_of_a_key_and_of_a_sandbox(tmp_path: Path) -> None:
    """The node's `Tenancy` (`proxy.access.check_team`): the team of the key a request carries,
    or of the key a cluster gateway checked and names; each sandbox's team."""
    async with double_node(tmp_path) as node, two_teams(node) as teams:
        sandbox = (
            await _json(await teams.a.post("/v2/sandboxes", json={"templateID": "base"}), 201)
        )["sandboxID"]
        tenancy = _Tenancy(node.orchestrator, teams.keys)

        def scope(key: str | None = None, named: str | None = None) -> dict[str, Any]:
            headers = [] if key is None else [(b"x-api-key", key.encode())]
            return {"headers": headers, "state": {} if named is None else {CALLER_STATE: named}}

        assert await tenancy.caller_team(scope(KEY_A)) == TEAM_ID
        assert await tenancy.caller_team(scope(KEY_B)) == teams.team_b
        assert await tenancy.caller_team(scope("e2b_" + "0" * 40)) is None
        assert await tenancy.caller_team(scope()) is None
        assert await tenancy.caller_team(scope(named=f"k1 {teams.team_b}")) == teams.team_b
        # A gateway's call for no user (its own) names no team: the key sent decides.
        assert await tenancy.caller_team(scope(KEY_B, OPERATOR_CALLER)) == teams.team_b
        assert tenancy.sandbox_team(sandbox) == TEAM_ID
        assert tenancy.sandbox_team("x" * 20) is None
