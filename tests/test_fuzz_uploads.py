"""Schemathesis against the routes that take files, on a node of their own (the API over the
doubles, served on a loopback port): the volume content API and the template build file
uploads. Whatever it sends, valid or not, no answer is a server error and every answer is as
the served OpenAPI document says. Half of the cases are aimed at a real volume and a real
template, so that they reach the code behind the 404s; generated names cannot touch anything
else, the node being this test's alone. (The server-wide run, tests/e2e/inner, leaves template
uploads out: there they could hit `base`.)"""

from __future__ import annotations

import asyncio
import collections
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, Phase, example, given, settings
from hypothesis import strategies as st
from hypothesis.errors import Unsatisfiable
from schemathesis import GenerationMode

from aenv.api.app import create_api
from aenv.api.keys import KeyStore
from tests.doubles.node import double_node
from tests.envd.fuzz_inputs import path_components
from tests.support.api_fuzz import CHECKS
from tests.support.loopback_api import served

KEY = "e2b_" + "ef" * 20
HEADERS = {"X-API-Key": KEY}
EXAMPLES = 25  # per operation and mode (valid, invalid input)
WRITTEN = b"written by the fuzzer"


def _fuzzed(path: str) -> bool:
    return path.startswith("/volumecontent/") or path == "/templates/{templateID}/files/{hash}"


@pytest.fixture
async def server(tmp_path: Path) -> AsyncIterator[str]:
    async with double_node(tmp_path) as node:
        keys = KeyStore(tmp_path / "api-keys.json")
        keys.add(KEY, "test")
        async with served(create_api(node.orchestrator, node.config, keys)) as url:
            yield url


class _Aim:
    """Every other case of an operation names the real volume (with its token: the content
    API's credential) or template."""

    def __init__(self, volume: dict[str, Any], template_id: str) -> None:
        self.volume = volume
        self.template_id = template_id
        self.turns: dict[str, int] = collections.Counter()

    def __call__(self, case: Any) -> None:
        self.turns[case.operation.label] += 1
        if self.turns[case.operation.label] % 2:
            return
        parameters = case.path_parameters or {}
        if "templateID" in parameters:
            parameters["templateID"] = self.template_id
        if "volume_id" in parameters:
            parameters["volume_id"] = self.volume["volumeID"]
            case.headers = {
                **(case.headers or {}),
                "Authorization": f"Bearer {self.volume['token']}",
            }


def _fuzz(operation: Any, mode: GenerationMode, server: str, aim: _Aim) -> None:
    @given(case=operation.as_strategy(generation_mode=mode))
    @settings(
        max_examples=EXAMPLES,
        deadline=None,
        database=None,
        phases=[Phase.explicit, Phase.generate],
        suppress_health_check=list(HealthCheck),
    )
    def check(case: Any) -> None:
        aim(case)
        response = case.call(
            base_url=server, headers={**HEADERS, **(case.headers or {})}, timeout=60
        )
        case.validate_response(response, checks=CHECKS)

    check()


def _run(server: str, aim: _Aim) -> list[str]:
    schema = schemathesis.openapi.from_url(f"{server}/openapi.json")
    failures: list[str] = []
    fuzzed = 0
    for result in schema.get_all_operations():
        operation = result.ok()  # type: ignore[union-attr]  # an Err is a bad spec: fail here
        if not _fuzzed(operation.path):
            continue
        fuzzed += 1
        for mode in GenerationMode:
            try:
                _fuzz(operation, mode, server, aim)
            except Unsatisfiable:
                assert mode is GenerationMode.NEGATIVE
            except Exception as e:
                failures.append(f"{operation.label} ({mode.value}): {e}")
    assert fuzzed >= 9, f"only {fuzzed} file routes in the document"
    return failures


async def test_file_routes_match_their_document(server: str) -> None:
    async with httpx.AsyncClient(base_url=server, headers=HEADERS) as client:
        volume = await client.post("/volumes", json={"name": "fuzzed"})
        assert volume.status_code == 201, volume.text
        template = await client.get("/templates/aliases/base")
        assert template.status_code == 200, template.text
        aim = _Aim(volume.json(), template.json()["templateID"])
        seeded = await client.put(
            f"/volumecontent/{volume.json()['volumeID']}/file",
            params={"path": "/seed.txt"},
            content=b"seed",
            headers={"Authorization": f"Bearer {volume.json()['token']}"},
        )
        assert seeded.status_code in (200, 201), seeded.text
    failures = await asyncio.to_thread(_run, server, aim)
    assert not failures, "\n\n".join(failures)


# The envd fuzzer's path components, with climbs and separators between them.
_VOLUME_PATHS = st.lists(
    st.one_of(path_components, st.sampled_from(["..", ".", "", "//"])), min_size=1, max_size=5
).map("/".join)


async def test_no_volume_path_escapes_or_breaks_the_api(server: str, tmp_path: Path) -> None:
    """Whatever path the content API is given, it answers (no 5xx), writes only inside the
    volume's own directory, and removes nothing outside it (a neighbour volume's file and one
    at the node's top stay)."""
    async with httpx.AsyncClient(base_url=server, headers=HEADERS) as client:
        created = await client.post("/volumes", json={"name": "paths"})
        assert created.status_code == 201, created.text
    volume_id = created.json()["volumeID"]
    token = {"Authorization": f"Bearer {created.json()['token']}"}
    base = f"{server}/volumecontent/{volume_id}"
    volume_dir = next(p for p in tmp_path.rglob(volume_id) if p.is_dir())
    keep = [volume_dir.parent / "neighbour" / "keep.txt", tmp_path / "keep.txt"]
    for path in keep:
        path.parent.mkdir(exist_ok=True)
        path.write_bytes(b"keep")

    @given(path=_VOLUME_PATHS, op=st.sampled_from(["put", "mkdir", "get", "stat", "delete"]))
    @example(path="a" * 300, op="put")  # a name over NAME_MAX was a 500 (ENAMETOOLONG)
    @example(path="a" * 300, op="mkdir")
    @example(path="/", op="put")
    @settings(
        max_examples=200, deadline=None, database=None, suppress_health_check=list(HealthCheck)
    )
    def attempt(path: str, op: str) -> None:
        params = {"path": path}
        with httpx.Client(headers=token, timeout=30) as http:
            response = {
                "put": lambda: http.put(f"{base}/file", params=params, content=WRITTEN),
                "mkdir": lambda: http.post(f"{base}/dir", params=params),
                "get": lambda: http.get(f"{base}/file", params=params),
                "stat": lambda: http.get(f"{base}/path", params=params),
                "delete": lambda: http.delete(f"{base}/path", params=params),
            }[op]()
        assert response.status_code < 500, (op, path, response.text)

    await asyncio.to_thread(attempt)
    assert all(path.read_bytes() == b"keep" for path in keep)
    written = [
        p for p in tmp_path.rglob("*")
        if p.is_file() and not p.is_relative_to(volume_dir) and p.read_bytes() == WRITTEN
    ]  # fmt: skip
    assert written == []
    # Not vacuous: the paths that stay inside were written.
    assert any(p.is_file() and p.read_bytes() == WRITTEN for p in volume_dir.rglob("*"))
