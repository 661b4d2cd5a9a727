"""The sandbox logs routes (v1 `SandboxLogs`, v2 `SandboxLogsV2Response`) over a real guest's
serial console: shapes checked against the OpenAPI spec, filters, limits, errors."""

from __future__ import annotations

import os
from collections.abc import Iterator
from datetime import datetime
from pathlib import Path
from typing import Any

import httpx
import jsonschema
import pytest
import yaml
from e2b import Sandbox

from tests.support.wait import eventually_sync

MARKS = ["aenv-log-1", "aenv-log-2", "aenv-log-3"]


def get(server: str, path: str, **params: Any) -> httpx.Response:
    headers = {"X-API-KEY": os.environ["E2B_API_KEY"]}
    return httpx.get(f"{server}{path}", params=params, headers=headers, timeout=30)


def schema(name: str) -> dict[str, Any]:
    spec_path = Path(__file__).resolve().parents[3] / "specs" / "e2b" / "openapi.yml"
    schemas = yaml.safe_load(spec_path.read_text())["components"]["schemas"]
    return {"$ref": f"#/components/schemas/{name}", "components": {"schemas": schemas}}


def ms(timestamp: str) -> int:
    return round(datetime.fromisoformat(timestamp).timestamp() * 1000)


def messages(server: str, sandbox_id: str) -> list[str]:
    return [e["message"] for e in get(server, f"/v2/sandboxes/{sandbox_id}/logs").json()["logs"]]


@pytest.fixture(scope="module")
def sandbox_id(server: str) -> Iterator[str]:
    sandbox = Sandbox.create(timeout=300)
    try:
        # The logs are the guest's serial console; root can write to it directly.
        sandbox.commands.run(
            f"for m in {' '.join(MARKS)}; do echo $m > /dev/console; done", user="root"
        )
        eventually_sync(
            lambda: all(m in messages(server, sandbox.sandbox_id) for m in MARKS),
            "the console lines showed in the logs",
            interval=0.5,
        )
        yield sandbox.sandbox_id
    finally:
        sandbox.kill()


def test_v1_shape_start_and_limit(server: str, sandbox_id: str) -> None:
    path = f"/sandboxes/{sandbox_id}/logs"
    body = get(server, path).json()
    jsonschema.validate(body, schema("SandboxLogs"))
    lines = [log["line"] for log in body["logs"]]
    assert [line for line in lines if line in MARKS] == MARKS
    assert [e["message"] for e in body["logEntries"]] == lines
    assert {(e["level"], str(e["fields"])) for e in body["logEntries"]} == {("info", "{}")}
    assert get(server, path).json() == body  # stamps are fixed once read
    last = ms(body["logs"][-1]["timestamp"])
    assert get(server, path, start=last + 1).json() == {"logs": [], "logEntries": []}
    assert get(server, path, start=last).json()["logs"][-1] == body["logs"][-1]
    assert get(server, path, limit=1).json()["logs"] == body["logs"][:1]


def test_v2_direction_cursor_level_search_limit(server: str, sandbox_id: str) -> None:
    path = f"/v2/sandboxes/{sandbox_id}/logs"
    forward = get(server, path).json()
    jsonschema.validate(forward, schema("SandboxLogsV2Response"))
    entries = forward["logs"]
    assert [e["message"] for e in entries if e["message"] in MARKS] == MARKS
    assert get(server, path, direction="backward").json()["logs"] == entries[::-1]
    first, last = ms(entries[0]["timestamp"]), ms(entries[-1]["timestamp"])
    assert get(server, path, cursor=last + 1).json()["logs"] == []
    assert get(server, path, cursor=first - 1, direction="backward").json()["logs"] == []
    assert get(server, path, cursor=last, direction="backward").json()["logs"] == entries[::-1]
    assert get(server, path, limit=2).json()["logs"] == entries[:2]
    assert get(server, path, limit=1, direction="backward").json()["logs"] == entries[-1:]
    assert get(server, path, level="debug").json()["logs"] == entries
    assert get(server, path, level="info").json()["logs"] == entries
    assert get(server, path, level="warn").json()["logs"] == []  # the console has no levels
    found = get(server, path, search="aenv-log-2").json()["logs"]
    assert [e["message"] for e in found] == ["aenv-log-2"]
    assert get(server, path, search="AENV-LOG-2").json()["logs"] == []  # case-sensitive


@pytest.mark.parametrize(
    ("version", "params"),
    [
        ("v1", {"start": "soon"}),
        ("v1", {"limit": "-1"}),
        ("v2", {"cursor": "x"}),
        ("v2", {"limit": "1001"}),
        ("v2", {"direction": "sideways"}),
        ("v2", {"level": "loud"}),
        ("v2", {"search": "x" * 257}),
    ],
)
def test_bad_query_values_are_400(
    server: str, sandbox_id: str, version: str, params: dict[str, str]
) -> None:
    prefix = "/v2" if version == "v2" else ""
    response = get(server, f"{prefix}/sandboxes/{sandbox_id}/logs", **params)
    assert response.status_code == 400
    assert response.json()["code"] == 400 and next(iter(params)) in response.json()["message"]


def test_unknown_sandbox_is_404(server: str) -> None:
    for path in ["/sandboxes/nosuchsandbox/logs", "/v2/sandboxes/nosuchsandbox/logs"]:
        response = get(server, path)
        assert response.status_code == 404
        assert response.json() == {"code": 404, "message": "sandbox 'nosuchsandbox' not found"}


def test_no_secret_reaches_the_console(server: str, sandbox_id: str) -> None:
    token = get(server, f"/sandboxes/{sandbox_id}").json()["envdAccessToken"]
    assert token
    lines = messages(server, sandbox_id)
    assert lines  # there is a console to look through
    for secret in (token, os.environ["E2B_API_KEY"]):
        assert not [line for line in lines if secret in line]
