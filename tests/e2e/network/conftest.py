"""Runs inside the server's namespace (test_network.py): point the SDK at the server by its
domain alone, over HTTPS, and wait until it is up."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from aenv.config import Paths
from tests.e2e.internet import NODE_DOMAIN
from tests.support.http_wait import wait_until_up

API = f"https://api.{NODE_DOMAIN}"


def sandbox_url(sandbox_id: str, port: int) -> str:
    return f"https://{port}-{sandbox_id}.{NODE_DOMAIN}"


@pytest.fixture(scope="session", autouse=True)
def server() -> Iterator[str]:
    home = Path(os.environ["AENV_HOME"])
    if not wait_until_up(f"{API}/health", 1200):
        pytest.fail("server did not come up:\n" + (home / "server.log").read_text()[-5000:])
    os.environ["E2B_API_KEY"] = Paths(home).api_key.read_text().strip()
    os.environ["E2B_DOMAIN"] = NODE_DOMAIN
    for key in ("E2B_API_URL", "E2B_SANDBOX_URL", "E2B_DEBUG"):
        os.environ.pop(key, None)
    yield API
