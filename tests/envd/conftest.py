"""Fixtures: one envd per session in a throwaway root, driven by the official e2b SDK in debug
mode (which talks to envd on localhost:49983 with no control plane)."""

from __future__ import annotations

import os
import socket
import time
import uuid
from collections.abc import AsyncIterator, Iterator

import pytest
from e2b import AsyncSandbox, Sandbox

from tests.support.envd_process import envd_in_throwaway_root

ENVD_PORT = 49983


def _port_is_free(port: int) -> bool:
    with socket.socket() as s:
        # As envd (uvicorn) binds: connections lingering in TIME_WAIT do not count.
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
        return True


@pytest.fixture(scope="session")
def envd_url() -> Iterator[str]:
    # The SDK's debug mode always dials localhost:49983. If another test session's envd holds
    # the port, ours could not bind it and the tests would silently run against that one.
    deadline = time.monotonic() + 120
    while not _port_is_free(ENVD_PORT):
        if time.monotonic() > deadline:
            pytest.fail(f"port {ENVD_PORT} is in use (another envd test session?)")
        time.sleep(0.5)
    os.environ["E2B_DEBUG"] = "true"
    with envd_in_throwaway_root(ENVD_PORT) as url:
        yield url


@pytest.fixture
def sandbox(envd_url: str) -> Sandbox:
    return Sandbox.create()


@pytest.fixture
async def async_sandbox(envd_url: str) -> AsyncIterator[AsyncSandbox]:
    yield await AsyncSandbox.create()


@pytest.fixture
def workdir(sandbox: Sandbox) -> Iterator[str]:
    """A fresh directory under the user's home, removed afterwards."""
    path = f"/home/user/t-{uuid.uuid4().hex[:8]}"
    sandbox.files.make_dir(path)
    yield path
    sandbox.files.remove(path)
