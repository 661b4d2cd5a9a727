"""`GET /openapi.json` describes exactly the routes the control plane serves (no VMs needed:
the routes are built around a stand-in orchestrator and never called)."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any
from unittest.mock import MagicMock

import httpx
import pytest
from openapi_spec_validator import validate
from starlette.routing import Route

from aenv.api.app import create_api
from aenv.api.keys import KeyStore
from aenv.api.openapi import build_document, load_e2b_spec
from aenv.config import Config

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
async def document(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    home = tmp_path_factory.mktemp("home")
    app = create_api(MagicMock(), Config(home=home), KeyStore(home / "api-keys.json"))
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://node") as client:
        response = await client.get("/openapi.json")  # no API key: the description is open
    assert response.status_code == 200
    doc: dict[str, Any] = response.json()
    return doc


def _refs(node: Any) -> list[str]:
    if isinstance(node, dict):
        return [v for k, v in node.items() if k == "$ref"] + [
            r for v in node.values() for r in _refs(v)
        ]
    if isinstance(node, list):
        return [r for v in node for r in _refs(v)]
    return []


def test_the_document_is_valid_openapi_and_self_contained(document: dict[str, Any]) -> None:
    validate(document)
    for ref in _refs(document):
        _, _, kind, name = ref.split("/", 3)
        assert name in document["components"][kind], ref
    assert list(document["components"]["securitySchemes"]) == ["ApiKeyAuth", "AdminApiKeyAuth"]


def test_it_lists_our_routes_and_only_those(document: dict[str, Any]) -> None:
    ops = {(path, method) for path, item in document["paths"].items() for method in item}
    for pair in [
        ("/sandboxes", "post"),
        ("/v2/sandboxes", "post"),  # not in E2B's spec: derived from the v1 create
        ("/v2/sandboxes/{sandboxID}/connect", "post"),
        ("/sandboxes/{sandboxID}", "delete"),
        ("/templates/aliases/{alias}", "get"),
        ("/metrics", "get"),
        ("/openapi.json", "get"),
    ]:
        assert pair in ops
    assert ("/volumes", "get") in ops
    assert "Volume" in document["components"]["schemas"]
    # This node's volume size, and the refusal of a volume the disk cannot hold.
    schemas = document["components"]["schemas"]
    assert schemas["NewVolume"]["properties"]["sizeMB"]["minimum"] == 16
    assert "sizeMB" in schemas["VolumeAndToken"]["properties"]
    assert "507" in document["paths"]["/volumes"]["post"]["responses"]
    assert ("/access-tokens", "post") not in ops  # in E2B's spec, not served here
    assert ("/secrets/{secretID}", "post") in ops


def test_routes_the_spec_lacks_still_appear() -> None:
    async def undocumented() -> None:
        """Something only this node does."""

    routes = [
        Route("/x/{thing_id}", undocumented),
        Route("/sandboxes/{sandbox_id}", undocumented, methods=["PATCH"]),
    ]
    doc = build_document(load_e2b_spec(), routes, open_paths=())
    validate(doc)
    op = doc["paths"]["/x/{thing_id}"]["get"]
    assert op["summary"] == "Something only this node does."
    assert op["parameters"][0]["name"] == "thing_id"
    assert op["security"] == [{"ApiKeyAuth": []}]
    # A method the spec lacks on a path it has: the spec's parameter names.
    patch = doc["paths"]["/sandboxes/{sandboxID}"]["patch"]
    assert patch["parameters"][0]["name"] == "sandboxID"


def test_open_paths_need_no_key_and_others_declare_it(document: dict[str, Any]) -> None:
    paths = document["paths"]
    assert paths["/health"]["get"]["security"] == []
    assert paths["/openapi.json"]["get"]["security"] == []
    create = paths["/v2/sandboxes"]["post"]
    assert create["security"] == [{"ApiKeyAuth": []}]
    assert {"400", "401", "404", "429"} <= set(create["responses"])


def test_the_packaged_spec_is_the_repository_copy() -> None:
    packaged = REPO / "src" / "aenv" / "api" / "specs" / "e2b.yml"
    assert packaged.read_bytes() == (REPO / "specs" / "e2b" / "openapi.yml").read_bytes()


def test_the_spec_is_parsed_once_and_building_leaves_it_as_it_was(tmp_path: Path) -> None:
    spec = load_e2b_spec()
    pristine = copy.deepcopy(spec)
    create_api(MagicMock(), Config(home=tmp_path), KeyStore(tmp_path / "api-keys.json"))
    assert load_e2b_spec() is spec  # every app built shares one parse

    async def endpoint() -> None:
        """A route the document describes from the spec, with this node's additions."""

    routes = [
        Route(path, endpoint, methods=["GET", "POST"])
        for path in ("/v2/sandboxes", "/volumes", "/sandboxes/{sandbox_id}", "/x")
    ]
    document = build_document(spec, routes, open_paths=())
    assert "sizeMB" in document["components"]["schemas"]["NewVolume"]["properties"]
    assert spec == pristine
