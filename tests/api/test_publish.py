"""The node's background publication of code-interpreter-v1 (`aenv.publish`) does not give up
at its first failure: a build that failed (a registry down for a while) is tried again while
the node runs, through the node's own API, as at start."""

from __future__ import annotations

import asyncio
import socket
from pathlib import Path

import uvicorn

from aenv.api.app import create_api, node_builder
from aenv.api.keys import KeyStore
from aenv.orchestrator.builds import Build, BuildStatus
from aenv.publish import Publication
from tests.doubles.node import double_node

KEY = "e2b_" + "cd" * 20
# Its base image is on a registry that refuses connections (loopback, nothing listens).
FAILING = {"name": "published", "fromImage": "127.0.0.1:9/nothing:latest"}


async def test_a_failed_publication_is_tried_again(tmp_path: Path) -> None:
    async with double_node(tmp_path) as node:
        keys = KeyStore(tmp_path / "api-keys.json")
        keys.add(KEY, "test")
        builder = node_builder(node.orchestrator, node.config)
        config = uvicorn.Config(
            create_api(node.orchestrator, node.config, keys, builder),
            lifespan="off",
            log_level="warning",
        )
        config.load()
        server = uvicorn.Server(config)
        server.lifespan = config.lifespan_class(config)
        sock = socket.socket()
        sock.bind(("127.0.0.1", 0))
        await server.startup(sockets=[sock])
        url = f"http://127.0.0.1:{sock.getsockname()[1]}"
        publication = Publication(
            FAILING,
            tmp_path / "template.yaml",
            url,
            KEY,
            node.orchestrator.templates,
            builder,
            builder.reserve("published"),
        )
        running = asyncio.create_task(publication.run(lambda: True, retry_after=0.01))
        try:
            async with asyncio.timeout(120):
                while len(_failed(builder.builds_of("published"))) < 3:
                    assert not running.done(), running
                    await asyncio.sleep(0.05)
        finally:
            running.cancel()
            await asyncio.gather(running, return_exceptions=True)
            await server.shutdown()
            sock.close()


def _failed(builds: list[Build]) -> list[Build]:
    return [b for b in builds if b.status is BuildStatus.ERROR]
