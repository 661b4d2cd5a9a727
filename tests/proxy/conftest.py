"""Fixtures: our envd in a throwaway root, an upstream test app, and the proxy, each served by a
real uvicorn on its own free port, with a dict-backed resolver that the tests fill."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from e2b import AsyncSandbox, ConnectionConfig, Sandbox
from packaging.version import Version

from aenv.envd import ENVD_VERSION
from aenv.proxy import SandboxProxy
from tests.proxy.support import DictResolver, FakeSandbox, Probe, serve, upstream_app
from tests.support.envd_process import envd_in_throwaway_root
from tests.support.ports import free_port

DOMAIN = "aenv.test"
ENVD = 49983
USER_PORT = 8000
ENVD_SANDBOX = "envdsandbox000000001"


@pytest.fixture(scope="session")
def resolver() -> DictResolver:
    return DictResolver()


@pytest.fixture(scope="session")
def proxy_url(resolver: DictResolver) -> Iterator[str]:
    with serve(SandboxProxy(resolver, domain=DOMAIN), free_port()) as url:
        yield url


@pytest.fixture(scope="session")
def envd_port(resolver: DictResolver) -> Iterator[int]:
    port = free_port()
    with envd_in_throwaway_root(port):
        resolver.sandboxes[ENVD_SANDBOX] = FakeSandbox({ENVD: port})
        yield port


@pytest.fixture
def probe() -> Probe:
    return Probe()


@pytest.fixture
def upstream_port(probe: Probe) -> Iterator[int]:
    port = free_port()
    with serve(upstream_app(probe), port):
        yield port


@pytest.fixture
def sandbox_id(resolver: DictResolver, upstream_port: int) -> Iterator[str]:
    """A sandbox whose user port 8000 is the upstream test app."""
    sandbox_id = "usersandbox000000001"
    resolver.sandboxes[sandbox_id] = FakeSandbox({USER_PORT: upstream_port})
    yield sandbox_id
    del resolver.sandboxes[sandbox_id]


def sdk_config(proxy_url: str, sandbox_id: str, envd_token: str | None = None) -> ConnectionConfig:
    """What `Sandbox.create()` builds after a create against our server: everything to the one
    URL, the sandbox named by the routing headers. Not debug mode, whatever the environment."""
    headers = {"E2b-Sandbox-Id": sandbox_id, "E2b-Sandbox-Port": str(ENVD)}
    if envd_token is not None:
        headers["X-Access-Token"] = envd_token
    return ConnectionConfig(
        debug=False,
        api_url=proxy_url,
        sandbox_url=proxy_url,
        api_key="e2b_" + "0" * 40,
        extra_sandbox_headers=headers,
    )


def sdk_sandbox(proxy_url: str, sandbox_id: str, envd_token: str | None = None) -> Sandbox:
    return Sandbox(
        sandbox_id=sandbox_id,
        sandbox_domain=DOMAIN,
        envd_version=Version(ENVD_VERSION),
        envd_access_token=envd_token,
        traffic_access_token=None,
        connection_config=sdk_config(proxy_url, sandbox_id, envd_token),
    )


def async_sdk_sandbox(proxy_url: str, sandbox_id: str) -> AsyncSandbox:
    return AsyncSandbox(
        sandbox_id=sandbox_id,
        sandbox_domain=DOMAIN,
        envd_version=Version(ENVD_VERSION),
        envd_access_token=None,
        traffic_access_token=None,
        connection_config=sdk_config(proxy_url, sandbox_id),
    )


@pytest.fixture
def sandbox(proxy_url: str, envd_port: int) -> Sandbox:
    return sdk_sandbox(proxy_url, ENVD_SANDBOX)
