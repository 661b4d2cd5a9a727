"""Nothing a client sends is silently dropped: every field of every request body and query
parameter in E2B's spec, on every route this node serves, is either honoured (listed below, and
then never refused) or refused with a 400 naming it. Over a node on doubles, served on loopback;
the effects of the honoured fields new here are checked in the tests after the walk."""

from __future__ import annotations

import re
import time
from pathlib import Path
from typing import Any

import httpx
from e2b import AsyncSandbox
from e2b.exceptions import SandboxException

from aenv.api.app import create_api
from aenv.api.keys import KeyStore
from aenv.api.openapi import load_e2b_spec
from aenv.orchestrator.states import SandboxState
from tests.api.test_routes import KEY, error, served
from tests.doubles.node import DoubleNode, double_node
from tests.support.wait import eventually

NOT_SUPPORTED = "is not supported here"
# (method, E2B path) -> the body fields and query parameters this node honours.
HONOURED: dict[tuple[str, str], set[str]] = {
    ("post", "/sandboxes"): {
        "templateID", "timeout", "autoPause", "autoPauseMemory", "autoResume", "secure",
        "allow_internet_access", "network", "metadata", "envVars", "volumeMounts", "iam",
    },
    ("post", "/volumes"): {"name"},
    ("get", "/secrets"): {"limit", "nextToken"},
    ("post", "/secrets"): {"name", "value", "metadata"},
    ("post", "/secrets/{secretID}"): {"value", "metadata"},
    ("get", "/sandboxes"): {"metadata"},
    ("get", "/v2/sandboxes"): {
        "metadata", "state", "order", "startedAfter", "template", "nextToken", "limit",
    },
    ("get", "/sandboxes/{sandboxID}/logs"): {"start", "limit"},
    ("get", "/v2/sandboxes/{sandboxID}/logs"): {
        "cursor", "limit", "direction", "level", "search",
    },
    ("get", "/sandboxes/{sandboxID}/metrics"): {"start", "end"},
    ("get", "/sandboxes/metrics"): {"sandbox_ids"},
    ("post", "/sandboxes/{sandboxID}/pause"): {"memory"},
    ("post", "/sandboxes/{sandboxID}/resume"): {"timeout", "autoPause", "memory"},
    ("post", "/sandboxes/{sandboxID}/fork"): {"timeout", "count"},
    ("post", "/sandboxes/{sandboxID}/connect"): {"timeout", "memory"},
    ("post", "/sandboxes/{sandboxID}/timeout"): {"timeout"},
    ("put", "/sandboxes/{sandboxID}/network"): {
        "allowOut", "denyOut", "egressProxy", "rules", "allow_internet_access",
    },
    ("post", "/sandboxes/{sandboxID}/refreshes"): {"duration"},
    ("post", "/sandboxes/{sandboxID}/snapshots"): {"name"},
    ("get", "/snapshots"): {"sandboxID", "name", "limit", "nextToken"},
    ("post", "/v3/templates"): {"name", "tags", "alias", "cpuCount", "memoryMB"},
    ("get", "/templates/{templateID}"): {"nextToken", "limit"},
    ("patch", "/templates/{templateID}"): {"public"},
    ("patch", "/v2/templates/{templateID}"): {"public"},
    ("post", "/v2/templates/{templateID}/builds/{buildID}"): {
        "fromImage", "fromTemplate", "fromImageRegistry", "force", "steps", "startCmd",
        "readyCmd",
    },
    ("get", "/templates/{templateID}/builds/{buildID}/status"): {"logsOffset", "limit", "level"},
    ("get", "/templates/{templateID}/builds/{buildID}/logs"): {
        "cursor", "limit", "direction", "level", "source",
    },
    ("post", "/templates/tags"): {"target", "tags"},
    ("delete", "/templates/tags"): {"name", "tags"},
    ("post", "/api-keys"): {"name"},
    ("patch", "/api-keys/{apiKeyID}"): {"name"},
    ("get", "/teams/{teamID}/metrics"): {"start", "end"},
    ("get", "/teams/{teamID}/metrics/max"): {"start", "end", "metric"},
    ("post", "/admin/teams/{teamID}/api-keys"): {"name"},
}  # fmt: skip


def _resolve(spec: dict[str, Any], node: dict[str, Any]) -> dict[str, Any]:
    while "$ref" in node:
        target: Any = spec
        for part in node["$ref"].split("/")[1:]:
            target = target[part]
        node = target
    return node


def _inputs(spec: dict[str, Any], op: dict[str, Any]) -> tuple[list[str], list[str]]:
    """The operation's query parameters and top-level body fields."""
    params = [_resolve(spec, p) for p in op.get("parameters", [])]
    query = [p["name"] for p in params if p["in"] == "query"]
    body = op.get("requestBody", {}).get("content", {}).get("application/json", {})
    schema = _resolve(spec, body.get("schema", {}))
    return query, list(schema.get("properties", {}))


def _served(node: DoubleNode) -> set[tuple[str, str]]:
    """(method, path with `{}` for each parameter) of every route the app serves."""
    app: Any = create_api(node.orchestrator, node.config, KeyStore(node.config.home / "k.json"))
    return {
        (method.lower(), _shape(route.path))
        for route in app.app.routes
        for method in route.methods or ()
        if method != "HEAD"
    }


def _shape(path: str) -> str:
    return re.sub(r"\{[^}]*\}", "{}", path)


def _refused(response: httpx.Response, name: str) -> bool:
    if response.status_code != 400:
        return False
    message = error(response, 400)
    return name in message and NOT_SUPPORTED in message


async def test_every_spec_field_is_honoured_or_refused(tmp_path: Path) -> None:
    spec = load_e2b_spec()  # the repository's copy (test_openapi), parsed once
    async with double_node(tmp_path) as node, served(node) as api:
        sandbox = (await api.post("/sandboxes", json={"templateID": "base"})).json()["sandboxID"]
        template = node.templates.get("base")
        ids = {
            "sandboxID": sandbox,
            "templateID": "base",
            "buildID": template.build_id,
            "apiKeyID": "none",
            "hash": "0" * 64,
            "alias": "base",
            "teamID": "local",
            "nodeID": "none",
            "volumeID": "none",
            "secretID": "none",
            "accessTokenID": "none",
        }
        serving = _served(node)
        # The admin routes take the operator's token: without it they answer 401 to anything.
        admin = {"X-Admin-Token": node.config.paths.admin_token.read_text().strip()}
        checked = 0
        for path, ops in spec["paths"].items():
            for method, op in ops.items():
                if (method, _shape(path)) not in serving:
                    continue  # answered 404 or 405, never accepted
                url = path.format(**{k: v for k, v in ids.items() if "{" + k + "}" in path})
                query, body = _inputs(spec, op)
                honoured = HONOURED.get((method, path), set())
                headers = admin if path.startswith("/admin/") else {}
                for name in [*query, "unknownParam"]:
                    response = await api.request(method, url, params={name: "1"}, headers=headers)
                    assert _refused(response, name) != (name in honoured), (method, path, name)
                    checked += 1
                if body or method in ("post", "put", "patch"):
                    for name in [*body, "unknownField"]:
                        response = await api.request(
                            method, url, json={name: None}, headers=headers
                        )
                        assert _refused(response, name) != (name in honoured), (method, path, name)
                        checked += 1
        assert checked > 100  # the walk reached the routes
        # Nothing refused touched the sandbox.
        assert node.orchestrator.get(sandbox).state is SandboxState.RUNNING


async def test_secure_false_is_refused(tmp_path: Path) -> None:
    async with double_node(tmp_path) as node, served(node) as api:
        refused = await api.post("/sandboxes", json={"templateID": "base", "secure": False})
        assert _refused(refused, "secure")
        assert node.catalog.list() == []
        created = await api.post("/sandboxes", json={"templateID": "base", "secure": True})
        assert created.json()["envdAccessToken"]


async def test_resume_with_auto_pause_sets_the_timeout_action(tmp_path: Path) -> None:
    async with double_node(tmp_path) as node, served(node) as api:
        sandbox = (await api.post("/sandboxes", json={"templateID": "base"})).json()["sandboxID"]
        assert (await api.post(f"/sandboxes/{sandbox}/pause")).status_code == 204
        resumed = await api.post(f"/sandboxes/{sandbox}/resume", json={"autoPause": True})
        assert resumed.status_code == 201, resumed.text
        detail = (await api.get(f"/sandboxes/{sandbox}")).json()
        assert detail["lifecycle"]["onTimeout"] == "pause"


async def test_metrics_range_selects_the_current_sample(tmp_path: Path) -> None:
    async with double_node(tmp_path) as node, served(node) as api:
        sandbox = (await api.post("/sandboxes", json={"templateID": "base"})).json()["sandboxID"]
        now = int(time.time())
        url = f"/sandboxes/{sandbox}/metrics"
        assert len((await api.get(url, params={"start": now - 60})).json()) == 1
        assert (await api.get(url, params={"start": 0, "end": now - 3600})).json() == []
        assert (await api.get(url, params={"start": now + 3600})).json() == []
        assert node.orchestrator.get(sandbox).state is SandboxState.RUNNING


async def test_batch_metrics_give_the_running_sandboxes_asked_for(tmp_path: Path) -> None:
    async with double_node(tmp_path) as node, served(node) as api:
        ids = [
            (await api.post("/sandboxes", json={"templateID": "base"})).json()["sandboxID"]
            for _ in range(3)
        ]
        assert (await api.post(f"/sandboxes/{ids[2]}/pause")).status_code == 204
        asked = ",".join([*ids, "unknown"])
        found = (await api.get("/sandboxes/metrics", params={"sandbox_ids": asked})).json()
        assert set(found["sandboxes"]) == set(ids[:2])  # not the paused one, nor the unknown
        assert found["sandboxes"][ids[0]]["memUsed"] == 100 << 20  # what the double envd says
        error(await api.get("/sandboxes/metrics"), 400)


async def test_the_sdk_is_told_what_is_not_supported(tmp_path: Path) -> None:
    async with double_node(tmp_path) as node, served(node) as api:
        opts: dict[str, Any] = {"api_key": KEY, "api_url": str(api.base_url)}
        mcp: Any = {"exa": {"apiKey": "x"}}
        try:
            await AsyncSandbox.create("base", mcp=mcp, **opts)
        except SandboxException as e:
            assert "'mcp'" in str(e) and NOT_SUPPORTED in str(e)
        else:
            raise AssertionError("mcp was accepted")
        assert node.catalog.list() == []


async def test_set_timeout_zero_runs_the_timeout_action_now(tmp_path: Path) -> None:
    async with double_node(tmp_path) as node, served(node) as api:
        opts: dict[str, Any] = {"api_key": KEY, "api_url": str(api.base_url)}
        pausing = (
            await api.post("/v2/sandboxes", json={"templateID": "base", "autoPause": True})
        ).json()["sandboxID"]
        killed = (await api.post("/v2/sandboxes", json={"templateID": "base"})).json()
        await AsyncSandbox.set_timeout(pausing, 0, **opts)
        await AsyncSandbox.set_timeout(killed["sandboxID"], 0, **opts)
        await eventually(lambda: node.orchestrator.is_paused(pausing))
        # keep_memory unset (autoPauseMemory omitted) is a full-memory pause, as the SDK says.
        assert node.orchestrator.get(pausing).checkpoint_mode.value == "full"
        await eventually(lambda: node.catalog.get(killed["sandboxID"]) is None)
