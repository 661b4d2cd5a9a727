"""Our envd, run in a throwaway root on loopback (as tests/envd run it), standing for a
sandbox's guest: the dashboard's terminal and files reach it through the `SandboxShells` the
node would give them."""

from __future__ import annotations

import dataclasses
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from aenv.dashboard.app import Dashboard
from aenv.orchestrator.envd_client import EnvdClient, http_client
from tests.dashboard.conftest import Site


@dataclasses.dataclass(frozen=True)
class EnvdOnPort(EnvdClient):
    """A guest's envd is on its fixed port; the test's shares loopback with others."""

    port: int = 0

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"


class Shells:
    """Every sandbox's envd is the one envd."""

    def __init__(self, envd: EnvdClient) -> None:
        self.client = envd

    async def envd(self, sandbox_id: str) -> EnvdClient:
        return self.client


@asynccontextmanager
async def dashboard_on(site: Site, port: int) -> AsyncIterator[Dashboard]:
    """The site's API behind a dashboard whose sandboxes' envd is the one on `port`."""
    http = http_client()
    try:
        shells = Shells(EnvdOnPort(http, "127.0.0.1", port=port))
        yield Dashboard(site.dashboard.api, shells, live_interval=0.05, stream_s=0.3)
    finally:
        await http.aclose()
