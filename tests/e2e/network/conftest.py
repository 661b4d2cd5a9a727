"""Runs inside the server's namespace (test_network.py): point the SDK at the server by its
domain alone, over HTTPS, and wait until it is up."""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.e2e.internet import NODE_DOMAIN

API = f"https://api.{NODE_DOMAIN}"


def sandbox_url(sandbox_id: str, port: int) -> str:
    return f"https://{port}-{sandbox_id}.{NODE_DOMAIN}"


@pytest.fixture(scope="session", autouse=True)
def server() -> Iterator[str]:
    home = Path(os.environ["AENV_HOME"])
    deadline = time.monotonic() + 1200
    while True:
        try:
            if httpx.get(f"{API}/health", timeout=2).is_success:
                break
        except httpx.TransportError:
            pass
        if time.monotonic() > deadline:
            pytest.fail("server did not come up:\n" + (home / "server.log").read_text()[-5000:])
        time.sleep(0.5)
    os.environ["E2B_API_KEY"] = (home / "api-key").read_text().strip()
    os.environ["E2B_DOMAIN"] = NODE_DOMAIN
    for key in ("E2B_API_URL", "E2B_SANDBOX_URL", "E2B_DEBUG"):
        os.environ.pop(key, None)
    yield API
