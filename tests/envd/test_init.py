"""POST /init (sandbox env vars, default user and workdir, access token, RNG reseed), /envs,
/metrics, against a separate envd so the session envd's settings stay untouched.

Deliberately not exercised here: `hostname` and a skewed `timestamp`. The throwaway root has its
own mount and PID namespaces but shares the host's UTS namespace and clock, so those would change
the host."""

from __future__ import annotations

import base64
import os
from collections.abc import Iterator

import httpx
import pytest
from e2b import Sandbox

from tests.envd.helpers import extra_envd, sandbox_for


@pytest.fixture(scope="module")
def init_url() -> Iterator[str]:
    with extra_envd() as url:
        yield url


@pytest.fixture
def fresh(init_url: str) -> Iterator[tuple[str, Sandbox]]:
    yield init_url, sandbox_for(init_url)
    # Back to defaults (no token: every test here leaves the envd open).
    response = httpx.post(
        f"{init_url}/init", json={"envVars": {}, "defaultUser": "user"}, timeout=10
    )
    assert response.status_code == 204


def test_env_precedence_base_sandbox_request(fresh: tuple[str, Sandbox]) -> None:
    url, sandbox = fresh
    response = httpx.post(
        f"{url}/init",
        json={"envVars": {"SANDBOX_ONLY": "s", "SHARED": "sandbox", "LOGNAME": "from-sandbox"}},
    )
    assert response.status_code == 204
    result = sandbox.commands.run(
        'echo "$SANDBOX_ONLY|$SHARED|$LOGNAME|$USER"', envs={"SHARED": "request"}
    )
    # base (USER, LOGNAME) < sandbox (/init envVars) < request envs
    assert result.stdout == "s|request|from-sandbox|user\n"
    envs = httpx.get(f"{url}/envs")
    assert envs.status_code == 200
    assert envs.headers["cache-control"] == "no-store"
    assert envs.json()["SANDBOX_ONLY"] == "s"
    # A later /init replaces the set.
    assert httpx.post(f"{url}/init", json={"envVars": {"OTHER": "o"}}).status_code == 204
    assert sandbox.commands.run('echo "[$SANDBOX_ONLY][$OTHER]"').stdout == "[][o]\n"


def test_default_user_and_workdir(fresh: tuple[str, Sandbox]) -> None:
    url, sandbox = fresh
    response = httpx.post(f"{url}/init", json={"defaultUser": "root", "defaultWorkdir": "/tmp"})
    assert response.status_code == 204
    try:
        assert sandbox.commands.run("id -un; pwd").stdout == "root\n/tmp\n"
        info = sandbox.files.write("/tmp/by-default-user.txt", "r")
        assert sandbox.files.get_info(info.path).owner == "root"
        assert sandbox.commands.run("pwd", user="user").stdout == "/tmp\n"
    finally:
        httpx.post(f"{url}/init", json={"defaultUser": "user"})
        sandbox.files.remove("/tmp/by-default-user.txt")


def test_unknown_default_user_is_rejected(fresh: tuple[str, Sandbox]) -> None:
    url, sandbox = fresh
    response = httpx.post(f"{url}/init", json={"defaultUser": "nobody-here-xyz"})
    assert response.status_code == 400
    assert sandbox.commands.run("id -un").stdout == "user\n"


def test_invalid_init_bodies(fresh: tuple[str, Sandbox]) -> None:
    url, sandbox = fresh
    for body in (b"{not json", b'{"envVars": "not a map"}', b'{"entropy": "%%%"}'):
        response = httpx.post(
            f"{url}/init", content=body, headers={"Content-Type": "application/json"}
        )
        assert response.status_code == 400
    assert sandbox.commands.run("echo ok").stdout == "ok\n"


def test_rng_reseed_from_entropy(fresh: tuple[str, Sandbox]) -> None:
    url, sandbox = fresh
    entropy = base64.b64encode(os.urandom(64)).decode()
    assert httpx.post(f"{url}/init", json={"entropy": entropy}).status_code == 204
    # The guest's RNG keeps working after the reseed.
    sample = sandbox.commands.run("head -c 32 /dev/urandom | od -An -tx1 | tr -d ' \\n'").stdout
    assert len(sample) == 64


def test_init_sets_and_enforces_token(fresh: tuple[str, Sandbox]) -> None:
    url, sandbox = fresh
    token = base64.b32encode(os.urandom(10)).decode()
    assert httpx.post(f"{url}/init", json={"accessToken": token}).status_code == 204
    try:
        denied = httpx.post(
            f"{url}/process.Process/List",
            content=b"{}",
            headers={"Content-Type": "application/json"},
        )
        assert denied.status_code == 401
        assert sandbox_for(url, token).commands.run("echo in").stdout == "in\n"
        # Changing or dropping it needs the current token.
        assert httpx.post(f"{url}/init", json={"accessToken": "other"}).status_code == 401
        assert httpx.get(f"{url}/health").status_code == 204
    finally:
        restored = httpx.post(
            f"{url}/init", json={"envVars": {}}, headers={"X-Access-Token": token}
        )
        assert restored.status_code == 204
    assert sandbox.commands.run("echo open").stdout == "open\n"


def test_metrics(fresh: tuple[str, Sandbox]) -> None:
    url, _ = fresh
    metrics = httpx.get(f"{url}/metrics").json()
    for key in (
        "ts",
        "cpu_count",
        "cpu_used_pct",
        "mem_total",
        "mem_used",
        "mem_total_mib",
        "mem_used_mib",
        "disk_used",
        "disk_total",
    ):
        assert isinstance(metrics[key], int | float), key
    assert metrics["cpu_count"] >= 1
    assert 0 < metrics["mem_used"] <= metrics["mem_total"]
