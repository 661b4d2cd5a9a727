"""Schemathesis against the running server, from the server's own `GET /openapi.json`: no
request it generates may get a 5xx, and every response must match the document (status code,
content type, headers, body schema), valid input and invalid alike.

Generated ids name nothing, so most sandbox operations would only ever see a 404. To reach the
real code paths, some cases are pointed at real things: every other valid create asks for the
`base` template with a short timeout (at most `REAL_CREATES` per run, each sandbox killed right
after), and every other case of a read or time-to-live operation targets one real sandbox. Pause,
resume, fork and snapshots only ever see generated ids (their own tests cover them; aimed at the
real sandbox they would start VMs in bulk), and operations that change templates (delete, builds,
tags, uploads) are left out: generated names could hit `base`, and builds boot VMs.

The strategy API rather than schemathesis' pytest plugin (`from_fixture` breaks on pytest 9) or
its CLI (which learns ids from responses: fed `base` from `GET /templates`, it deletes it).
"""

from __future__ import annotations

import collections
import os
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis.errors import Unsatisfiable
from schemathesis import GenerationMode

from tests.support.api_fuzz import CHECKS

EXAMPLES = int(
    os.environ.get("AENV_TEST_FUZZ_EXAMPLES", "10")
)  # per operation and mode (valid, invalid input)
REAL_CREATES = 6
CREATES = {"/sandboxes", "/v2/sandboxes"}
# Operations that may target the real sandbox: they read it or move its end time.
ON_REAL_SANDBOX = {
    ("GET", "/sandboxes/{sandboxID}"),
    ("GET", "/sandboxes/{sandboxID}/metrics"),
    ("GET", "/sandboxes/{sandboxID}/logs"),
    ("GET", "/v2/sandboxes/{sandboxID}/logs"),
    ("POST", "/sandboxes/{sandboxID}/timeout"),
    ("POST", "/sandboxes/{sandboxID}/refreshes"),
    ("POST", "/sandboxes/{sandboxID}/connect"),
    ("POST", "/v2/sandboxes/{sandboxID}/connect"),
}


def _changes_templates(method: str, path: str) -> bool:
    return method != "GET" and "templates" in path.split("/")[1:3]


@pytest.fixture(scope="module")
def headers() -> dict[str, str]:
    return {"X-API-Key": os.environ["E2B_API_KEY"]}


@pytest.fixture(scope="module")
def real_sandbox(server: str, headers: dict[str, str]) -> Iterator[str]:
    before = _sandbox_ids(server, headers)
    created = httpx.post(
        f"{server}/v2/sandboxes",
        json={"templateID": "base", "timeout": 600},
        headers=headers,
        timeout=120,
    )
    assert created.status_code == 201, created.text
    yield created.json()["sandboxID"]
    # Whatever the run created (the real sandbox, creates that slipped past a kill) goes.
    for sandbox_id in _sandbox_ids(server, headers) - before:
        httpx.delete(f"{server}/sandboxes/{sandbox_id}", headers=headers, timeout=60)
    assert _sandbox_ids(server, headers) == before


def _sandbox_ids(server: str, headers: dict[str, str]) -> set[str]:
    listed = httpx.get(f"{server}/v2/sandboxes", headers=headers, params={"limit": 100})
    return {s["sandboxID"] for s in listed.json()}


class _Aim:
    """Points some generated cases at real things (see the module docstring)."""

    def __init__(self, sandbox_id: str) -> None:
        self.sandbox_id = sandbox_id
        self.turns: dict[str, int] = collections.Counter()
        self.creates = 0

    def __call__(self, case: Any, mode: GenerationMode) -> None:
        path, method = case.operation.path, case.method.upper()
        self.turns[case.operation.label] += 1
        turn = self.turns[case.operation.label]
        if (method, path) in ON_REAL_SANDBOX and turn % 2 == 0:
            case.path_parameters["sandboxID"] = self.sandbox_id
        # Invalid creates are never aimed: one the server wrongly accepts would start a VM.
        if (
            mode is GenerationMode.NEGATIVE
            or path not in CREATES
            or not isinstance(case.body, dict)
        ):
            return
        if self.creates < REAL_CREATES and turn % 2 == 0:
            self.creates += 1
            case.body["templateID"] = "base"
            case.body["timeout"] = turn


def _fuzz(
    operation: Any, mode: GenerationMode, server: str, headers: dict[str, str], aim: _Aim
) -> None:
    @given(case=operation.as_strategy(generation_mode=mode))
    @settings(
        max_examples=EXAMPLES,
        deadline=None,
        database=None,  # nothing written to the work tree
        phases=[Phase.explicit, Phase.generate],  # no shrinking: it would repeat creates
        suppress_health_check=list(HealthCheck),
    )
    def check(case: Any) -> None:
        aim(case, mode)
        response = case.call(base_url=server, headers=headers, timeout=120)
        try:
            case.validate_response(response, checks=CHECKS)
        finally:
            if case.operation.path in CREATES and response.status_code == 201:
                sandbox_id = response.json()["sandboxID"]
                httpx.delete(f"{server}/sandboxes/{sandbox_id}", headers=headers, timeout=60)

    check()


def test_the_api_matches_its_document(
    server: str, headers: dict[str, str], real_sandbox: str
) -> None:
    schema = schemathesis.openapi.from_url(f"{server}/openapi.json")
    aim = _Aim(real_sandbox)
    failures: list[str] = []
    for result in schema.get_all_operations():
        operation = result.ok()  # type: ignore[union-attr]  # an Err is a bad spec: fail here
        if _changes_templates(operation.method.upper(), operation.path):
            continue
        for mode in GenerationMode:
            try:
                _fuzz(operation, mode, server, headers, aim)
            except Unsatisfiable:
                assert mode is GenerationMode.NEGATIVE  # no input of this operation can be wrong
            except Exception as e:
                failures.append(f"{operation.label} ({mode.value}): {e}")
    assert not failures, "\n\n".join(failures)
