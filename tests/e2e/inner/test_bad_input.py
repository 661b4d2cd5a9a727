"""Bad input to the control plane and the data plane: each gets a clear 4xx with E2B's JSON
error body (`{"code", "message"}`) and changes nothing (the sandbox list and the node's create
counters are the same before and after)."""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from e2b import Sandbox

from aenv.api.models import MAX_ENV_BYTES, MAX_ENV_VARS, MAX_METADATA_BYTES, MAX_METADATA_ENTRIES
from aenv.config import Config

ENVD_PORT = "49983"
MAX_TIMEOUT = Config().max_timeout  # the e2e server runs with the default


def _key() -> dict[str, str]:
    return {"X-API-KEY": os.environ["E2B_API_KEY"]}


def _state(server: str) -> tuple[set[str], dict[str, str]]:
    """The sandboxes listed, and the node's create and sandbox counters."""
    listed = httpx.get(f"{server}/v2/sandboxes", headers=_key(), params={"limit": 100}).json()
    counters = {}
    for line in httpx.get(f"{server}/metrics").text.splitlines():
        if line.startswith(("aenv_creates_total", "aenv_sandboxes{", "aenv_create_queue")):
            name, value = line.rsplit(" ", 1)
            counters[name] = value
    return {s["sandboxID"] for s in listed}, counters


@pytest.fixture(scope="module")
def sandbox() -> Iterator[Sandbox]:
    sbx = Sandbox.create(timeout=300)
    yield sbx
    sbx.kill()


@pytest.fixture
def unchanged(server: str, sandbox: Sandbox) -> Iterator[None]:
    before = _state(server)
    yield
    assert _state(server) == before


def _assert_error(response: httpx.Response, status: int, *words: str) -> None:
    assert response.status_code == status, response.text
    body = response.json()
    assert body["code"] == status and isinstance(body["message"], str) and body["message"]
    for word in words:
        assert word in body["message"]


def _create(server: str, body: Any, headers: dict[str, str] | None = None) -> httpx.Response:
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    return httpx.post(
        f"{server}/v2/sandboxes",
        content=content,
        headers={"Content-Type": "application/json", **(_key() if headers is None else headers)},
        timeout=60,
    )


@pytest.mark.parametrize(
    "body",
    [
        b'{"templateID": "base",',  # malformed JSON
        b"",
        b"[]",
        {},  # no template
        {"templateID": ""},
        {"templateID": 5},
        {"templateID": "base", "timeout": "soon"},
        {"templateID": "base", "timeout": 1.5},
        {"templateID": "base", "metadata": {"a": 1}},
        {"templateID": "base", "metadata": "a=b"},
        {"templateID": "base", "envVars": ["A=1"]},
        {"templateID": "base", "autoPause": "maybe"},
        {"templateID": "base", "network": {"allowOut": "8.8.8.8"}},
    ],
)
def test_malformed_or_mistyped_create_is_400(server: str, unchanged: None, body: Any) -> None:
    _assert_error(_create(server, body), 400, "invalid request body")


@pytest.mark.parametrize("timeout", [0, -5, MAX_TIMEOUT + 1, 2**31, 10**30])
def test_timeout_out_of_range_is_400(server: str, unchanged: None, timeout: int) -> None:
    _assert_error(_create(server, {"templateID": "base", "timeout": timeout}), 400)


def test_unknown_template_is_404(server: str, unchanged: None) -> None:
    _assert_error(_create(server, {"templateID": "no-such-template"}), 404, "no-such-template")


@pytest.mark.parametrize(
    "headers",
    [{}, {"X-API-KEY": "e2b_" + "0" * 40}, {"Authorization": "Bearer wrong"}],
    ids=["missing", "wrong", "wrong-bearer"],
)
def test_bad_api_key_is_401(server: str, unchanged: None, headers: dict[str, str]) -> None:
    _assert_error(_create(server, {"templateID": "base"}, headers=headers), 401)
    _assert_error(httpx.get(f"{server}/v2/sandboxes", headers=headers), 401)


@pytest.mark.parametrize(
    ("field", "value", "words"),
    [
        ("metadata", {f"k{i}": "v" for i in range(MAX_METADATA_ENTRIES + 1)}, "entries"),
        ("metadata", {"k": "v" * MAX_METADATA_BYTES}, "bytes"),
        ("envVars", {f"V{i}": "1" for i in range(MAX_ENV_VARS + 1)}, "variables"),
        ("envVars", {"BIG": "x" * MAX_ENV_BYTES}, "bytes"),
        ("envVars", {"": "x"}, "invalid variable"),
        ("envVars", {"A=B": "x"}, "invalid variable"),
        ("envVars", {"A": "x\0y"}, "invalid variable"),
    ],
    ids=["metadata-keys", "metadata-bytes", "env-count", "env-bytes", "env-empty", "env-eq", "nul"],
)
def test_oversized_or_invalid_metadata_and_env_vars_are_400(
    server: str, unchanged: None, field: str, value: dict[str, str], words: str
) -> None:
    _assert_error(_create(server, {"templateID": "base", field: value}), 400, field, words)


def test_a_body_over_a_mebibyte_is_413(server: str, unchanged: None) -> None:
    body = {"templateID": "base", "metadata": {"k": "v" * (1024 * 1024)}}
    _assert_error(_create(server, body), 413)


@pytest.mark.parametrize(
    ("route", "body"),
    [
        ("timeout", {"timeout": MAX_TIMEOUT + 1}),
        ("timeout", {"timeout": -1}),
        ("timeout", {}),
        ("refreshes", {"duration": 3601}),
        ("connect", {"timeout": 10**15}),
        ("connect", {"timeout": MAX_TIMEOUT + 1}),
    ],
)
def test_bad_time_to_live_is_400_and_leaves_the_sandbox_as_it_was(
    server: str, unchanged: None, sandbox: Sandbox, route: str, body: dict[str, Any]
) -> None:
    before = sandbox.get_info().end_at
    url = f"{server}/sandboxes/{sandbox.sandbox_id}/{route}"
    _assert_error(httpx.post(url, json=body, headers=_key()), 400)
    assert sandbox.get_info().end_at == before


def test_unknown_sandbox_is_404(server: str, unchanged: None) -> None:
    for method, path in [
        ("GET", "/sandboxes/nosuchsandbox"),
        ("DELETE", "/sandboxes/nosuchsandbox"),
        ("POST", "/sandboxes/nosuchsandbox/timeout"),
        ("POST", "/v2/sandboxes/nosuchsandbox/connect"),
    ]:
        response = httpx.request(method, f"{server}{path}", json={"timeout": 30}, headers=_key())
        _assert_error(response, 404, "nosuchsandbox")


def test_wrong_envd_access_token_through_the_proxy_is_401(
    server: str, unchanged: None, sandbox: Sandbox
) -> None:
    routed = {"E2b-Sandbox-Id": sandbox.sandbox_id, "E2b-Sandbox-Port": ENVD_PORT}
    for token in ("wrong", None):
        headers = routed if token is None else {**routed, "X-Access-Token": token}
        files = httpx.get(f"{server}/files", params={"path": "/etc/hostname"}, headers=headers)
        _assert_error(files, 401)
        rpc = httpx.post(
            f"{server}/process.Process/List",
            content=b"{}",
            headers={**headers, "Content-Type": "application/json"},
        )
        assert rpc.status_code == 401, rpc.text
    # The right token still works: the SDK's own request through the same proxy.
    assert sandbox.commands.run("echo ok").stdout == "ok\n"
