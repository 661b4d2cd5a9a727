"""Runs inside the server's namespace: point the SDK at the server and wait until it is up
(the first start builds the `base` template, which boots a VM)."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from aenv.config import Paths
from tests.support.http_wait import wait_until_up

BASE = "http://127.0.0.1:3000"
# A sandbox timeout (seconds) for tests whose steps are slow: a create with volumes boots a VM
# (≈ 30 s here, several times that on a slow CI host), and a sandbox whose timeout passes while
# the test still uses it is killed under its open command streams.
LIFETIME = 900


@pytest.fixture(scope="session", autouse=True)
def server() -> Iterator[str]:
    home = Path(os.environ["AENV_HOME"])
    if not wait_until_up(f"{BASE}/health", 1200):
        pytest.fail("server did not come up:\n" + (home / "server.log").read_text()[-5000:])
    os.environ["E2B_API_KEY"] = Paths(home).api_key.read_text().strip()
    os.environ["E2B_API_URL"] = BASE
    os.environ["E2B_SANDBOX_URL"] = BASE
    os.environ.pop("E2B_DEBUG", None)
    yield BASE
