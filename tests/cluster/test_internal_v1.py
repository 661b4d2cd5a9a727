"""Version 1 of a node's internal API on a node's own routes (the real API over the real
orchestrator and catalog, on the doubles): each operation answers what the node's public route
answers a client, plus the kind of a refusal, which the routes say, not the status; a malformed
call is a 400 naming its field, and the cluster token still guards it."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest

from aenv.api.app import create_api
from aenv.api.internal import CURSORS_HEADER
from aenv.api.internal_models import NodeAnswer, Refusal
from aenv.api.keys import KeyStore
from aenv.cluster.internal import CALLER_HEADER, TOKEN_HEADER, InternalGate
from aenv.orchestrator.states import SandboxState
from tests.cluster.shared import SECRET
from tests.doubles.node import DoubleNode, double_node
from tests.support import loopback_api
from tests.support.wait import eventually

API_KEY = "e2b_" + "7" * 40


@dataclass
class Node:
    http: httpx.AsyncClient
    doubles: DoubleNode
    draining: bool = False  # what the node's memory of its drain says

    async def v1(self, path: str, call: dict[str, Any]) -> NodeAnswer:
        answer = await self.http.post(
            f"/internal/v1{path}",
            json=call,
            headers={TOKEN_HEADER: SECRET.bearer, CALLER_HEADER: "key-1"},
        )
        assert answer.status_code == 200, answer.text
        return NodeAnswer.model_validate_json(answer.content)

    async def public(self, method: str, path: str, body: str = "") -> httpx.Response:
        return await self.http.request(method, path, content=body, headers={"X-API-Key": API_KEY})


@pytest.fixture
def settings() -> dict[str, Any]:
    return {}


@pytest.fixture
async def node(tmp_path: Path, settings: dict[str, Any]) -> AsyncIterator[Node]:
    async with double_node(tmp_path, **settings) as doubles:
        keys = KeyStore(tmp_path / "api-keys.json")
        keys.add(API_KEY, "test")
        api = create_api(doubles.orchestrator, doubles.config, keys)
        gate = InternalGate(api, SECRET, lambda: served.draining)
        async with httpx.AsyncClient(
            transport=httpx.ASGITransport(app=gate), base_url="http://node"
        ) as http:
            served = Node(http, doubles)
            yield served


async def test_a_sandbox_lives_through_version_1_as_through_its_e2b_routes(node: Node) -> None:
    made = await node.v1("/sandboxes", {"api": "v2", "body": '{"templateID": "base"}'})
    assert made.refusal is None and made.status == 201, made
    sandbox_id = _json(made)["sandboxID"]
    record = node.doubles.row(sandbox_id)
    # v2's default timeout, and the caller the gateway named owns it.
    assert record.timeout == 300 and record.owner == "key-1"
    paused = await node.v1(f"/sandboxes/{sandbox_id}/pause", {"body": ""})
    assert (paused.refusal, paused.status) == (None, 204)
    assert node.doubles.row(sandbox_id).state is SandboxState.PAUSED
    again = await node.v1(f"/sandboxes/{sandbox_id}/pause", {})
    public = await node.public("POST", f"/sandboxes/{sandbox_id}/pause")
    # Refused as the public route refuses (E2B's 409, already paused), said to be the client's.
    assert (again.refusal, again.status) == (Refusal.REJECTED, 409)
    assert _json(again) == public.json()
    resumed = await node.v1(f"/sandboxes/{sandbox_id}/connect", {"body": '{"timeout": 60}'})
    assert (resumed.refusal, resumed.status) == (None, 201)
    assert _json(resumed)["sandboxID"] == sandbox_id
    assert (
        await node.v1(f"/sandboxes/{sandbox_id}/timeout", {"body": '{"timeout": 90}'})
    ).status == 204
    killed = await node.v1(f"/sandboxes/{sandbox_id}/kill", {})
    assert (killed.refusal, killed.status) == (None, 204)
    gone = await node.v1(f"/sandboxes/{sandbox_id}/kill", {})
    assert (gone.refusal, gone.status) == (Refusal.NOT_HERE, 404)
    assert _json(gone) == {"code": 404, "message": f"sandbox '{sandbox_id}' not found"}


async def test_the_nodes_extensions_go_through_version_1(node: Node) -> None:
    made = await node.v1("/sandboxes", {"api": "v2", "body": '{"templateID": "base"}'})
    sandbox_id = _json(made)["sandboxID"]
    saved = await node.v1(f"/sandboxes/{sandbox_id}/snapshot", {"body": "{}"})
    assert (saved.refusal, saved.status) == (None, 201), saved
    snapshot = json.dumps({"snapshotID": _json(saved)["snapshotID"]})
    reset = await node.v1(f"/sandboxes/{sandbox_id}/reset", {"body": snapshot})
    assert (reset.refusal, reset.status) == (None, 200), reset
    assert _json(reset)["sandboxID"] == sandbox_id
    children = '{"children": [{"metadata": {"rank": "0"}}, {"metadata": {"rank": "1"}}]}'
    forked = await node.v1(f"/sandboxes/{sandbox_id}/batch-fork", {"body": children})
    assert (forked.refusal, forked.status) == (None, 201), forked
    children_ids = [c["sandbox"]["sandboxID"] for c in _json(forked)]
    assert [node.doubles.row(c).metadata["rank"] for c in children_ids] == ["0", "1"]
    unknown = await node.v1("/sandboxes/nosuch/reset", {"body": snapshot})
    assert (unknown.refusal, unknown.status) == (Refusal.NOT_HERE, 404)
    timed = await node.v1(
        "/bulk/timeout", {"query": "metadata=rank%3D1", "body": '{"timeout": 60}'}
    )
    assert (timed.refusal, timed.status) == (None, 200), timed
    assert [e["sandboxID"] for e in _json(timed)["sandboxes"]] == [children_ids[1]]
    killed = await node.v1("/bulk/kill", {"query": "metadata=rank%3D0"})
    assert [e["sandboxID"] for e in _json(killed)["sandboxes"]] == [children_ids[0]]
    assert node.doubles.catalog.get(children_ids[0]) is None
    unfiltered = await node.v1("/bulk/pause", {})
    assert (unfiltered.refusal, unfiltered.status) == (Refusal.REJECTED, 400)


async def test_a_sandboxs_logs_metrics_and_events_are_read_through_version_1(node: Node) -> None:
    made = await node.v1("/sandboxes", {"api": "v2", "body": '{"templateID": "base"}'})
    sandbox_id = _json(made)["sandboxID"]
    for op, path, query in [
        ("logs", f"/sandboxes/{sandbox_id}/logs", "limit=5"),
        ("logs-v2", f"/v2/sandboxes/{sandbox_id}/logs", "direction=backward"),
        ("metrics", f"/sandboxes/{sandbox_id}/metrics", ""),
    ]:
        read = await node.v1(f"/sandboxes/{sandbox_id}/{op}", {"query": query})
        public = await node.public("GET", f"{path}?{query}")
        assert (read.refusal, read.status) == (None, 200), (op, read)
        assert _json(read) == public.json(), op
    events = await node.v1(f"/sandboxes/{sandbox_id}/events", {"query": "orderAsc=true"})
    public = await node.public("GET", f"/events/sandboxes/{sandbox_id}?orderAsc=true")
    assert (events.refusal, events.status) == (None, 200)
    assert _json(events) == public.json() and len(_json(events)) == 1
    everyone = await node.v1("/lists/events", {"query": "limit=5"})
    assert _json(everyone) == (await node.public("GET", "/events/sandboxes?limit=5")).json()
    no_hook = await node.v1("/webhooks/nosuch/deliveries", {"query": "limit=5"})
    assert (no_hook.refusal, no_hook.status) == (Refusal.NOT_HERE, 404)
    bad = await node.v1(f"/sandboxes/{sandbox_id}/logs", {"query": "region=eu"})
    assert (bad.refusal, bad.status) == (Refusal.REJECTED, 400)
    assert "'region'" in _json(bad)["message"]


async def test_a_create_of_a_template_not_here_is_refused_as_not_here(node: Node) -> None:
    answer = await node.v1("/sandboxes", {"api": "v1", "body": '{"templateID": "elsewhere"}'})
    assert (answer.refusal, answer.status) == (Refusal.NOT_HERE, 404)
    assert _json(answer)["message"] == "template 'elsewhere' not found"


async def test_a_bad_e2b_body_is_rejected_with_the_routes_own_error(node: Node) -> None:
    body = '{"templateID": "base", "mcp": {}}'
    answer = await node.v1("/sandboxes", {"api": "v2", "body": body})
    public = await node.public("POST", "/v2/sandboxes", body)
    assert (answer.refusal, answer.status) == (Refusal.REJECTED, 400)
    assert _json(answer) == public.json() and "'mcp'" in public.json()["message"]
    assert node.doubles.catalog.list() == []


@pytest.mark.parametrize("settings", [{"max_sandboxes": 1}])
async def test_a_full_node_refuses_as_full_with_e2bs_429(node: Node) -> None:
    first = await node.v1("/sandboxes", {"api": "v2", "body": '{"templateID": "base"}'})
    assert first.status == 201
    full = await node.v1("/sandboxes", {"api": "v2", "body": '{"templateID": "base"}'})
    assert (full.refusal, full.status) == (Refusal.FULL, 429)
    assert _json(full)["error_code"] == "sandbox_capacity_unavailable"
    assert len(node.doubles.catalog.list()) == 1


async def test_a_draining_node_refuses_creates_as_draining_and_serves_the_rest(
    node: Node,
) -> None:
    made = await node.v1("/sandboxes", {"api": "v2", "body": '{"templateID": "base"}'})
    node.draining = True
    refused = await node.v1("/sandboxes", {"api": "v2", "body": '{"templateID": "base"}'})
    assert (refused.refusal, refused.status) == (Refusal.DRAINING, 503)
    assert "draining" in _json(refused)["message"]
    assert len(node.doubles.catalog.list()) == 1
    killed = await node.v1(f"/sandboxes/{_json(made)['sandboxID']}/kill", {})
    assert (killed.refusal, killed.status) == (None, 204)


async def test_a_sandboxs_rules_change_through_version_1(node: Node) -> None:
    made = await node.v1("/sandboxes", {"api": "v2", "body": '{"templateID": "base"}'})
    sandbox_id = _json(made)["sandboxID"]
    rules = '{"denyOut": ["10.9.0.0/16"]}'
    changed = await node.v1(f"/sandboxes/{sandbox_id}/network", {"body": rules})
    assert (changed.refusal, changed.status) == (None, 204), changed
    assert node.doubles.row(sandbox_id).network.deny_out == ("10.9.0.0/16",)


async def test_a_volume_is_made_read_and_deleted_through_version_1(node: Node) -> None:
    made = await node.v1("/volumes", {"body": '{"name": "data"}'})
    assert (made.refusal, made.status) == (None, 201), made
    assert _json(made)["name"] == "data"
    taken = await node.v1("/volumes", {"body": '{"name": "data"}'})
    assert (taken.refusal, taken.status) == (Refusal.REJECTED, 400)
    volume_id = _json(made)["volumeID"]
    read = await node.v1(f"/volumes/{volume_id}/info", {})
    assert (read.refusal, read.status) == (None, 200)
    assert _json(read) == (await node.public("GET", f"/volumes/{volume_id}")).json()
    deleted = await node.v1(f"/volumes/{volume_id}/delete", {})
    assert (deleted.refusal, deleted.status) == (None, 204)
    gone = await node.v1(f"/volumes/{volume_id}/info", {})
    assert (gone.refusal, gone.status) == (Refusal.NOT_HERE, 404)


async def test_a_template_is_read_through_version_1_or_refused_as_not_here(node: Node) -> None:
    held = await node.v1("/templates/base/info", {"query": "limit=1"})
    public = await node.public("GET", "/templates/base?limit=1")
    assert (held.refusal, held.status) == (None, 200)
    assert _json(held) == public.json() and len(_json(held)["builds"]) == 1
    alias = await node.v1("/templates/base/alias", {})
    assert (alias.refusal, alias.status) == (None, 200)
    unknown = await node.v1("/templates/elsewhere/info", {})
    assert (unknown.refusal, unknown.status) == (Refusal.NOT_HERE, 404)
    gone = await node.v1("/templates/elsewhere/delete", {})
    assert (gone.refusal, gone.status) == (Refusal.NOT_HERE, 404)
    bad = await node.v1("/templates/base/info", {"query": "region=eu"})
    assert (bad.refusal, bad.status) == (Refusal.REJECTED, 400)
    assert "'region'" in _json(bad)["message"]


async def test_lists_are_the_public_routes_with_the_cursors_a_gateway_merges(node: Node) -> None:
    for _ in range(2):
        await node.v1("/sandboxes", {"api": "v2", "body": '{"templateID": "base"}'})
    listed = await node.v1("/lists/sandboxes-v2", {"query": "limit=1"})
    public = await node.public("GET", "/v2/sandboxes?limit=1")
    assert (listed.refusal, listed.status) == (None, 200)
    assert _json(listed) == public.json() and len(_json(listed)) == 1
    headers = {n.lower(): v for n, v in listed.headers}
    # Asked for a gateway: each sandbox's cursor, and the next page's token, as on version 0.
    assert headers["x-next-token"] == public.headers["x-next-token"]
    assert len(headers[CURSORS_HEADER.lower()].split(",")) == 1
    assert CURSORS_HEADER.lower() not in public.headers
    everyone = await node.v1("/lists/sandboxes", {})
    assert len(_json(everyone)) == 2
    for op, path in [("snapshots", "/snapshots"), ("templates", "/templates"),
                     ("templates-v2", "/v2/templates"), ("volumes", "/volumes")]:  # fmt: skip
        answer = await node.v1(f"/lists/{op}", {})
        assert answer.status == 200 and _json(answer) == (await node.public("GET", path)).json()
    bad = await node.v1("/lists/sandboxes-v2", {"query": "limit=0"})
    assert (bad.refusal, bad.status) == (Refusal.REJECTED, 400)


async def test_tags_change_through_version_1_and_an_unknown_template_is_not_here(
    node: Node,
) -> None:
    given = await node.v1("/tags/assign", {"body": '{"target": "base", "tags": ["v1"]}'})
    assert (given.refusal, given.status) == (None, 201), given
    listed = (await node.public("GET", "/templates/base/tags")).json()
    assert [t["tag"] for t in listed] == ["v1"]
    bad = await node.v1("/tags/assign", {"body": '{"target": "base", "tags": ["no/slash"]}'})
    assert (bad.refusal, bad.status) == (Refusal.REJECTED, 400)
    unknown = await node.v1("/tags/delete", {"body": '{"name": "elsewhere", "tags": ["v1"]}'})
    assert (unknown.refusal, unknown.status) == (Refusal.NOT_HERE, 404)
    removed = await node.v1("/tags/delete", {"body": '{"name": "base", "tags": ["v1"]}'})
    assert (removed.refusal, removed.status) == (None, 204)
    assert (await node.public("GET", "/templates/base/tags")).json() == []


async def test_a_builds_calls_go_through_version_1_but_its_upload(node: Node) -> None:
    asked = await node.v1("/builds", {"body": '{"name": "web", "cpuCount": 1}'})
    assert (asked.refusal, asked.status) == (None, 202), asked
    template_id, build_id = _json(asked)["templateID"], _json(asked)["buildID"]
    files = await node.v1(f"/templates/{template_id}/files/{'a' * 64}", {})
    assert (files.refusal, files.status) == (None, 201)
    assert _json(files)["present"] is False
    build = f"/templates/{template_id}/builds/{build_id}"
    status = await node.v1(f"{build}/status", {"query": "logsOffset=0"})
    public = await node.public("GET", f"/templates/{template_id}/builds/{build_id}/status")
    assert (status.refusal, status.status) == (None, 200)
    assert _json(status) == public.json() and _json(status)["status"] == "waiting"
    logs = await node.v1(f"{build}/logs", {"query": "direction=backward"})
    assert (logs.refusal, logs.status) == (None, 200) and _json(logs) == {"logs": []}
    both = '{"fromImage": "alpine", "fromTemplate": "base"}'
    bad = await node.v1(f"{build}/start", {"body": both})
    assert (bad.refusal, bad.status) == (Refusal.REJECTED, 400)
    unknown = await node.v1(f"/templates/{template_id}/builds/nosuch/status", {})
    assert (unknown.refusal, unknown.status) == (Refusal.NOT_HERE, 404)
    bad_name = await node.v1("/builds", {"body": '{"name": "No Name"}'})
    assert (bad_name.refusal, bad_name.status) == (Refusal.REJECTED, 400)


async def test_batch_metrics_are_the_public_routes(node: Node) -> None:
    made = [await node.v1("/sandboxes", {"api": "v2", "body": '{"templateID": "base"}'})]
    made.append(await node.v1("/sandboxes", {"api": "v2", "body": '{"templateID": "base"}'}))
    running, paused = (_json(m)["sandboxID"] for m in made)
    await node.v1(f"/sandboxes/{paused}/pause", {})
    found = await node.v1("/metrics", {"sandbox_ids": [running, paused, "unknown"]})
    public = await node.public("GET", f"/sandboxes/metrics?sandbox_ids={running},{paused}")
    assert (found.refusal, found.status) == (None, 200)
    assert set(_json(found)["sandboxes"]) == {running} == set(public.json()["sandboxes"])
    none = await node.v1("/metrics", {"sandbox_ids": []})
    assert (none.refusal, none.status) == (Refusal.REJECTED, 400)
    assert "between 1 and 100" in _json(none)["message"]


@pytest.mark.parametrize("settings", [{"reserve_disk_mb": 2**40}])
async def test_a_node_without_disk_for_a_volume_refuses_as_full(node: Node) -> None:
    full = await node.v1("/volumes", {"body": '{"name": "data"}'})
    assert (full.refusal, full.status) == (Refusal.FULL, 507)
    assert node.doubles.orchestrator.volumes.list() == []


@pytest.mark.parametrize(
    ("path", "call", "named"),
    [
        ("/sandboxes", {"body": "{}"}, "api"),
        ("/sandboxes", {"api": "v3", "body": "{}"}, "api"),
        ("/sandboxes", {"api": "v2", "body": "{}", "region": "x"}, "'region'"),
        ("/sandboxes/sbx/hibernate", {}, "op"),
        ("/templates/base/build", {}, "op"),
        ("/templates/base/info", {"query": 1}, "query"),
        ("/adopt/volume", {"record": "{}"}, "kind"),
        ("/lists/keys", {}, "op"),
        ("/templates/t/builds/b/cancel", {}, "op"),
        ("/templates/t/files/h", {"query": ""}, "'query'"),
        ("/builds", {}, "body"),
        ("/volumes/data/resize", {}, "op"),
        ("/volumes/data/info", {"body": ""}, "'body'"),
        ("/tags/rename", {"body": "{}"}, "op"),
        ("/tags/assign", {}, "body"),
        ("/metrics", {}, "sandbox_ids"),
        ("/metrics", {"sandbox_ids": "a,b"}, "sandbox_ids"),
        ("/lists/volumes", {"body": ""}, "'body'"),
        ("/adopt/sandbox", {}, "record"),
    ],
)
async def test_a_malformed_call_is_a_400_naming_its_field(
    node: Node, path: str, call: dict[str, Any], named: str
) -> None:
    answer = await node.http.post(
        f"/internal/v1{path}", json=call, headers={TOKEN_HEADER: SECRET.bearer}
    )
    assert answer.status_code == 400
    assert set(answer.json()) == {"code", "message"} and named in answer.json()["message"]
    assert node.doubles.catalog.list() == []


async def test_version_1_needs_the_cluster_token(node: Node) -> None:
    call = {"api": "v2", "body": '{"templateID": "base"}'}
    missing = await node.http.post("/internal/v1/sandboxes", json=call)
    user = await node.http.post("/internal/v1/sandboxes", json=call, headers={"X-API-Key": API_KEY})
    assert missing.status_code == 401 and user.status_code == 401
    assert "cluster's token" in missing.json()["message"]
    assert node.doubles.catalog.list() == []


def _json(answer: NodeAnswer) -> Any:
    return json.loads(answer.body)


async def test_a_create_waits_through_version_1_and_leaves_when_the_gateway_goes(
    tmp_path: Path,
) -> None:
    """The client's wait reaches the node's queue in version 1, and a gateway that drops its
    call (its client went away) takes the waiter out: on loopback, as a gateway calls."""
    async with double_node(tmp_path, max_sandboxes=1, create_max_wait=3600) as doubles:
        keys = KeyStore(tmp_path / "api-keys.json")
        api = create_api(doubles.orchestrator, doubles.config, keys)
        orc = doubles.orchestrator
        async with (
            loopback_api.served(InternalGate(api, SECRET, lambda: False)) as url,
            httpx.AsyncClient(base_url=url) as http,
        ):
            running, _ = await orc.create(doubles.request())
            call = {"api": "v2", "body": '{"templateID": "base"}', "wait": "3600"}
            headers = {TOKEN_HEADER: SECRET.bearer, CALLER_HEADER: "key-1"}

            def waiting() -> asyncio.Task[httpx.Response]:
                sent = http.post("/internal/v1/sandboxes", json=call, headers=headers)
                return asyncio.create_task(sent)

            dropped = waiting()
            await eventually(lambda: len(orc.waiting) == 1, "the create waiting")
            dropped.cancel()
            await eventually(lambda: len(orc.waiting) == 0, "the waiter gone")
            assert orc.waiting.stats.left == 1
            served = waiting()
            await eventually(lambda: len(orc.waiting) == 1, "the next create waiting")
            await orc.kill(running.id)
            answer = NodeAnswer.model_validate_json((await served).content)
            assert answer.status == 201, answer
            assert doubles.row(_json(answer)["sandboxID"]).owner == "key-1"
            for record in orc.list():
                await orc.kill(record.id)
