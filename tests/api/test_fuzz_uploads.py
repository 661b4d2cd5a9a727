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
import socket
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import schemathesis
import uvicorn
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis.errors import Unsatisfiable
from schemathesis import GenerationMode

from aenv.api.app import create_api
from aenv.api.keys import KeyStore
from tests.doubles.node import double_node
from tests.support.api_fuzz import CHECKS

KEY = "e2b_" + "ef" * 20
HEADERS = {"X-API-Key": KEY}
EXAMPLES = 25  # per operation and mode (valid, invalid input)


def _fuzzed(path: str) -> bool:
    return path.startswith("/volumecontent/") or path == "/templates/{templateID}/files/{hash}"


@pytest.fixture
async def server(tmp_path: Path) -> AsyncIterator[str]:
    async with double_node(tmp_path) as node:
        keys = KeyStore(tmp_path / "api-keys.json")
        keys.add(KEY, "test")
        config = uvicorn.Config(
            create_api(node.orchestrator, node.config, keys), lifespan="off", log_level="error"
        )
        config.load()
        served = uvicorn.Server(config)
        served.lifespan = config.lifespan_class(config)
        sock = socket.socket()
        sock.bind(("127.0.0.1", 0))
        await served.startup(sockets=[sock])
        try:
            yield f"http://127.0.0.1:{sock.getsockname()[1]}"
        finally:
            await served.shutdown()
            sock.close()


class _Aim:
    """Every other case of an operation names the real volume or template."""

    def __init__(self, volume_id: str, template_id: str) -> None:
        self.targets = {"volume_id": volume_id, "templateID": template_id}
        self.turns: dict[str, int] = collections.Counter()

    def __call__(self, case: Any) -> None:
        self.turns[case.operation.label] += 1
        if self.turns[case.operation.label] % 2:
            return
        for name, value in self.targets.items():
            if name in (case.path_parameters or {}):
                case.path_parameters[name] = value


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
        response = case.call(base_url=server, headers=HEADERS, timeout=60)
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
        aim = _Aim(volume.json()["volumeID"], template.json()["templateID"])
        await client.put(
            f"/volumecontent/{volume.json()['volumeID']}/file",
            params={"path": "/seed.txt"},
            content=b"seed",
        )
    failures = await asyncio.to_thread(_run, server, aim)
    assert not failures, "\n\n".join(failures)
