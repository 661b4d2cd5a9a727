"""Fixtures for the Firecracker driver tests: the swagger validators and a Firecracker API peer
serving on a unix socket in this event loop."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path

import fc_peer
import fc_swagger
import pytest


@pytest.fixture(scope="session")
def swagger() -> fc_swagger.Swagger:
    if not fc_swagger.SPEC_PATH.is_file():
        pytest.skip(f"Firecracker swagger not found at {fc_swagger.SPEC_PATH}")
    return fc_swagger.load()


@pytest.fixture
async def peer(tmp_path: Path, swagger: fc_swagger.Swagger) -> AsyncIterator[fc_peer.PeerState]:
    """A Firecracker peer on `tmp_path/api.sock`; the fixture value is its recorded state."""
    state = fc_peer.PeerState(root=tmp_path)
    socket_path = tmp_path / "api.sock"
    server = fc_peer.make_server(state, socket_path)
    task = asyncio.create_task(server.serve())
    for _ in range(500):
        if server.started or task.done():
            break
        await asyncio.sleep(0.01)
    assert server.started, "peer did not start"
    yield state
    server.should_exit = True
    await task
